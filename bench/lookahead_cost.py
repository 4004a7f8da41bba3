"""What feedgpu's next-epoch lookahead costs in a one-epoch run on a busy CPU (a diagnostic for
``bench/torch_dataset.py``'s JPEG case).

    .venv/bin/python -m bench.lookahead_cost --rounds 3

With ``persistent_workers``, once every batch of the epoch is submitted, feedgpu submits the
next epoch's first batches (``feedgpu.loader.epoch.Ahead``) so the next epoch starts without waiting
for the pool to refill. In a run of one epoch those batches are never delivered, and on a CPU
with no spare core they compete with the epoch's last batches. This runs the JPEG Dataset of
``bench/torch_dataset.py`` with torch's loader, feedgpu's, and feedgpu's with the lookahead
switched off (``EpochRunner._lookahead_ok`` patched to False: a diagnostic, not a setting),
rotating the order per round. Recorded per run: samples/s, worker CPU ms per delivered batch
when the loop ends, and 2 s later (the lookahead's batches finished meanwhile).
Results: ``bench/results/lookahead_cost.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch.utils.data as tud

import feedgpu
import feedgpu.loader.epoch as fe
from feedgpu.sample_data import default_sample
from bench.torch_dataset import RESULTS, JpegFolder, cpu_s as _cpu_s

KINDS = ("torch", "feedgpu", "feedgpu-no-lookahead")


def run(kind: str, ds, args) -> dict:
    original = fe.EpochRunner._lookahead_ok
    if kind == "feedgpu-no-lookahead":
        fe.EpochRunner._lookahead_ok = lambda self: False
    try:
        make = tud.DataLoader if kind == "torch" else feedgpu.DataLoader
        loader = make(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, persistent_workers=True)
        it = iter(loader)
        next(it)
        pids = [w.pid for w in it._workers] if kind == "torch" else loader.worker_pids()
        w0 = sum(map(_cpu_s, pids))
        n = batches = 0
        t0 = time.perf_counter()
        for _, labels in it:
            n += len(labels)
            batches += 1
        wall = time.perf_counter() - t0
        at_end = sum(map(_cpu_s, pids)) - w0
        time.sleep(2.0)
        settled = sum(map(_cpu_s, pids)) - w0
        del it, loader
    finally:
        fe.EpochRunner._lookahead_ok = original
    return {"rate": n / wall, "workers_ms_at_end": 1e3 * at_end / batches, "workers_ms_settled": 1e3 * settled / batches}


def main() -> None:
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    ds = JpegFolder(default_sample(args.images, progress=False))
    runs = {k: [] for k in KINDS}
    load_start = os.getloadavg()
    for r in range(args.rounds):
        order = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]
        for k in order:
            runs[k].append(run(k, ds, args))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]['rate']:.0f}/s" for k, v in runs.items()), flush=True)
    doc = {"machine": {"cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg(),
                       "note": args.note},
           "settings": {k: v for k, v in vars(args).items() if k != "note"}, "runs": runs,
           "median": {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lookahead_cost.json").write_text(json.dumps(doc, indent=1))
    lines = ["# What the next-epoch lookahead costs in a one-epoch JPEG run", "",
             f"Machine: {doc['machine']}. Settings: {doc['settings']}. Written by `bench/lookahead_cost.py`.", "",
             "| loader | median samples/s | worker CPU ms/batch at the loop's end | 2 s later | per round (samples/s) |",
             "| --- | ---: | ---: | ---: | --- |"]
    for k, v in runs.items():
        m = doc["median"][k]
        lines.append(f"| {k} | {m['rate']:.0f} | {m['workers_ms_at_end']:.1f} | {m['workers_ms_settled']:.1f} | "
                     + ", ".join(f"{x['rate']:.0f}" for x in v) + " |")
    (RESULTS / "lookahead_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
