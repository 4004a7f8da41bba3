"""The ``feedgpu`` command line, through click's runner and once as the installed console script."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from conftest import REPO

TRAIN = REPO / "pipelines" / "imagenet_train.yaml"
VAL = REPO / "pipelines" / "imagenet_val.yaml"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cli():
    from feedgpu.cli.main import main

    return main


def run(cli, *args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("path", [TRAIN, VAL], ids=lambda p: p.name)
def test_validate_ok(cli, path):
    res = run(cli, "pipeline", "validate", path)
    assert res.exit_code == 0, res.output
    assert f"{path}: ok" in res.stdout
    assert "batch 256" in res.stdout


def test_validate_reports_the_key_path_with_exit_code_2(cli, tmp_path):
    data = yaml.safe_load(TRAIN.read_text())
    data["stages"][1]["sizee"] = 224
    data["stages"][1]["interpolation"] = "cubicx"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    res = run(cli, "pipeline", "validate", bad)
    assert res.exit_code == 2
    assert res.stdout == ""
    assert "stages[1] (random_resized_crop)" in res.stderr and "allowed keys" in res.stderr
    assert "interpolation" in res.stderr and "'bicubic'" in res.stderr
    assert "Traceback" not in res.stderr


def test_validate_with_overrides(cli):
    res = run(cli, "pipeline", "validate", TRAIN, "--set", "loader.batch_size=64", "--set", "loader.num_workers=0")
    assert res.exit_code == 0 and "batch 64" in res.stdout and "0 workers" in res.stdout
    res = run(cli, "pipeline", "validate", TRAIN, "--set", "loader.batch_size=zero")
    assert res.exit_code == 2 and "loader.batch_size" in res.stderr
    res = run(cli, "pipeline", "validate", TRAIN, "--set", "nonsense")
    assert res.exit_code == 2 and "KEY=VALUE" in res.output


def test_validate_missing_file(cli, tmp_path):
    res = run(cli, "pipeline", "validate", tmp_path / "nope.yaml")
    assert res.exit_code == 2 and "no such pipeline file" in res.stderr


def test_explain_shows_the_stage_table_and_output_shape(cli, folder_ds):
    res = run(cli, "pipeline", "explain", TRAIN, "--data", folder_ds, "--device", "cpu")
    assert res.exit_code == 0, res.output
    out = res.stdout
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["stage"])
    table = [line.split()[0] for line in lines[header + 2:header + 7]]
    assert table == ["source", "decode", "random_resized_crop", "horizontal_flip", "normalize"]
    assert "[256, 3, 224, 224]" in out and "float32" in out
    assert f"folder at {folder_ds}" in out


def test_explain_without_data_still_plans(cli):
    res = run(cli, "pipeline", "explain", VAL, "--device", "cpu", "--set", "loader.batch_size=32")
    assert res.exit_code == 0, res.output
    assert "[32, 3, 224, 224]" in res.stdout and "(path not set)" in res.stdout


def test_doctor(cli):
    res = run(cli, "doctor")
    assert res.exit_code == 0, res.output
    assert "PIL:" in res.stdout and "torch:" in res.stdout and "DALI:" in res.stdout and "Ray:" in res.stdout
    res = run(cli, "doctor", "--json")
    info = json.loads(res.stdout)
    import PIL
    import torch

    assert info["pil"]["version"] == PIL.__version__ and info["torch"] == torch.__version__
    assert info["cuda_available"] == torch.cuda.is_available()
    import ray

    assert info["ray"] == ray.__version__  # the test environment has the ray extra
    assert info["pil"]["simd"] is True  # the project's environment runs Pillow-SIMD


def test_console_script_runs(folder_ds):
    exe = shutil.which("feedgpu", path=str(Path(sys.executable).parent))
    assert exe, "the feedgpu console script is not installed beside this Python"
    ok = subprocess.run([exe, "pipeline", "explain", str(VAL), "--data", str(folder_ds), "--device", "cpu"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "resize_center_crop" in ok.stdout and "[256, 3, 224, 224]" in ok.stdout
    bad = subprocess.run([exe, "pipeline", "validate", str(REPO / "pyproject.toml")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and "0.1.0" in version.stdout


@pytest.mark.timeout(240)
def test_bench_writes_json_with_both_loaders(cli, folder_ds, tmp_path):
    pytest.importorskip("feedgpu.bench.measure")
    out = tmp_path / "out.json"
    res = run(cli, "bench", "--data", folder_ds, "--batches", 3, "--rounds", 1, "--workers", 1, "--batch-size", 8,
              "--warmup", 1, "--json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {"feedgpu", "torch"}
    for name in ("feedgpu", "torch"):
        s = doc["summary"][name]
        assert s["workers"] == 1 and s["rounds"] == 1 and s["samples_per_s"] > 0
    assert doc["settings"]["timed_batches"] == 3 and doc["settings"]["batch_size"] == 8
    assert {r["loader"] for r in doc["runs"]} == {"feedgpu", "torch"}
    assert "feedgpu" in res.stdout and "torch" in res.stdout
    # memory per worker next to throughput: USS, its growth over the run, feedgpu's budget
    assert "USS/worker MB" in res.stdout and "feedgpu's budget" in res.stdout
    for name in ("feedgpu", "torch"):
        s = doc["summary"][name]
        assert s["uss_mb_per_worker"] > 0 and s["cow_growth_mb_per_worker"] is not None
    assert doc["summary"]["feedgpu"]["worker_memory_mb"] >= 64
    # samples/s and ms/batch from the same timed window: their product is the batch size
    for r in doc["runs"] + list(doc["summary"].values()):
        assert abs(r["samples_per_s"] * r["ms_per_batch"] / 1e3 - 8) < 1e-6, r
        assert r["wait_ms_median"] > 0
    assert "RSS" not in res.stdout.splitlines()[next(i for i, ln in enumerate(res.stdout.splitlines())
                                                      if ln.startswith("loader "))]


@pytest.mark.timeout(240)
def test_bench_times_each_run_for_at_least_seconds(cli, folder_ds, tmp_path):
    out = tmp_path / "out.json"
    res = run(cli, "bench", "--data", folder_ds, "--seconds", 2, "--rounds", 1, "--workers", 1, "--batch-size", 8,
              "--warmup", 1, "--no-baseline", "--json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    (r,) = doc["runs"]
    assert r["seconds"] >= 2 and r["batches"] >= doc["settings"]["timed_batches"]
    assert doc["settings"]["min_seconds"] == 2
    assert "at least" in res.stdout and f"{r['batches']} in" in res.stdout


def test_bench_help_names_the_baseline_as_it_runs(cli):
    text = " ".join(run(cli, "bench", "--help").stdout.split())
    assert "DataLoader + Pillow" not in text
    assert "same PIL build" in text and "Pillow-SIMD" in text


# -- what help and listings import ----------------------------------------------------------------
#: modules a help or listing command must not import (each costs a second or more to import)
HEAVY = ("torch", "torchvision", "feedgpu.loader.front", "pyarrow", "ray", "nvidia.dali", "matplotlib")


def _imported_by(*args: str, prelude: str = "") -> list[str]:
    """The modules of :data:`HEAVY` that running ``feedgpu ARGS`` in a fresh interpreter imported
    (after running the code ``prelude``)."""
    code = (f"import json, sys\n{prelude}\nfrom feedgpu.cli.main import main\n"
            f"try:\n    main({list(args)!r}, prog_name='feedgpu')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


@pytest.mark.parametrize("args", [["--help"], ["stages"], ["stages", "--json"], ["pipeline", "--help"],
                                  ["bench", "--help"], ["cache", "--help"], ["scan", "--help"], ["index", "--help"],
                                  ["convert", "--help"]], ids=" ".join)
def test_help_and_listings_do_not_import_torch(args):
    assert _imported_by(*args) == []


@pytest.mark.parametrize("command", ["validate", "explain"])
def test_validate_and_explain_without_a_gpu_driver_do_not_import_torch(command):
    """``output.device: auto`` resolves to cpu without torch where no GPU driver is present."""
    no_driver = "import feedgpu.pipeline as fp; fp._GPU_DRIVER_PATHS = ('/nonexistent/nvidia',)"
    assert _imported_by("pipeline", command, str(TRAIN), prelude=no_driver) == []


def test_auto_still_asks_torch_where_a_gpu_driver_may_be(monkeypatch):
    import torch

    import feedgpu.pipeline as fp

    monkeypatch.setattr(fp, "_GPU_DRIVER_PATHS", ("/",))   # "a driver is there": torch decides
    assert fp.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(fp, "_GPU_DRIVER_PATHS", ("/nonexistent/nvidia",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # torch already imported: it decides
    assert fp.resolve_device("auto") == "cuda" and fp.device_label("auto") == "cuda (output.device auto)"
    assert fp.device_label("cpu") == "cpu"


def test_import_feedgpu_is_lazy_and_its_names_resolve():
    code = ("import sys, feedgpu\nassert 'torch' not in sys.modules, 'import feedgpu imported torch'\n"
            "from feedgpu import DataLoader, Pipeline, FolderSource\nimport torch.utils.data as tud\n"
            "assert issubclass(DataLoader, tud.DataLoader) and feedgpu.Pipeline is Pipeline\n"
            "ns = {}\nexec('from feedgpu import *', ns)\nassert all(n in ns for n in feedgpu.__all__)\n"
            "assert set(feedgpu.__all__) <= set(dir(feedgpu))\n"
            "try:\n    feedgpu.NoSuchName\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no error')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr


def test_help_lists_every_command(cli):
    res = run(cli, "--help")
    assert res.exit_code == 0
    for name in ("bench", "cache", "convert", "doctor", "index", "pipeline", "scan", "stages"):
        assert f"  {name} " in res.stdout, name


# -- explain and validate agree with `stages` and with each other --------------------------------------
def test_explain_names_stage_kinds_as_stages_does_and_says_random_stages_are_seeded(cli):
    res = run(cli, "pipeline", "explain", TRAIN, "--device", "cpu")
    assert res.exit_code == 0, res.output
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines() if line.startswith("  ")}
    assert rows["stage"][:3] == ["stage", "kind", "runs"]
    listed = json.loads(run(cli, "stages", "--json").stdout)
    kinds = {d["name"]: d["kind"] for d in listed}
    for op in ("decode", "random_resized_crop", "horizontal_flip", "normalize"):
        assert rows[op][1] == kinds[op], op
    assert "Pillow" not in " ".join(rows["normalize"]) and "numpy" in " ".join(rows["normalize"])
    assert "no (seeded)" in " ".join(rows["random_resized_crop"]) and "no (seeded)" in " ".join(rows["horizontal_flip"])
    assert "same seed gives the same batches" in res.stdout
    text = run(cli, "stages").stdout
    assert "horizontal_flip  (sample stage, random, seeded" in text


def test_validate_and_explain_name_the_same_device(cli):
    from feedgpu.pipeline import resolve_device

    here = resolve_device("auto")
    val = run(cli, "pipeline", "validate", TRAIN)
    exp = run(cli, "pipeline", "explain", TRAIN)
    assert f"float32 on {here} (output.device auto)" in val.stdout
    assert f"on {here} (output.device auto)" in exp.stdout
    assert "on auto" not in val.stdout + exp.stdout
    exp = run(cli, "pipeline", "explain", TRAIN, "--device", "cpu")
    assert "labels int64 [256] on cpu\n" in exp.stdout
