"""The read-ahead through the loader: a tar pipeline whose shards come over a simulated link.

    .venv/bin/python bench/shard_ahead_loader.py             # ~2 min on the 2-core dev machine
    .venv/bin/python bench/shard_ahead_loader.py --rounds 3 --latency 0.1 --transfer 0.05

Tar shards of ``--per-shard`` samples are written once from the embedded sample (``--images``
JPEGs). A ``feedgpu.DataLoader`` (decode + resize/center-crop 64 px, ``--workers`` workers,
``shuffle: shards`` with ``--window``) reads one epoch with a fake shard cache attached
(:func:`feedgpu.shard_ahead.attach`): each fetch answers with the local shard after ``--latency``
seconds (overlapping) plus ``--transfer`` seconds on one shared link (``bench/shard_ahead.py``'s
:class:`Link`). Settings, in turn in each round: no fetcher (the local baseline), ``on demand``
(``max_in_flight=1, max_held=1``), ``ahead 4`` (``max_in_flight=4``). Reported: the epoch's wall
time and the loader's wait for the network (``loader.stats()["read_ahead"]``), medians and
per-round ranges. Results: ``bench/results/shard_ahead_loader.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from feedgpu import DataLoader, Pipeline
from feedgpu.convert import folder_to_tar
from feedgpu.sample_data import build_imagenet_like
from feedgpu.shard_ahead import attach
from feedgpu.stages import Decode, ResizeCenterCrop
from shard_ahead import Link   # bench/shard_ahead.py: the script's folder is on sys.path

RESULTS = Path(__file__).resolve().parent / "results"
PHOTOS = Path(__file__).resolve().parents[1] / "feedgpu" / "assets" / "photos"


def epoch(shards: Path, a, fetch: dict | None) -> dict:
    p = Pipeline({"format": "tar", "path": str(shards)}, [Decode(), ResizeCenterCrop(72, 64)], batch_size=a.batch,
                 num_workers=a.workers, device="cpu", shuffle="shards", shard_window=a.window, seed=0)
    loader = DataLoader(p)
    if fetch is not None:
        attach(loader, Link(a.latency, a.transfer), **fetch)
    t0 = time.perf_counter()
    n = sum(len(b.labels) for b in loader)
    wall = time.perf_counter() - t0
    st = loader.stats()["read_ahead"] or {}
    loader.shutdown()
    return {"wall_s": round(wall, 3), "samples": n, "network_wait_s": round(st.get("network_wait_s", 0.0), 3),
            "fetched": st.get("fetched", 0), "max_held": st.get("max_held", 0), "load": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--per-shard", type=int, default=20)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.1)
    ap.add_argument("--transfer", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "shard_ahead_loader"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_imagenet_like(Path(tmp) / "train", a.images, photos_dir=PHOTOS, seed=0)
        shards = Path(tmp) / "tar"
        folder_to_tar(folder, shards, samples_per_shard=a.per_shard)
        settings = {"local (no fetcher)": None, "on demand": {"max_in_flight": 1, "max_held": 1},
                    "ahead 4": {"max_in_flight": 4}}
        runs: dict[str, list] = {k: [] for k in settings}
        epoch(shards, a, None)   # warm the page cache and the imports
        for r in range(a.rounds):
            for name, fetch in settings.items():
                runs[name].append(epoch(shards, a, fetch))
                print(r, name, runs[name][-1], flush=True)
    summary = {name: {k: {"median": statistics.median(x[k] for x in rs), "min": min(x[k] for x in rs),
                          "max": max(x[k] for x in rs)} for k in ("wall_s", "network_wait_s")}
               for name, rs in runs.items()}
    out = {"settings": vars(a), "runs": runs, "summary": summary,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "note": "2-core VM shared with other agents; load average per run in 'runs'"},
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    shards_n = -(-a.images // a.per_shard)
    lines = [f"# The read-ahead through the loader ({a.rounds} rounds, `bench/shard_ahead_loader.py`)", "",
             f"{a.images} JPEGs in {shards_n} tar shards of {a.per_shard}, decode + resize/crop 64 px, {a.workers} "
             f"workers, batches of {a.batch}, `shuffle: shards` window {a.window}; each fetch "
             f"{1e3 * a.latency:.0f} ms to first byte (overlapping) + {1e3 * a.transfer:.0f} ms on one shared link. "
             f"{os.cpu_count()} cores, shared with other agents (load average per run in the JSON).", "",
             "| setting | epoch wall (s) | loader waiting for the network (s) |", "| --- | --- | --- |"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['wall_s']['median']:.2f} ({s['wall_s']['min']:.2f}-{s['wall_s']['max']:.2f}) | "
                     f"{s['network_wait_s']['median']:.2f} ({s['network_wait_s']['min']:.2f}-"
                     f"{s['network_wait_s']['max']:.2f}) |")
    lines += ["", "Medians, per-round range in brackets."]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
