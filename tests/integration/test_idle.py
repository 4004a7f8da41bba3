"""Why is my GPU idle: the three-phase measurement, its recommendation, the built-in models and
the ``feedgpu bench --consumer-rate/--model`` report."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from feedgpu import ConfigError, DataLoader, Pipeline
from feedgpu.bench.idle import ModelConsumer, RateConsumer, analyze, load_model, plot, recommend, time_model
from feedgpu.bench.models import resnet18, resnet50
from feedgpu.stages import Decode, RandomResizedCrop

pytestmark = pytest.mark.timeout(180)


def small_pipeline(folder_ds):
    return Pipeline({"format": "folder", "path": str(folder_ds)}, [Decode(), RandomResizedCrop(64)],
                    batch_size=8, device="cpu", seed=1)


def test_rate_consumer_takes_its_rate():
    c = RateConsumer(400)
    t = time_model(c, (torch.zeros(8, 3, 4, 4), torch.zeros(8)), duration_s=0.3)
    assert t["samples_per_s"] == pytest.approx(400, rel=0.1)
    with pytest.raises(ConfigError, match="consumer-rate"):
        RateConsumer(0)


def test_slow_consumer_is_fed_and_fast_one_starves(folder_ds, no_leaked_workers):
    p = small_pipeline(folder_ds)
    fed = analyze(lambda: DataLoader(p, num_workers=1), RateConsumer(40), duration_s=1.5, on_gpu=False)
    assert fed["gpu_idle_fraction"] < 0.1, fed
    assert fed["recommendation"].startswith("GPU-bound")
    starved = analyze(lambda: DataLoader(p, num_workers=1), RateConsumer(1e6), duration_s=1.5, on_gpu=False)
    # a consumer a thousand times faster than one worker waits nearly all the time
    assert starved["gpu_idle_fraction"] > 0.8, starved
    assert not starved["recommendation"].startswith("GPU-bound")
    assert starved["together"]["samples_per_s"] == pytest.approx(starved["loader_alone"]["samples_per_s"], rel=0.5)
    costs = starved["stage_costs"]["ms_per_sample"]
    assert costs["decode"] > 0 and costs["random_resized_crop"] > 0
    split = starved["wait_split"]
    assert split["read"] + split["preprocess"] == pytest.approx(starved["gpu_idle_fraction"])


DIAG = {"verdict": "CPU-bound", "demand_rate": 3000.0, "delivered_rate": 600.0, "wait_fraction": 0.8,
        "cpu_cores_used": 1.9, "cpu_budget": 2.0, "rate_per_core": 315.8, "cores_needed": 9.5, "extra_cores": 7.5,
        "workers": 2, "engine": "python", "message": ""}


def test_recommendations_name_the_bottleneck_with_figures():
    costs = {"ms_per_sample": {"read": 0.05, "decode": 1.0, "random_resized_crop": 0.2}, "read_share": 0.04}
    cpu = recommend(0.8, DIAG, costs, on_gpu=True)
    assert cpu.startswith("CPU-bound") and "7.5 more cores" in cpu and "600 samples/s" in cpu
    assert "engine: dali, device: gpu" in cpu and "80 %" in cpu
    assert "engine: dali" not in recommend(0.8, DIAG, costs, on_gpu=False)
    read = recommend(0.5, DIAG, {"ms_per_sample": {"read": 3.0, "decode": 1.0}, "read_share": 0.75}, on_gpu=False)
    assert read.startswith("Read-bound") and "75 %" in read
    idle_cores = dict(DIAG, verdict="input-bound", cpu_cores_used=0.5)
    assert recommend(0.3, idle_cores, costs, on_gpu=False).startswith("Input-bound")
    assert recommend(0.01, DIAG, costs, on_gpu=False).startswith("GPU-bound")


def test_builtin_resnets_have_the_reference_sizes():
    # parameter counts of torchvision's resnet18 / resnet50 (11,689,512 and 25,557,032)
    assert sum(p.numel() for p in resnet18().parameters()) == 11_689_512
    assert sum(p.numel() for p in resnet50().parameters()) == 25_557_032
    assert resnet18(10)(torch.zeros(2, 3, 64, 64)).shape == (2, 10)


def test_model_consumer_trains_on_uint8_nhwc_batches():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 1000))
    before = [p.detach().clone() for p in model.parameters()]
    c = ModelConsumer(model, "cpu", "tiny")
    c.step((torch.randint(0, 255, (4, 16, 16, 3), dtype=torch.uint8), torch.arange(4)))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_load_model_by_name_and_by_module_callable(tmp_path, monkeypatch):
    assert load_model("resnet18")[1] == "resnet18"
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        def tiny():
            return torch.nn.Linear(2, 2)
        def not_a_model():
            return 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    m, label = load_model("mymodels:tiny")
    assert isinstance(m, torch.nn.Linear) and label == "mymodels:tiny"
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        load_model("mymodels:not_a_model")
    with pytest.raises(ConfigError, match="no attribute"):
        load_model("mymodels:missing")
    with pytest.raises(ConfigError, match="resnet18"):
        load_model("vgg")
    sys.modules.pop("mymodels", None)


def test_bench_consumer_rate_writes_report_json_and_png(folder_ds, tmp_path, no_leaked_workers):
    from feedgpu.cli.main import main

    out, png = tmp_path / "idle.json", tmp_path / "idle.png"
    res = CliRunner().invoke(main, ["bench", "--data", str(folder_ds), "--consumer-rate", "100000", "--duration", "3",
                                    "--batch-size", "8", "--json", str(out),
                                    "--plot", str(png)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["format"] == "feedgpu.idle/1" and doc["num_workers"] == "auto"
    assert 0.5 < doc["gpu_idle_fraction"] <= 1.0
    assert doc["balancer"]["timeline"], "the auto loader measured windows"
    assert "GPU idle:" in res.stdout and doc["recommendation"] in res.stdout
    # the header names the phases as they run: start-up and settling untimed, then the timed seconds
    assert f"{doc['warmup_s']:g} s settling (untimed) + 3 s timed each" in res.stderr
    # the log: every step from the loader's start, and how it ended (a verdict or the step on trial)
    bal = doc["balancer"]
    steps = [p for p in bal["timeline"] if p["decision"] not in ("hold", "settle")]
    assert [d["t"] for d in bal["decisions"]] == [p["t"] for p in steps]
    log = [ln for ln in res.stdout.splitlines() if ln.startswith("  t=+")]
    assert len(log) == len(steps) + 1
    assert ("the run ended while trying" if bal["trying"] else "at the end: ") in log[-1]
    # phase 2 and phase 3 are different loaders: each count says whose it is
    assert "loader alone:" in res.stdout and "(its balancer ended at" in res.stdout
    assert f"phase 3 (loader + consumer): {len(bal['timeline'])} windows, ended at {bal['final_workers']}" in res.stdout
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _report_with_windows(n: int = 12, trying: str | None = "3 workers / prefetch 2") -> dict:
    tl = [{"t": 100.0 + 1.5 * i, "workers": 2 + (i >= 8), "prefetch": 2, "delivered_rate": 500.0,
           "demand_rate": 1800.0, "wait_fraction": 0.7, "decision": "add" if i % 2 else "hold", "next_workers": 2,
           "next_prefetch": 2, "reason": f"step {i}"} for i in range(n)]
    decisions = [{"t": p["t"], "kind": p["decision"], "workers": 2, "prefetch": 2, "reason": p["reason"]}
                 for p in tl if p["decision"] != "hold"]
    return {"consumer": "synthetic", "gpu_idle_fraction": 0.8, "duration_s": 12.0, "warmup_s": 6.0,
            "balancer": {"timeline": tl, "decisions": decisions, "final_workers": 3, "final_prefetch": 2,
                         "summary": "3 workers / prefetch 2: settled", "trying": trying,
                         "t_begin": 98.0, "t_timed": 105.0}}


def test_the_balancer_log_has_every_step_from_the_start_and_its_end():
    from feedgpu.bench.report import balancer_lines

    lines = balancer_lines(_report_with_windows()["balancer"])
    steps = [ln for ln in lines if ln.startswith("  t=+")]
    assert len(steps) == 6 + 1 and steps[0].startswith("  t=+4s add")   # 100 + 1.5 - 98: from the start
    assert "settling until t=+7s" in lines[1]
    assert steps[-1] == "  t=+18s the run ended while trying 3 workers / prefetch 2: no verdict on it yet"
    done = balancer_lines(_report_with_windows(trying=None)["balancer"])
    assert done[-1] == "  t=+18s at the end: 3 workers / prefetch 2: settled"


def test_the_plot_keeps_its_legend_off_the_lines_and_spans_both_parts_of_the_phase(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    assert plot(_report_with_windows(), str(tmp_path / "p.png")) is True
    (fig,) = figs
    fig.canvas.draw()
    top = fig.axes[0]
    legend = top.get_legend()
    assert legend.get_window_extent().y0 >= top.get_window_extent().y1 - 1, "the legend overlaps the plot"
    assert fig.axes[2].get_xlim() == (0, 18.5)     # start-up and 6 s settling, then 12 s timed: to the last window
    assert "6 s settling, then 12 s timed" in fig.axes[2].get_xlabel()
    label = fig.axes[2].xaxis.label.get_window_extent()
    assert label.x0 >= 0 and label.x1 <= fig.bbox.x1, "the axis label runs off the figure"
    plt.close(fig)


def test_plot_without_windows_writes_nothing(tmp_path, caplog):
    report = {"balancer": {"timeline": []}, "consumer": "x", "gpu_idle_fraction": 0.0}
    pytest.importorskip("matplotlib")
    assert plot(report, str(tmp_path / "p.png")) is False and not (tmp_path / "p.png").exists()


def test_compare_engines_measures_dali_cpu_and_picks_a_placement(folder_ds, no_leaked_workers):
    pytest.importorskip("nvidia.dali")
    p = small_pipeline(folder_ds)
    r = analyze(lambda **over: DataLoader(p, num_workers=1, **over), RateConsumer(1e6), duration_s=1.5,
                on_gpu=False, compare_engines=True)
    pl = r["placement"]
    assert set(pl["measured"]) == {"python", "dali-cpu"} and not pl["not_measured"]
    assert all(v["samples_per_s"] > 0 and v["cpu_cores"] > 0 for v in pl["measured"].values())
    # demand is unlimited: the faster engine per the measurements wins unless within 5 % (then fewer cores)
    rates = {k: v["samples_per_s"] for k, v in pl["measured"].items()}
    other = "python" if pl["choice"] == "dali-cpu" else "dali-cpu"
    assert rates[pl["choice"]] >= 0.95 * rates[other]
    assert pl["choice"] in pl["reason"] and "Placement measured" in r["recommendation"]


def test_compare_engines_labels_a_dali_pipeline_as_dali(folder_ds, no_leaked_workers):
    """A pipeline configured for DALI (``--set engine.name=dali`` with ``--compare-engines``, as
    bench/gpu_check.py runs it): its loader-alone rate is dali-cpu's, the Python engine is the one
    measured besides it. Before, the DALI rate was reported as "python" and DALI measured twice."""
    pytest.importorskip("nvidia.dali")
    p = Pipeline({"format": "folder", "path": str(folder_ds)}, [Decode(), RandomResizedCrop(64)],
                 batch_size=8, device="cpu", seed=1, engine={"name": "dali", "device": "cpu"})
    asked = []

    def make_loader(**over):
        asked.append(over.get("engine"))
        return DataLoader(p, num_workers=1, **over)

    r = analyze(make_loader, RateConsumer(1e6), duration_s=1.0, on_gpu=False, compare_engines=True)
    pl = r["placement"]
    assert pl["configured"] == "dali-cpu" and r["loader_alone"]["engine"] == "dali-cpu"
    assert set(pl["measured"]) == {"python", "dali-cpu"} and not pl["not_measured"]
    assert pl["measured"]["dali-cpu"]["samples_per_s"] == r["loader_alone"]["samples_per_s"]
    assert [e for e in asked if e is not None] == [{"name": "python"}]
    assert pl["engine_settings"] == ({"name": "python"} if pl["choice"] == "python"
                                     else {"name": "dali", "device": "cpu", "threads": 1})


def test_fixed_workers_get_a_diagnosis_too(folder_ds, no_leaked_workers):
    p = small_pipeline(folder_ds)
    r = analyze(lambda: DataLoader(p, num_workers=1), RateConsumer(1e6), duration_s=1.5, on_gpu=False)
    assert r["diagnosis"] is not None and r["diagnosis"]["workers"] == 1
    assert "too few windows" not in r["recommendation"]
    assert r["warmup_s"] == 0.0
