"""The throughput balancer's policy, against simulated producers and consumers.

No processes, no GPU, no clock: every scenario runs a few hundred simulated windows through
:class:`feedgpu.exec.balancer.Policy` in milliseconds, and the same seed gives the same run.
"""
from __future__ import annotations

import logging
import math

import pytest

from feedgpu.errors import ConfigError
from feedgpu.exec.balancer import (
    DaliTrial, Decision, EngineRate, Measurement, Policy, PolicyConfig, choose_dali_settings, choose_placement,
    dali_gpu_candidates, diagnose, start_workers,
)
from feedgpu.exec.simulate import MIB, Producer, Simulation, at, run

GIB = 2**30


# -- helpers -------------------------------------------------------------------------------------

def real_changes(steps) -> list[int]:
    """Windows whose decision changed the setting, leaving out re-check probes that were undone
    (a probe and the revert back to the setting before it)."""
    changes = [i for i, s in enumerate(steps) if s.decision.changes]
    out, k = [], 0
    while k < len(changes):
        i = changes[k]
        if steps[i].decision.kind == "probe" and k + 1 < len(changes):
            j = changes[k + 1]
            before = (steps[i].measurement.workers, steps[i].measurement.prefetch)
            if steps[j].decision.kind == "revert" and (steps[j].decision.workers, steps[j].decision.prefetch) == before:
                k += 2
                continue
        out.append(i)
        k += 1
    return out


def converged_at(steps, since: int = 0) -> int:
    """Windows after ``since`` until the last real change (0 when none)."""
    later = [i for i in real_changes(steps) if i >= since]
    return later[-1] - since + 1 if later else 0


def check_final(sim: Simulation, steps, *, tolerance: float = 0.05):
    """The last setting delivers within ``tolerance`` of the best fixed setting's rate and uses at
    most one worker more than it."""
    last = steps[-1].decision
    best_w, best_rate = sim.best_fixed(prefetch=last.prefetch)
    got = sim.delivered(last.workers, last.prefetch)
    assert got >= (1 - tolerance) * best_rate, (
        f"{last.workers} workers deliver {got:.0f}/s, best fixed {best_w} workers {best_rate:.0f}/s; "
        f"last decision: {last.reason}")
    assert last.workers <= best_w + 1, f"{last.workers} workers, best fixed {best_w}: {last.reason}"
    return best_w, best_rate


# -- scenarios: constant demand ---------------------------------------------------------------------

#: name -> (producer, demand, bound on windows to converge). The bound counts windows (a few
#: seconds each in the loader); it includes the settle window after every change and the
#: windows re-measured on close calls.
SCENARIOS = {
    # the CPU can meet demand: 5 workers of 200/s for 900/s
    "below": (Producer(200, 8), 900, 25),
    # demand above all the cores give: the budget's 8 workers
    "above": (Producer(200, 8), 4000, 10),
    # demand just inside the budget (7.5 workers' worth)
    "near": (Producer(200, 8), 1500, 25),
    # diminishing returns (rate ~ workers ** 0.9) on the 16-core reference box, 15 for the pool
    "diminishing": (Producer(213, 15, scaling=0.9), 100_000, 10),
    # a hand-off cap (1,500/s) reached at 5 workers though 12 cores are free
    "capped": (Producer(300, 12, cap_rate=1500), 5000, 30),
    # docs/anchors.md: torch+Pillow ~213/s per worker, ResNet-50 demand 4,722/s, 15 cores
    "reference-cpu-bound": (Producer(213, 15), 4722, 10),
    # same box, a consumer the CPU can meet with 12 workers
    "reference-meets": (Producer(213, 15), 2500, 30),
    # the 2-core development machine
    "two-cores": (Producer(300, 2), 500, 10),
    # a consumer one worker can feed
    "tiny-demand": (Producer(300, 8), 100, 10),
    # workers idle for lack of queued batches: prefetch 4 is needed
    "shallow-prefetch": (Producer(200, 8, min_prefetch=4), 1300, 40),
    # a loader-only benchmark: the consumer takes everything
    "loader-only": (Producer(200, 8), math.inf, 10),
}


@pytest.mark.parametrize("noise,seeds", [(0.0, (0,)), (0.02, (1, 2, 3))], ids=["exact", "noisy"])
@pytest.mark.parametrize("start", ["one", "half", "budget"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_converges_to_best_fixed_setting(name, start, noise, seeds):
    producer, demand, bound = SCENARIOS[name]
    for seed in seeds:
        sim = Simulation(producer, demand, noise=noise, seed=seed)
        w0 = {"one": 1, "half": start_workers(producer.cores), "budget": int(producer.cores)}[start]
        steps = run(Policy(), sim, 200, w0)
        check_final(sim, steps)
        took = converged_at(steps)
        assert took <= bound, f"seed {seed}: converged after {took} windows (bound {bound}): {real_changes(steps)}"
        # no oscillation: nothing changes in the last 100 windows but undone re-check probes
        assert not [i for i in real_changes(steps) if i >= 100], real_changes(steps)


@pytest.mark.parametrize("seed", range(4))
def test_noisier_windows_still_converge(seed):
    """3 % noise per window on both rates: within 5 % of the best, one worker more at most."""
    for producer, demand, _ in (SCENARIOS["below"], SCENARIOS["near"], SCENARIOS["reference-meets"]):
        sim = Simulation(producer, demand, noise=0.03, seed=seed)
        steps = run(Policy(), sim, 200, start_workers(producer.cores))
        check_final(sim, steps)
        assert converged_at(steps) <= 40


def test_long_run_is_quiet():
    """1,000 noisy windows at a steady demand: after converging, no change but re-check probes,
    and those come at doubling intervals only while the consumer waits."""
    sim = Simulation(Producer(200, 8), 900, noise=0.02, seed=7)
    steps = run(Policy(), sim, 1000, 4)
    assert converged_at(steps) <= 25
    assert not [s for s in steps[25:] if s.decision.changes]  # supply meets demand: no probes

    sim = Simulation(Producer(200, 8), 4000, noise=0.02, seed=7)  # at the CPU budget: nothing to probe
    steps = run(Policy(), sim, 1000, 4)
    assert max(real_changes(steps)) < 10 and not [s for s in steps if s.decision.kind == "probe"]

    sim = Simulation(Producer(300, 12, cap_rate=1500), 5000, noise=0.02, seed=7)  # waits below budget
    steps = run(Policy(), sim, 1000, 6)
    probes = [i for i, s in enumerate(steps) if s.decision.kind == "probe"]
    assert max(real_changes(steps)) < 30
    assert 2 <= len(probes) <= 4, probes
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert all(g2 > g1 for g1, g2 in zip(gaps, gaps[1:])), gaps


def test_deterministic():
    def trace():
        sim = Simulation(Producer(213, 15, scaling=0.9), ((0, 2000), (60, 3000)), noise=0.03, seed=11)
        return [s.decision for s in run(Policy(), sim, 150, 3)]

    assert trace() == trace()


# -- scenarios: changes over time ----------------------------------------------------------------------

STEP_AT = 100


@pytest.mark.parametrize("noise,seed", [(0.0, 0), (0.02, 1), (0.02, 2)])
@pytest.mark.parametrize("before,after", [(600, 1400), (1400, 600), (900, 4000), (4000, 900)],
                         ids=["up", "down", "up-past-cpu", "down-from-cpu"])
def test_adapts_to_a_step_in_demand(before, after, noise, seed):
    sim = Simulation(Producer(200, 8), ((0, before), (STEP_AT, after)), noise=noise, seed=seed)
    steps = run(Policy(), sim, 250, 4)
    w_before, rate_before = sim.best_fixed(t=STEP_AT - 1)
    d = steps[STEP_AT - 2].decision
    assert sim.delivered(d.workers, d.prefetch, t=STEP_AT - 1) >= 0.95 * rate_before
    assert d.workers <= w_before + 1
    check_final(sim, steps)
    assert converged_at(steps, since=STEP_AT) <= 30
    assert any("demand moved" in s.decision.reason for s in steps[STEP_AT:STEP_AT + 5])


@pytest.mark.parametrize("budget_sees_contention", [True, False], ids=["budget-sees-it", "budget-blind"])
@pytest.mark.parametrize("noise,seed", [(0.0, 0), (0.02, 3)])
def test_adapts_to_cpu_contention(budget_sees_contention, noise, seed):
    """Another process takes 4 of 8 cores from window 100: the pool shrinks to what is left
    (more workers only share the same cores)."""
    sim = Simulation(Producer(250, 8), 1500, contention=((0, 0), (STEP_AT, 4)), noise=noise, seed=seed,
                     budget_sees_contention=budget_sees_contention)
    steps = run(Policy(), sim, 250, 4)
    best_w, _ = check_final(sim, steps)
    assert best_w == 4
    assert converged_at(steps, since=STEP_AT) <= 40
    if budget_sees_contention:
        assert all(s.decision.workers <= 4 for s in steps[STEP_AT:])  # at once, never over budget
    else:
        assert any("rate at" in s.decision.reason and "moved" in s.decision.reason for s in steps[STEP_AT:])


@pytest.mark.parametrize("budget_sees_contention", [True, False], ids=["budget-sees-it", "budget-blind"])
def test_grows_back_when_contention_ends(budget_sees_contention):
    """The neighbour leaves at window 100. With a budget that counts other processes' CPU the pool
    grows at once; blind to it, the periodic re-check finds the free cores."""
    sim = Simulation(Producer(250, 8), 1500, contention=((0, 4), (STEP_AT, 0)), noise=0.02, seed=5,
                     budget_sees_contention=budget_sees_contention)
    steps = run(Policy(), sim, 400, 4)
    check_final(sim, steps)
    took = converged_at(steps, since=STEP_AT)
    assert took <= (30 if budget_sees_contention else PolicyConfig().recheck_windows + 40)


def test_never_exceeds_the_cpu_budget():
    sim = Simulation(Producer(200, 16), 10_000, cpu_budget=5.6)  # round(5.6) = 6
    steps = run(Policy(), sim, 100, 2)
    assert max(s.decision.workers for s in steps) == 6
    assert "CPU budget" in steps[-1].decision.reason


def test_shrinks_at_once_when_the_budget_drops():
    p = Policy()
    m = Measurement(t=1, workers=8, delivered_rate=1600, demand_rate=4000, wait_fraction=0.6,
                    cpu_cores_used=8, cpu_budget=3.2)
    d = p.decide(m)
    assert (d.kind, d.workers) == ("remove", 3)
    assert "CPU budget (3.2 cores)" in d.reason


def test_respects_the_ram_budget():
    """1 GiB per worker over 512 MiB, 5 GiB budget: at most 4 workers however hungry the consumer."""
    producer = Producer(200, 16, rss_base_bytes=512 * MIB, rss_per_worker_bytes=GIB)
    sim = Simulation(producer, 10_000, ram_budget_bytes=5 * GIB, noise=0.02, seed=1)
    steps = run(Policy(), sim, 120, 1)
    assert all(s.measurement.rss_bytes <= 5 * GIB for s in steps)
    assert steps[-1].decision.workers == 4
    assert "RAM budget" in steps[-1].decision.reason
    # over budget (the budget shrank): straight down to what fits
    d = Policy().decide(Measurement(t=1, workers=8, delivered_rate=1600, demand_rate=4000, wait_fraction=0.6,
                                    cpu_cores_used=8, cpu_budget=16, rss_bytes=8 * GIB,
                                    ram_budget_bytes=4 * GIB))
    assert d.kind == "remove" and d.workers == 4 and "RAM budget" in d.reason


def test_min_and_max_workers():
    cfg = PolicyConfig(min_workers=2, max_workers=5)
    steps = run(Policy(cfg), Simulation(Producer(200, 16), 100), 60, 3)
    assert min(s.decision.workers for s in steps) == 2
    steps = run(Policy(cfg), Simulation(Producer(200, 16), 10_000), 60, 3)
    assert max(s.decision.workers for s in steps) == 5
    assert "configured maximum" in steps[-1].decision.reason


# -- single rules --------------------------------------------------------------------------------------

def window(t, workers, rate, demand=1000.0, *, prefetch=2, cores=None, budget=8.0, **kw) -> Measurement:
    wait = max(0.0, 1 - rate / demand) if demand != math.inf else 0.999
    return Measurement(t=t, workers=workers, delivered_rate=rate, demand_rate=demand, wait_fraction=wait,
                       cpu_cores_used=workers if cores is None else cores, cpu_budget=budget, prefetch=prefetch, **kw)


def quiet(**kw) -> PolicyConfig:
    """No settle window, no estimate jump, one window per step: each rule in isolation."""
    base = dict(settle_windows=0, estimate=False, base_windows=1, noise_prior=0.01)
    base.update(kw)
    return PolicyConfig(**base)


def test_add_kept_when_it_gains_more_than_7_percent():
    p = Policy(quiet())
    assert p.decide(window(1, 4, 400)).kind == "add"          # the consumer waits 60 %
    d = p.decide(window(2, 5, 500))                           # +25 %: kept, and add again
    assert (d.kind, d.workers) == ("add", 6)
    assert "kept the add to 5 workers" in d.reason


def test_add_undone_when_it_gains_less():
    p = Policy(quiet())
    p.decide(window(1, 4, 400))
    d = p.decide(window(2, 5, 410))                           # +2.5 %
    assert (d.kind, d.workers) == ("revert", 4)
    assert "undid the add" in d.reason and "+2.5 %" in d.reason
    d = p.decide(window(3, 4, 400))                           # not tried again
    assert (d.kind, d.workers) == ("hold", 4)
    assert "not worth it" in d.reason


def test_add_threshold_shrinks_in_large_pools():
    cfg = PolicyConfig()
    assert cfg.add_threshold(2) == pytest.approx(0.07)
    assert cfg.add_threshold(10) == pytest.approx(0.05)      # half an average worker's share
    assert cfg.add_threshold(40) == pytest.approx(0.04)      # never below the floor
    with pytest.raises(ConfigError):
        PolicyConfig(loss_threshold=0.05, add_floor=0.04)


def test_remove_kept_while_the_consumer_does_not_wait():
    p = Policy(quiet())
    assert p.decide(window(1, 6, 1000)).kind == "remove"      # supply >= demand
    d = p.decide(window(2, 5, 1000))
    assert (d.kind, d.workers) == ("remove", 4)
    d = p.decide(window(3, 4, 800))                           # the consumer waits 20 %
    assert (d.kind, d.workers) == ("revert", 5)
    assert "now waits 20.0 %" in d.reason
    assert p.decide(window(4, 5, 1000)).kind == "hold"


def test_plateau_removal_when_workers_idle():
    """The consumer waits but the workers idle (a hand-off limit): fewer workers give as much."""
    p = Policy(quiet(max_prefetch=2))
    assert p.decide(window(1, 8, 500, cores=2.0, budget=16)).kind == "add"
    d = p.decide(window(2, 9, 500, cores=2.0, budget=16))
    assert d.kind == "revert"
    d = p.decide(window(3, 8, 500, cores=2.0, budget=16))
    assert (d.kind, d.workers) == ("remove", 3)               # ceil(2 cores * 1.1)
    d = p.decide(window(4, 3, 495, cores=2.0, budget=16))     # 1 % less: kept; 4 to 8 gave no more
    assert d.kind == "remove" and d.workers == 2
    d = p.decide(window(5, 2, 400, cores=2.0, budget=16))
    assert (d.kind, d.workers) == ("revert", 3)
    assert p.decide(window(6, 3, 495, cores=2.0, budget=16)).kind == "hold"


def test_prefetch_deepened_when_workers_idle():
    p = Policy(quiet())
    d = p.decide(window(1, 4, 400, cores=2.0))
    assert (d.kind, d.workers, d.prefetch) == ("prefetch", 4, 3)
    d = p.decide(window(2, 4, 600, cores=3.0, prefetch=3))
    assert d.kind == "prefetch" and d.prefetch == 4


def test_estimate_jump():
    p = Policy(PolicyConfig(settle_windows=0))
    assert p.decide(window(1, 2, 400, demand=1500)).kind == "measure"
    d = p.decide(window(2, 2, 400, demand=1500))
    assert (d.kind, d.workers) == ("add", 8)                  # ceil(1500 / 200)
    assert "estimated" in d.reason
    p = Policy(PolicyConfig(settle_windows=0))
    p.decide(window(1, 12, 1000, cores=4.0, budget=16))
    d = p.decide(window(2, 12, 1000, cores=4.0, budget=16))
    assert (d.kind, d.workers) == ("remove", 5)               # ceil(4 cores * 1.1)


def test_close_calls_are_measured_again():
    p = Policy(quiet(noise_prior=0.03, noise_floor=0.03))
    p.decide(window(1, 4, 400))
    d = p.decide(window(2, 5, 430))                           # +7.5 %, noise 3 %: unclear
    assert d.kind == "measure" and "close call" in d.reason


def test_settle_window_after_each_change():
    p = Policy(PolicyConfig(estimate=False, base_windows=1))
    assert p.decide(window(1, 4, 400)).kind == "settle"       # the first window is warm-up
    assert p.decide(window(2, 4, 400)).kind == "add"
    assert p.decide(window(3, 5, 500)).kind == "settle"


def test_demand_drift_forgets_records():
    p = Policy(quiet())
    p.decide(window(1, 4, 400))
    p.decide(window(2, 5, 410))                               # refused
    p.decide(window(3, 4, 400))
    p.decide(window(4, 4, 400, demand=1500))                  # one window: not yet
    d = p.decide(window(5, 4, 400, demand=1500))
    assert "demand moved" in d.reason
    assert d.kind == "add"                                    # the refusal is forgotten
    assert p.stats()["resets"] == 1


def test_loader_running_another_setting_is_followed():
    p = Policy(quiet())
    p.decide(window(1, 4, 400))                               # asks for 5
    d = p.decide(window(2, 3, 300))
    assert "not the 5 / 2 decided" in d.reason


def test_decisions_are_logged_with_reasons(caplog):
    sim = Simulation(Producer(200, 8), 900)
    with caplog.at_level(logging.DEBUG, logger="feedgpu.balancer"):
        steps = run(Policy(), sim, 20, 2)
    changes = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(changes) == sum(s.decision.changes for s in steps) > 0
    assert all(r.name == "feedgpu.balancer" for r in caplog.records)
    assert "workers" in changes[0].getMessage()


def test_stats_for_the_loader():
    p = Policy()
    run(p, Simulation(Producer(200, 8), 900), 30, 2)
    st = p.stats()
    assert st["workers"] == 5 and st["prefetch"] == 2
    assert st["decisions"] == 30 and st["changes"] >= 1
    assert st["rates"]["5w/p2"] == pytest.approx(900)
    assert st["last"][-1]["kind"] == "hold" and st["last"][-1]["reason"]
    assert len(p.history) == 30 and isinstance(p.history[0], Decision)


def test_dali_engines_report_threads():
    sim = Simulation(Producer(500, 8), 3000, engine="dali-cpu")
    steps = run(Policy(), sim, 40, 2)
    d = steps[-1].decision
    assert d.engine == "dali-cpu" and d.dali_threads == d.workers == 6


def test_measurement_validation():
    with pytest.raises(ConfigError, match="wait_fraction"):
        Measurement(t=0, workers=1, delivered_rate=1, demand_rate=1, wait_fraction=1.5, cpu_cores_used=1,
                    cpu_budget=1)
    with pytest.raises(ConfigError, match="workers"):
        Measurement(t=0, workers=0, delivered_rate=1, demand_rate=1, wait_fraction=0, cpu_cores_used=0, cpu_budget=1)
    with pytest.raises(ConfigError, match="engine"):
        Measurement(t=0, workers=1, delivered_rate=1, demand_rate=1, wait_fraction=0, cpu_cores_used=0,
                    cpu_budget=1, engine="tpu")
    with pytest.raises(ConfigError, match="cpu_budget"):
        Measurement(t=0, workers=1, delivered_rate=1, demand_rate=None, wait_fraction=0, cpu_cores_used=0, cpu_budget=0)


def test_unknown_demand_steers_by_wait():
    p = Policy(quiet())
    m = Measurement(t=1, workers=4, delivered_rate=400, demand_rate=None, wait_fraction=0.5, cpu_cores_used=4,
                    cpu_budget=8)
    assert p.decide(m).kind == "add"


# -- diagnosis -------------------------------------------------------------------------------------

def test_diagnosis_cpu_bound_with_the_numbers():
    """docs/anchors.md: 15 Pillow workers give 3,197/s; ResNet-50 takes 4,722/s."""
    sim = Simulation(Producer(3197 / 15, 15), 4722)
    steps = run(Policy(), sim, 40, 8)
    dg = diagnose([s.measurement for s in steps[-5:]])
    assert dg.verdict == "CPU-bound"
    assert dg.delivered_rate == pytest.approx(3197, rel=1e-6)
    assert dg.rate_per_core == pytest.approx(3197 / 15, rel=1e-6)
    assert dg.cores_needed == pytest.approx(4722 / (3197 / 15), rel=1e-6)   # 22.2 cores
    assert dg.extra_cores == pytest.approx(4722 / (3197 / 15) - 15, rel=1e-6)  # 7.2 more
    assert "22.2 cores, 7.2 more" in dg.message and "dali-gpu" in dg.message


def test_diagnosis_meets_demand_and_input_bound():
    sim = Simulation(Producer(200, 8), 900)
    steps = run(Policy(), sim, 40, 2)
    assert diagnose(steps[-1].measurement).verdict == "meets demand"
    sim = Simulation(Producer(300, 12, cap_rate=1500), 5000)
    steps = run(Policy(), sim, 60, 6)
    dg = Policy().diagnose(steps[-1].measurement)
    assert dg.verdict == "input-bound" and "not the CPU" in dg.message
    m = window(1, 8, 1600, demand=math.inf)
    dg = diagnose(m)
    assert dg.verdict == "CPU-bound" and dg.cores_needed == math.inf
    with pytest.raises(ConfigError):
        diagnose([])


# -- placement -----------------------------------------------------------------------------------------

GB = 10**9


def test_placement_fewest_cores_among_those_meeting_demand():
    opts = [EngineRate("python", 3195, 15, 15), EngineRate("dali-cpu", 4700, 12, 12),
            EngineRate("dali-gpu", 4750, 2, 4, hw_decoder_load=0.9, gpu_mem_bytes=2 * GB)]
    pl = choose_placement(opts, cpu_budget=15, gpu_mem_free_bytes=40 * GB, demand_rate=4722)
    assert pl.engine == "dali-gpu" and pl.dali_threads == 4 and pl.hw_decoder_load == 0.9
    assert pl.engine_settings() == {"name": "dali", "device": "gpu", "threads": 4, "hw_decoder_load": 0.9}
    assert "python" in pl.reason
    # without a GPU, DALI on the CPU is the best that fits
    pl = choose_placement(opts, cpu_budget=15, gpu_mem_free_bytes=None, demand_rate=4722)
    assert pl.engine == "dali-cpu" and "no GPU" in pl.reason


def test_placement_prefers_the_cpu_when_it_meets_demand_too():
    """Both meet demand with the same cores: the GPU's SMs stay the model's."""
    opts = [EngineRate("dali-cpu", 2000, 2, 2), EngineRate("dali-gpu", 9000, 2, 2, gpu_mem_bytes=GB)]
    pl = choose_placement(opts, cpu_budget=8, gpu_mem_free_bytes=10 * GB, demand_rate=1900)
    assert pl.engine == "dali-cpu"
    # a demand only the GPU meets
    pl = choose_placement(opts, cpu_budget=8, gpu_mem_free_bytes=10 * GB, demand_rate=5000)
    assert pl.engine == "dali-gpu"


def test_placement_within_5_percent_takes_fewer_resources():
    opts = [EngineRate("python", 1000, 8, 8), EngineRate("dali-cpu", 980, 4, 4)]
    assert choose_placement(opts, cpu_budget=8).engine == "dali-cpu"        # 2 % slower, half the cores
    opts = [EngineRate("python", 1000, 4, 4), EngineRate("dali-cpu", 1010, 4, 4)]
    assert choose_placement(opts, cpu_budget=8).engine == "python"          # same cores: the simpler one
    opts = [EngineRate("python", 1000, 4, 4), EngineRate("dali-cpu", 1200, 6, 6)]
    assert choose_placement(opts, cpu_budget=8).engine == "dali-cpu"        # 20 % more is worth 2 cores


def test_placement_budgets():
    opts = [EngineRate("python", 1000, 12, 12), EngineRate("dali-gpu", 5000, 1, 2, gpu_mem_bytes=8 * GB)]
    with pytest.raises(ConfigError, match="no engine fits"):
        choose_placement(opts, cpu_budget=6, gpu_mem_free_bytes=9 * GB, gpu_mem_reserve_bytes=2 * GB)
    assert choose_placement(opts, cpu_budget=6, gpu_mem_free_bytes=12 * GB).engine == "dali-gpu"
    with pytest.raises(ConfigError):
        EngineRate("tpu", 1, 1, 1)


def test_dali_settings():
    """docs/anchors.md, DALI GPU data-only: 4 threads / 0.9 fastest; 8 threads within 6 %."""
    trials = [DaliTrial(8, 0.75, 30851), DaliTrial(8, 0.9, 29579), DaliTrial(4, 0.9, 32656),
              DaliTrial(2, 0.9, 17126), DaliTrial(8, 0.0, 12374)]
    assert choose_dali_settings(trials) == DaliTrial(4, 0.9, 32656)
    # a demand of 20,000/s: 2 threads cannot meet it, 4 can
    assert choose_dali_settings(trials, demand_rate=20_000) == DaliTrial(4, 0.9, 32656)
    # ResNet-50 takes 4,722/s: 2 threads are enough
    assert choose_dali_settings(trials, demand_rate=4722) == DaliTrial(2, 0.9, 17126)
    assert dali_gpu_candidates(2) == [(2, 0.75), (2, 0.9)]
    assert dali_gpu_candidates(15) == [(t, h) for t in (2, 4, 8) for h in (0.75, 0.9)]


# -- the simulator itself ---------------------------------------------------------------------------

def test_simulator_model():
    p = Producer(200, 8, scaling=1.0)
    assert p.capacity(4, 2) == 800 and p.capacity(12, 2) == 1600           # no more than the cores
    assert p.capacity(8, 2, contention=6) == 400
    assert Producer(200, 8, min_prefetch=4).capacity(4, 2) == 400
    assert at(((0, 1), (10, 2)), 5) == 1 and at(((0, 1), (10, 2)), 10) == 2 and at(3.0, 99) == 3
    sim = Simulation(p, 1000)
    m = sim.measure(4, 2)
    assert (m.delivered_rate, m.wait_fraction, m.cpu_cores_used) == (800, pytest.approx(0.2), 4)
    m = sim.measure(8, 2)
    assert m.wait_fraction == 0 and m.cpu_cores_used == pytest.approx(5)    # idle 3/8 of the time
    assert sim.best_fixed() == (5, 1000)
    a = [Simulation(p, 1000, noise=0.05, seed=3).measure(4, 2) for _ in range(2)]
    assert a[0] == a[1]
