"""The cause "waiting for the network": the balancer's measurement, its diagnosis, the
autoscaler's windows and report, and ``feedgpu bench``'s report text."""
from __future__ import annotations

import pytest

from test_autoscale import FakeClock, FakeProbe, scaler
from feedgpu.errors import ConfigError
from feedgpu.balancer import Measurement, diagnose
from feedgpu.bench.idle import recommend
from feedgpu.bench.report import idle_lines


def window(wait: float, network: float = 0.0, cores: float = 1.0) -> Measurement:
    return Measurement(t=1.0, workers=2, delivered_rate=400.0, demand_rate=1000.0, wait_fraction=wait,
                       cpu_cores_used=cores, cpu_budget=8.0, network_wait_fraction=network)


def test_a_consumer_waiting_while_the_loader_waits_for_the_network_is_network_bound():
    dg = diagnose(window(0.6, network=0.5))
    assert dg.verdict == "network-bound" and dg.network_wait_fraction == pytest.approx(0.5)
    assert "waited for the network 50.0 %" in dg.message and "more workers do not help" in dg.message


def test_a_small_network_wait_is_named_but_another_cause_wins():
    dg = diagnose(window(0.6, network=0.1, cores=7.9))
    assert dg.verdict == "CPU-bound" and "waiting for the network 10.0 %" in dg.message
    plain = diagnose(window(0.6, cores=7.9))
    assert plain.verdict == "CPU-bound" and "network" not in plain.message and plain.network_wait_fraction == 0
    fed = diagnose(window(0.01, network=0.02))
    assert fed.verdict == "meets demand" and "network 2.0 %" in fed.message


def test_the_measurement_refuses_a_share_outside_0_1():
    with pytest.raises(ConfigError, match="network_wait_fraction"):
        window(0.5, network=1.5)


def _windows(network_per_batch: float):
    clock = FakeClock()
    a = scaler(clock, workers=1, prefetch=2, window_s=1.0, min_batches=3, probe=FakeProbe(clock))
    a.start([100])
    for _ in range(20):                       # 0.25 s a batch: 4 batches a window
        clock.t += 0.25
        if network_per_batch:
            a.add_network_wait(network_per_batch)
        a.on_batch(32, 0.1, [100])
    return a


def test_the_autoscaler_measures_the_network_wait_of_each_window():
    a = _windows(0.1)                          # 0.1 s of each 0.25 s batch: 40 %
    m = a.last_measurement
    assert m.network_wait_fraction == pytest.approx(0.4, abs=1e-6)
    assert a.timeline[-1]["network_wait_fraction"] == pytest.approx(0.4, abs=1e-6)
    assert "waited for the network 40.0 % of the window" in a.report()
    quiet = _windows(0.0)
    assert quiet.last_measurement.network_wait_fraction == 0.0
    assert "network_wait_fraction" not in quiet.timeline[-1] and "network" not in quiet.report()


def _report(network: float) -> dict:
    return {"consumer": "synthetic consumer at 3,000 samples/s",
            "model_alone": {"seconds_per_step": 0.01, "samples_per_s": 3000.0},
            "loader_alone": {"samples_per_s": 900.0, "workers": 2},
            "together": {"samples_per_s": 800.0, "median_wait_ms": 12.0},
            "gpu_idle_fraction": 0.7, "wait_split": {"read": 0.1, "preprocess": 0.6},
            "stage_costs": {"ms_per_sample": {}}, "network_wait_fraction": network,
            "balancer": {"timeline": [], "decisions": []}, "placement": None, "recommendation": "r"}


def test_bench_reports_the_network_wait_only_when_there_is_one():
    assert ("network:       the loader waited for shard downloads 35.0 % of the time (waiting for the network)"
            in idle_lines(_report(0.35)))
    assert not [line for line in idle_lines(_report(0.0)) if "network" in line]


def test_the_recommendation_names_the_network():
    diag = diagnose(window(0.6, network=0.5)).as_dict()
    text = recommend(0.55, diag, {"ms_per_sample": {"read": 0.1}, "read_share": 0.9}, on_gpu=True)
    assert text.startswith("Network-bound") and "55.0 %" in text and "50.0 %" in text
