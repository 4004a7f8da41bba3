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
rounds, and the ratio of medians and per round. The loaders alternate which runs first (the
order rotates each round). Beside the rate, each run records the CPU time it used per batch in
the main process (``time.process_time``: all its threads) and in its worker processes
(``/proc/<pid>/stat``, user + system), which a machine shared with other work disturbs less than
the rate; the load average is recorded at the start and the end.
Results: ``bench/results/torch_dataset.{json,md}``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.utils.data as tud
from PIL import Image

import feedgpu
from bench.harness import RESULTS, alternating, machine, md_table, write_results
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


def cpu_s(pid: int) -> float:
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
    w0, m0 = sum(map(cpu_s, pids)), time.process_time()
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
    workers_ms = 1e3 * (sum(map(cpu_s, pids)) - w0) / batches
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
    ap.add_argument("--out", default=str(RESULTS), help="where torch_dataset.json/.md go")
    ap.add_argument("--note", default="", help="said with the machine (e.g. who else used it)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    datasets = {"jpeg": JpegFolder(default_sample(args.images, progress=False)), "tiny": Tiny(args.tiny)}
    loaders = {"torch": tud.DataLoader, "feedgpu": feedgpu.DataLoader}
    runs = {d: {k: [] for k in loaders} for d in datasets}
    order = alternating(list(loaders), args.rounds, rotate=True)
    for r in range(1, args.rounds + 1):
        names = [name for rr, name in order if rr == r]
        for d, ds in datasets.items():
            for name in names:
                runs[d][name].append(run(loaders[name], ds, args))
            print(f"round {r}/{args.rounds} {d} ({' first, '.join(names)} second): " +
                  ", ".join(f"{k} {v[-1]['rate']:,.0f}/s" for k, v in runs[d].items()), flush=True)
    summary = {}
    for d, v in runs.items():
        rates = {k: [x["rate"] for x in xs] for k, xs in v.items()}
        per_round = [f / t for f, t in zip(rates["feedgpu"], rates["torch"])]
        cpu = {k: {part: [x[part] for x in xs] for part in ("main_ms", "workers_ms")} for k, xs in v.items()}
        summary[d] = {"samples_per_s": rates, "median": {k: statistics.median(x) for k, x in rates.items()},
                      "ratio_of_medians": statistics.median(rates["feedgpu"]) / statistics.median(rates["torch"]),
                      "ratio_per_round": per_round, "cpu_ms_per_batch": cpu,
                      "median_cpu_ms_per_batch": {k: {part: statistics.median(x) for part, x in c.items()}
                                                  for k, c in cpu.items()}}
    doc = {"format": "feedgpu.bench.torch_dataset/2", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m bench.torch_dataset " + " ".join(sys.argv[1:]),
           "machine": machine(load_average_start=load_start, note=args.note),
           "settings": {k: v for k, v in vars(args).items() if k not in ("out", "note")}, "results": summary,
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
        f"{m['torch']}, load average {m.get('load_average_start', '?')} at the start, {m.get('load_average')} at "
        f"the end. {m.get('note', '')} Settings: {doc['settings']}.", "",
        *md_table(("dataset", "torch (median samples/s)", "feedgpu", "ratio of medians", "per round"), rows,
                  "lrrrl"), *cpu_table(doc)]) + "\n"


def cpu_table(doc: dict) -> list[str]:
    """CPU ms per batch, median (range over rounds), by dataset and loader (absent before format 2)."""
    rows = []
    for d, s in doc["results"].items():
        c, m = s.get("cpu_ms_per_batch"), s.get("median_cpu_ms_per_batch")
        if c is None:
            return []

        def cell(k, part, c=c, m=m):
            return f"{m[k][part]:.2f} ({min(c[k][part]):.2f}-{max(c[k][part]):.2f})"
        rows.append((d, cell("torch", "main_ms"), cell("feedgpu", "main_ms"), cell("torch", "workers_ms"),
                     cell("feedgpu", "workers_ms")))
    return ["", "CPU time per batch, ms: median (range over rounds); main process with its threads, worker "
            "processes summed.", "",
            *md_table(("dataset", "torch main", "feedgpu main", "torch workers", "feedgpu workers"), rows)]


if __name__ == "__main__":
    main()
