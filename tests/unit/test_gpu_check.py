"""bench/gpu_check.py's summary: only this run's figures, and GPU tests that did not run are no pass."""
from __future__ import annotations

import importlib.util
import json

from conftest import REPO


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DATA = {"summary": {"feedgpu": {"label": "feedgpu (fresh)", "samples_per_s": 555.0, "ms_per_batch": 50.0,
                                "cpu_percent": 100.0}}}
E2E = {"model_alone": {"samples_per_s": 3000.0}, "loader_alone": {"samples_per_s": 600.0},
       "together": {"samples_per_s": 620.0}, "gpu_idle_fraction": 0.8, "placement": {"choice": "python"}}


def fake_runner(results: dict):
    """run_step stand-in: ``results[name] = (rc, last line, {file name: JSON document})``."""
    def run_step(name, cmd, limit, out):
        rc, last, files = results[name]
        for fname, doc in files.items():
            (out / fname).write_text(json.dumps(doc))
        return {"step": name, "rc": rc, "seconds": 0.1, "last": last}
    return run_step


def test_the_table_never_shows_an_earlier_runs_figures(tmp_path, monkeypatch, capsys):
    gc = load_gpu_check()
    stale = {**DATA, "summary": {"feedgpu": {**DATA["summary"]["feedgpu"], "label": "feedgpu (stale)"}}}
    (tmp_path / "data_only.json").write_text(json.dumps(stale))
    (tmp_path / "e2e_synthetic_python.json").write_text(json.dumps(E2E))
    (tmp_path / "e2e_resnet50_python.json").write_text(json.dumps(E2E))   # another mode's step
    monkeypatch.setattr(gc, "run_step", fake_runner({
        "data only": (1, "Traceback: boom", {}),
        "synthetic python": (0, "wrote e2e", {"e2e_synthetic_python.json": E2E}),
        "synthetic dali-cpu": ("timeout", "", {})}))
    rc = gc.main(["--cpu", "--out", str(tmp_path), "--only", "data", "--only", "synthetic"])
    table = (tmp_path / "summary.md").read_text()
    assert rc == 1
    assert "| data only | FAILED (1) |" in table and "| synthetic dali-cpu | FAILED (timeout) |" in table
    assert "stale" not in table and "data only: loader" not in table, "the failed step's old JSON was shown"
    assert not (tmp_path / "data_only.json").exists(), "removed before the step ran"
    assert "| synthetic_python |" in table, "this run's JSON is shown"
    assert "resnet50" not in table, "a file no step of this run wrote is not shown"
    capsys.readouterr()


def test_gpu_tests_that_all_skip_are_not_a_pass_on_a_gpu_run(tmp_path, monkeypatch):
    gc = load_gpu_check()
    monkeypatch.setattr(gc, "run_step", fake_runner({"gpu tests": (0, "5 skipped, 48 deselected in 2.07s", {})}))
    assert gc.main(["--out", str(tmp_path), "--only", "gpu tests"]) == 1
    assert "| gpu tests | FAILED (no test ran) |" in (tmp_path / "summary.md").read_text()
    # --cpu: skipping is expected, and said
    assert gc.main(["--cpu", "--out", str(tmp_path), "--only", "gpu tests"]) == 0
    assert "| gpu tests | skipped (no test ran) |" in (tmp_path / "summary.md").read_text()
    monkeypatch.setattr(gc, "run_step", fake_runner({"gpu tests": (0, "5 passed, 48 deselected in 9.1s", {})}))
    assert gc.main(["--out", str(tmp_path), "--only", "gpu tests"]) == 0
    assert "| gpu tests | ok |" in (tmp_path / "summary.md").read_text()
