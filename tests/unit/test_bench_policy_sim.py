"""bench/policy_sim.py, the pure policy replayed on simulated loops, and the paired mean that
bench/balancer.py reports."""
from __future__ import annotations

import math
import statistics

import pytest

from bench.policy_sim import CURVES, run, summarise


def test_the_simulated_policy_finds_the_best_count_and_is_deterministic():
    runs = [run(CURVES["cnn-all"], 0.06, 0.3, 200, seed, 5, 0.3) for seed in range(3)]
    s = summarise(runs, 35)
    assert s["after_lead"] > 0.95, s                 # two workers train 414/s, one 357/s, three 391/s
    assert s["workers_share"].get("2", 0) > 0.7, s
    assert run(CURVES["cnn-all"], 0.06, 0.3, 200, 1, 5, 0.3) == runs[1]
    flat = summarise([run(CURVES["sleep-300"], 0.02, 0.0, 150, 0, 0, 0.0)], 35)
    assert flat["workers_share"] == {"1": 1.0}, flat  # the fewest workers where all train alike


def test_paired_mean_is_geometric_with_the_standard_error_of_the_log_ratios():
    from bench.balancer import paired_mean
    r = paired_mean([0.9, 1.1])
    assert math.isclose(r["auto_vs_best_paired_mean"], math.sqrt(0.99))
    assert math.isclose(r["auto_vs_best_paired_se"], abs(math.log(1.1) - math.log(0.9)) / 2)
    assert paired_mean([1.0])["auto_vs_best_paired_se"] is None
    assert paired_mean([])["auto_vs_best_paired_mean"] is None


def _lag_one(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    d = [x - m for x in xs]
    return sum(a * b for a, b in zip(d, d[1:])) / sum(a * a for a in d)


def test_curve_windows_correlate_as_asked_and_expected_is_the_settings_rate():
    from feedgpu.balancer.simulate import Curve
    rate = {1: 300.0, 2: 400.0}
    c = Curve(lambda w, p: rate[w], wait=lambda w, p: 0.05, noise=0.1, phi=0.5, seed=3)
    xs = [c.measure(2, 2).delivered_rate for _ in range(4000)]
    assert abs(_lag_one(xs) - 0.5) < 0.06
    sd = statistics.pstdev(xs) / statistics.fmean(xs)
    assert 0.09 < sd < 0.11                       # phi keeps the spread of one window at `noise`
    assert c.expected == 400.0
    independent = Curve(lambda w, p: rate[w], wait=lambda w, p: 0.05, noise=0.1, seed=3)
    assert abs(_lag_one([independent.measure(2, 2).delivered_rate for _ in range(4000)])) < 0.06
    with pytest.raises(ValueError):
        Curve(lambda w, p: 1.0, phi=1.0)


def test_curve_start_settle_and_warmup_windows():
    from feedgpu.balancer.simulate import Curve
    rate = {1: 300.0, 2: 400.0}
    c = Curve(lambda w, p: rate[w], wait=lambda w, p: 0.05, start_windows=1, settle_mix=True, warmup_windows=2, warmup_dip=0.5)
    got = [(c.measure(w, 2).delivered_rate, c.expected) for w in (1, 1, 1, 2, 2, 1, 1)]
    assert got == [(150.0, 300.0), (150.0, 300.0), (300.0, 300.0),
                   (300.0, 300.0),     # a worker more: one window at the old setting (cold start)
                   (400.0, 400.0),
                   (350.0, 350.0),     # a worker less: the mean of the two (batches in flight)
                   (300.0, 300.0)]


def test_a_curve_that_changes_shape_is_followed_and_scored_against_its_new_best():
    from bench.policy_sim import CHANGES
    before, after, at = CHANGES["cnn-all, then one worker"]
    r = run(CURVES[before], 0.03, 0.0, at + 200, 0, 0, 0.0, then=(after, at))
    assert r["workers"][at - 1] == 2 and r["workers"][-100:].count(1) > 90, r["workers"][at - 5:]
    assert statistics.fmean(r["trained"][-100:]) > 0.95  # against the new best: one worker, 357/s
    assert r["trained"][at - 1] == 1.0                 # two workers: the old curve's best, 414/s
