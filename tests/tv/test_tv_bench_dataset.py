"""``feedgpu bench --dataset module:factory`` on a user's torchvision dataset: both loaders
measured, the ratio and the explain table printed, JSON written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_dataset_runs_both_loaders(folder_ds, tmp_path):
    (tmp_path / "mytrain.py").write_text(
        "import torchvision.transforms as T\n"
        "from torchvision.datasets import ImageFolder\n"
        f"def make():\n    return ImageFolder({str(folder_ds)!r}, transform=T.Compose([T.RandomResizedCrop(64), "
        "T.RandomHorizontalFlip(), T.ColorJitter(0.2), T.ToTensor()]))\n")
    out = tmp_path / "bench.json"
    env = {"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-m", "feedgpu.cli.main", "bench", "--dataset", "mytrain:make",
                          "--rounds", "1", "--batches", "2", "--batch-size", "16", "--workers", "1",
                          "--json", str(out)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "feedgpu.DataLoader / torch's DataLoader:" in res.stdout
    assert "feedgpu has no stage for ColorJitter" in res.stdout
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"torch", "feedgpu"} and doc["samples"] == 120
    assert all(r["samples_per_s"] > 0 for v in doc["runs"].values() for r in v)

    bad = subprocess.run([sys.executable, "-m", "feedgpu.cli.main", "bench", "--dataset", "nowhere:make"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "cannot import" in bad.stderr
