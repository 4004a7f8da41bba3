"""IterableDataset the way torch runs it: every behaviour run with ``torch.utils.data.DataLoader``
and with feedgpu (:class:`feedgpu.exec.iterable.runner.IterableRunner` and ``feedgpu.DataLoader``),
comparing batches or errors. Datasets are module-level so that spawned workers can unpickle them.
"""
from __future__ import annotations

import gc
import math
import multiprocessing as mp
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import torch.utils.data as tud
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

import feedgpu
from feedgpu.errors import ConfigError, LoaderTimeout, StateError, WorkerError
from feedgpu.exec.iterable.runner import IterableRunner

REPO = Path(__file__).resolve().parents[2]
PHOTOS = REPO.parent / "shared" / "data" / "photos"

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


# -- datasets ------------------------------------------------------------------------------------------
def shard(lo: int, hi: int) -> tuple[int, int]:
    """This worker's part of ``range(lo, hi)`` (all of it in the main process)."""
    wi = get_worker_info()
    if wi is None:
        return lo, hi
    per = math.ceil((hi - lo) / wi.num_workers)
    start = lo + wi.id * per
    return start, min(hi, start + per)


class Shards(IterableDataset):
    """``range(start, end)`` split per worker with ``get_worker_info()`` (torch's doc example)."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(*shard(self.start, self.end)))


class SizedShards(Shards):
    def __len__(self):
        return self.end - self.start


class Uneven(IterableDataset):
    """Worker ``i`` yields ``lengths[i]`` items ``(i, j)``, so workers end at different batches."""

    def __init__(self, lengths):
        self.lengths = list(lengths)

    def __iter__(self):
        wi = get_worker_info()
        i = 0 if wi is None else wi.id
        for j in range(self.lengths[i]):
            yield {"worker": i, "j": j}


_INIT = {}


def record_init(wid: int) -> None:
    _INIT.update(wid=wid, initial_seed=torch.initial_seed(), info=get_worker_info().seed)


class SeedProbe(IterableDataset):
    """Yields, per worker, what torch's seeding and ``get_worker_info()`` gave it."""

    def __iter__(self):
        wi = get_worker_info()
        yield {"id": wi.id, "num_workers": wi.num_workers, "seed": wi.seed, "initial_seed": torch.initial_seed(),
               "init": dict(_INIT), "torch": torch.rand(1).item(), "random": random.random(),
               "numpy": float(np.random.rand()), "dataset_is_copy": isinstance(wi.dataset, SeedProbe)}


class _FlakyIter:
    def __init__(self, items, bad):
        self.items, self.bad = iter(items), bad

    def __iter__(self):
        return self

    def __next__(self):
        x = next(self.items)
        if x in self.bad:
            raise ValueError(f"bad item {x}")
        return x


class Flaky(Shards):
    """An iterator object that raises ``ValueError`` on the items in ``bad`` and goes on after."""

    def __init__(self, start, end, bad):
        super().__init__(start, end)
        self.bad = set(bad)

    def __iter__(self):
        return _FlakyIter(range(*shard(self.start, self.end)), self.bad)


class FlakyGen(Flaky):
    """A generator that raises on an item in ``bad``: its stream ends there."""

    def __iter__(self):
        for x in range(*shard(self.start, self.end)):
            if x in self.bad:
                raise KeyError(x)
            yield x


class Stuck(IterableDataset):
    """Worker 0 never yields; worker 1 does."""

    def __iter__(self):
        if get_worker_info().id == 0:
            time.sleep(3600)
        yield from range(4)


class Killer(IterableDataset):
    """Worker 1 is killed (SIGKILL) from inside ``__iter__``."""

    def __iter__(self):
        if get_worker_info().id == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        yield from range(6)


class Counting(IterableDataset):
    """Stateful (torchdata's protocol): its position is updated before each item is yielded."""

    def __init__(self, n: int):
        self.n, self.pos = n, None

    def __iter__(self):
        lo, hi = shard(0, self.n)
        if self.pos is None:
            self.pos = lo
        while self.pos < hi:
            x = self.pos
            self.pos += 1
            yield x
        self.pos = None   # the next pass starts over

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def tag_collate(items):
    """A custom collate_fn that runs in the worker: it says which worker collated."""
    wi = get_worker_info()
    return {"x": torch.tensor(items), "by": -1 if wi is None else wi.id}


# -- helpers -------------------------------------------------------------------------------------------
def plain(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def error_text(e: BaseException) -> str:
    """The original message of a worker's exception. torch re-raises it as a new exception whose
    message is ``Caught X in DataLoader worker process i.\nOriginal Traceback ... X: message``;
    feedgpu re-raises the original exception with that text as a note (deliberate difference)."""
    text = str(e)
    if text.startswith("Caught "):
        last = [line for line in text.splitlines() if line.strip()][-1]
        return last.split(": ", 1)[1] if ": " in last else ""
    return text.splitlines()[0] if text else ""


def events(loader, limit: int = 500) -> list:
    """Batches and errors in delivery order: ("batch", value) or ("error", type, first line)."""
    out, it = [], iter(loader)
    while len(out) < limit:
        try:
            b = next(it)
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001
            out.append(("error", type(e).__name__, error_text(e)))
            continue
        out.append(("batch", plain(b)))
    return out


def both(dataset, **kw):
    """The events of torch's loader and of feedgpu's runner, each with the same seeded generator."""
    theirs = events(tud.DataLoader(dataset, generator=torch.Generator().manual_seed(7), **kw))
    mine = events(IterableRunner(dataset, generator=torch.Generator().manual_seed(7), **kw))
    return theirs, mine


def wait_gone(pids, budget_s: float = 30.0) -> list:
    """The pids still running after up to ``budget_s`` seconds."""
    deadline = time.monotonic() + budget_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    return alive


# -- order, sharding, batching -------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("batch_size, drop_last", [(None, False), (1, False), (4, False), (4, True)])
def test_worker_sharding_with_get_worker_info_matches_torch(num_workers, batch_size, drop_last):
    theirs, mine = both(Shards(3, 26), batch_size=batch_size, drop_last=drop_last, num_workers=num_workers)
    assert mine == theirs
    assert all(kind == "batch" for kind, *_ in mine)
    flat = [v for _, b in mine for v in (b if isinstance(b, list) else [b])]
    if not drop_last:   # every item of the stream once
        assert sorted(flat) == list(range(3, 26))


@pytest.mark.parametrize("lengths, batch_size, drop_last", [
    ([7, 1, 4], 2, False), ([7, 1, 4], 2, True), ([0, 5, 2], 1, False), ([3, 3, 0], None, False)])
def test_uneven_workers_round_robin_skips_finished_ones_as_torch(lengths, batch_size, drop_last):
    theirs, mine = both(Uneven(lengths), batch_size=batch_size, drop_last=drop_last, num_workers=3)
    assert mine == theirs and mine


def test_unbatched_items_go_through_default_convert_as_torch():
    class Arrays(IterableDataset):
        def __iter__(self):
            for i in range(*shard(0, 5)):
                yield {"a": np.full((2, 3), i, np.float32), "n": i, "s": f"x{i}"}

    for nw in (0, 2):
        loaders = [tud.DataLoader(Arrays(), batch_size=None, num_workers=nw),
                   IterableRunner(Arrays(), batch_size=None, num_workers=nw)]
        got = [list(loader) for loader in loaders]
        assert [plain(b) for b in got[0]] == [plain(b) for b in got[1]]
        assert all(isinstance(b["a"], torch.Tensor) and b["a"].shape == (2, 3) for b in got[1])


def test_custom_collate_fn_runs_in_the_worker_as_torch():
    theirs, mine = both(Shards(0, 17), batch_size=3, num_workers=2, collate_fn=tag_collate)
    assert mine == theirs
    assert {b["by"] for _, b in mine} == {0, 1}


def test_batches_from_workers_are_tensors_in_shared_memory():
    batches = list(IterableRunner(Shards(0, 40), batch_size=8, num_workers=2))
    assert batches and all(isinstance(b, torch.Tensor) and b.is_shared() for b in batches)


@pytest.mark.parametrize("ctx", ["spawn", "forkserver", "fork-object"])
def test_start_methods_give_torchs_batches(ctx):
    context = mp.get_context("fork") if ctx == "fork-object" else ctx
    kw = dict(batch_size=3, num_workers=2)
    expected = events(tud.DataLoader(Uneven([5, 2]), multiprocessing_context=context, **kw))
    assert events(IterableRunner(Uneven([5, 2]), multiprocessing_context=context, **kw)) == expected
    assert len(expected) == 3


def test_len_as_torch():
    for kw in (dict(batch_size=3), dict(batch_size=3, drop_last=True), dict(batch_size=None)):
        assert len(IterableRunner(SizedShards(0, 10), **kw)) == len(tud.DataLoader(SizedShards(0, 10), **kw))
    with pytest.raises(TypeError):
        len(tud.DataLoader(Shards(0, 10)))
    with pytest.raises(TypeError):
        len(IterableRunner(Shards(0, 10)))


def test_reported_length_exceeded_warns_as_torch():
    for make in (tud.DataLoader, IterableRunner):
        loader = make(_Liar(), batch_size=1)
        assert len(loader) == 6
        with pytest.warns(UserWarning, match="was reported to be 6"):
            assert len(list(loader)) == 8


class _Liar(IterableDataset):
    def __len__(self):
        return 6

    def __iter__(self):
        return iter(range(8))


# -- seeds and worker_init_fn ------------------------------------------------------------------------
def test_seeds_worker_info_and_worker_init_fn_match_torch():
    theirs, mine = both(SeedProbe(), batch_size=None, num_workers=3, worker_init_fn=record_init)
    assert mine == theirs
    base = mine[0][1]["seed"]
    for wid, (_, probe) in enumerate(mine):
        assert probe["id"] == wid and probe["num_workers"] == 3 and probe["dataset_is_copy"]
        assert probe["seed"] == base + wid == probe["initial_seed"]
        assert probe["init"] == {"wid": wid, "initial_seed": base + wid, "info": base + wid}


def test_base_seed_comes_from_torchs_global_rng_without_generator():
    got = []
    for make in (tud.DataLoader, IterableRunner):
        torch.manual_seed(123)
        got.append(events(make(SeedProbe(), batch_size=None, num_workers=2)))
        got.append(torch.rand(1).item())   # the draw consumed the global RNG the same way
    assert got[0] == got[2] and got[1] == got[3]


def test_persistent_workers_keep_their_seed_and_processes_as_torch():
    def epochs(loader):
        return [events(loader) for _ in range(2)]

    g = torch.Generator().manual_seed(3)
    theirs = epochs(tud.DataLoader(SeedProbe(), batch_size=None, num_workers=2, persistent_workers=True, generator=g))
    runner = IterableRunner(SeedProbe(), batch_size=None, num_workers=2, persistent_workers=True,
                            generator=torch.Generator().manual_seed(3))
    mine = epochs(runner)
    assert [[b["seed"] for _, b in e] for e in mine] == [[b["seed"] for _, b in e] for e in theirs]
    assert mine[0][0][1]["torch"] == theirs[0][0][1]["torch"]
    pids = runner._workers.pids()
    assert list(runner) and runner._workers.pids() == pids   # same processes every epoch
    runner.shutdown()
    assert wait_gone(pids) == []


# -- errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers, batch_size", [(0, 2), (2, 2), (2, None), (3, 1)])
def test_exception_then_next_batch_as_torch(num_workers, batch_size):
    theirs, mine = both(Flaky(0, 20, bad={3, 11, 12}), batch_size=batch_size, num_workers=num_workers)
    assert mine == theirs
    assert sum(e[0] == "error" for e in mine) >= 2 and mine[-1][0] == "batch"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_generator_that_raises_ends_its_stream_as_torch(num_workers):
    theirs, mine = both(FlakyGen(0, 12, bad={2}), batch_size=2, num_workers=num_workers)
    assert mine == theirs
    assert [e[:2] for e in mine if e[0] == "error"] == [("error", "KeyError")]


def test_worker_exception_keeps_type_and_carries_the_worker_traceback():
    it = iter(IterableRunner(Flaky(0, 4, bad={0}), batch_size=1, num_workers=1))
    with pytest.raises(ValueError, match="bad item 0") as info:
        next(it)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "Caught ValueError in DataLoader worker process 0" in notes and "__next__" in notes
    assert next(it).tolist() == [1]


class Unpicklable(Exception):
    def __init__(self, f):
        super().__init__("cannot travel")
        self.f = f


class RaisesUnpicklable(IterableDataset):
    def __iter__(self):
        raise Unpicklable(lambda: 0)
        yield


def test_unpicklable_worker_exception_becomes_worker_error():
    with pytest.raises(WorkerError, match="Unpicklable: cannot travel"):
        list(IterableRunner(RaisesUnpicklable(), num_workers=1))


def fail_init(wid):
    if wid == 0:
        raise OSError(f"init failed in {wid}")


def test_worker_init_fn_error_raises_its_type_first_as_torch():
    kw = dict(batch_size=2, num_workers=2, worker_init_fn=fail_init)
    assert events(tud.DataLoader(Shards(0, 8), **kw), limit=1) == events(IterableRunner(Shards(0, 8), **kw), limit=1)
    # feedgpu: the failed worker's stream then counts as exhausted; the other one is delivered whole
    assert events(IterableRunner(Shards(0, 8), **kw))[1:] == [("batch", [4, 5]), ("batch", [6, 7])]


class BadIter(IterableDataset):
    """``iter()`` fails in worker 0 (or in the main process)."""

    def __iter__(self):
        wi = get_worker_info()
        if wi is None or wi.id == 0:
            raise OSError("no shard")
        return iter(range(4))


def test_iter_error_raises_at_iter_in_the_main_process_as_torch():
    for make in (tud.DataLoader, IterableRunner):
        with pytest.raises(OSError, match="no shard"):
            iter(make(BadIter(), batch_size=2))


def test_iter_error_in_a_worker_is_raised_once_then_that_worker_is_exhausted():
    kw = dict(batch_size=2, num_workers=2)
    theirs = events(tud.DataLoader(BadIter(), **kw), limit=2)
    mine = events(IterableRunner(BadIter(), **kw))
    assert mine[:2] == theirs == [("error", "OSError", "no shard"), ("batch", [0, 1])]
    # torch then raises UnboundLocalError for worker 0 at every round, for ever; feedgpu ends its stream
    assert mine[2:] == [("batch", [2, 3])]


def test_timeout_raises_runtime_error_as_torch():
    # the first batch is worker 0's, which never comes: whatever the machine's speed, both time out
    for make in (tud.DataLoader, IterableRunner):
        it = iter(make(Stuck(), batch_size=2, num_workers=2, timeout=0.5))
        for _ in range(2):   # and the iterator stays usable: the next next() waits again
            with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 0\.5 seconds") as info:
                next(it)
        del it
    assert isinstance(info.value, LoaderTimeout)


def test_a_whole_float_timeout_is_printed_as_torch_prints_it():
    messages = []
    for make in (tud.DataLoader, IterableRunner):
        it = iter(make(Stuck(), batch_size=2, num_workers=1, timeout=1.0))
        with pytest.raises(RuntimeError) as info:
            next(it)
        messages.append(str(info.value))
        del it
    assert messages[0] == "DataLoader timed out after 1.0 seconds"
    assert messages[1].startswith(messages[0] + ". ") and "IterableDataset worker 0" in messages[1], messages


def test_killed_worker_raises_torchs_message():
    for make, pattern in ((tud.DataLoader, r"DataLoader worker \(pid"),
                          (IterableRunner, r"^DataLoader worker \(pid \d+\) is killed by signal: Killed\.")):
        seen = []
        with pytest.raises(RuntimeError, match=pattern) as info:
            for b in make(Killer(), batch_size=2, num_workers=2):
                seen.append(b.tolist())
        assert seen == [[0, 1], [2, 3], [4, 5]][:len(seen)]   # only worker 0's batches, in order
    assert isinstance(info.value, WorkerError)


def test_break_and_del_stop_the_workers():
    runner = IterableRunner(Shards(0, 10 ** 6), batch_size=4, num_workers=2)
    it = iter(runner)
    next(it)
    pids = it.workers.pids()
    del it
    gc.collect()
    assert wait_gone(pids) == []
    for b in runner:   # break: the next iter() (or garbage collection) stops them
        pids = runner._live().workers.pids()
        break
    iter(runner)
    assert wait_gone(pids) == []
    runner.shutdown()


class Probe(IterableDataset):
    """An endless stream counting the items each worker has fetched (in fork-shared memory)."""

    def __init__(self):
        self.made = mp.get_context("fork").Array("i", 4)

    def __iter__(self):
        wid = get_worker_info().id
        while True:
            with self.made.get_lock():
                self.made[wid] += 1
            yield wid


def test_at_most_prefetch_factor_batches_per_worker_in_flight():
    ds = Probe()
    runner = IterableRunner(ds, batch_size=1, num_workers=2, prefetch_factor=3, multiprocessing_context="fork")
    it = iter(runner)
    taken = [next(it).item() for _ in range(5)]
    assert taken == [0, 1, 0, 1, 0]
    for _ in range(10):   # whatever the workers do meanwhile, they stay within their credits
        time.sleep(0.05)
        assert ds.made[0] <= 3 + 3 and ds.made[1] <= 2 + 3
    runner.shutdown()


@pytest.mark.parametrize("ctx, persistent", [("fork", False), ("fork", True), ("spawn", False)])
def test_no_hang_at_exit_after_an_error_mid_epoch_with_large_batches(ctx, persistent, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        from torch.utils.data import IterableDataset
        import feedgpu

        class Big(IterableDataset):
            def __iter__(self):
                for i in range(10 ** 6):
                    if i == 40:
                        raise ValueError("boom")
                    yield torch.zeros(3, 256, 256)

        if __name__ == "__main__":
            loader = feedgpu.DataLoader(Big(), batch_size=16, num_workers=2, multiprocessing_context=sys.argv[1],
                                        persistent_workers=sys.argv[2] == "1")
            it = iter(loader)
            next(it)
            print("pids", *it.workers.pids(), flush=True)
            for b in it:
                pass
    """))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, str(script), ctx, str(int(persistent))], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1 and "ValueError: boom" in r.stderr, r.stderr[-2000:]
    pids = [int(p) for p in r.stdout.split("pids", 1)[1].split()]
    assert wait_gone(pids) == []


# -- resume ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers, batch_size", [(0, 2), (0, None), (2, 3), (3, 2), (3, None)])
def test_stateful_resume_at_every_batch_continues_exactly(num_workers, batch_size):
    kw = dict(batch_size=batch_size, num_workers=num_workers)
    reference = [plain(b) for b in IterableRunner(Counting(11), **kw)]
    assert reference == [plain(b) for b in tud.DataLoader(Counting(11), **kw)]
    for k in range(len(reference) + 1):
        first = IterableRunner(Counting(11), **kw)
        it = iter(first)
        head = [plain(next(it)) for _ in range(k)]
        state = pickle.loads(pickle.dumps(first.state_dict()))
        first.shutdown()
        second = IterableRunner(Counting(11), **kw)
        second.load_state_dict(state)
        assert head + [plain(b) for b in second] == reference, k


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_after_a_break_and_a_dropped_iterator_resumes_exactly(num_workers):
    kw = dict(batch_size=2, num_workers=num_workers)
    reference = [plain(b) for b in IterableRunner(Counting(10), **kw)]
    runner = IterableRunner(Counting(10), **kw)
    head = []
    for b in runner:
        head.append(plain(b))
        if len(head) == 3:
            break
    del b
    gc.collect()   # the iterator is gone (its workers stopped); the position stays with the runner
    state = runner.state_dict()
    again = IterableRunner(Counting(10), **kw)
    again.load_state_dict(state)
    assert head + [plain(b) for b in again] == reference


class Epochs(IterableDataset):
    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        lo, hi = shard(0, 4)
        return iter([self.epoch * 100 + i for i in range(lo, hi)])


def test_set_epoch_reaches_the_dataset_and_new_workers():
    loader = feedgpu.DataLoader(Epochs(), batch_size=2, num_workers=2)
    loader.set_epoch(3)
    assert [b.tolist() for b in loader] == [[300, 301], [302, 303]]


def test_stateful_resume_in_a_later_epoch_with_persistent_workers():
    kw = dict(batch_size=2, num_workers=2, persistent_workers=True)
    runner = IterableRunner(Counting(9), **kw)
    epoch1 = [plain(b) for b in runner]
    it = iter(runner)
    head = [plain(next(it)) for _ in range(3)]
    state = runner.state_dict()
    runner.shutdown()
    again = IterableRunner(Counting(9), **kw)
    again.load_state_dict(state)
    assert head + [plain(b) for b in again] == epoch1
    done = again.state_dict()   # after a whole pass: a restore starts the next one
    third = IterableRunner(Counting(9), **kw)
    third.load_state_dict(done)
    assert [plain(b) for b in third] == epoch1
    again.shutdown()
    third.shutdown()


def test_state_dict_without_stateful_dataset_raises_state_error():
    runner = IterableRunner(Shards(0, 4), batch_size=2)
    next(iter(runner))
    with pytest.raises(StateError, match="has no state_dict\\(\\) and load_state_dict\\(\\)"):
        runner.state_dict()
    with pytest.raises(StateError, match="Stateful"):
        feedgpu.DataLoader(Shards(0, 4)).state_dict()


def test_state_from_other_settings_is_refused():
    state = IterableRunner(Counting(5), batch_size=2, num_workers=0).state_dict()
    with pytest.raises(StateError, match="batch_size: saved 2, here 3"):
        IterableRunner(Counting(5), batch_size=3).load_state_dict(state)


# -- feedgpu.DataLoader ---------------------------------------------------------------------------------
def test_feedgpu_dataloader_runs_an_iterable_dataset_as_torch():
    kw = dict(batch_size=3, num_workers=2, drop_last=True)
    assert events(feedgpu.DataLoader(Uneven([5, 8]), **kw)) == events(tud.DataLoader(Uneven([5, 8]), **kw))
    assert len(feedgpu.DataLoader(SizedShards(0, 10), batch_size=4)) == 3


@pytest.mark.parametrize("kw", [dict(shuffle=True), dict(sampler=[0, 1]), dict(batch_sampler=[[0]]),
                                dict(num_workers=-1), dict(prefetch_factor=2), dict(persistent_workers=True),
                                dict(batch_size=None, drop_last=True), dict(timeout=-1),
                                dict(multiprocessing_context="nope", num_workers=1),
                                dict(multiprocessing_context="spawn")])
def test_argument_errors_as_torch(kw):
    with pytest.raises(ValueError) as theirs:
        tud.DataLoader(Shards(0, 4), **kw)
    with pytest.raises(ValueError) as mine:
        feedgpu.DataLoader(Shards(0, 4), **kw)
    assert str(mine.value).split(",")[0].split(";")[0][:40] == str(theirs.value).split(",")[0].split(";")[0][:40]


def test_context_of_the_wrong_type_is_a_type_error_as_torch():
    for make in (tud.DataLoader, feedgpu.DataLoader):
        with pytest.raises(TypeError, match="multiprocessing_context option should be a valid context"):
            make(Shards(0, 4), num_workers=1, multiprocessing_context=3)


def test_feedgpu_only_options_are_refused_for_an_iterable_dataset():
    with pytest.raises(ConfigError, match="seed"):
        feedgpu.DataLoader(Shards(0, 4), seed=3)
    with pytest.raises(ConfigError, match="in_order=False"):
        feedgpu.DataLoader(Shards(0, 4), in_order=False)
    with pytest.raises(ConfigError, match="num_workers='auto'"):
        feedgpu.DataLoader(Shards(0, 4), num_workers="auto")


# -- real data ------------------------------------------------------------------------------------------
class PhotoStream(IterableDataset):
    """The JPEGs of ``shared/data/photos``, decoded with PIL; worker ``i`` streams every n-th file."""

    def __init__(self, root: Path):
        self.files = sorted(str(p) for p in root.glob("*.jpg"))

    def __iter__(self):
        wi = get_worker_info()
        wid, n = (0, 1) if wi is None else (wi.id, wi.num_workers)
        for i in range(wid, len(self.files), n):
            with Image.open(self.files[i]) as im:
                img = im.convert("RGB").resize((64, 48), Image.BILINEAR)
            yield torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1), i


def test_streaming_real_jpegs_matches_torch():
    ds = PhotoStream(PHOTOS)
    assert len(ds.files) >= 30
    kw = dict(batch_size=4, num_workers=2)
    theirs = list(tud.DataLoader(ds, **kw))
    mine = list(feedgpu.DataLoader(ds, **kw))
    assert len(mine) == len(theirs)
    for (xa, ia), (xb, ib) in zip(theirs, mine):
        assert ia.tolist() == ib.tolist() and torch.equal(xa, xb)
        assert xb.dtype == torch.uint8 and xb.shape[1:] == (3, 48, 64)
    assert sorted(i for _, idx in mine for i in idx.tolist()) == list(range(len(ds.files)))   # each photo once


# -- pin_memory ------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only warning")
def test_pin_memory_without_cuda_warns_as_torch_and_delivers_plain_tensors():
    for make in (tud.DataLoader, IterableRunner):
        with pytest.warns(UserWarning, match="pin_memory"):
            batches = list(make(Shards(0, 6), batch_size=3, num_workers=1, pin_memory=True))
        assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_memory_pins_batches_from_workers():
    batches = list(IterableRunner(Uneven([3, 2]), batch_size=2, num_workers=2, pin_memory=True))
    assert batches and all(b["j"].is_pinned() for b in batches)


def test_workers_busy_in_a_batch_exit_when_the_main_process_dies():
    """The main process is SIGKILLed while every worker is in the middle of a batch that never
    ends (a stream stuck on a read): the workers exit by themselves, as the map-style pool's do."""
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(REPO)!r})
        import torch.utils.data as tud
        from feedgpu import DataLoader

        class StuckAfterOne(tud.IterableDataset):
            def __iter__(self):
                yield 1
                time.sleep(3600)   # the next batch never comes

        loader = DataLoader(StuckAfterOne(), batch_size=2, num_workers=2)
        it = iter(loader)
        print(" ".join(map(str, loader.worker_pids())), flush=True)
        time.sleep(2)   # both workers are now in their first batch's sleep
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    assert wait_gone(pids, budget_s=15) == [], "orphaned workers keep running"


def test_explain_says_how_an_iterable_dataset_runs():
    inline = feedgpu.DataLoader(Shards(0, 8)).explain()
    assert "Shards (an IterableDataset" in inline and "main process" in inline and "dataset[i]" not in inline
    assert "round-robin" in feedgpu.DataLoader(Shards(0, 8), num_workers=2).explain()
