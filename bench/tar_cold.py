"""What a cold open of tar shards costs, split: reading the bytes (page cache or disk) and numpy's
work, per shard; reading only the headers; the member table beside a shard; 1 or 2 threads.

    .venv/bin/python -m bench.tar_cold --shards 30 --rounds 3

Data (under ``--root``, deleted at the end unless ``--keep``): ``--shards`` shards of
``--per-shard`` samples, as :mod:`bench.scale_10m` builds them (an 8x8 JPEG of 337 bytes and a
``.cls`` per sample: 2 KiB a sample, 20 MB a shard of 10,000), each with its member table
(:func:`feedgpu.sources.tar.local.write_tables`), written 2 s after the shards. A shard is made
"disk-cold" by ``posix_fadvise(POSIX_FADV_DONTNEED)`` on it (clean pages of a file can be
dropped without root; the storage bytes a measurement read, from ``/proc/self/io``, show it
worked); "cached" is a shard just read.

Per shard, for every shard in each round (figures: the median over shards and rounds, with the
range of the rounds' medians):

* ``read``: the whole shard read in 8 MiB ``readinto`` calls; ``dd direct``: ``dd bs=4M
  iflag=direct``, the disk's own rate with no page cache;
* ``scan``: :func:`feedgpu.sources.tar.scan.scan_plain` (mmap + numpy); ``numpy only``: the same
  scan on the shard's bytes already in memory;
* ``headers only``: each 512-byte header read by ``pread`` at the offset the previous header's
  size gives (``POSIX_FADV_RANDOM``: no readahead), in Python;
* ``hash``: :func:`feedgpu.sources.tar.table.content_hash` (xxh3-128 of the shard);
  ``table (mtime)`` / ``table (hash)``: :func:`~feedgpu.sources.tar.table.load_table`, taking the
  table on the shard's mtime / on the hash of its bytes (the mtime check patched off).

Whole set: ``TarShardSource(shards, index_dir=False)`` with 1 and 2 indexing threads
(:data:`feedgpu.sources.tar.local.INDEX_THREADS`), the tables patched off (the numpy scan) or on
(taken on their hash), cached and disk-cold. Results: ``bench/results/tar_cold.{json,md}``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import RESULTS, git_commit, machine, md_table, write_results
from bench.scale_10m import evict, tar_shard, tiny_jpeg

__all__ = ["build", "main", "per_shard", "storage_read", "whole_set"]


def storage_read() -> int:
    """Bytes this process has had read from storage (``/proc/self/io`` ``read_bytes``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def build(root: Path, shards: int, per: int) -> list[str]:
    from feedgpu.sources.tar.local import write_tables

    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    payload = tiny_jpeg()
    paths = [root / f"shard-{s:05d}.tar" for s in range(shards)]
    for s, p in enumerate(paths):
        tar_shard(p, s, s * per, per, payload)
    os.sync()
    time.sleep(2.1)   # the tables' mtime check needs shards older than the table
    write_tables([str(p) for p in paths])
    os.sync()
    return [str(p) for p in paths]


def _read(path: str) -> None:
    buf = bytearray(8 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _prepare(path: str, cold: bool) -> None:
    """Before a timed step: drop the shard and its member table from the page cache (``cold``),
    else read the shard so that it is in the page cache."""
    if cold:
        from feedgpu.sources.tar import table as tar_table

        evict(path)
        evict(tar_table.table_path(path))
    else:
        _read(path)


def _dd(path: str) -> None:
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"], check=True, capture_output=True)


def _headers_only(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        size, at, n = os.fstat(fd).st_size, 0, 0
        while at + 512 <= size:
            h = os.pread(fd, 512, at)
            if not h.strip(b"\0"):
                break
            at += 512 + -(-int(h[124:136].strip(b"\0 ") or b"0", 8) // 512) * 512
            n += 1
        return n
    finally:
        os.close(fd)


def _numpy_only(data: bytes) -> None:
    from feedgpu.sources.tar.members import IMAGE_SUFFIXES, LABEL_SUFFIXES
    from feedgpu.sources.tar.scan import _scan

    arr = np.frombuffer(data, np.uint8)
    assert _scan(arr, len(data), IMAGE_SUFFIXES, LABEL_SUFFIXES) is not None


def per_shard(paths: list[str], rounds: int) -> dict:
    from feedgpu.sources.tar import table as tar_table
    from feedgpu.sources.tar.members import IMAGE_SUFFIXES, LABEL_SUFFIXES
    from feedgpu.sources.tar.scan import scan_plain

    def scan(p):
        assert scan_plain(p, IMAGE_SUFFIXES, LABEL_SUFFIXES) is not None

    def table(p):
        part, problem, read = tar_table.load_table(p)
        assert part is not None and problem is None, problem

    def table_hash(p):
        keep = tar_table.racy_ns
        tar_table.racy_ns = lambda m: 1 << 62   # the mtime never trusted: the hash decides
        try:
            part, problem, read = tar_table.load_table(p)
        finally:
            tar_table.racy_ns = keep
        assert part is not None and read, problem

    measures = {"read": _read, "dd direct": _dd, "scan": scan, "headers only": _headers_only,
                "hash": tar_table.content_hash, "table (mtime)": table, "table (hash)": table_hash}
    runs: dict = {}
    for r in range(rounds):
        for name, fn in measures.items():
            for cold in (False, True):
                if name == "dd direct" and not cold:
                    continue
                times, stored = [], []
                for p in paths:
                    _prepare(p, cold)
                    b0, t0 = storage_read(), time.perf_counter()
                    fn(p)
                    times.append(time.perf_counter() - t0)
                    stored.append(storage_read() - b0)
                key = f"{name}, {'disk' if cold else 'cached'}" if name != "dd direct" else name
                runs.setdefault(key, []).append({"s": statistics.median(times), "storage_bytes": statistics.median(stored)})
        times = []
        for p in paths:
            data = Path(p).read_bytes()
            t0 = time.perf_counter()
            _numpy_only(data)
            times.append(time.perf_counter() - t0)
        runs.setdefault("numpy only (bytes in memory)", []).append({"s": statistics.median(times), "storage_bytes": 0})
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]['s'] * 1e3:.1f} ms" for k, v in runs.items()), flush=True)
    return runs


def whole_set(paths: list[str], rounds: int) -> dict:
    import warnings

    from feedgpu.sources.tar import local as tar_local, table as tar_table
    from feedgpu.sources.tar import TarShardSource

    def no_table(p):
        return None, None, False

    runs: dict = {}
    keep = tar_local.INDEX_THREADS, tar_local.load_table, tar_table.racy_ns
    for r in range(rounds):
        for what in ("scan", "table (hash)"):
            for cold in (False, True):
                for threads in (1, 2):
                    for p in paths:
                        _prepare(p, cold)
                    tar_local.INDEX_THREADS = threads
                    if what == "scan":
                        tar_local.load_table = no_table
                    else:
                        tar_table.racy_ns = lambda m: 1 << 62   # the hash decides, as for a copied dataset
                    b0, t0 = storage_read(), time.perf_counter()
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("error")
                            src = TarShardSource(paths, index_dir=False)
                    finally:
                        tar_local.INDEX_THREADS, tar_local.load_table, tar_table.racy_ns = keep
                    took = time.perf_counter() - t0
                    assert src.table_shards == (len(paths) if what != "scan" else 0)
                    key = f"{what}, {'disk' if cold else 'cached'}, {threads} thread{'s' if threads > 1 else ''}"
                    runs.setdefault(key, []).append({"s": took, "per_shard_s": took / len(paths),
                                                     "storage_bytes": storage_read() - b0, "samples": len(src)})
                    print(f"round {r + 1}: {key} {took:.2f} s", flush=True)
    return runs


def markdown(doc: dict) -> str:
    s = doc["settings"]
    m = doc["machine"]
    lines = ["# A cold open of tar shards, split: bytes, numpy, headers only, member table, threads", "",
             f"Machine: {m.get('cpu_count', '?')} CPUs ({m.get('cpu_model', '')}), {m.get('ram_gb', '?')} GiB, "
             f"{m.get('platform', '')}; load average "
             f"{doc['load_before']} before, {doc['load_after']} after. Commit {doc['commit']}. Script: "
             "`bench/tar_cold.py`; every round in `tar_cold.json`.", "",
             f"Data: {s['shards']} shards of {s['per_shard']:,} samples (8x8 JPEG of {doc['payload_bytes']} B + "
             f".cls), {doc['shard_bytes'] / 1e6:.1f} MB a shard, with member tables. \"disk\" = the shard's pages "
             "dropped first (`posix_fadvise DONTNEED`), \"cached\" = the shard just read. Rounds: "
             f"{s['rounds']}.", "", "## Per shard", ""]

    def fmt(runs, key="s", scale=1e3, digits=1):
        vals = [r[key] * scale for r in runs]
        med = statistics.median(vals)
        return f"{med:.{digits}f}" + (f" ({min(vals):.{digits}f}-{max(vals):.{digits}f})" if len(vals) > 1 else "")

    rows = []
    for name, runs in doc["per_shard"].items():
        ms = statistics.median(r["s"] for r in runs)
        rows.append([name, fmt(runs), f"{doc['shard_bytes'] / ms / 1e9:.2f}",
                     f"{statistics.median(r['storage_bytes'] for r in runs) / 1e6:.1f}"])
    lines += md_table(["measure", "ms a shard, median (rounds)", "GB/s of shard", "storage MB read"], rows)
    lines += ["", "## Whole set: TarShardSource(index_dir=False)", ""]
    rows = []
    for name, runs in doc["whole_set"].items():
        rows.append([name, fmt(runs, "s", 1, 2), fmt(runs, "per_shard_s"),
                     f"{statistics.median(r['storage_bytes'] for r in runs) / 1e9:.2f}"])
    lines += md_table(["run", "s, median (rounds)", "ms a shard", "storage GB read"], rows)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "feedgpu-tar-cold")
    ap.add_argument("--shards", type=int, default=30)
    ap.add_argument("--per-shard", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    t0 = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    paths = build(a.root, a.shards, a.per_shard)
    try:
        doc = {"machine": machine(), "load_before": load_before, "commit": git_commit(),
               "payload_bytes": len(tiny_jpeg()), "shard_bytes": os.path.getsize(paths[0]),
               "settings": {"shards": a.shards, "per_shard": a.per_shard, "rounds": a.rounds},
               "per_shard": per_shard(paths, a.rounds), "whole_set": whole_set(paths, a.rounds)}
        doc["load_after"] = [round(x, 2) for x in os.getloadavg()]
        doc["total_seconds"] = time.perf_counter() - t0
        write_results(a.out, "tar_cold", doc, markdown)
    finally:
        if not a.keep:
            shutil.rmtree(a.root, ignore_errors=True)


if __name__ == "__main__":
    main()
