#!/usr/bin/env python
"""The torchvision ImageNet reference train recipe, compiled by ``feedgpu.DataLoader``, on DALI
(``engine="dali"``) and on the Python engine, batches delivered to ``--device``: the step of
``bench/gpu_check.py`` that measures a user's unchanged torchvision script on a GPU.

    python -m bench.torchvision_gpu --device cuda --json out.json
    python -m bench.torchvision_gpu --device cpu --images 200 --batches 3    # try it without a GPU

Without torchvision (it must match the machine's torch) it writes ``{"skipped": reason}`` and
exits 0, saying so.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def measure(ds, engine: str, a) -> dict:
    import torch

    import feedgpu

    kw = {"engine": "dali", "device": a.device} if engine == "dali" else {}
    loader = feedgpu.DataLoader(ds, batch_size=a.batch_size, shuffle=True, num_workers=a.workers, drop_last=True,
                                pin_memory=a.device != "cpu" and engine != "dali", **kw)
    it = iter(loader)
    for _ in range(2):
        next(it)
    n, t0 = 0, time.perf_counter()
    for _ in range(a.batches):
        x, y = next(it)
        n += len(y)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    res = {"samples_per_s": round(n / wall, 1), "samples": n, "batch_device": str(x.device),
           "shape": list(x.shape), "dtype": str(x.dtype)}
    del it, loader
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    try:
        import torchvision.transforms as T
        from torchvision.datasets import ImageFolder
    except Exception as e:  # noqa: BLE001 - not installed, or built for another torch
        doc = {"skipped": f"torchvision does not import ({type(e).__name__}: {e})"}
        print(f"skipped: {doc['skipped']}")
    else:
        from feedgpu.sample_data import build_imagenet_like

        data = build_imagenet_like(ROOT / "bench" / "out" / f"imagenet-like-{a.images}", a.images)
        ds = ImageFolder(data, transform=T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                                                    T.ToTensor(), T.Normalize(MEAN, STD)]))
        doc = {"settings": vars(a), "recipe": "ImageNet reference train (v1)"}
        for engine in ("dali", "python"):
            doc[engine] = measure(ds, engine, a)
            print(f"{engine}: {doc[engine]['samples_per_s']:,.0f} samples/s, batches on {doc[engine]['batch_device']}",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
