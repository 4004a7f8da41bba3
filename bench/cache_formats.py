#!/usr/bin/env python
"""What a local cache should store: re-encoded JPEG vs raw pixels (zstd per sample, Arrow IPC zstd).

A pipeline caches the output of its deterministic prefix (decode + resize the short side to N px,
bilinear, uint8 HWC) and runs its random stages (random resized crop 224, flip, ...) after the
cache. This script measures, for each candidate way of storing that output in Arrow IPC files,
size on disk, write time and read-and-decode speed on ONE core, with the original JPEGs (no
resize, no cache) as the baseline:

* ``jpeg-orig``: the original JPEG bytes (what a loader reads without a cache);
* ``jpeg``: the resized image re-encoded as JPEG (Pillow, 4:2:0) at quality 90 and 95;
* ``raw``: the resized pixels, uncompressed;
* ``raw+zstd``: the resized pixels compressed per sample with ``zstandard`` (levels 1, 3, 9);
* ``raw+ipc-zstd``: the resized pixels in an Arrow IPC file written with Arrow's own buffer
  compression (``IpcWriteOptions(compression=Codec("zstd", level))``, levels 1, 3, 9). Arrow
  compresses each column buffer of a record batch as one frame, so reading one row decompresses
  its whole batch: these files are read sequentially (batch after batch), and one-row random
  access is measured separately on a few rows.

Every file: columns ``key`` string, ``label`` int64, ``height``/``width`` int32, ``data``
large_binary; one record batch per ~``--batch-mib`` MiB of ``data``. Reading memory-maps the
file (``pa.memory_map`` + ``pa.ipc.open_file``), takes zero-copy views of each batch's ``data``
buffer, and visits the rows in a shuffled order (random access, as a training loader does):

* read+decode: the uint8 HWC array (JPEG: Pillow decode + ``np.asarray``; zstd: decompress +
  ``np.frombuffer``; raw: ``np.frombuffer`` view, no copy);
* read+decode+crop: then what training does after the cache, a random resized crop to 224
  (torchvision's parameters, ``feedgpu.stages.geometry.random_resized_crop_params``) fused with
  the resize as ``Image.fromarray(arr).resize((224, 224), BILINEAR, box=...)``, a random
  horizontal flip and ``np.asarray``. For JPEG stores the decoded PIL image is cropped directly.

The process is pinned to one CPU (pyarrow's thread pools set to 1). Files are read warm (in the
page cache: they were just written and are read once untimed before the timed passes); with
``--cold`` one extra pass per store reads it after evicting the file's own pages with
``posix_fadvise(DONTNEED)`` (the VM's host may still cache the disk). Medians over ``--reps``
repetitions, stores in rotating order. Writes: ``bench/results/cache_formats.{json,md}``.

    .venv/bin/python -m bench.cache_formats                    # 6-8 min on the 2-core dev machine
    .venv/bin/python -m bench.cache_formats --sizes 256 --reps 3 --quiet-wait 0
    .venv/bin/python -m bench.cache_formats --render-only      # rewrite the .md from the .json
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import zstandard
from PIL import Image

from bench.harness import REPO, busy_seconds, machine, wait_quiet, write_markdown  # noqa: E402

from feedgpu.sample_data import build_imagenet_like  # noqa: E402
from feedgpu.stages.geometry import random_resized_crop_params  # noqa: E402

SCHEMA = pa.schema([("key", pa.string()), ("label", pa.int64()), ("height", pa.int32()),
                    ("width", pa.int32()), ("data", pa.large_binary())])
BILINEAR = Image.Resampling.BILINEAR
FLIP = Image.Transpose.FLIP_LEFT_RIGHT
CROP = 224
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


# -- data ------------------------------------------------------------------------------------------
def dataset(args) -> Path:
    """``--data`` if given; else /tmp/fg/ds<N> when it is a complete build of N images; else build
    under the work folder."""
    if args.data:
        return Path(args.data)
    shared = Path(f"/tmp/fg/ds{args.images}")
    marker = shared / ".feedgpu-sample.json"
    if marker.exists():
        try:
            if json.loads(marker.read_text()).get("n_images") == args.images and \
                    len(list(shared.glob("*/*.jpg"))) == args.images:
                return shared
        except (OSError, ValueError):
            pass
    return build_imagenet_like(Path(args.work) / f"ds{args.images}", args.images,
                               photos_dir=args.photos, progress=True)


def list_images(root: Path) -> tuple[list[str], list[int], list[bytes]]:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    keys, labels, blobs = [], [], []
    for label, c in enumerate(classes):
        for f in sorted((root / c).iterdir()):
            if f.suffix.lower() in (".jpg", ".jpeg"):
                keys.append(f"{c}/{f.name}")
                labels.append(label)
                blobs.append(f.read_bytes())
    return keys, labels, blobs


def short_side_size(w: int, h: int, n: int) -> tuple[int, int]:
    s = n / min(w, h)
    return (n, max(1, round(h * s))) if w <= h else (max(1, round(w * s)), n)


def prefix(blobs: list[bytes], n: int) -> tuple[list[np.ndarray], dict]:
    """The deterministic prefix: decode (RGB) then resize the short side to ``n``, bilinear."""
    out, t_dec, t_res = [], [], []
    for b in blobs:
        t0 = time.perf_counter()
        img = Image.open(io.BytesIO(b))
        img = img.convert("RGB") if img.mode != "RGB" else img
        img.load()
        t1 = time.perf_counter()
        r = img.resize(short_side_size(img.width, img.height, n), BILINEAR)
        a = np.asarray(r)
        t2 = time.perf_counter()
        out.append(a)
        t_dec.append(t1 - t0)
        t_res.append(t2 - t1)
    return out, {"decode_ms": 1e3 * statistics.fmean(t_dec), "resize_ms": 1e3 * statistics.fmean(t_res),
                 "ms_per_image": 1e3 * (statistics.fmean(t_dec) + statistics.fmean(t_res))}


# -- stores ----------------------------------------------------------------------------------------
class Store:
    def __init__(self, name: str, fmt: str, level: str, kind: str, size: int | None, path: Path,
                 ipc_level: int | None = None):
        self.name, self.fmt, self.level, self.kind, self.size, self.path = name, fmt, level, kind, size, path
        self.ipc_level = ipc_level  # Arrow IPC buffer compression: rows are read batch by batch

    @property
    def random_access(self) -> bool:
        return self.ipc_level is None


def payloads(store: Store, blobs, arrays):
    """(height, width, bytes) per image, encoded as the store wants (lazy: timed by the writer)."""
    if store.kind == "jpeg-orig":
        for b in blobs:
            with Image.open(io.BytesIO(b)) as im:
                w, h = im.size
            yield h, w, b
    elif store.kind == "jpeg":
        q = int(store.level.removeprefix("q"))
        for a in arrays:
            bio = io.BytesIO()
            Image.fromarray(a).save(bio, "JPEG", quality=q)
            yield a.shape[0], a.shape[1], bio.getvalue()
    elif store.kind == "zstd":
        cctx = zstandard.ZstdCompressor(level=int(store.level))
        for a in arrays:
            yield a.shape[0], a.shape[1], cctx.compress(a)
    else:  # raw, raw in a compressed IPC file
        for a in arrays:
            yield a.shape[0], a.shape[1], a.tobytes()


def write_store(store: Store, keys, labels, items, batch_bytes: int) -> dict:
    opts = pa.ipc.IpcWriteOptions(use_threads=False, compression=(
        pa.Codec("zstd", compression_level=store.ipc_level) if store.ipc_level is not None else None))
    store.path.parent.mkdir(parents=True, exist_ok=True)
    n_batches = 0
    t0 = time.perf_counter()
    with pa.OSFile(str(store.path), "wb") as sink, pa.ipc.new_file(sink, SCHEMA, options=opts) as w:
        rows: list[tuple] = []
        size = 0

        def flush():
            nonlocal rows, size, n_batches
            if rows:
                idx, hs, ws, data = zip(*rows)
                w.write_batch(pa.RecordBatch.from_arrays([
                    pa.array([keys[j] for j in idx], pa.string()), pa.array([labels[j] for j in idx], pa.int64()),
                    pa.array(hs, pa.int32()), pa.array(ws, pa.int32()), pa.array(data, pa.large_binary())],
                    schema=SCHEMA))
                n_batches += 1
            rows, size = [], 0

        for i, (h, wd, data) in enumerate(items):
            rows.append((i, h, wd, data))
            size += len(data)
            if size >= batch_bytes:
                flush()
        flush()
    write_s = time.perf_counter() - t0
    return {"write_s": write_s, "bytes": store.path.stat().st_size, "batches": n_batches}


# -- reading ---------------------------------------------------------------------------------------
def open_store(path: Path):
    src = pa.memory_map(str(path))
    return src, pa.ipc.open_file(src, options=pa.ipc.IpcReadOptions(use_threads=False))


def batch_views(batch: pa.RecordBatch):
    """Zero-copy: (offsets int64, data uint8, heights, widths) of one record batch."""
    col = batch.column(4)
    bufs = col.buffers()
    offs = np.frombuffer(bufs[1], dtype=np.int64)[col.offset:col.offset + len(col) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    return offs, data, batch.column(2).to_numpy(), batch.column(3).to_numpy()


class Decoder:
    """Bytes of one row -> uint8 HWC array (``as_image=True``: a PIL image when that is cheaper)."""

    def __init__(self, kind: str, zstd_lib: str = "zstandard"):
        self.kind = kind
        self.dctx = zstandard.ZstdDecompressor()
        self.codec = pa.Codec("zstd") if zstd_lib == "pyarrow" else None

    def __call__(self, h: int, w: int, buf: np.ndarray, as_image: bool = False):
        if self.kind in ("jpeg", "jpeg-orig"):
            img = Image.open(io.BytesIO(buf))
            img = img.convert("RGB") if img.mode != "RGB" else img
            img.load()
            return img if as_image else np.asarray(img)
        if self.kind == "zstd" and self.codec is not None:  # same frames, Arrow's libzstd binding
            arr = np.frombuffer(self.codec.decompress(buf, decompressed_size=h * w * 3), dtype=np.uint8).reshape(h, w, 3)
        elif self.kind == "zstd":
            arr = np.frombuffer(self.dctx.decompress(buf), dtype=np.uint8).reshape(h, w, 3)
        else:
            arr = buf.reshape(h, w, 3)
        return Image.fromarray(arr) if as_image else arr


def crop_flip(img: Image.Image, rng) -> np.ndarray:
    top, left, h, w = random_resized_crop_params(img.width, img.height, SCALE, RATIO, rng)
    out = img.resize((CROP, CROP), BILINEAR, box=(left, top, left + w, top + h))
    if rng.random() < 0.5:
        out = out.transpose(FLIP)
    return np.asarray(out)


def read_pass(store: Store, mode: str, crop: bool, order: np.ndarray, seed: int, limit: int | None = None,
              zstd_lib: str = "zstandard") -> dict:
    """One timed pass; ``mode``: ``random`` (rows in ``order``, all batches viewed once at open),
    ``sequential`` (batch after batch, rows in file order), ``per_row`` (rows in ``order``, the
    row's batch read anew for each row, as a random-access reader of a compressed IPC file must)."""
    dec = Decoder(store.kind, zstd_lib)
    rng = np.random.default_rng(seed)
    n_done = 0
    t0 = time.perf_counter()
    src, reader = open_store(store.path)
    nb = reader.num_record_batches
    if mode == "sequential":
        for b in range(nb):
            offs, data, hs, ws = batch_views(reader.get_batch(b))
            for j in range(len(hs)):
                x = dec(int(hs[j]), int(ws[j]), data[offs[j]:offs[j + 1]], as_image=crop)
                if crop:
                    crop_flip(x, rng)
                n_done += 1
    else:
        counts = [reader.get_batch(b).num_rows for b in range(nb)] if mode == "per_row" else None
        views = [batch_views(reader.get_batch(b)) for b in range(nb)] if mode == "random" else None
        sizes = [len(v[2]) for v in views] if views is not None else counts
        starts = np.cumsum([0] + sizes)
        for g in (order if limit is None else order[:limit]):
            b = int(np.searchsorted(starts, g, side="right")) - 1
            j = int(g - starts[b])
            offs, data, hs, ws = views[b] if views is not None else batch_views(reader.get_batch(b))
            x = dec(int(hs[j]), int(ws[j]), data[offs[j]:offs[j + 1]], as_image=crop)
            if crop:
                crop_flip(x, rng)
            n_done += 1
    dt = time.perf_counter() - t0
    del reader
    src.close()
    return {"images": n_done, "seconds": dt, "img_per_s": n_done / dt}


def verify(store: Store, arrays: list[np.ndarray] | None) -> dict:
    """Untimed sequential pass (also warms the page cache): lossless stores must give back the
    exact prefix output; JPEG stores get their PSNR against it."""
    if arrays is None:
        read_pass(store, "sequential", False, np.arange(0), 0)
        return {}
    dec = Decoder(store.kind)
    src, reader = open_store(store.path)
    i, exact, psnr = 0, True, []
    for b in range(reader.num_record_batches):
        offs, data, hs, ws = batch_views(reader.get_batch(b))
        for j in range(len(hs)):
            a = dec(int(hs[j]), int(ws[j]), data[offs[j]:offs[j + 1]])
            ref = arrays[i]
            if store.kind == "jpeg":
                mse = float(np.mean((a.astype(np.float32) - ref.astype(np.float32)) ** 2))
                psnr.append(99.0 if mse == 0 else 10 * math.log10(255 ** 2 / mse))
            elif a.shape != ref.shape or not np.array_equal(a, ref):
                exact = False
            i += 1
    del reader
    src.close()
    if store.kind == "jpeg":
        return {"psnr_db_mean": statistics.fmean(psnr), "psnr_db_min": min(psnr)}
    if not exact or i != len(arrays):
        raise SystemExit(f"{store.name}: read back differs from what was written")
    return {"lossless_verified": True}


def evict(path: Path) -> str:
    """Drop this file's pages from the page cache (clean pages only: fsync first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:  # resident pages left, e.g. "0B"
        out = subprocess.run(["fincore", "-n", "-o", "RES", str(path)], capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


# -- environment -----------------------------------------------------------------------------------
def steal_seconds() -> float:
    import psutil

    return getattr(psutil.cpu_times(), "steal", 0.0)


# -- main ------------------------------------------------------------------------------------------
def make_stores(args, work: Path) -> list[Store]:
    stores = [Store("jpeg-orig", "original JPEG (no cache)", "-", "jpeg-orig", None, work / "jpeg-orig.arrow")]
    for n in args.sizes:
        d = work / f"s{n}"
        for q in args.qualities:
            stores.append(Store(f"s{n}/jpeg-q{q}", "JPEG re-encoded", f"q{q}", "jpeg", n, d / f"jpeg-q{q}.arrow"))
        stores.append(Store(f"s{n}/raw", "raw", "-", "raw", n, d / "raw.arrow"))
        for lv in args.levels:
            stores.append(Store(f"s{n}/raw-zstd{lv}", "raw + zstd per sample", str(lv), "zstd", n, d / f"raw-zstd{lv}.arrow"))
        for lv in args.levels:
            stores.append(Store(f"s{n}/raw-ipc-zstd{lv}", "raw + Arrow IPC zstd", str(lv), "raw", n,
                                d / f"raw-ipc-zstd{lv}.arrow", ipc_level=lv))
    return stores


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="ImageFolder of JPEGs (default: /tmp/fg/ds<images> or build one)")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--photos", default="/work/shared/data/photos", help="photographs to build the data set from")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 160], help="short side after the prefix resize")
    ap.add_argument("--qualities", type=int, nargs="+", default=[90, 95])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 3, 9])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch-mib", type=float, default=32.0, help="target data bytes per record batch")
    ap.add_argument("--per-row", type=int, default=20, help="rows read by one-row random access of IPC-compressed files")
    ap.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                    help="one extra random-access pass per store after evicting the file from the page cache")
    ap.add_argument("--work", default="/tmp/fg/cache_formats", help="where the stores are written")
    ap.add_argument("--keep", action="store_true", help="keep the store files")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="before each repetition, wait up to this long "
                    "for other processes to leave the machine idle")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite cache_formats.md from the recorded cache_formats.json, measuring nothing")
    args = ap.parse_args(argv)
    if args.render_only:
        out = Path(args.out)
        doc = json.loads((out / "cache_formats.json").read_text())
        doc["choice"]["feedgpu_write_ms"] = feedgpu_write_ms()
        (out / "cache_formats.json").write_text(json.dumps(doc, indent=1) + "\n")
        write_markdown(out / "cache_formats.md", render(doc))
        return 0

    t_start = time.perf_counter()
    pinned = None
    if hasattr(os, "sched_setaffinity"):
        pinned = max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {pinned})
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    work = Path(args.work)
    busy0, own0, wall0, steal0 = busy_seconds(), time.process_time(), time.perf_counter(), steal_seconds()

    root = dataset(args)
    keys, labels, blobs = list_images(root)
    n = len(blobs)
    print(f"data: {root} ({n} images, {sum(map(len, blobs)) / 2**20:.1f} MiB of JPEG)", file=sys.stderr)
    dims = []
    for b in blobs:
        with Image.open(io.BytesIO(b)) as im:
            dims.append(im.size)
    data_meta = {"path": str(root), "images": n, "classes": len(set(labels)),
                 "jpeg_bytes": sum(map(len, blobs)), "jpeg_kb_mean": sum(map(len, blobs)) / n / 1e3,
                 "width_mean": statistics.fmean(w for w, _ in dims), "height_mean": statistics.fmean(h for _, h in dims),
                 "megapixels_mean": statistics.fmean(w * h for w, h in dims) / 1e6,
                 "short_side_mean": statistics.fmean(min(w, h) for w, h in dims)}
    # zstd on JPEG bytes: does it shrink them? (size only)
    cctx3 = zstandard.ZstdCompressor(level=3)
    data_meta["zstd3_on_jpeg_ratio"] = sum(len(cctx3.compress(b)) for b in blobs) / data_meta["jpeg_bytes"]

    stores = make_stores(args, work)
    prefix_info, arrays_by_size = {}, {}
    results: dict[str, dict] = {}
    batch_bytes = int(args.batch_mib * 2**20)
    for s in stores:
        arrays = None
        if s.size is not None:
            if s.size not in arrays_by_size:
                arrays_by_size.clear()  # keep one size in memory at a time
                print(f"prefix: decode + resize short side to {s.size}", file=sys.stderr)
                arrays_by_size[s.size], info = prefix(blobs, s.size)
                info["raw_bytes"] = sum(a.nbytes for a in arrays_by_size[s.size])
                info["height_mean"] = statistics.fmean(a.shape[0] for a in arrays_by_size[s.size])
                info["width_mean"] = statistics.fmean(a.shape[1] for a in arrays_by_size[s.size])
                prefix_info[s.size] = info
            arrays = arrays_by_size[s.size]
        print(f"write {s.name}", file=sys.stderr)
        r = write_store(s, keys, labels, payloads(s, blobs, arrays), batch_bytes)
        r.update(verify(s, arrays))
        r.update({"name": s.name, "format": s.fmt, "level": s.level, "short_side": s.size,
                  "access": "random" if s.random_access else "sequential", "path": str(s.path)})
        results[s.name] = r
    arrays_by_size.clear()

    order = np.random.default_rng(args.seed).permutation(n)
    waited = []
    for rep in range(args.reps):
        k = rep % len(stores)
        for s in stores[k:] + stores[:k]:
            waited.append(wait_quiet(args.quiet_wait, 25.0))
            r = results[s.name]
            print(f"rep {rep + 1}/{args.reps}: {s.name}", file=sys.stderr)
            mode = "random" if s.random_access else "sequential"
            r.setdefault("read_decode", []).append(read_pass(s, mode, False, order, args.seed + rep))
            r.setdefault("read_decode_crop", []).append(read_pass(s, mode, True, order, args.seed + rep))
            r.setdefault("seq_read_decode", []).append(read_pass(s, "sequential", False, order, args.seed + rep))
            if s.kind == "zstd":
                r.setdefault("pyarrow_codec_read_decode", []).append(
                    read_pass(s, mode, False, order, args.seed + rep, zstd_lib="pyarrow"))
            if not s.random_access:
                r.setdefault("per_row_read_decode", []).append(
                    read_pass(s, "per_row", False, order, args.seed + rep, limit=args.per_row))
    if args.cold:
        for s in stores:
            r = results[s.name]
            print(f"cold: {s.name}", file=sys.stderr)
            waited.append(wait_quiet(args.quiet_wait, 25.0))
            r["cold_resident_after_evict"] = evict(s.path)
            mode = "random" if s.random_access else "sequential"
            r["cold_read_decode_crop"] = read_pass(s, mode, True, order, args.seed + 1000)
    busy1, own1, wall1, steal1 = busy_seconds(), time.process_time(), time.perf_counter(), steal_seconds()

    for r in results.values():
        for key in ("read_decode", "read_decode_crop", "seq_read_decode", "per_row_read_decode",
                    "pyarrow_codec_read_decode"):
            if key in r:
                r[key + "_img_per_s"] = statistics.median(x["img_per_s"] for x in r[key])
    base = results["jpeg-orig"]
    for r in results.values():
        r["kb_per_image"] = r["bytes"] / n / 1e3
        r["ratio_vs_orig"] = r["bytes"] / base["bytes"]
        r["speedup_vs_orig"] = r["read_decode_crop_img_per_s"] / base["read_decode_crop_img_per_s"]
        if "cold_read_decode_crop" in r:
            r["cold_speedup_vs_orig"] = r["cold_read_decode_crop"]["img_per_s"] / base["cold_read_decode_crop"]["img_per_s"]

    spreads = {r["name"]: (max(x["img_per_s"] for x in r["read_decode_crop"]) - min(x["img_per_s"] for x in r["read_decode_crop"]))
               / r["read_decode_crop_img_per_s"] for r in results.values()}
    worst = max(spreads, key=spreads.get)
    spread = {"median": statistics.median(spreads.values()), "max": spreads[worst], "worst": worst}
    choice = choose(results, prefix_info, args)
    choice["feedgpu_write_ms"] = feedgpu_write_ms()
    elapsed = time.perf_counter() - t_start
    settings = {k: v for k, v in vars(args).items()}
    settings.update({"crop": CROP, "scale": SCALE, "ratio": RATIO, "resize_interpolation": "bilinear",
                     "jpeg_subsampling": "4:2:0 (Pillow default)", "batch_bytes": batch_bytes})
    doc = {"recorded": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(["python -m bench.cache_formats", *(argv or sys.argv[1:])]),
           "elapsed_s": elapsed, "spread": spread, "machine": machine(pinned_cpu=pinned, numpy=np.__version__, pyarrow=pa.__version__,
                                                               zstandard=zstandard.__version__,
                                                               zstd_lib=".".join(map(str, zstandard.ZSTD_VERSION))), "data": data_meta, "settings": settings,
           "prefix": {str(k): v for k, v in prefix_info.items()},
           "quiet_waits_s": {"count": len(waited), "total": sum(waited), "max": max(waited, default=0.0)}, "others_cpu_pct": 100 * max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0),
           "steal_pct": 100 * (steal1 - steal0) / (wall1 - wall0) / (os.cpu_count() or 1),
           "stores": list(results.values()), "choice": choice}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache_formats.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(write_markdown(out / "cache_formats.md", render(doc)))
    if not args.keep:
        for s in stores:
            s.path.unlink(missing_ok=True)
    return 0


CHOICE_RULE = ("at the default short side, among the lossless stores with random row access (a cache must "
               "give training the same pixels as no cache, in a shuffled order), drop those more than 25 % larger "
               "than the smallest of them (bytes cost disk, page cache and, when the cache does not fit in RAM, "
               "read bandwidth on every epoch); of the rest, the fastest read+decode+crop wins, rates within 5 % "
               "of it counting as equal and the cheapest to write winning among equals.")


def feedgpu_write_ms() -> float | None:
    """feedgpu's per-sample cost after the crop and flip (normalize into the batch buffer), from the
    recorded CPU benchmark, when there is one: a fixed cost every store pays."""
    try:
        st = json.loads((REPO / "bench" / "results" / "cpu_loader.json").read_text())["summary"]["feedgpu"]["stage_ms_per_sample"]
        return float(st["write"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def choose(results: dict, prefix_info: dict, args) -> dict:
    """The default store, by ``CHOICE_RULE``."""
    size = args.sizes[0]
    cands = [r for r in results.values() if r["short_side"] == size and r["access"] == "random"
             and r.get("lossless_verified")]
    smallest = min(r["bytes"] for r in cands)
    small = [r for r in cands if r["bytes"] <= 1.25 * smallest]
    best = max(r["read_decode_crop_img_per_s"] for r in small)
    fast = [r for r in small if r["read_decode_crop_img_per_s"] >= 0.95 * best]
    pick = min(fast, key=lambda r: r["write_s"])
    return {"name": pick["name"], "short_side": size, "rule": CHOICE_RULE,
            "considered": [r["name"] for r in cands], "within_size": [r["name"] for r in small],
            "within_speed": [r["name"] for r in fast], "prefix_ms_per_image": prefix_info[size]["ms_per_image"]}


# -- report ----------------------------------------------------------------------------------------
def render(doc: dict) -> str:
    m, d, st, stores = doc["machine"], doc["data"], doc["settings"], doc["stores"]
    by = {r["name"]: r for r in stores}
    base = by["jpeg-orig"]
    n = d["images"]
    L = []
    L.append("# Cache formats: re-encoded JPEG vs raw pixels (+ zstd) in Arrow IPC\n")
    L.append(f"Recorded {doc['recorded']} with `{doc['command']}` ({doc['elapsed_s']:.0f} s). "
             "Every number, every repetition: `cache_formats.json`.\n")
    L.append("What a local cache of a pipeline's deterministic prefix (decode + resize the short side to N, "
             "bilinear) should store, measured: size on disk against read-and-decode speed on one core, "
             "with the original JPEGs (no cache) as the baseline.\n")
    L.append("## Setup\n")
    L.append(f"- Machine: {m.get('cpu_count', m.get('nproc', m.get('cpus')))} CPUs ({m['cpu_model']}), {m['ram_gb']} GB RAM, {m['platform']}; "
             f"the benchmark process pinned to CPU {m['pinned_cpu']} (one core; pyarrow thread pools set to 1). "
             f"Python {m['python']}, numpy {m['numpy']}, pyarrow {m['pyarrow']}, zstandard {m['zstandard']} "
             f"(libzstd {m['zstd_lib']}), PIL: {m['pil_label']} (libjpeg-turbo: {m['pil']['libjpeg_turbo']}). "
             f"During the run other processes used {doc['others_cpu_pct']:.0f} % of a core on average and the "
             f"hypervisor took {doc['steal_pct']:.1f} % of the CPUs' time (steal).")
    L.append(f"- Data: {n} ImageNet-like JPEGs, {d['classes']} classes (`feedgpu.sample_data.build_imagenet_like` "
             f"from `{st['photos']}`; `{d['path']}`): mean {d['jpeg_kb_mean']:.1f} KB, "
             f"{d['width_mean']:.0f}×{d['height_mean']:.0f} px ({d['megapixels_mean']:.3f} MP).")
    for k, p in doc["prefix"].items():
        L.append(f"- Prefix, short side {k}: mean {p['width_mean']:.0f}×{p['height_mean']:.0f} px, "
                 f"{p['raw_bytes'] / n / 1e3:.0f} KB raw per image; costs {p['ms_per_image']:.2f} ms per image "
                 f"(decode {p['decode_ms']:.2f} + resize {p['resize_ms']:.2f}) — the work a cache hit avoids.")
    L.append(f"- Stores: Arrow IPC files, columns key string, label int64, height/width int32, data large_binary; "
             f"one record batch per ~{st['batch_mib']:g} MiB of data. JPEG re-encoding: Pillow, "
             f"{st['jpeg_subsampling']}. zstd per sample: `zstandard.ZstdCompressor(level)` per image, "
             "`ZstdDecompressor().decompress` + `np.frombuffer`. Arrow IPC zstd: "
             "`IpcWriteOptions(compression=pa.Codec(\"zstd\", level))`.")
    L.append(f"- Reading: `pa.memory_map` + `pa.ipc.open_file`, zero-copy views of each batch's data buffer, "
             f"rows in one shuffled order (random access) for {n} images; file open included in the time. "
             "read+decode = the uint8 HWC array of the cached image (JPEG: decode + `np.asarray`; zstd: decompress; "
             "raw: `np.frombuffer` view, no copy — its pixels are first touched by the crop). "
             f"read+decode+crop = then RandomResizedCrop({CROP}, scale {st['scale'][0]}–{st['scale'][1]}, "
             "ratio 3/4–4/3, bilinear, fused `Image.fromarray(arr).resize(..., box=...)`) + random horizontal "
             "flip + `np.asarray` — the baseline does the same on the original full-size JPEG.")
    L.append(f"- Medians over {st['reps']} repetitions, stores in rotating order. Warm: every file is in the page "
             "cache (just written and read once untimed, which also checks the lossless stores byte for byte). "
             f"Before each store's passes the script waits for the machine to go quiet (up to {st['quiet_wait']:g} s; "
             f"{doc['quiet_waits_s']['total']:.0f} s waited in all, at most {doc['quiet_waits_s']['max']:.1f} s at once); "
             f"spread of read+decode+crop over the repetitions, (max − min) / median: {doc['spread']['median']:.0%} "
             f"typical, {doc['spread']['max']:.0%} worst ({doc['spread']['worst']}). "
             "Write s = encode + write to the page cache (no fsync), once, from the prefix output in memory.\n")

    for size in st["sizes"]:
        L.append(f"## Short side {size}\n")
        L.append("| format | level | MB on disk | KB per image | ratio vs original JPEG | write s | "
                 "read+decode img/s (1 core) | read+decode+crop img/s | speed-up vs original JPEG path |")
        L.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        rows = [base] + [r for r in stores if r["short_side"] == size]
        for r in rows:
            seq = "" if r["access"] == "random" else " †"
            rd = r["read_decode_img_per_s"]
            rd_s = f"{rd:,.0f}" + (" ‡" if r["name"].endswith("/raw") else "")
            bold = "**" if r["name"] == doc["choice"]["name"] else ""
            L.append(f"| {bold}{r['format']}{bold} | {r['level']} | {r['bytes'] / 1e6:.1f} | {r['kb_per_image']:.1f} | "
                     f"{r['ratio_vs_orig']:.2f} | {r['write_s']:.1f} | {rd_s}{seq} | "
                     f"{r['read_decode_crop_img_per_s']:,.0f}{seq} | {r['speedup_vs_orig']:.2f}×{seq} |")
        L.append("")
        jp = [r for r in rows if "psnr_db_mean" in r]
        if jp:
            L.append("Re-encoded JPEG quality against the exact prefix output: " + "; ".join(
                f"{r['level']}: PSNR {r['psnr_db_mean']:.1f} dB mean ({r['psnr_db_min']:.1f} min)" for r in jp)
                + ". The other cached stores are lossless (verified byte for byte).\n")
        ipc = [r for r in rows if r["access"] == "sequential"]
        if ipc:
            L.append("† Arrow IPC buffer compression: read sequentially, batch after batch (each batch's data "
                     "buffer is one zstd frame of ~" f"{st['batch_mib']:g} MiB). One-row random access has to "
                     "decompress the row's whole batch: " + "; ".join(
                         f"level {r['level']}: {r['per_row_read_decode_img_per_s']:.1f} img/s" for r in ipc)
                     + f" (read+decode, {st['per_row']} rows). ‡ a zero-copy view: no work until the crop reads the pixels.\n")
        seqs = ", ".join(f"{r['format'].replace('raw + ', '')}{'' if r['level'] == '-' else ' ' + r['level']}: "
                         f"{r['seq_read_decode_img_per_s']:,.0f}" for r in rows)
        L.append(f"Sequential read+decode (file order, same files), img/s: {seqs}.\n")
        if "cold_read_decode_crop" in base:
            cold = ", ".join(f"{r['format'].replace('raw + ', '')}{'' if r['level'] == '-' else ' ' + r['level']}: "
                             f"{r['cold_read_decode_crop']['img_per_s']:,.0f} ({r['cold_speedup_vs_orig']:.2f}×)"
                             for r in rows)
            L.append("Cold-ish read+decode+crop (indicative: one pass), after evicting the file's pages "
                     f"(`posix_fadvise(DONTNEED)`; the VM host may still cache the disk), img/s (× original): {cold}.\n")

    c = doc["choice"]
    pick = by[c["name"]]
    L.append("## Choice\n")
    L.append(choice_text(doc, pick, by))
    L.append("")
    return "\n".join(L) + "\n"


def _name(r: dict) -> str:
    return r["format"] + ("" if r["level"] == "-" else f" {r['level']}")


def choice_text(doc: dict, pick: dict, by: dict) -> str:
    c = doc["choice"]
    n = doc["data"]["images"]
    size = c["short_side"]
    raw = by[f"s{size}/raw"]
    base = by["jpeg-orig"]

    def ms(r):
        return 1e3 * r["write_s"] / n

    parts = [f"Rule (`CHOICE_RULE` in the script): {c['rule']}",
             f"Default: **{_name(pick)}, short side {size}** — {pick['kb_per_image']:.0f} KB per image "
             f"({pick['ratio_vs_orig']:.2f}× the original JPEGs, {pick['bytes'] / raw['bytes']:.2f}× raw), "
             f"{pick['read_decode_crop_img_per_s']:,.0f} img/s read+decode+crop on one core, "
             f"{pick['speedup_vs_orig']:.2f}× the original JPEG path ({base['read_decode_crop_img_per_s']:,.0f} img/s); "
             f"writing costs {ms(pick):.2f} ms per image once, against {c['prefix_ms_per_image']:.2f} ms for the "
             "prefix (decode + resize) it saves on every later epoch."]
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
