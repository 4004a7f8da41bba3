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
    # the user's module is found in the current directory, as with `python -m`, through the
    # installed `feedgpu` command (whose own path does not hold the current directory)
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    feedgpu_cmd = [str(Path(sys.executable).parent / "feedgpu")]
    res = subprocess.run(feedgpu_cmd + ["bench", "--dataset", "mytrain:make",
                          "--rounds", "1", "--batches", "2", "--batch-size", "16", "--workers", "1",
                          "--json", str(out)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "feedgpu.DataLoader / torch's DataLoader:" in res.stdout
    assert "feedgpu has no compiled op for ColorJitter" in res.stdout
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"torch", "feedgpu"} and doc["samples"] == 120
    assert all(r["samples_per_s"] > 0 for v in doc["runs"].values() for r in v)

    bad = subprocess.run(feedgpu_cmd + ["bench", "--dataset", "nowhere:make"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "bench --dataset: cannot import 'nowhere:make'" in bad.stderr


def test_bench_dataset_factory_returning_no_dataset(tmp_path):
    (tmp_path / "notds.py").write_text(
        "import torch.utils.data as tud\n"
        "def five():\n    return 5\n"
        "def name():\n    return 'train'\n"
        "class Stream(tud.IterableDataset):\n    def __iter__(self):\n        return iter(range(3))\n"
        "def stream():\n    return Stream()\n")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    feedgpu_cmd = [str(Path(sys.executable).parent / "feedgpu")]
    for ref, words in [("notds:five", "returned 5 (int), not a Dataset"),
                       ("notds:name", "returned 'train' (str), not a Dataset"),
                       ("notds:stream", "(Stream), an IterableDataset: bench --dataset measures map-style")]:
        res = subprocess.run(feedgpu_cmd + ["bench", "--dataset", ref, "--rounds", "1", "--batches", "1"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        assert res.returncode == 2, res.stderr[-2000:]
        assert f"bench --dataset: '{ref}' returned" in res.stderr and words in res.stderr
        assert "Traceback" not in res.stderr
