"""A worker's unique memory (USS) on a Parquet file of one big row group, with and without a budget,
and copy-on-read growth of a torch Dataset holding a Python list against one holding a numpy array.

    .venv/bin/python bench/worker_memory.py                          # ~3 min on the 2-core dev machine
    .venv/bin/python bench/worker_memory.py --baseline ../main       # also the same runs on another checkout
    .venv/bin/python bench/worker_memory.py --rows 2000 --rounds 1

Data: one Parquet file, one row group of ``--rows`` records of ~27 KB (a real 32 x 32 JPEG made from
``shared/data/photos`` carrying random comment segments: the row group's size of the issue's
271 MB / 10,000-JPEG case, images that decode fast), label = row % 8, ~1 MiB pages, written to
``bench/out/`` once. Each configuration runs in a fresh child process (this checkout, or
``--baseline``'s on its ``PYTHONPATH``): one worker reads one epoch in order (decode,
resize_center_crop 16, batch 64) and its USS and RSS are read with psutil at the epoch's end, and
its USS over and over while the epoch runs (the peak);
every label is checked. Configurations: ``default`` (``worker_memory`` not given), ``64MiB``,
``256MiB`` (on a checkout without ``worker_memory`` only ``default`` runs). Copy-on-read: a torch
Dataset of 2,000,000 Python ints in a list (each sample sums 100 of them) and the same values in a
numpy array, 1 forked worker, one shuffled epoch; the USS growth minus RSS growth from the pool's
start to the epoch's end (feedgpu.exec.memory_watch) and whether CopyOnReadWarning was raised.
Rounds alternate the configurations; medians and per-round values are reported.
Results: ``bench/results/worker_memory.{json,md}``.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

MiB = 1 << 20


def make_data(path: Path, rows: int, pad: int) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image, ImageOps

    if path.exists() and pq.ParquetFile(path).metadata.num_rows == rows:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    small = []
    for p in sorted((REPO.parent / "shared" / "data" / "photos").glob("*.jpg"))[:8]:
        buf = io.BytesIO()
        ImageOps.fit(Image.open(p).convert("RGB"), (32, 32)).save(buf, "JPEG", quality=90)
        small.append(buf.getvalue())
    imgs = []
    for i in range(rows):
        segs, left = [], pad
        while left > 0:
            k = min(left, 65000)
            segs.append(b"\xff\xfe" + (k + 2).to_bytes(2, "big") + rng.bytes(k))
            left -= k
        j = small[i % len(small)]
        imgs.append(j[:2] + b"".join(segs) + j[2:])
    t = pa.table({"image": pa.array(imgs, pa.binary()), "label": pa.array([i % 8 for i in range(rows)], pa.int64())})
    tmp = path.with_suffix(".tmp")
    pq.write_table(t, tmp, row_group_size=rows, compression="none", data_page_size=1 << 20, write_batch_size=8)
    os.replace(tmp, path)
    return path


# -- children ------------------------------------------------------------------------------------
def child_parquet(data: str, budget: str | None) -> dict:
    import importlib.util
    import threading

    import psutil

    from feedgpu import DataLoader, ParquetSource, Pipeline
    from feedgpu.stages import Decode, ResizeCenterCrop

    src = ParquetSource(data)
    kw = {} if budget is None else {"worker_memory": budget}
    if budget is not None and importlib.util.find_spec("feedgpu.exec.memory_budget") is None:
        return {"skipped": "no worker_memory setting in this checkout"}
    p = Pipeline(src, [Decode(), ResizeCenterCrop(resize=16, crop=16)], batch_size=64, num_workers=1,
                 device="cpu", shuffle=False, persistent_workers=True, **kw)
    dl = DataLoader(p)
    peak, done = [0], threading.Event()

    def watch():   # the worker's USS read over and over while the epoch runs
        while not done.is_set():
            try:
                pids = dl.worker_pids()
                if pids:
                    peak[0] = max(peak[0], psutil.Process(pids[0]).memory_full_info().uss)
            except (psutil.Error, AttributeError):
                pass
            done.wait(0.002)

    t = time.perf_counter()
    threading.Thread(target=watch, daemon=True).start()
    labels = [int(v) for _, y in dl for v in y]
    seconds = time.perf_counter() - t
    done.set()
    assert labels == [i % 8 for i in range(len(src))], "a record was lost, repeated or mislabelled"
    m = psutil.Process(dl.worker_pids()[0]).memory_full_info()
    dl.shutdown()
    return {"uss_mib": round(m.uss / MiB, 1), "peak_uss_mib": round(max(peak[0], m.uss) / MiB, 1), "rss_mib": round(m.rss / MiB, 1), "seconds": round(seconds, 2),
            "cache_mib": round(src.cache_bytes / MiB, 1)}


def child_cow(kind: str) -> dict:
    import warnings

    import numpy as np
    import psutil
    import torch.utils.data as tud

    from feedgpu import DataLoader

    n, chunk = 2_000_000, 100

    class Ints(tud.Dataset):
        def __init__(self):
            self.items = list(range(10**7, 10**7 + n)) if kind == "list" else np.arange(10**7, 10**7 + n)

        def __len__(self):
            return n // chunk

        def __getitem__(self, i):
            return int(sum(self.items[i * chunk:(i + 1) * chunk]))

    dl = DataLoader(Ints(), batch_size=500, shuffle=True, num_workers=1, seed=3, persistent_workers=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = sum(len(b) for b in dl)
    assert count == n // chunk
    watch = getattr(dl, "_memory_watch", None)
    m = psutil.Process(dl.worker_pids()[0]).memory_full_info()
    dl.shutdown()
    return {"copied_mib": max(watch.report()["growth_mb"]) if watch is not None else None,
            "uss_mib": round(m.uss / MiB, 1),
            "warned": any(w.category.__name__ == "CopyOnReadWarning" for w in caught)}


def run_child(pythonpath: str, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *args], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def commit_of(repo: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=repo).stdout.strip()
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--pad", type=int, default=27_000, help="bytes of comment segments per image")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", help="another checkout of feedgpu to run the same children on")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        kind, *rest = a.child
        res = child_parquet(rest[0], None if rest[1] == "default" else rest[1]) if kind == "parquet" \
            else child_cow(rest[0])
        print(json.dumps(res))
        return 0
    from cpu_loader import write_results  # shared results writer
    from faults import machine

    t0 = time.perf_counter()
    data = make_data(HERE / "out" / f"one-row-group-{a.rows}x{a.pad}.parquet", a.rows, a.pad)
    import pyarrow.parquet as pq

    group = pq.ParquetFile(data).metadata.row_group(0).column(0).total_uncompressed_size
    trees = {"this": str(REPO)}
    if a.baseline:
        trees["baseline"] = str(Path(a.baseline).resolve())
    configs = [(t, "parquet", b) for t in trees for b in ("default", "64MiB", "256MiB")] + \
              [(t, "cow", k) for t in trees for k in ("list", "numpy")]
    runs = []
    for r in range(a.rounds):
        for tree, kind, arg in configs:
            args = [kind, str(data), arg] if kind == "parquet" else [kind, arg]
            res = run_child(trees[tree], args)
            res.update(round=r + 1, tree=tree, kind=kind, setting=arg)
            runs.append(res)
            print(f"round {r + 1}: {tree} {kind} {arg}: {res}", file=sys.stderr, flush=True)
    summary = {}
    for tree, kind, arg in configs:
        rs = [x for x in runs if (x["tree"], x["kind"], x["setting"]) == (tree, kind, arg) and "skipped" not in x]
        if not rs:
            continue
        keys = ("uss_mib", "peak_uss_mib", "rss_mib", "seconds", "cache_mib") if kind == "parquet" else ("copied_mib", "uss_mib")
        summary[f"{tree}/{kind}/{arg}"] = {k: {"median": statistics.median(x[k] for x in rs),
                                               "runs": [x[k] for x in rs]} for k in keys if rs[0].get(k) is not None}
        if kind == "cow":
            summary[f"{tree}/{kind}/{arg}"]["warned"] = [x["warned"] for x in rs]
    doc = {"machine": machine() | {"feedgpu_commit": commit_of(REPO),
                                   "baseline_commit": commit_of(Path(a.baseline)) if a.baseline else None},
           "settings": vars(a) | {"data": str(data), "row_group_image_bytes": group},
           "runs": runs, "summary": summary, "total_seconds": time.perf_counter() - t0}
    write_results(a.out, "worker_memory", doc, markdown)
    return 0


def markdown(doc: dict) -> str:
    m, s, sm = doc["machine"], doc["settings"], doc["summary"]
    lines = ["# Worker memory: one big Parquet row group, and copy-on-read", "",
             f"Machine: {m['platform']}, {m.get('cpus', m.get('cpu_count'))} CPUs, Python {m['python']}, "
             f"torch {m['torch']}, feedgpu {m.get('feedgpu_commit', '?')}"
             + (f" (baseline: {m['baseline_commit']})" if m.get("baseline_commit") else "")
             + f". Shared with other agents' jobs (load average {m.get('load_average', '?')}).", "",
             f"Data: one Parquet file, one row group of {s['rows']:,} JPEGs of ~{s['pad'] // 1000} KB "
             f"({s['row_group_image_bytes'] / MiB:,.0f} MiB of image column), ~1 MiB pages. One worker, one epoch "
             f"in order, decode + resize_center_crop 16, batch 64; {s['rounds']} rounds, medians (per-round values). "
             "Worker USS at the epoch's end; peak USS: the highest of the worker's USS read over and over (every "
             "~2 ms plus psutil's read) while the epoch ran.", "",
             "| checkout | worker_memory | row-group cache MiB | worker USS MiB | peak USS MiB | worker RSS MiB | "
             "epoch s |", "| --- | --- | --- | --- | --- | --- | --- |"]

    def cell(d, k, spec=".1f"):
        v = d.get(k)
        return "-" if v is None else f"{v['median']:{spec}} ({', '.join(format(x, spec) for x in v['runs'])})"

    for key, d in sm.items():
        tree, kind, arg = key.split("/")
        if kind == "parquet":
            lines.append(f"| {tree} | {arg} | {cell(d, 'cache_mib', '.0f')} | {cell(d, 'uss_mib')} | "
                         f"{cell(d, 'peak_uss_mib')} | {cell(d, 'rss_mib')} | {cell(d, 'seconds', '.2f')} |")
    lines += ["", "Copy-on-read: a torch Dataset of 2,000,000 Python ints (list) or the same values in a numpy "
              "array, 1 forked worker, one shuffled epoch of 20,000 samples (each sums 100 ints). Copied = the "
              "worker's USS growth minus its RSS growth from the pool's start to the epoch's end.", "",
              "| checkout | dataset | copied MiB | worker USS MiB | CopyOnReadWarning |", "| --- | --- | --- | --- | --- |"]
    for key, d in sm.items():
        tree, kind, arg = key.split("/")
        if kind == "cow":
            lines.append(f"| {tree} | {arg} | {cell(d, 'copied_mib')} | {cell(d, 'uss_mib')} | "
                         f"{', '.join(map(str, d['warned']))} |")
    lines += ["", "CopyOnReadWarning fires above 64 MiB copied per worker (feedgpu.exec.memory_watch.THRESHOLD_BYTES); "
              "the 2 M ints here stay under it (tests/integration/test_copy_on_read.py injects 32 MiB). The commit named above is "
              "the checkout's HEAD when the script ran."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
