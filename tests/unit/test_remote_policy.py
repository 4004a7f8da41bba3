"""The balancer's remote decision (``executor: ray``) against a simulated local pool, remote
workers and consumer: no processes, no Ray, no clock."""
from __future__ import annotations

import pytest

from feedgpu.errors import ConfigError
from feedgpu.balancer import Measurement, Policy, PolicyConfig
from feedgpu.balancer.policy_config import WindowRules
from feedgpu.balancer.remote_policy import RemoteConfig, RemotePolicy


class Sim:
    """Local workers deliver ``local_rate`` each up to ``budget`` cores, remote ones
    ``remote_rate`` each; the consumer takes ``demand`` samples/s."""

    def __init__(self, local_rate=100.0, remote_rate=100.0, demand=250.0, budget=2.0):
        self.local_rate, self.remote_rate, self.demand, self.budget = local_rate, remote_rate, demand, budget

    def measure(self, t: int, workers: int, prefetch: int, remote: int) -> Measurement:
        local = min(workers, self.budget) * self.local_rate
        supply = local + remote * self.remote_rate
        delivered = min(self.demand, supply)
        wait = max(0.0, 1.0 - supply / self.demand)
        return Measurement(t=float(t), workers=workers, delivered_rate=delivered, demand_rate=self.demand,
                           wait_fraction=wait, cpu_cores_used=min(workers, self.budget) * min(1.0, delivered / supply),
                           cpu_budget=self.budget, prefetch=prefetch, remote_workers=remote)


def run(sim: Sim, windows: int, policy: Policy, remote: RemotePolicy, start=(2, 2, 0), t0: int = 0):
    workers, prefetch, r = start
    out = []
    for t in range(t0, t0 + windows):
        m = sim.measure(t, workers, prefetch, r)
        d = remote.decide(m, policy)
        out.append(d)
        workers, prefetch, r = d.workers, d.prefetch, d.remote_workers
    return out, (workers, prefetch, r)


def policies(max_local=2, max_remote=4):
    return Policy(PolicyConfig(min_workers=1, max_workers=max_local, max_prefetch=4)), \
        RemotePolicy(RemoteConfig(max_remote=max_remote))


def test_adds_remote_workers_only_when_the_local_pool_is_at_its_budget_and_the_loop_waits():
    local, remote = policies(max_local=8)   # 2 cores: a third local worker trains no faster
    sim = Sim(demand=450)   # 2 local cores give 200/s: 3 remote workers more are needed (500/s)
    ds, (w, _, r) = run(sim, 160, local, remote)
    assert (w, r) == (2, 3)
    adds = [d for d in ds if d.kind == "remote-add"]
    assert [d.remote_workers for d in adds][:3] == [1, 2, 3]
    assert "cannot grow" in adds[0].reason and "3 workers / prefetch 2: 200/s vs 200/s" in adds[0].reason
    assert all(d.workers <= 3 for d in ds), "a third local worker is tried, never a fourth"
    assert all(d.workers == 2 for d in ds if d.kind.startswith("remote")), \
        "remote workers are added with the local pool at its best"
    # a 4th remote worker: tried when the loop still waits at 3? It does not (450 < 500)
    assert sim.measure(0, w, 2, r).wait_fraction == 0.0


def test_no_remote_worker_while_the_local_pool_can_still_grow():
    local, remote = policies(max_local=4)
    sim = Sim(demand=300, budget=4.0)   # 3 local workers meet demand
    ds, (w, _, r) = run(sim, 60, local, remote, start=(1, 2, 0))
    assert r == 0 and w >= 3
    assert not any(d.kind == "remote-add" for d in ds)


def test_a_remote_worker_that_adds_nothing_is_undone_and_not_tried_again():
    local, remote = policies()
    sim = Sim(demand=450, remote_rate=0.0)   # e.g. a one-node cluster on the same busy cores
    ds, (_, _, r) = run(sim, 160, local, remote)
    assert r == 0
    adds = [i for i, d in enumerate(ds) if d.kind == "remote-add"]
    assert adds and all(b - a >= RemoteConfig().recheck_windows for a, b in zip(adds, adds[1:])), adds
    revert = next(d for d in ds if d.kind == "revert" and "remote" in d.reason)
    assert revert.remote_workers == 0 and "undone: 0 -> 1 remote workers" in revert.reason
    assert remote.stats()["not_worth_adding"].keys() == {0}


def test_releases_remote_workers_when_demand_falls_and_keeps_what_is_needed():
    local, remote = policies()
    sim = Sim(demand=450)
    _, state = run(sim, 160, local, remote)
    assert state[2] == 3
    sim.demand = 320          # 2 local + 2 remote (400/s) meet it; 2 local + 1 remote (300/s) do not
    ds, (w, _, r) = run(sim, 120, local, remote, start=state, t0=160)
    assert (w, r) == (2, 2)
    kinds = [d.kind for d in ds]
    assert kinds.count("remote-remove") == 2 and "revert" in kinds   # 3 -> 2 kept, 2 -> 1 undone
    sim.demand = 150          # the local pool alone is enough: every remote worker goes
    ds, (w, _, r) = run(sim, 120, local, remote, start=(w, 2, r), t0=280)
    assert r == 0
    assert all(d.kind != "remote-add" for d in ds)


def test_remote_steps_are_released_before_local_workers():
    local, remote = policies()
    sim = Sim(demand=450)
    _, state = run(sim, 160, local, remote)
    sim.demand = 100
    ds, _ = run(sim, 12, local, remote, start=state, t0=160)
    first_change = next(d for d in ds if d.changes)
    assert first_change.kind == "remote-remove" and first_change.workers == 2


def test_the_window_knobs_are_one_declaration_with_each_policys_defaults():
    """Both policies take the window knobs from :class:`WindowRules`: the same names, the same
    bounds checked once, each with its own defaults (the values these classes always had)."""
    knobs = ("wait_threshold", "drift_threshold", "settle_windows", "start_windows", "measure_windows",
             "base_windows", "recheck_windows")
    local, remote = PolicyConfig(), RemoteConfig()
    assert isinstance(local, WindowRules) and isinstance(remote, WindowRules)
    assert {k: getattr(local, k) for k in knobs} == {
        "wait_threshold": 0.03, "drift_threshold": 0.15, "settle_windows": 1, "start_windows": 1,
        "measure_windows": 2, "base_windows": 2, "recheck_windows": 120}
    assert {k: getattr(remote, k) for k in knobs} == {
        "wait_threshold": 0.03, "drift_threshold": 0.15, "settle_windows": 1, "start_windows": 20,
        "measure_windows": 2, "base_windows": 3, "recheck_windows": 60}
    for cls in (PolicyConfig, RemoteConfig):
        for bad in ({"settle_windows": -1}, {"measure_windows": 0}, {"base_windows": 0}):
            with pytest.raises(ConfigError, match=cls.__name__):
                cls(**bad)
    with pytest.raises(ConfigError, match="start_windows"):
        RemoteConfig(start_windows=0)   # the remote policy needs a window to wait for Ray
    assert PolicyConfig(start_windows=0).start_windows == 0   # the local one may judge at once


def test_the_limit_applies_at_once_and_bad_config_is_refused():
    local, remote = policies(max_remote=1)
    d = remote.decide(Sim().measure(0, 2, 2, 3), local)
    assert (d.kind, d.remote_workers) == ("remote-remove", 1)
    with pytest.raises(ConfigError):
        RemoteConfig(max_remote=-1)
    with pytest.raises(ConfigError):
        RemoteConfig(measure_windows=0)
    with pytest.raises(ConfigError):
        Measurement(t=0, workers=1, delivered_rate=1, demand_rate=1, wait_fraction=0, cpu_cores_used=0,
                    cpu_budget=1, remote_workers=-1)


def test_same_measurements_same_decisions():
    a = run(Sim(demand=450), 60, *policies())[0]
    b = run(Sim(demand=450), 60, *policies())[0]
    assert [(d.kind, d.workers, d.remote_workers) for d in a] == [(d.kind, d.workers, d.remote_workers) for d in b]


def test_a_step_is_judged_once_the_new_remote_worker_has_started():
    local, remote = policies(max_local=8)
    sim = Sim(demand=450)
    state, late = (2, 2, 0), 6            # Ray takes 6 windows to start each new worker
    started_at = {}
    decisions = []
    for t in range(160):
        w, p, r = state
        m = sim.measure(t, w, p, r)
        started = sum(1 for k in range(1, r + 1) if t - started_at.get(k, t) >= late)
        m = Measurement(**{**m.__dict__, "remote_started": started,
                           "delivered_rate": min(sim.demand, 200 + 100 * started),
                           "wait_fraction": max(0.0, 1 - (200 + 100 * started) / sim.demand)})
        d = remote.decide(m, local)
        decisions.append(d)
        if d.remote_workers > r:
            started_at[d.remote_workers] = t
        state = (d.workers, d.prefetch, d.remote_workers)
    judged = [d.reason.split(":")[0] for d in decisions if d.reason.startswith(("kept: ", "undone: 0", "undone: 1 ->",
                                                                                 "undone: 2 -> 3"))]
    assert judged[:3] == ["kept"] * 3, [(d.kind, d.reason) for d in decisions]   # no add judged before it ran
    assert sum("waiting for Ray to start" in d.reason for d in decisions) >= 15


def test_a_remote_worker_ray_never_starts_is_given_back():
    local = policies(max_local=8)[0]
    remote = RemotePolicy(RemoteConfig(max_remote=2, start_windows=3))
    sim = Sim(demand=450)
    state = (2, 2, 0)
    decisions = []
    for t in range(60):
        w, p, r = state
        m = Measurement(**{**sim.measure(t, w, p, 0).__dict__, "remote_workers": r, "remote_started": 0})
        d = remote.decide(m, local)
        decisions.append(d)
        state = (d.workers, d.prefetch, d.remote_workers)
    revert = next(d for d in decisions if d.kind == "revert" and "remote" in d.reason)
    assert revert.remote_workers == 0 and "did not start a remote worker within 3 windows" in revert.reason
    assert [d.kind for d in decisions].count("remote-add") == 1, "not tried again while the loop still waits"


class Faster(Sim):
    """The machine gets ``speedup`` faster from window ``at`` on (another job left it)."""

    def __init__(self, at: int, speedup: float, **kw):
        super().__init__(**kw)
        self.at, self.speedup = at, speedup

    def measure(self, t, workers, prefetch, remote):
        m = super().measure(t, workers, prefetch, remote)
        if t < self.at:
            return m
        return Measurement(**{**m.__dict__, "delivered_rate": m.delivered_rate * self.speedup})


def first_add(ds):
    return next(i for i, d in enumerate(ds) if d.kind == "remote-add")


def test_a_small_remote_gain_is_confirmed_against_the_old_count_measured_afresh():
    """A remote worker that adds nothing, added just as the machine got 8 % faster, looks +8 %
    on its windows: more than the 3 % a worker more must gain, less than a drift. The old count
    is measured again after it, trains as fast, and the add is undone (A-B-A)."""
    local, remote = policies()
    probe = run(Sim(demand=450, remote_rate=0.0), 160, *policies())[0]
    at = first_add(probe) + 1                         # the add's first window, at the new speed
    ds, (_, _, r) = run(Faster(at, 1.08, demand=450, remote_rate=0.0), at + 12, local, remote)
    assert r == 0
    reasons = [d.reason for d in ds[at:]]
    confirm = next(x for x in reasons if "afresh" in x)
    assert "0 -> 1 remote workers: 200/s -> 216/s (+8.0%)" in confirm and "drift" in confirm, confirm
    undone = next(x for x in reasons if x.startswith("undone"))
    assert "216/s -> 216/s" in undone and "measured afresh after the add" in undone, undone
    assert remote.stats()["not_worth_adding"].keys() == {0}
    assert [d.kind for d in ds[at:]].count("remote-add") == 0   # not tried again at once


def test_a_real_small_remote_gain_is_kept_after_the_old_count_is_measured_afresh():
    """A remote worker that adds 8 % (16/s on 200/s) is kept once the old count, measured
    again, still trains 200/s; one that adds 50 % is kept at once."""
    local, remote = policies(max_remote=1)
    ds, (_, _, r) = run(Sim(demand=450, remote_rate=16.0), 160, local, remote)
    assert r == 1
    kept = [d for d in ds if d.reason.startswith("kept")]
    assert kept and kept[0].kind == "remote-add" and "measured afresh after the add" in kept[0].reason, kept
    assert "0 -> 1 remote workers: 200/s -> 216/s (+8.0%)" in kept[0].reason
    counts = [0] + [d.remote_workers for d in ds]
    assert [b for a, b in zip(counts, counts[1:]) if a != b] == [1, 0, 1]   # A-B-A-B: one confirmation
    local, remote = policies(max_remote=1)
    ds, (_, _, r) = run(Sim(demand=450), 160, local, remote)
    assert r == 1 and not any("afresh" in d.reason for d in ds)


class NoisyFaster(Faster):
    """:class:`Faster` with window rates spreading ``spread`` (a cycle, no randomness) and the
    waiting shares as they were: the loop's own work and the loader got faster together."""

    def __init__(self, at: int, speedup: float, spread=(0.9, 1.1, 0.95, 1.05, 1.0), **kw):
        super().__init__(at, speedup, **kw)
        self.spread = spread

    def measure(self, t, workers, prefetch, remote):
        m = super().measure(t, workers, prefetch, remote)
        return Measurement(**{**m.__dict__, "delivered_rate": m.delivered_rate * self.spread[t % len(self.spread)]})


def test_a_remote_gain_the_wait_cannot_explain_is_not_kept():
    """A remote worker that adds nothing, added as the machine got 20 % faster (more than a
    drift must move): the loop waits as long as before, so the shorter wait explains no gain,
    and the add is undone at once, without the A-B-A a gain that size would otherwise skip."""
    probe = run(NoisyFaster(10_000, 1.0, demand=450, remote_rate=0.0), 160, *policies())[0]
    at = first_add(probe) + 1
    local, remote = policies()
    ds, (_, _, r) = run(NoisyFaster(at, 1.2, demand=450, remote_rate=0.0), at + 12, local, remote)
    assert r == 0
    undone = next(d.reason for d in ds[at:] if d.reason.startswith("undone"))
    assert "the shorter wait explains at most +0.0%" in undone and "afresh" not in undone, undone
    assert not any("afresh" in d.reason for d in ds[at:])
