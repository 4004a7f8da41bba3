"""Index time, index memory, first batch and resume at 10 M samples: tar shards and Parquet files.

    .venv/bin/python bench/scale_10m.py                     # builds ~21 GB once (kept with --keep), runs
    .venv/bin/python bench/scale_10m.py --samples 1000000 --keep

Data (built once under ``--root``, outside the repository, reused while its marker matches the
settings; deleted at the end unless ``--keep``): ``--samples`` tiny samples, one 8x8 JPEG of a few
hundred bytes (the same bytes for every sample) and a label ``i % 1000``:

* tar: ``--shards`` shards in WebDataset layout, ``<shard>/<i>.jpg`` + ``<shard>/<i>.cls`` per
  sample, written as :mod:`tarfile` writes ustar members (headers built with numpy: 2 KiB a sample);
* Parquet: ``--files`` files, columns ``image`` (binary) and ``label`` (int64), row groups of ~8 MiB,
  uncompressed, no dictionary.

Each measurement is a fresh process (``--child``): the source's open (the index) and its time,
the process's RSS growth over it and the bytes of the index's arrays per sample, then a
``feedgpu.DataLoader`` (decode, resize/crop 8, normalize; batch 256, shuffled, 2 workers) and its
first batch; for ``resume`` the same after ``load_state_dict`` of a state at 10 %, 50 % and 99 %
of the epoch. Order: tar cold (no saved index: the tar index folder is emptied; the member
tables beside the shards, if any, not used: the numpy scan), tar warm (the index the cold run
saved), with ``--tables`` (the data then has a member table beside each shard, as ``feedgpu
convert`` writes them: :mod:`feedgpu.sources.tar.table`) tar cold with one indexing thread,
tar_table (no saved index, the tables taken on the shards' mtimes) and tar_table_hash (taken on
the hash of each shard's bytes, as for a copy that lost its mtimes), Parquet (it keeps no saved
index: each open reads the footers and the label column), resume on each, and torch's loader over
the same Parquet files (a map-style Dataset with pyarrow: the label column read at start, a row
group read per item) for its first batch. "Cold" means no saved index; the page cache cannot be
dropped as a whole (that needs root on the host), so the files are in memory as far as the
machine's page cache holds them (23 GiB for ~22 GB of data, shared with other users). With
``--evict`` the cold tar opens are also measured after each shard's pages are dropped
(``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no root for clean pages): runs named
``*_disk``. ``--files 0`` builds no Parquet files (run ``--only`` tar runs then).

The resume states are another loader's ``state_dict()`` with ``samples_seen`` and ``batches_seen``
set to the position (what a run that stopped there saves: the state holds the position, nothing
else; iterating 10 M samples to reach it is not needed to measure the seek). ``load_state_dict``
is timed on a fresh loader, so it includes the source's fingerprint (``order_identity``), which a
loader computes once.

Results: ``bench/results/scale_10m.{json,md}`` (``--out``; the cold-open study:
``scale_10m_cold``).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

MiB = 1 << 20
BATCH = 256
STAGES = [{"op": "decode"}, {"op": "resize_center_crop", "resize": 8, "crop": 8},
          {"op": "normalize", "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}]


def tiny_jpeg() -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(buf, "JPEG", quality=50, optimize=True)
    return buf.getvalue()


# -- the data ------------------------------------------------------------------------------------
def _octal(values, digits: int):
    """``values`` as ``digits`` zero-padded octal ASCII digits per row (uint8, shape (n, digits))."""
    import numpy as np

    v = np.asarray(values, dtype=np.int64)[:, None]
    powers = 8 ** np.arange(digits - 1, -1, -1, dtype=np.int64)
    return ((v // powers) % 8 + 48).astype(np.uint8)


def tar_shard(path: Path, shard: int, first: int, n: int, payload: bytes) -> None:
    """One shard of ``n`` samples, ``{shard:05d}/{i:09d}.jpg`` + ``.cls``, byte for byte what
    :mod:`tarfile` (ustar, mode 644, mtime 0) writes for them, end blocks and record padding included."""
    import numpy as np

    def headers(names: list[bytes], sizes) -> np.ndarray:
        h = np.zeros((len(names), 512), np.uint8)
        w = len(names[0])
        h[:, :w] = np.frombuffer(b"".join(names), np.uint8).reshape(len(names), w)
        h[:, 100:108] = np.frombuffer(b"0000644\0", np.uint8)
        h[:, 108:116] = np.frombuffer(b"0000000\0", np.uint8)
        h[:, 116:124] = np.frombuffer(b"0000000\0", np.uint8)
        h[:, 124:135] = _octal(sizes, 11)
        h[:, 136:148] = np.frombuffer(b"00000000000\0", np.uint8)
        h[:, 148:156] = 32
        h[:, 156] = ord("0")
        h[:, 257:265] = np.frombuffer(b"ustar\x0000", np.uint8)
        h[:, 329:337] = np.frombuffer(b"0000000\0", np.uint8)
        h[:, 337:345] = np.frombuffer(b"0000000\0", np.uint8)
        h[:, 148:154] = _octal(h.sum(axis=1, dtype=np.int64), 6)
        h[:, 154] = 0
        return h

    idx = np.arange(first, first + n)
    stems = [f"{shard:05d}/{i:09d}".encode() for i in idx]
    labels = [str(i % 1000).encode() for i in idx]
    jb = -(-len(payload) // 512)
    img = np.zeros((n, jb * 512), np.uint8)
    img[:, :len(payload)] = np.frombuffer(payload, np.uint8)
    cls = np.zeros((n, 512), np.uint8)
    for j, lab in enumerate(labels):
        cls[j, :len(lab)] = np.frombuffer(lab, np.uint8)
    body = np.concatenate([headers([s + b".jpg" for s in stems], np.full(n, len(payload))), img,
                           headers([s + b".cls" for s in stems], [len(x) for x in labels]), cls], axis=1)
    size = body.nbytes + 1024
    size += -size % 10240
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(body.data)
        f.write(b"\0" * (size - body.nbytes))
    os.replace(tmp, path)


def evict(path) -> None:
    """Drop a (clean) file's pages from the page cache (``posix_fadvise DONTNEED``: no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def build(root: Path, samples: int, shards: int, files: int, tables: bool = False) -> float:
    settings = {"samples": samples, "shards": shards, "files": files, "recipe": 1}
    if tables:
        settings["tables"] = True
    marker = root / "settings.json"
    if marker.exists() and json.loads(marker.read_text()) == settings:
        return 0.0
    t = time.perf_counter()
    if root.exists():
        shutil.rmtree(root)
    (root / "tar").mkdir(parents=True)
    (root / "parquet").mkdir()
    payload = tiny_jpeg()
    per = samples // shards
    for s in range(shards):
        n = per + (s < samples % shards)
        first = s * per + min(s, samples % shards)
        tar_shard(root / "tar" / f"shard-{s:05d}.tar", s, first, n, payload)
    import pyarrow as pa
    import pyarrow.parquet as pq

    per = samples // max(1, files)
    rows_per_group = max(1, (8 * MiB) // (len(payload) + 8))
    for k in range(files):
        n = per + (k < samples % files)
        first = k * per + min(k, samples % files)
        import numpy as np

        table = pa.table({"image": pa.array([payload] * n, pa.binary()),
                          "label": pa.array(np.arange(first, first + n, dtype=np.int64) % 1000)})
        pq.write_table(table, root / "parquet" / f"part-{k:04d}.parquet", row_group_size=rows_per_group,
                       compression="none", use_dictionary=False)
    time.sleep(2)
    if tables:   # beside each shard, as feedgpu convert writes them (2 s after the shards: mtimes are not racy)
        from feedgpu.sources.tar.local import write_tables

        os.sync()
        write_tables(sorted(str(p) for p in (root / "tar").glob("*.tar")))
    marker.write_text(json.dumps(settings))
    return time.perf_counter() - t


# -- one measured run, in a fresh process -------------------------------------------------------
def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _index_bytes(src) -> int:
    import numpy as np

    arrays = [getattr(src, name, None) for name in ("offsets", "sizes", "labels", "_shard_starts", "_shard_ids",
                                                    "_file_ids", "_groups", "_rows", "_locs")]
    members = getattr(src, "members", None)
    if members is not None:
        arrays += [members.blob, members.offsets]
    for name, value in vars(src).items():   # the Parquet index's own arrays, whatever their names
        if isinstance(value, np.ndarray) and not any(value is a for a in arrays):
            arrays.append(value)
    return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))


def child(kind: str, root: str, workers: int, at: float) -> dict:
    import psutil

    t0 = time.time() - psutil.Process().create_time()
    out: dict = {"kind": kind, "process_start_s": t0}
    fmt = "tar" if kind.startswith("tar") else "parquet"
    if kind.startswith("torch"):
        return _torch_child(out, root, workers)
    from feedgpu.sources.tar import local as tar_local, table as tar_table

    flags = set(kind.split("-")[1:])
    if "notable" in flags or kind.startswith("scan"):   # the member tables beside the shards not used
        tar_local.load_table = lambda p: (None, None, False)
    if "hash" in flags:   # a table is taken on the hash of its shard, not its mtime (a copy that lost mtimes)
        tar_table.racy_ns = lambda m: 1 << 62
    for f in flags:
        if f.startswith("t") and f[1:].isdigit():
            tar_local.INDEX_THREADS = int(f[1:])
    out["index_threads"] = tar_local.INDEX_THREADS
    if kind.startswith("scan"):   # the first shards, no saved index: the numpy scan or tarfile
        from feedgpu.sources.tar import TarShardSource

        shards = sorted(str(p) for p in (Path(root) / "tar").glob("*.tar"))[:int(kind.split("-")[2])]
        if kind.startswith("scan-tarfile"):
            tar_local.scan_plain = lambda *a: None
        t = time.perf_counter()
        src = TarShardSource(shards, index_dir=False)
        out.update(index_s=time.perf_counter() - t, samples=len(src), shards=len(shards))
        return out
    import feedgpu
    from feedgpu import DataLoader, Pipeline

    rss0 = _rss()
    p = Pipeline.from_config({"version": 1, "source": {"format": fmt, "path": str(Path(root) / fmt)},
                              "stages": STAGES, "loader": {"batch_size": BATCH, "shuffle": True,
                                                           "num_workers": workers}})
    t = time.perf_counter()
    src = p.source
    out["index_s"] = time.perf_counter() - t
    out["index_rss_mib"] = (_rss() - rss0) / MiB
    out["samples"] = n = len(src)
    out["index_bytes_per_sample"] = _index_bytes(src) / n
    members = getattr(src, "members", None)
    if members is not None:
        out["key_bytes_per_sample"] = members.blob.nbytes / n
        out["index_bytes_per_sample_less_keys"] = out["index_bytes_per_sample"] - members.blob.nbytes / n
    out["from_saved_index"] = getattr(src, "from_saved_index", None)
    out["saved_shards"] = getattr(src, "saved_shards", None)
    out["table_shards"] = getattr(src, "table_shards", None)
    loader = DataLoader(p, num_workers=workers)
    if at:
        t = time.perf_counter()
        state = DataLoader(p, num_workers=workers).state_dict()   # another loader: its fingerprint is not reused
        pos = int(n * at) // BATCH * BATCH
        state.update(samples_seen=pos, batches_seen=pos // BATCH)
        out["state_dict_s"] = time.perf_counter() - t
        t = time.perf_counter()
        loader.load_state_dict(state)   # a fresh loader: the source's fingerprint, then the seek
        out["load_state_dict_s"] = time.perf_counter() - t
        out["resumed_at"] = pos
    t = time.perf_counter()
    batch = next(iter(loader))
    out["first_batch_after_index_s"] = time.perf_counter() - t
    out["first_batch_s"] = time.time() - psutil.Process().create_time()
    out["batch_shape"] = list(batch.images.shape)
    out["rss_mib"] = _rss() / MiB
    out["feedgpu_version"] = feedgpu.__version__
    loader.shutdown()
    return out


def _torch_child(out: dict, root: str, workers: int) -> dict:
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.utils.data as tud
    from PIL import Image

    rss0 = _rss()
    t = time.perf_counter()
    files = sorted(str(p) for p in (Path(root) / "parquet").glob("*.parquet"))
    starts, groups, labels = [], [], []
    for i, f in enumerate(files):
        pf = pq.ParquetFile(f)
        for g in range(pf.num_row_groups):
            groups.append((i, g))
            starts.append(pf.metadata.row_group(g).num_rows)
        labels.append(pq.read_table(f, columns=["label"]).column("label").to_numpy())
    labels = np.concatenate(labels)
    bounds = np.concatenate([[0], np.cumsum(starts)])
    out["index_s"] = time.perf_counter() - t
    out["index_rss_mib"] = (_rss() - rss0) / MiB
    out["samples"] = len(labels)
    mean = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1)

    class Rows(tud.Dataset):
        def __init__(self):
            self.open = {}

        def __len__(self):
            return len(labels)

        def __getitem__(self, i):
            k = int(np.searchsorted(bounds, i, side="right")) - 1
            fi, g = groups[k]
            pf = self.open.get(fi) or self.open.setdefault(fi, pq.ParquetFile(files[fi]))
            data = pf.read_row_group(g, columns=["image"]).column(0)[i - int(bounds[k])].as_py()
            img = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32) / 255
            return (torch.from_numpy(img).permute(2, 0, 1) - mean) / 0.25, int(labels[i])

    g = torch.Generator()
    g.manual_seed(0)
    loader = tud.DataLoader(Rows(), batch_size=BATCH, shuffle=True, num_workers=workers, generator=g)
    t = time.perf_counter()
    images, _ = next(iter(loader))
    out["first_batch_after_index_s"] = time.perf_counter() - t
    import psutil

    out["first_batch_s"] = time.time() - psutil.Process().create_time()
    out["batch_shape"] = list(images.shape)
    out["rss_mib"] = _rss() / MiB
    return out


def run_child(kind: str, root: Path, workers: int, cache_dir: Path, at: float = 0.0) -> dict:
    env = dict(os.environ, FEEDGPU_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, __file__, "--child", kind, "--root", str(root), "--workers", str(workers),
                          "--at", str(at)], capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        return {"kind": kind, "error": res.stderr[-3000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def markdown(doc: dict) -> str:
    lines = ["# 10 M samples: index, first batch and resume (tar shards, Parquet)", "",
             f"Machine: {doc['machine']}. Shared with other agents' builds and tests (load average "
             f"{doc['load_before']} before, {doc['load_after']} after): single runs move by up to 2x.", "",
             f"Data: {doc['settings']['samples']:,} samples (an 8x8 JPEG of {doc['payload_bytes']} bytes and a label) "
             f"in {doc['settings']['shards']} tar shards ({doc['tar_gb']:.1f} GB) and {doc['settings']['files']} "
             f"Parquet files ({doc['parquet_gb']:.2f} GB, ~8 MiB row groups). Loader: batch {BATCH}, shuffled, "
             f"{doc['settings']['workers']} workers, decode + resize/crop 8 + normalize. Commit {doc['commit']}. "
             "\"Cold\" = no saved index; *_disk runs also start with the shards dropped from the page cache "
             "(posix_fadvise DONTNEED per file), the others find what the page cache kept; tar_cold = the numpy scan "
             "(member tables not used), tar_table = the tables beside the shards taken on their mtimes, "
             "tar_table_hash = on the hash of each shard's bytes. Script: `bench/scale_10m.py`; "
             f"every run's figures in `{doc.get('out_name', 'scale_10m')}.json`.", "",
             "| run | rounds | index (s) median (range) | index RSS (MiB) | index B/sample (less keys) "
             "| load_state_dict (s) | first batch after index (s) | first batch from process start (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, runs in doc["runs"].items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {name} | 0 | error: see json | | | | | |")
            continue

        def med(key, fmt="{:.2f}"):
            vals = sorted(r[key] for r in ok if r.get(key) is not None)
            if not vals:
                return ""
            m = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
            return fmt.format(m) + (f" ({fmt.format(vals[0])}-{fmt.format(vals[-1])})" if len(vals) > 1 else "")

        bps = med("index_bytes_per_sample", "{:.1f}")
        less = med("index_bytes_per_sample_less_keys", "{:.1f}")
        lines.append(f"| {name} | {len(ok)} | {med('index_s')} | {med('index_rss_mib', '{:.0f}')} | {bps}"
                     + (f" ({less})" if less else "") + f" | {med('load_state_dict_s', '{:.3f}')} | "
                     f"{med('first_batch_after_index_s')} | {med('first_batch_s')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "feedgpu-scale-10m")
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated runs (scan,tarfile,tar_cold,tar_cold_disk,tar_warm,tar_cold_1thread,"
                    "tar_table,tar_table_hash,tar_table_disk,tar_table_hash_disk,parquet,resume,torch)")
    ap.add_argument("--keep", action="store_true", help="keep the data for a later run")
    ap.add_argument("--tables", action="store_true", help="write the member tables beside the shards (as feedgpu "
                    "convert does) and measure opens that use them: tar_table (on mtimes), tar_table_hash")
    ap.add_argument("--evict", action="store_true", help="also measure each cold open with the shards and tables "
                    "dropped from the page cache first (posix_fadvise DONTNEED): runs named *_disk")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "scale_10m")
    ap.add_argument("--child")
    ap.add_argument("--at", type=float, default=0.0)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, str(a.root), a.workers, a.at)))
        return
    built_s = build(a.root, a.samples, a.shards, a.files, a.tables)
    print(f"data ready under {a.root} (built in {built_s:.0f} s)", flush=True)
    if a.build_only:
        return
    only = set(filter(None, a.only.split(",")))
    cache = a.root / "cache"
    runs: dict[str, list] = {}

    def go(name, kind, at=0.0, clear=False, disk=False):
        if only and name.split(" ")[0].split("@")[0] not in only:
            return
        if clear and cache.exists():
            shutil.rmtree(cache)
        if disk:
            t = time.perf_counter()
            for p in (a.root / "tar").iterdir():
                evict(p)
            print(f"evicted the shards from the page cache in {time.perf_counter() - t:.1f} s", flush=True)
        r = run_child(kind, a.root, a.workers, cache, at)
        r["load_average"] = [round(x, 2) for x in os.getloadavg()]
        runs.setdefault(name, []).append(r)
        print(name, json.dumps(r)[:600], flush=True)

    load_before = [round(x, 2) for x in os.getloadavg()]
    for _ in range(a.rounds):
        go("scan 10 shards", "scan-numpy-10")
        go("tarfile 10 shards", "scan-tarfile-10")
        go("tar_cold", "tar-notable", clear=True)
        if a.evict:
            go("tar_cold_disk", "tar-notable", clear=True, disk=True)
        go("tar_warm", "tar")
        if a.tables:
            go("tar_cold_1thread", "tar-notable-t1", clear=True)
            go("tar_table", "tar", clear=True)
            go("tar_table_hash", "tar-hash", clear=True)
            if a.evict:
                go("tar_table_disk", "tar", clear=True, disk=True)
                go("tar_table_hash_disk", "tar-hash", clear=True, disk=True)
        go("parquet", "parquet")
        for at in (0.1, 0.5, 0.99):
            go(f"resume tar @{at:.0%}", "tar", at)
            go(f"resume parquet @{at:.0%}", "parquet", at)
        go("torch parquet", "torch")
    import platform

    tar_bytes = sum(p.stat().st_size for p in (a.root / "tar").glob("*.tar"))
    pq_bytes = sum(p.stat().st_size for p in (a.root / "parquet").glob("*.parquet"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "feedgpu"], capture_output=True, text=True, cwd=REPO).stdout
    doc = {"out_name": a.out.name, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                      f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, {platform.platform()}",
           "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()],
           "commit": commit + ("+" if dirty else ""), "built_s": built_s, "payload_bytes": len(tiny_jpeg()),
           "tar_gb": tar_bytes / 1e9, "parquet_gb": pq_bytes / 1e9,
           "settings": {"samples": a.samples, "shards": a.shards, "files": a.files, "workers": a.workers,
                        "rounds": a.rounds, "batch": BATCH, "tables": a.tables, "evict": a.evict}, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    md = markdown(doc)
    conclusions = ""
    if a.out.with_suffix(".md").exists():
        old = a.out.with_suffix(".md").read_text()
        if "## Conclusions" in old:
            conclusions = "\n" + old[old.index("## Conclusions"):]
    a.out.with_suffix(".md").write_text(md + conclusions)
    print(md)
    if not a.keep:
        shutil.rmtree(a.root)


if __name__ == "__main__":
    main()
