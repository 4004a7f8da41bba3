"""feedgpu.DataLoader against torch.utils.data.DataLoader on the same plain torch Dataset.

    .venv/bin/python bench/torch_dataset.py                    # ~3 min on the 2-core dev machine
    .venv/bin/python bench/torch_dataset.py --rounds 7 --workers 2

Two map-style Datasets, each given to both loaders with the same arguments (``batch_size``,
``shuffle=True``, ``num_workers``, ``persistent_workers``):

* ``jpeg``: an ImageFolder-like Dataset over the embedded sample (JPEG decode with PIL,
  resize to 160 px on the short side, center crop 128, HWC uint8 -> CHW float32 tensor), the
  work a torchvision-style Dataset does per sample;
* ``tiny``: items of a 16-float tensor and an int, where the loader's own per-batch cost
  (sampling, transport, collation) is all there is.

Each round runs both loaders in one process, torch first in odd rounds and feedgpu first in even
ones, each timing ``--epochs`` epochs after one warm-up batch; the result is samples/s, the
median over rounds, and the ratio of medians and per round. Beside the wall-clock rate, each run
records the CPU time it used per batch in the main process (``time.process_time``: all its
threads) and in its worker processes (``/proc/<pid>/stat``, user + system), which a machine
shared with other work disturbs less than the rate. The load average is recorded at the start
and the end. Results: ``bench/results/torch_dataset.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.utils.data as tud
from PIL import Image

import feedgpu
from feedgpu.sample_data import default_sample

RESULTS = Path(__file__).resolve().parent / "results"


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


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(make, ds, args) -> dict:
    """One timed run: ``rate`` (samples/s), ``main_ms`` and ``workers_ms`` (CPU ms per batch)."""
    loader = make(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                  persistent_workers=args.workers > 0)
    it = iter(loader)
    next(it)  # warm-up: workers started
    if not args.workers:
        pids = []
    elif isinstance(loader, feedgpu.DataLoader):
        pids = loader.worker_pids()
    else:
        pids = [w.pid for w in it._workers]   # torch's iterator keeps its worker processes there
    w0, m0 = sum(map(_cpu_s, pids)), time.process_time()
    n, batches, t0 = 0, 0, time.perf_counter()
    for _, labels in it:
        n += len(labels)
        batches += 1
    for _ in range(args.epochs - 1):
        for _, labels in loader:
            n += len(labels)
            batches += 1
    wall = time.perf_counter() - t0
    main_ms = 1e3 * (time.process_time() - m0) / batches
    workers_ms = 1e3 * (sum(map(_cpu_s, pids)) - w0) / batches
    del it, loader
    return {"rate": n / wall, "main_ms": main_ms, "workers_ms": workers_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--tiny", type=int, default=100_000)
    ap.add_argument("--note", default="", help="said with the machine in the results (e.g. who else used it)")
    args = ap.parse_args()
    datasets = {"jpeg": JpegFolder(default_sample(args.images, progress=False)), "tiny": Tiny(args.tiny)}
    loaders = {"torch": tud.DataLoader, "feedgpu": feedgpu.DataLoader}
    runs = {d: {k: [] for k in loaders} for d in datasets}
    load_start = os.getloadavg()
    for r in range(args.rounds):
        names = list(loaders) if r % 2 == 0 else list(loaders)[::-1]
        for d, ds in datasets.items():
            for name in names:
                runs[d][name].append(run(loaders[name], ds, args))
            print(f"round {r + 1}/{args.rounds} {d}: " +
                  ", ".join(f"{k} {v[-1]['rate']:,.0f}/s" for k, v in runs[d].items()), flush=True)
    load_end = os.getloadavg()
    summary = {}
    for d, v in runs.items():
        rates = {k: [x["rate"] for x in xs] for k, xs in v.items()}
        per_round = [f / t for f, t in zip(rates["feedgpu"], rates["torch"])]
        summary[d] = {"samples_per_s": rates, "median": {k: statistics.median(x) for k, x in rates.items()},
                      "ratio_of_medians": statistics.median(rates["feedgpu"]) / statistics.median(rates["torch"]),
                      "ratio_per_round": per_round,
                      "cpu_ms_per_batch": {k: {part: [x[part] for x in xs] for part in ("main_ms", "workers_ms")}
                                           for k, xs in v.items()},
                      "median_cpu_ms_per_batch": {k: {part: statistics.median(x[part] for x in xs)
                                                      for part in ("main_ms", "workers_ms")} for k, xs in v.items()}}
    doc = {"machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                       "platform": platform.platform(), "load_average_start": load_start,
                       "load_average_end": load_end, "note": args.note},
           "settings": {k: v for k, v in vars(args).items() if k != "note"}, "results": summary}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "torch_dataset.json").write_text(json.dumps(doc, indent=1))
    lines = ["# feedgpu.DataLoader vs torch.utils.data.DataLoader, same plain torch Dataset", "",
             f"Machine: {doc['machine']}. Settings: {doc['settings']}. Written by `bench/torch_dataset.py`.", "",
             "| dataset | torch (median samples/s) | feedgpu | ratio of medians | per round |",
             "| --- | ---: | ---: | ---: | --- |"]
    for d, s in summary.items():
        lines.append(f"| {d} | {s['median']['torch']:,.0f} | {s['median']['feedgpu']:,.0f} | "
                     f"{s['ratio_of_medians']:.2f}x | {min(s['ratio_per_round']):.2f}-{max(s['ratio_per_round']):.2f}x |")
    lines += ["", "CPU time per batch (median over rounds, ms; main process incl. its threads / worker processes "
              "summed; range over rounds):", "",
              "| dataset | torch main | feedgpu main | torch workers | feedgpu workers |", "| --- | ---: | ---: | ---: | ---: |"]
    for d, s in summary.items():
        c, m = s["cpu_ms_per_batch"], s["median_cpu_ms_per_batch"]

        def cell(k, part):
            return f"{m[k][part]:.2f} ({min(c[k][part]):.2f}-{max(c[k][part]):.2f})"
        lines.append(f"| {d} | {cell('torch', 'main_ms')} | {cell('feedgpu', 'main_ms')} | "
                     f"{cell('torch', 'workers_ms')} | {cell('feedgpu', 'workers_ms')} |")
    (RESULTS / "torch_dataset.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
