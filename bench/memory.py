"""RSS and USS of the main process and of each worker over 10 epochs on a 1,000,000-sample index.

    .venv/bin/python -m bench.memory                          # ~5 min on the 2-core dev machine
    .venv/bin/python -m bench.memory --samples 200000 --epochs 3

The data set is one Parquet file of ``--samples`` rows (8 distinct 8 x 8 PNGs made from
``shared/data/photos``, repeated; label = row), written to ``bench/out/`` once. The loader runs the
real pipeline (Parquet source, decode, resize_center_crop 8) with persistent workers; after every
epoch the main process and each worker are measured with ``psutil`` (RSS, and USS: the pages only
that process holds). Flat means the last epoch is within ``--tolerance`` MiB of the first measured
epoch (epoch 1; epoch 0 pays first-touch costs). Results: ``bench/results/memory.{json,md}``.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import REPO, RESULTS, git_commit, machine, write_results  # noqa: E402

MiB = 1 << 20


def make_data(path: Path, n: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image, ImageOps

    if path.exists() and pq.ParquetFile(path).metadata.num_rows == n:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    blobs = []
    for p in sorted((REPO.parent / "shared" / "data" / "photos").glob("*.jpg"))[:8]:
        buf = io.BytesIO()
        ImageOps.fit(Image.open(p).convert("RGB"), (8, 8)).save(buf, "PNG")  # ~250 bytes
        blobs.append(buf.getvalue())
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, pa.schema([("image", pa.binary()), ("label", pa.int64())])) as w:
        for lo in range(0, n, 100_000):
            hi = min(n, lo + 100_000)
            w.write_table(pa.table({"image": pa.array([blobs[i % 8] for i in range(lo, hi)], pa.binary()),
                                    "label": pa.array(range(lo, hi), pa.int64())}), row_group_size=10_000)
    os.replace(tmp, path)
    return path


def measure(pid: int) -> dict:
    import psutil

    m = psutil.Process(pid).memory_full_info()
    return {"rss_mib": round(m.rss / MiB, 1), "uss_mib": round(m.uss / MiB, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--tolerance", type=float, default=8.0, help="MiB of growth still called flat")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--rewrite", metavar="JSON", help="only rewrite the report from a results JSON")
    a = ap.parse_args(argv)
    if a.rewrite:
        doc = json.loads(Path(a.rewrite).read_text())
        doc.update(summarize(doc["epochs"], doc["settings"]["tolerance"]))
        write_results(a.out, "memory", doc, markdown)
        return 0
    t0 = time.perf_counter()
    data = REPO / "bench" / "out" / f"memory-{a.samples}.parquet"
    if not data.exists():  # built in a child: its Arrow buffers must not sit in the measured process
        subprocess.run([sys.executable, "-c", "from bench import memory; "
                        f"memory.make_data(memory.Path({str(data)!r}), {a.samples})"], check=True, cwd=REPO)

    from feedgpu import DataLoader, ParquetSource, Pipeline
    from feedgpu.stages import Decode, ResizeCenterCrop

    # the whole file's image column fits the per-process row-group cache: shuffled reads never
    # re-read a row group (a smaller cache makes every epoch re-read row groups, ~100x slower)
    src = ParquetSource(data, cache_bytes=512 << 20)
    p = Pipeline(src, [Decode(), ResizeCenterCrop(8, 8)], batch_size=a.batch_size, shuffle=True, seed=0,
                 num_workers=a.workers, persistent_workers=True, device="cpu")
    loader = DataLoader(p, timeout=120)
    rows = [{"epoch": "start", "main": measure(os.getpid()), "workers": []}]
    seen = 0
    for epoch in range(a.epochs):
        te = time.perf_counter()
        checksum = 0
        for b in loader:
            seen += len(b.labels)
            checksum += int(b.labels.sum())
        assert checksum == a.samples * (a.samples - 1) // 2, "a sample was lost or repeated"
        rows.append({"epoch": epoch, "seconds": round(time.perf_counter() - te, 1), "main": measure(os.getpid()),
                     "workers": [measure(pid) for pid in loader.worker_pids()]})
        print(f"epoch {epoch}: {rows[-1]}", file=sys.stderr, flush=True)
    loader.shutdown()
    doc = {"machine": machine(feedgpu_commit=git_commit()), "settings": vars(a) | {"data": str(data)}, "samples_delivered": seen,
           "epochs": rows, "total_seconds": time.perf_counter() - t0}
    doc.update(summarize(rows, a.tolerance))
    write_results(a.out, "memory", doc, markdown)
    return 0


def _growth(first: dict, last: dict) -> dict:
    return {"main_rss_mib": round(last["main"]["rss_mib"] - first["main"]["rss_mib"], 1),
            "main_uss_mib": round(last["main"]["uss_mib"] - first["main"]["uss_mib"], 1),
            "worker_rss_mib": [round(b["rss_mib"] - a["rss_mib"], 1) for a, b in zip(first["workers"], last["workers"])],
            "worker_uss_mib": [round(b["uss_mib"] - a["uss_mib"], 1) for a, b in zip(first["workers"], last["workers"])]}


def summarize(rows: list[dict], tolerance: float) -> dict:
    """Growth from epoch 1 to the last, and over the second half of the epochs. Flat: over the
    second half, main RSS and every worker's RSS and USS grow by at most ``tolerance`` MiB (a leak
    grows every epoch; warm-up settles in the first ones). Main USS is reported, not judged: it
    moves when workers drop pages they shared with the main process (then those pages become the
    main process's own without any new memory)."""
    epochs = [r for r in rows if r["epoch"] != "start"]
    half = _growth(epochs[len(epochs) // 2], epochs[-1])
    flat = max([abs(half["main_rss_mib"]), *map(abs, half["worker_rss_mib"]),
                *map(abs, half["worker_uss_mib"])]) <= tolerance
    return {"growth_from_epoch_1": _growth(epochs[min(1, len(epochs) - 1)], epochs[-1]),
            "growth_second_half": half, "second_half_from_epoch": epochs[len(epochs) // 2]["epoch"], "flat": flat}


def markdown(doc: dict) -> str:
    s, m = doc["settings"], doc["machine"]
    lines = [f"# Memory over {s['epochs']} epochs on a {s['samples']:,}-sample index", "",
             f"Machine: {m['platform']}, {m.get('cpu_count', m.get('nproc', m.get('cpus')))} CPUs, Python {m['python']}, torch {m['torch']}, "
             f"feedgpu {m['feedgpu_commit']}.", "",
             f"Data: one Parquet file, {s['samples']:,} rows of 8 x 8 PNGs (label = row). Pipeline: decode, "
             f"resize_center_crop 8; batch {s['batch_size']}, shuffle, {s['workers']} persistent workers, CPU. "
             f"{doc['samples_delivered']:,} samples delivered in {doc['total_seconds']:.0f} s.", "",
             "| epoch | s | main RSS MiB | main USS MiB | " + " | ".join(
                 f"worker {i} RSS / USS MiB" for i in range(s["workers"])) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in range(s["workers"])) + " |"]
    for r in doc["epochs"]:
        ws = r["workers"] or [{"rss_mib": "-", "uss_mib": "-"}] * s["workers"]
        lines.append(f"| {r['epoch']} | {r.get('seconds', '')} | {r['main']['rss_mib']} | {r['main']['uss_mib']} | "
                     + " | ".join(f"{w['rss_mib']} / {w['uss_mib']}" for w in ws) + " |")
    for label, g in (("epoch 1 to the last", doc["growth_from_epoch_1"]),
                     (f"epoch {doc['second_half_from_epoch']} to the last", doc["growth_second_half"])):
        lines.append(f"- Growth from {label}: main RSS {g['main_rss_mib']} MiB (USS {g['main_uss_mib']}); "
                     f"workers RSS {g['worker_rss_mib']} MiB, USS {g['worker_uss_mib']} MiB.")
    lines += ["", f"Flat (second half: main RSS, worker RSS and USS within {s['tolerance']} MiB; main USS not "
              f"checked): **{doc['flat']}**.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
