"""num_workers="auto": the autoscaler measures windows and the loader applies its decisions
without changing what it delivers."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from feedgpu import DataLoader, Pipeline
from feedgpu.balancer.autoscale import Autoscaler, default_config
from feedgpu.balancer import Decision, Policy, PolicyConfig
from feedgpu.stages import Decode, PythonStage, ResizeCenterCrop

pytestmark = pytest.mark.timeout(120)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeProbe:
    """Workers each burn ``per_worker`` cores (a number, or a function of the number of workers:
    a worker waiting for a free batch slot burns none); the main process burns ``main``."""

    def __init__(self, clock, per_worker=1.0, main=0.1, others=0.0):
        self.clock, self.per_worker, self.main, self.others, self.last = clock, per_worker, main, others, 0.0

    def sample(self, pids, memory):
        dt, self.last = self.clock.t - self.last, self.clock.t
        each = self.per_worker(len(pids)) if callable(self.per_worker) else self.per_worker
        return (each * len(pids) * dt, self.main * dt, 100 * 2**20 * len(pids) if memory else 0,
                self.others * dt)


GIB = 2**30


def scaler(clock, cores=8, probe=None, **kw) -> Autoscaler:
    """An autoscaler on a fake clock and probe, with 16 GiB of memory free: nothing it sees
    depends on the machine's load."""
    kw.setdefault("config", default_config(cores))
    return Autoscaler(clock=clock, probe=probe or FakeProbe(clock), cores=cores,
                      memory_available=lambda: 16 * GIB, **kw)


def drive(a: Autoscaler, clock: FakeClock, rate_per_worker: float, demand: float, seconds: float, rows=32):
    """Batches arrive as a pool of ``a.workers`` x ``rate_per_worker`` delivers them to a consumer
    that needs ``rows / demand`` seconds per batch."""
    decisions, pids = [], [100]
    a.start(pids)
    end = clock.t + seconds
    while clock.t < end:
        produce = rows / (rate_per_worker * a.workers)
        busy = rows / demand
        waited = max(0.0, produce - busy)
        clock.t += busy + waited
        pids = list(range(100, 100 + a.workers))
        d = a.on_batch(rows, waited, pids)
        if d is not None:
            decisions.append(d)
    return decisions


def test_windows_build_measurements_and_skip_the_start_up_window():
    clock = FakeClock()
    events = []
    a = scaler(clock, workers=1, prefetch=2, window_s=1.0, min_batches=3, probe=FakeProbe(clock, others=1.5),
               callback=events.append)
    decisions = drive(a, clock, rate_per_worker=100, demand=1000, seconds=4.0)  # windows of 4 batches, 1.28 s
    assert decisions, "windows closed"
    m = a.last_measurement
    # one worker delivers 100 samples/s to a consumer that could take 1000: it waits ~90 %
    assert m.delivered_rate == pytest.approx(100, rel=0.05)
    assert m.demand_rate == pytest.approx(1000, rel=0.05)
    assert m.wait_fraction == pytest.approx(0.9, abs=0.03)
    assert m.cpu_budget == pytest.approx(8 - 0.1 - 1.5, abs=0.01)  # cores minus the main process and others
    assert len(events) == len(decisions)
    assert set(events[0]) == {"t", "measurement", "decision", "waiting_share", "experiment", "report"}
    assert events[0]["waiting_share"] == pytest.approx(0.9, abs=0.03)
    assert "waited for batches 9" in events[0]["report"] and "of its step time" in events[0]["report"]
    assert m.ram_budget_bytes == 8 * GIB + m.rss_bytes            # half of the injected free memory
    # three windows close; the start-up one is not judged
    assert len(decisions) == 2


def test_worker_cores_are_the_cpu_time_over_the_time_between_its_readings():
    """A callback that takes 0.2 s after each window (a user's logger) runs between one window's
    end and the next one's start: the workers' CPU time over that stretch is not divided by the
    window's wall time, so two workers busy on two cores read 2 cores, not 2.4 (over one core
    per worker, the policy could no longer bound what a worker less delivers)."""
    clock = FakeClock()

    def slow_logger(event):
        clock.t += 0.2

    a = scaler(clock, workers=2, prefetch=2, callback=slow_logger,
               config=PolicyConfig(min_workers=2, max_workers=2, min_prefetch=2, max_prefetch=2))
    drive(a, clock, rate_per_worker=100, demand=1000, seconds=8.0)
    assert len(a.measurements) >= 3
    assert all(m.cpu_cores_used == pytest.approx(2.0) for m in a.measurements)
    assert all(m.cpu_budget == pytest.approx(8 - 0.1) for m in a.measurements)


def test_autoscaler_grows_to_meet_demand_and_stays():
    clock = FakeClock()
    a = scaler(clock, workers=1, prefetch=2)
    drive(a, clock, rate_per_worker=100, demand=450, seconds=60)
    # 450/s needs 5 workers of 100/s; the balancer may keep one more, never fewer
    assert a.workers in (5, 6)
    s = a.stats()
    assert s["workers"] == a.workers and s["diagnosis"]["verdict"] == "meets demand"
    late = [p["workers"] for p in a.timeline if p["t"] > 40]
    assert len(set(late)) == 1, f"oscillates: {late}"


def test_autoscaler_shrinks_when_demand_drops():
    """Six workers of 100/s feed a loop that takes 150/s: each is busy a quarter of the time (1.5
    cores in all), so a worker less can still deliver, and the pool shrinks to 2 or 3."""
    clock = FakeClock()
    a = scaler(clock, workers=6, prefetch=2, probe=FakeProbe(clock, per_worker=lambda n: min(1.0, 150 / (100 * n))))
    drive(a, clock, rate_per_worker=100, demand=150, seconds=60)
    assert a.workers in (2, 3)


def test_workers_busy_on_every_core_are_not_dropped_by_a_loop_that_does_not_wait():
    """Six workers of 100/s, each busy all the time, feed a loop that takes 600/s and waits for
    none of it: five could deliver at most 500/s, so the balancer never tries a worker less."""
    clock = FakeClock()
    a = scaler(clock, workers=6, prefetch=2)
    decisions = drive(a, clock, rate_per_worker=100, demand=600, seconds=30)
    assert a.workers == 6 and not any(d.kind == "remove" for d in decisions)
    assert "no worker less" in a.policy.stats()["last"][-1]["reason"]


def test_a_busy_training_process_does_not_stop_a_worker_that_trains_faster():
    """The training process takes a core and another process half of one (a CPU budget of 0.5
    cores on 2), yet a second worker trains faster, and a third (over-subscribing the two cores;
    in this model 3 x 400/s meets the loop's 870/s, 2 workers give 800/s): the balancer measures
    that and keeps them."""
    clock = FakeClock()
    a = scaler(clock, cores=2, workers=1, prefetch=2, probe=FakeProbe(clock, main=1.0, others=0.5))
    drive(a, clock, rate_per_worker=400, demand=870, seconds=30)
    assert a.workers == 3
    assert a.last_measurement.cpu_budget == pytest.approx(1.0)  # reported (floored at 1), not a limit
    s = a.stats()
    kept = [e for e in s["experiments"] if e["kept"]]
    assert kept and kept[0]["kind"] == "add" and kept[0]["to"] == "2w/p2"
    assert "tried 2 workers / prefetch 2 (add)" in kept[0]["text"]
    assert s["waiting_share"] is not None and 0 <= s["waiting_share_mean"] <= 1
    assert "of its step time" in s["report"]


# -- in the loader ---------------------------------------------------------------------------------

class Painted(tud.Dataset):
    def __init__(self, n=480):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((8, 8, 3), i % 251, np.uint8), i


def burn(img):
    """~4 ms of CPU per sample: workers are CPU-bound, as decoding is."""
    t = time.thread_time()
    while time.thread_time() - t < 0.004:
        pass
    return img


def pipeline(**kw):
    opts = dict(batch_size=8, shuffle=True, seed=5, device="cpu")
    opts.update(kw)
    return Pipeline(Painted(), [Decode(), ResizeCenterCrop(8, 8), PythonStage(burn)], **opts)


def labels_of(loader, epochs=1):
    out = []
    for e in range(epochs):
        loader.set_epoch(e)
        out += [b.labels.clone() for b in loader]
    return torch.cat(out)


class Scripted(Policy):
    """Decides ``workers`` at the first judged window, then holds: a resize the test can count
    on whatever the machine's load (the real policy measures whether it pays)."""

    def __init__(self, config, workers):
        super().__init__(config)
        self.to = workers

    def _decide(self, m):
        if m.workers != self.to:
            return Decision(self.to, m.prefetch, "add", f"scripted: {self.to} workers", t=m.t)
        return Decision(m.workers, m.prefetch, "hold", "scripted: hold", t=m.t)


def test_auto_is_the_pipeline_default_and_resizes_without_changing_the_batches(no_leaked_workers):
    fixed = labels_of(DataLoader(pipeline(), num_workers=2), epochs=2)
    loader = DataLoader(pipeline())
    assert loader.auto_workers and loader._backend.autoscaler is not None
    a = loader._backend.autoscaler
    assert type(a.policy) is Policy
    a.window_s, a.min_batches = 0.25, 2
    a._memory_available = lambda: 16 * GIB
    # force a resize mid-epoch: start at 1 worker, the (scripted) policy asks for 2
    a.policy = Scripted(a.policy.config, 2)
    a.workers = loader.num_workers = 1
    seen_workers = set()
    got = []
    for e in range(2):
        loader.set_epoch(e)
        for b in loader:
            got.append(b.labels.clone())
            seen_workers.add(len(loader.worker_pids()))
    assert torch.equal(torch.cat(got), fixed)
    s = loader.stats()["balancer"]
    assert s["windows"] >= 2 and s["decisions"] >= 1 and s["last_window"]["delivered_rate"] > 0
    assert 1 in seen_workers and 2 in seen_workers, s["last"]
    loader.shutdown()


def test_auto_state_dict_resumes_exactly_after_a_resize(no_leaked_workers):
    ref = labels_of(DataLoader(pipeline(), num_workers=1))
    loader = DataLoader(pipeline())
    loader._backend.autoscaler.window_s, loader._backend.autoscaler.min_batches = 0.2, 2
    it = iter(loader)
    head = [next(it).labels.clone() for _ in range(30)]
    state = loader.state_dict()
    loader.shutdown()
    again = DataLoader(pipeline())
    again.load_state_dict(state)
    tail = [b.labels.clone() for b in again]
    assert torch.equal(torch.cat(head + tail), ref)


def test_stats_callback_receives_each_window(no_leaked_workers):
    events = []
    loader = DataLoader(pipeline(), stats_callback=events.append)
    loader._backend.autoscaler.window_s, loader._backend.autoscaler.min_batches = 0.2, 2
    n = sum(1 for _ in loader)
    assert n == len(loader)
    assert events and all(e["decision"]["workers"] >= 1 for e in events)
    assert events[-1]["measurement"]["delivered_rate"] > 0


def test_auto_with_a_torch_dataset(no_leaked_workers):
    ds = Painted(64)
    got = torch.cat([y for _, y in DataLoader(ds, batch_size=8, num_workers="auto", shuffle=False)])
    assert torch.equal(got, torch.arange(64))


def test_policy_bounds_follow_the_cores():
    c = default_config(6)
    # one worker more than the cores: whether it trains faster is measured
    assert isinstance(c, PolicyConfig) and (c.min_workers, c.max_workers, c.max_prefetch) == (1, 7, 4)
    assert default_config(6, max_workers=12).max_workers == 12   # a user's max_local_workers, as given


def test_next_epoch_is_submitted_while_this_one_ends(no_leaked_workers):
    """Persistent workers start the next epoch's first batches before the epoch ends; the next
    iteration adopts them when it starts that epoch, and drops them for any other."""
    ref = DataLoader(pipeline(), num_workers=0)
    expect = {e: labels_of_epoch(ref, e) for e in (0, 1, 5)}
    loader = DataLoader(pipeline(), num_workers=2)
    assert torch.equal(labels_of_epoch(loader, 0), expect[0])
    ahead = loader._backend.ahead
    assert ahead is not None and ahead.epoch == 1 and len(ahead) > 0 and ahead.submitted == len(ahead)
    assert torch.equal(labels_of_epoch(loader, 1), expect[1])      # adopted
    assert loader._backend.ahead is not None and loader._backend.ahead.epoch == 2
    assert torch.equal(labels_of_epoch(loader, 5), expect[5])      # epoch 2's dropped, 5 computed
    it = iter(loader)
    next(it)
    del it                                                         # an abandoned epoch leaves nothing ahead
    assert loader._backend.ahead is None
    loader.set_epoch(1)
    assert torch.equal(labels_of_epoch(loader, 1), expect[1])
    loader.shutdown()
    assert loader._backend.ahead is None


def labels_of_epoch(loader, epoch):
    loader.set_epoch(epoch)
    return torch.cat([b.labels.clone() for b in loader])


def test_set_epoch_of_the_restored_epoch_keeps_the_position(no_leaked_workers):
    """``for epoch in range(start, n): loader.set_epoch(epoch)`` after load_state_dict resumes
    mid-epoch without repeating a batch; another epoch starts from its first batch."""
    full = DataLoader(pipeline(), num_workers=2)
    expect = labels_of_epoch(full, 1)
    loader = DataLoader(pipeline(), num_workers=2)
    loader.set_epoch(1)
    it = iter(loader)
    head = [next(it).labels.clone() for _ in range(4)]
    state = loader.state_dict()
    loader.shutdown()
    again = DataLoader(pipeline(), num_workers=2)
    again.load_state_dict(state)
    again.set_epoch(1)
    assert torch.equal(torch.cat(head + [b.labels.clone() for b in again]), expect)
    other = DataLoader(pipeline(), num_workers=0)
    other.load_state_dict(state)
    other.set_epoch(2)
    assert len([b for b in other]) == len(other)


class Tiny(tud.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        burn(None)
        return torch.tensor([i])


def test_windows_span_short_epochs_of_non_persistent_workers(no_leaked_workers):
    events = []
    loader = DataLoader(Tiny(), batch_size=4, num_workers="auto", stats_callback=events.append)
    assert not loader.persistent_workers
    loader.balancer.window_s, loader.balancer.min_batches = 0.3, 2
    for e in range(8):  # 12 batches per epoch, a new pool each epoch
        loader.set_epoch(e)
        for _ in loader:
            pass
    assert loader.stats()["balancer"]["windows"] >= 2 and events


def test_more_workers_than_cores_warns():
    from feedgpu.host import cpu_cores

    n = cpu_cores() + 1
    with pytest.warns(UserWarning) as caught:   # torch's words, which log filters and tests look for
        DataLoader(Tiny(), batch_size=4, num_workers=n)
    message = str(caught[0].message)
    assert "excessive worker creation might get DataLoader running slow or even freeze" in message
    assert f"will create {n} worker processes" in message and f"is {n - 1}," in message
    assert caught[0].filename == __file__   # points at the caller's line


class SlowSeven(tud.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 7:
            time.sleep(5)
        return torch.tensor([i])


def test_timeout_names_the_dataset_item(no_leaked_workers):
    from feedgpu import LoaderTimeout

    loader = DataLoader(SlowSeven(), batch_size=4, num_workers=1, timeout=1.0)
    with pytest.raises(LoaderTimeout, match=r"in stage '__getitem__' on SlowSeven\[7\]"):
        list(loader)


def test_the_timeline_counts_forgets_and_keeps_the_reason_of_a_hold_that_forgot():
    """A pool held at its only setting whose rate halves: the window that forgets the records is
    a hold, and its timeline point keeps the reason; plain holds leave it to the policy's history,
    and every point carries the count of forgets so far (``resets``)."""
    clock = FakeClock()
    only = PolicyConfig(min_workers=2, max_workers=2, min_prefetch=2, max_prefetch=2)
    a = scaler(clock, workers=2, prefetch=2, window_s=1.0, min_batches=3, config=only)
    a.start([100, 101])
    for interval in [0.1] * 200 + [0.2] * 30:     # 320 samples/s, then 160
        clock.t += interval
        a.on_batch(32, 0.0, [100, 101])
    points = list(a.timeline)
    forgot = [p for p in points if "records forgotten" in p.get("reason", "")]
    assert len(forgot) == 1 and forgot[0]["decision"] == "hold", forgot
    assert points[-1]["resets"] == 1 and points[0]["resets"] == 0
    assert all("reason" not in p for p in points if p["decision"] == "hold" and p is not forgot[0])
