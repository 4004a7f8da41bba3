"""feedgpu.DataLoader against torch.utils.data.DataLoader on the same plain torch Dataset.

    .venv/bin/python -m bench.torch_dataset                    # a few minutes on a 2-core machine
    .venv/bin/python -m bench.torch_dataset --rounds 7 --workers 2

Two map-style Datasets, each given to both loaders with the same arguments (``batch_size``,
``shuffle=True``, ``num_workers``, ``persistent_workers``):

* ``jpeg``: an ImageFolder-like Dataset over the embedded sample (JPEG decode with PIL,
  resize to 160 px on the short side, center crop 128, HWC uint8 -> CHW float32 tensor), the
  work a torchvision-style Dataset does per sample;
* ``tiny``: items of a 16-float tensor and an int, where the loader's own per-batch cost
  (sampling, transport, collation) is all there is.

Rounds alternate the two loaders (torch first, then feedgpu, per round, in one process), each
timing ``--epochs`` epochs after one warm-up batch; the result is samples/s, the median over
rounds, and the ratio of medians and per round. Results: ``bench/results/torch_dataset.{json,md}``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.utils.data as tud
from PIL import Image

import feedgpu
from bench.harness import RESULTS, machine, md_table, write_results
from feedgpu.sample_data import default_sample


class JpegFolder(tud.Dataset):
    """(CHW float32 tensor of 3 x 128 x 128, class index) per JPEG of an ImageFolder tree."""

    def __init__(self, root: Path):
        classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        self.items = [(str(p), c) for c, name in enumerate(classes) for p in sorted((root / name).glob("*.jpg"))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        with Image.open(path) as im:
            im = im.convert("RGB")
            w, h = im.size
            s = 160 / min(w, h)
            im = im.resize((max(128, round(w * s)), max(128, round(h * s))), Image.BILINEAR)
            w, h = im.size
            left, top = (w - 128) // 2, (h - 128) // 2
            a = np.asarray(im.crop((left, top, left + 128, top + 128)), dtype=np.uint8)
        return torch.from_numpy(a).permute(2, 0, 1).float().div_(255), label


class Tiny(tud.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((16,), float(i)), i


def run(make, ds, args) -> float:
    loader = make(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                  persistent_workers=args.workers > 0)
    it = iter(loader)
    next(it)  # warm-up: workers started
    n, t0 = 0, time.perf_counter()
    for _, labels in it:
        n += len(labels)
    for _ in range(args.epochs - 1):
        for _, labels in loader:
            n += len(labels)
    rate = n / (time.perf_counter() - t0)
    del it, loader
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--tiny", type=int, default=100_000)
    ap.add_argument("--out", default=str(RESULTS), help="where torch_dataset.json/.md go")
    args = ap.parse_args()
    t0 = time.perf_counter()
    datasets = {"jpeg": JpegFolder(default_sample(args.images, progress=False)), "tiny": Tiny(args.tiny)}
    loaders = {"torch": tud.DataLoader, "feedgpu": feedgpu.DataLoader}
    rates = {d: {k: [] for k in loaders} for d in datasets}
    for r in range(args.rounds):
        for d, ds in datasets.items():
            for name, make in loaders.items():
                rates[d][name].append(run(make, ds, args))
            print(f"round {r + 1}/{args.rounds} {d}: " +
                  ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates[d].items()), flush=True)
    summary = {}
    for d, v in rates.items():
        per_round = [f / t for f, t in zip(v["feedgpu"], v["torch"])]
        summary[d] = {"samples_per_s": v, "median": {k: statistics.median(x) for k, x in v.items()},
                      "ratio_of_medians": statistics.median(v["feedgpu"]) / statistics.median(v["torch"]),
                      "ratio_per_round": per_round}
    doc = {"format": "feedgpu.bench.torch_dataset/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m bench.torch_dataset " + " ".join(sys.argv[1:]), "machine": machine(),
           "settings": {k: v for k, v in vars(args).items() if k != "out"}, "results": summary,
           "total_seconds": round(time.perf_counter() - t0, 1)}
    write_results(args.out, "torch_dataset", doc, markdown)


def markdown(doc: dict) -> str:
    m = doc["machine"]
    rows = [(d, f"{s['median']['torch']:,.0f}", f"{s['median']['feedgpu']:,.0f}", f"{s['ratio_of_medians']:.2f}x",
             f"{min(s['ratio_per_round']):.2f}-{max(s['ratio_per_round']):.2f}x") for d, s in doc["results"].items()]
    return "\n".join([
        "# feedgpu.DataLoader vs torch.utils.data.DataLoader, same plain torch Dataset", "",
        f"Recorded {doc.get('created', '?')} with `{doc.get('command', 'python bench/torch_dataset.py').strip()}` "
        f"({doc.get('total_seconds', 0):.0f} s). Machine: {m.get('cpus_usable', m.get('cpus'))} CPUs "
        f"({m.get('cpu_model', '?')}), {m.get('ram_gb', '?')} GB, {m['platform']}, Python {m['python']}, torch "
        f"{m['torch']}, load average {m.get('load_average')}. Settings: {doc['settings']}.", "",
        *md_table(("dataset", "torch (median samples/s)", "feedgpu", "ratio of medians", "per round"), rows,
                  "lrrrl")]) + "\n"


if __name__ == "__main__":
    main()
