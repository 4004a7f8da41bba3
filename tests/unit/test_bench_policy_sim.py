"""bench/policy_sim.py, the pure policy replayed on simulated loops, and the paired mean that
bench/balancer.py reports."""
from __future__ import annotations

import math

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
