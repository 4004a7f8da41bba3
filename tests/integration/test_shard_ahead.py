"""Read-ahead of shards (feedgpu.shard_ahead) against a fake fetcher: threads and injected
delays, no network."""
from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from concurrent.futures import Future

import numpy as np
import pytest

from feedgpu.errors import ConfigError, ShardFetchError
from feedgpu.shard_ahead import ShardAhead
from feedgpu.order.shard_shuffle import shard_order

pytestmark = pytest.mark.timeout(60)


class FakeFetcher:
    """Fetches on threads after ``delay(shard)`` seconds; shards in ``fail`` raise OSError; with
    ``gated``, a fetch finishes only when the test calls :meth:`finish`."""

    def __init__(self, delay=lambda s: 0.0, fail=(), gated=False):
        self.delay, self.fail, self.gated = delay, set(fail), gated
        self.lock = threading.Lock()
        self.active = self.peak = 0
        self.calls: list = []
        self.released: list = []
        self.pending: dict = {}

    def fetch_async(self, shard) -> Future:
        fut: Future = Future()
        with self.lock:
            self.calls.append(shard)
            self.active += 1
            self.peak = max(self.peak, self.active)
        if self.gated:
            with self.lock:
                self.pending[shard] = fut
            return fut
        threading.Thread(target=self._work, args=(shard, fut), daemon=True).start()
        return fut

    def _work(self, shard, fut):
        time.sleep(self.delay(shard))
        self._complete(shard, fut)

    def _complete(self, shard, fut):
        with self.lock:
            self.active -= 1
        if not fut.set_running_or_notify_cancel():   # cancelled by close(), as an executor's would be
            return
        if shard in self.fail:
            fut.set_exception(OSError(f"HTTP 503 for {shard}"))
        else:
            fut.set_result(f"/cache/{shard}")

    def finish(self, shard):
        with self.lock:
            fut = self.pending.pop(shard)
        self._complete(shard, fut)

    def release(self, shard):
        with self.lock:
            self.released.append(shard)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


def ahead_threads():
    return [t for t in threading.enumerate() if t.name == "feedgpu-shard-ahead"]


def layout(shards=20, size=10, window=3, seed=0):
    shard_of = np.repeat(np.arange(shards), size)
    return shard_order(shard_of, seed=seed, epoch=0, window=window), shard_of


def read_all(ahead, order, shard_of, names):
    for pos in range(len(order)):
        assert ahead.acquire(pos) == f"/cache/{names[shard_of[order[pos]]]}"
        ahead.release(pos)


def test_requests_follow_the_order_of_need_within_the_in_flight_cap():
    order, shard_of = layout()
    names = [f"s{i}.tar" for i in range(20)]
    rnd = random.Random(1)
    delays = {n: rnd.uniform(0, 0.02) for n in names}
    f = FakeFetcher(delay=delays.get)
    with ShardAhead(order, shard_of, f, names=names, max_in_flight=2) as ahead:
        read_all(ahead, order, shard_of, names)
        st = ahead.stats()
    seq = shard_of[order]
    _, first = np.unique(seq, return_index=True)
    need = [names[s] for s in seq[np.sort(first)]]
    assert f.calls == need, "one request per shard, in the order of first need"
    assert f.peak <= 2 and st["max_in_flight"] <= 2
    assert sorted(f.released) == sorted(names) and st["released"] == 20 and st["fetched"] == 20
    assert st["held"] == 0 and st["in_flight"] == 0
    assert not ahead_threads()


def test_the_held_budget_bounds_what_is_fetched_ahead():
    order, shard_of = layout(window=2)
    f = FakeFetcher()
    ahead = ShardAhead(order, shard_of, f, max_in_flight=3, max_held=4)
    try:
        until(lambda: ahead.stats()["fetched"] == 4)
        time.sleep(0.05)
        assert len(f.calls) == 4, "nothing fetched past the held budget while nothing was read"
        first_shard = int(shard_of[order[0]])
        last = int(np.flatnonzero(shard_of[order] == first_shard).max())
        for pos in range(last + 1):          # read until the first shard is done
            ahead.acquire(pos)
            ahead.release(pos)
        until(lambda: len(f.calls) >= 5)
        assert first_shard in f.released
        assert ahead.stats()["max_held"] <= 4
    finally:
        ahead.close()


def test_waiting_for_the_network_is_accounted_only_when_the_reader_blocks():
    order, shard_of = layout(shards=4, size=5, window=1)
    clock = FakeClock()
    f = FakeFetcher(gated=True)
    waits = []
    ahead = ShardAhead(order, shard_of, f, max_in_flight=2, max_held=4, clock=clock, on_wait=waits.append)
    try:
        until(lambda: len(f.calls) == 2)
        got = []
        reader = threading.Thread(target=lambda: got.append(ahead.acquire(0)))
        reader.start()
        until(lambda: ahead.stats()["waiting"] == 1)     # the reader is blocked on the first shard
        clock.t += 5.0                       # the download takes 5 s of the injected clock
        f.finish(f.calls[0])
        reader.join(5)
        assert got == [f"/cache/{f.calls[0]}"]
        st = ahead.stats()
        assert st["network_wait_s"] == pytest.approx(5.0) and st["waits"] == 1
        assert waits == [pytest.approx(5.0)], "on_wait hears of each blocked acquire"
        # a shard fetched before it is read costs the reader nothing
        f.finish(f.calls[1])
        until(lambda: ahead.stats()["fetched"] == 2)
        clock.t += 3.0
        second = int(np.flatnonzero(shard_of[order] == f.calls[1])[0])
        assert ahead.acquire(second) == f"/cache/{f.calls[1]}"
        assert ahead.stats()["network_wait_s"] == pytest.approx(5.0) and ahead.stats()["waits"] == 1
        assert len(waits) == 1
    finally:
        ahead.close()


@pytest.mark.parametrize("how", ["future", "at once"])
def test_a_failed_fetch_reaches_the_reader_naming_the_shard_and_the_rest_is_read(how):
    order, shard_of = layout(shards=6, size=8, window=2)
    names = [f"https://store/s{i}.tar" for i in range(6)]
    if how == "future":
        f = FakeFetcher(fail={names[3]}, delay=lambda s: 0.005)
    else:
        class Raising(FakeFetcher):
            def fetch_async(self, shard):
                if shard == names[3]:
                    raise ConnectionError("connection refused")
                return super().fetch_async(shard)
        f = Raising(delay=lambda s: 0.005)
    failed, read = [], 0
    with ShardAhead(order, shard_of, f, names=names, max_in_flight=2, max_held=2) as ahead:
        for pos in range(len(order)):
            try:
                ahead.acquire(pos)
                read += 1
            except ShardFetchError as e:
                failed.append(e)
            ahead.release(pos)
        st = ahead.stats()
    assert read == 40 and len(failed) == 8, "every other sample read; the failed shard's 8 raise"
    assert {e.shard for e in failed} == {names[3]}
    assert names[3] in str(failed[0]) and ("503" in failed[0].reason or "refused" in failed[0].reason)
    assert st["failed"] == 1 and st["fetched"] == 5 and st["held"] == 0


def test_a_fetch_that_never_finishes_times_out_with_a_typed_error():
    order, shard_of = layout(shards=3, size=4, window=1)
    f = FakeFetcher(gated=True)
    with ShardAhead(order, shard_of, f, names=["a", "b", "c"], timeout=0.2) as ahead:
        with pytest.raises(ShardFetchError, match=r"shard [abc]: not fetched within 0.2 s"):
            ahead.acquire(0)
        assert ahead.stats()["waits"] == 1


def test_close_wakes_a_waiting_reader_and_leaves_no_thread():
    order, shard_of = layout(shards=3, size=4, window=1)
    f = FakeFetcher(gated=True)
    ahead = ShardAhead(order, shard_of, f)
    errors = []

    def read():
        try:
            ahead.acquire(0)
        except ShardFetchError as e:
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    until(lambda: ahead.stats()["waiting"] == 1)
    ahead.close()
    reader.join(5)
    assert not reader.is_alive() and len(errors) == 1 and "closed" in errors[0].reason
    assert not ahead_threads()
    assert all(fut.cancelled() for fut in f.pending.values())


def test_a_read_ahead_dropped_without_close_stops_its_thread():
    order, shard_of = layout(shards=3, size=4, window=1)
    ahead = ShardAhead(order, shard_of, FakeFetcher())
    until(lambda ref=weakref.ref(ahead): ref().stats()["fetched"] == 3)
    del ahead
    gc.collect()
    until(lambda: not ahead_threads(), timeout=5)


def test_a_reader_ahead_of_its_turn_is_served_next_and_a_released_shard_is_fetched_again():
    order, shard_of = layout(shards=10, size=5, window=1)
    f = FakeFetcher(gated=True)
    ahead = ShardAhead(order, shard_of, f, max_in_flight=1, max_held=2)
    try:
        until(lambda: len(f.calls) == 1)
        late = int(shard_of[order[-1]])      # needed last
        got = []
        t = threading.Thread(target=lambda: got.append(ahead.acquire_shard(late)))
        t.start()
        until(lambda: ahead.stats()["waiting"] == 1)
        f.finish(f.calls[0])
        until(lambda: len(f.calls) == 2)
        assert f.calls[1] == late, "the waiting reader's shard is requested before the next in need"
        f.finish(late)
        t.join(5)
        assert got == [f"/cache/{late}"]
        ahead.release_shard(late)             # its planned reads are still to come: kept
        assert late not in f.released
    finally:
        ahead.close()


def test_a_held_budget_below_the_window_cannot_deadlock():
    order, shard_of = layout(shards=12, size=6, window=4)
    names = [str(i) for i in range(12)]
    f = FakeFetcher(delay=lambda s: 0.002)
    with ShardAhead(order, shard_of, f, names=names, max_in_flight=1, max_held=1) as ahead:
        read_all(ahead, order, shard_of, names)
        assert ahead.stats()["over_budget"] > 0
    assert f.peak == 1


def test_a_shard_whose_reads_were_all_released_before_it_landed_is_released_when_it_lands():
    order, shard_of = layout(shards=3, size=4, window=1)
    f = FakeFetcher(gated=True)
    with ShardAhead(order, shard_of, f, max_in_flight=1, max_held=1) as ahead:
        until(lambda: len(f.calls) == 1)
        first = f.calls[0]
        for pos in np.flatnonzero(shard_of[order] == first).tolist():
            ahead.release(pos)                # the reader skipped its samples
        f.finish(first)
        until(lambda: len(f.calls) == 2)      # its slot is free again: the next shard is fetched
        assert f.released == [first] and ahead.stats()["held"] == 1


@pytest.mark.parametrize("kw", [{"max_in_flight": 0}, {"max_held": 0}, {"max_in_flight": 1.5}])
def test_bad_budgets(kw):
    order, shard_of = layout(shards=2, size=2, window=1)
    with pytest.raises(ConfigError):
        ShardAhead(order, shard_of, FakeFetcher(), **kw)


def test_a_loader_view_of_tar_shards_is_read_through_the_read_ahead(tar_ds):
    """Real shards: a rank's resumed view of a shard-aware epoch; the fake cache hands back the
    shard's own path, and every sample read through it has the source's bytes and label."""
    import os

    from feedgpu import DataLoader, Pipeline
    from feedgpu.stages import Decode, ResizeCenterCrop

    pipe = Pipeline({"format": "tar", "path": str(tar_ds)}, [Decode(), ResizeCenterCrop(40, 32)], batch_size=10,
                    num_workers=0, device="cpu", shuffle="shards", shard_window=2)
    src = pipe.source
    order = DataLoader(pipe, rank=1, world_size=2)._backend.order(collective=False)
    view = order.view(epoch=1, start=40)              # 40 samples taken before a resume

    class LocalCache(FakeFetcher):
        def _complete(self, shard, fut):
            with self.lock:
                self.active -= 1
            if fut.set_running_or_notify_cancel():
                fut.set_result(shard)                 # a local shard is its own cache

    f = LocalCache(delay=lambda s: 0.01)
    with ShardAhead.for_view(view, src, f, max_in_flight=1) as ahead:
        for pos, idx in enumerate(view.indices.tolist()):
            path = ahead.acquire(pos)
            with open(path, "rb") as fh:
                data = os.pread(fh.fileno(), int(src.sizes[idx]), int(src.offsets[idx]))
            rec = src.read(idx)
            assert bytes(data) == bytes(rec.payload) and path == src.shards[src.shard_ids[idx]]
            ahead.release(pos)
        st = ahead.stats()
    assert st["fetched"] == len(set(src.shard_ids[view.indices].tolist())) and st["held"] == 0
    assert st["max_held"] <= 2 + 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_with_a_fetcher_attached_fetches_each_batchs_shards_first(tar_ds, workers, no_leaked_workers):
    """The loader's hook: every batch's shards are acquired before the batch is read and
    released once it is delivered; what the loader waited is reported; the batches are those of
    the order, as without a fetcher."""
    from feedgpu import DataLoader, Pipeline
    from feedgpu.shard_ahead import attach
    from feedgpu.stages import Decode, ResizeCenterCrop

    def pipe():
        return Pipeline({"format": "tar", "path": str(tar_ds)}, [Decode(), ResizeCenterCrop(40, 32)],
                        batch_size=10, num_workers=workers, device="cpu", shuffle="shards", shard_window=2, seed=3)

    plain = DataLoader(pipe())
    plain.set_epoch(1)
    expected = [b.labels.clone() for b in plain]
    plain.shutdown()
    p = pipe()
    loader = DataLoader(p)
    loader.set_epoch(1)

    class Checked(FakeFetcher):
        """A local shard is its own cache."""
        def _complete(self, shard, fut):
            with self.lock:
                self.active -= 1
            if fut.set_running_or_notify_cancel():
                fut.set_result(shard)

    f = Checked(delay=lambda s: 0.05)
    attach(loader, f, max_in_flight=2)
    try:
        got = [b.labels.clone() for b in loader]
        st = loader.stats()["read_ahead"]
        assert [t.tolist() for t in got] == [t.tolist() for t in expected]
        assert sorted(f.calls) == sorted(p.source.shard_names()) and sorted(f.released) == sorted(f.calls)
        # whether the loader waited depends on how fast its workers start: not asserted here
        assert st["fetched"] == 3 and st["held"] == 0 and st["max_in_flight"] <= 2 and st["network_wait_s"] >= 0
        attach(loader, None)
        loader.set_epoch(2)
        n = sum(len(b.labels) for b in loader)
        assert n == len(p.source) and len(f.calls) == 3, "detached: nothing fetched"
    finally:
        loader.shutdown()
    until(lambda: not ahead_threads(), timeout=5)


def test_the_loaders_read_ahead_reports_its_waits_to_the_balancer(tar_ds):
    from feedgpu import DataLoader, Pipeline
    from feedgpu.shard_ahead import attach
    from feedgpu.stages import Decode, ResizeCenterCrop

    p = Pipeline({"format": "tar", "path": str(tar_ds)}, [Decode(), ResizeCenterCrop(40, 32)], batch_size=10,
                 num_workers="auto", device="cpu", shuffle="shards", shard_window=2)
    loader = DataLoader(p)
    attach(loader, FakeFetcher(), max_held=3)
    ahead = loader.read_ahead.for_view(loader._backend.order().view(0))
    try:
        assert ahead.on_wait == loader.balancer.add_network_wait and ahead.max_held == 3
    finally:
        ahead.close()
        loader.shutdown()


def test_a_failed_fetch_in_the_loader_is_named_and_the_source_still_reads(tar_ds):
    from feedgpu import DataLoader, Pipeline
    from feedgpu.shard_ahead import attach
    from feedgpu.stages import Decode, ResizeCenterCrop

    p = Pipeline({"format": "tar", "path": str(tar_ds)}, [Decode(), ResizeCenterCrop(40, 32)], batch_size=10,
                 num_workers=0, device="cpu", shuffle="shards", shard_window=2)
    loader = DataLoader(p)
    bad = p.source.shard_names()[1]
    attach(loader, FakeFetcher(fail={bad}))
    with pytest.warns(UserWarning, match=f"shard {bad}: OSError: HTTP 503") as rec:
        labels = [lab for b in loader for lab in b.labels.tolist()]
    assert sum(bad in str(w.message) for w in rec) == 1, "named once"
    assert sorted(labels) == sorted(p.source.labels.tolist())
    with pytest.raises(ConfigError, match="unknown options"):
        attach(loader, FakeFetcher(), window=3)
    with pytest.raises(ConfigError, match="max_in_flight"):
        attach(loader, FakeFetcher(), max_in_flight=0)
