"""The per-worker memory budget (feedgpu.exec.memory_budget): parsing and defaults, what it sizes
(the Parquet row-group cache and slices, the prefetch depth), the balancer's limit, and a real
worker's unique memory (USS) under a small budget on a Parquet file of one big row group."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps

from feedgpu import DataLoader, ParquetSource, Pipeline
from feedgpu.errors import ConfigError
from feedgpu.exec.memory_budget import (DEFAULT_CACHE_MAX, MIN_WORKER_BYTES, MemoryBudget, MemoryBudgetWarning,
                                        parse_worker_memory)
from feedgpu.stages import Decode, Normalize, ResizeCenterCrop

from conftest import PHOTOS
from test_autoscale import GIB, FakeClock, drive, scaler

pytestmark = pytest.mark.timeout(300)
MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def padded_jpegs(n: int, pad: int, seed: int = 0) -> list[bytes]:
    """``n`` real 32 x 32 JPEGs (from the shared photos), each carrying ``pad`` bytes of random
    comment segments (COM markers, skipped by decoders): big records that decode fast."""
    rng = np.random.default_rng(seed)
    small = []
    for p in sorted(PHOTOS.glob("*.jpg"))[:8]:
        buf = io.BytesIO()
        ImageOps.fit(Image.open(p).convert("RGB"), (32, 32)).save(buf, "JPEG", quality=90)
        small.append(buf.getvalue())
    out = []
    for i in range(n):
        segs, left = [], pad
        while left > 0:
            k = min(left, 65000)
            segs.append(b"\xff\xfe" + (k + 2).to_bytes(2, "big") + rng.bytes(k))
            left -= k
        j = small[i % len(small)]
        out.append(j[:2] + b"".join(segs) + j[2:])
    return out


@pytest.fixture(scope="module")
def one_big_group(tmp_path_factory):
    """One Parquet file, one row group of 320 images of ~200 KB (~61 MiB of image column),
    pages of ~1 MiB; label = row % 8."""
    path = tmp_path_factory.mktemp("bigrg") / "big.parquet"
    imgs = padded_jpegs(320, 200_000)
    t = pa.table({"image": pa.array(imgs, pa.binary()), "label": pa.array([i % 8 for i in range(320)], pa.int64())})
    pq.write_table(t, path, row_group_size=320, compression="none", data_page_size=1 << 20, write_batch_size=8)
    assert pq.ParquetFile(path).num_row_groups == 1
    return path


# -- the setting ---------------------------------------------------------------------------------------
def test_parse_and_default():
    assert parse_worker_memory("2GiB") == 2 * GIB
    assert parse_worker_memory(512 * MIB) == 512 * MIB
    assert parse_worker_memory("auto") is None and parse_worker_memory(None) is None
    for bad in ("lots", "1KiB", True, 1.5, -3):
        with pytest.raises(ConfigError, match="worker_memory"):
            parse_worker_memory(bad)
    # default: half the available memory over the largest pool, at least 64 MiB
    b = MemoryBudget.make(None, 4, available=8 * GIB)
    assert (b.worker_bytes, b.total_bytes, b.given) == (GIB, 4 * GIB, False)
    assert b.cache_bytes == DEFAULT_CACHE_MAX          # a default budget's cache stays at 256 MiB
    assert MemoryBudget.make(None, 64, available=GIB).worker_bytes == MIN_WORKER_BYTES
    g = MemoryBudget.make("2GiB", 4, available=8 * GIB)
    assert (g.worker_bytes, g.cache_bytes, g.given) == (2 * GIB, GIB, True)
    # prefetch: a quarter of the budget in batches in flight, at least one
    assert g.max_prefetch(100 * MIB) == 5 and g.max_prefetch(4 * GIB) == 1


def test_setting_on_the_pipeline_yaml_and_loader(parquet_ds, tmp_path):
    src = {"format": "parquet", "path": str(parquet_ds)}
    y = tmp_path / "p.yaml"
    y.write_text("source: {format: parquet}\nloader: {worker_memory: 96MiB, num_workers: 0}\n"
                 "output: {dtype: uint8, layout: NHWC}\n"
                 "stages: [{op: decode}, {op: resize_center_crop, resize: 16, crop: 16}]\n")
    p = Pipeline.from_yaml(y, source=src)
    assert p.worker_memory == "96MiB"
    with pytest.raises(ConfigError, match="worker_memory"):
        Pipeline.from_yaml(y, source=src, **{"loader.worker_memory": "a lot"})
    with pytest.raises(ConfigError, match="worker_memory"):
        DataLoader(p, worker_memory="1KiB")
    # the loader's value wins over the pipeline's; it sizes the Parquet row-group cache
    dl = DataLoader(p, worker_memory="40MiB", device="cpu")
    next(iter(dl))
    assert dl.memory_budget.worker_bytes == 40 * MIB and p.source.cache_bytes == 20 * MIB
    dl = DataLoader(p, device="cpu")
    next(iter(dl))
    assert p.source.cache_bytes == 48 * MIB


def test_an_explicit_parquet_cache_is_kept(one_big_group):
    src = ParquetSource(one_big_group, cache_bytes=300 * MIB)
    src.fit_memory(8 * MIB)
    assert src.cache_bytes == 300 * MIB
    src = ParquetSource(one_big_group)
    assert src.cache_bytes == 256 * MIB           # outside a loader, as before
    src.fit_memory(8 * MIB)
    assert src.cache_bytes == 8 * MIB


def test_prefetch_is_capped_by_the_budget(folder_ds):
    """Batches of 32 float32 3 x 112 x 112 samples are 4.6 MiB: a 40 MiB budget (a quarter for
    batches in flight) allows 2 per worker; 4 asked are lowered with a warning, and the shared
    buffers are sized for 2."""
    p = Pipeline({"format": "folder", "path": str(folder_ds)},
                 [Decode(), ResizeCenterCrop(resize=112, crop=112), Normalize(dtype="float32")],
                 batch_size=32, num_workers=1, device="cpu")
    dl = DataLoader(p, prefetch_factor=4, worker_memory="40MiB")
    with pytest.warns(MemoryBudgetWarning, match="prefetch_factor 4 lowered to 2"):
        it = iter(dl)
    x, y = next(it)
    assert x.shape == (32, 3, 112, 112) and dl.prefetch_factor == 2
    assert dl._backend.work.slots.count == 1 * 2 + dl._backend.work.keep_views
    del it, x, y
    # a budget that holds the asked depth changes nothing, silently
    dl = DataLoader(p, prefetch_factor=4, worker_memory="1GiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryBudgetWarning)
        next(iter(dl))
    assert dl.prefetch_factor == 4


# -- the balancer ----------------------------------------------------------------------------------------
def test_balancer_adds_no_worker_over_the_budget():
    """Each worker measures 100 MiB (injected); the loop needs 5 workers of 100 samples/s. With a
    memory budget of 350 MiB the balancer stops at 3 (a 4th would take it to 400 MiB) and says
    why; without one it grows to 5 or 6."""
    clock = FakeClock()
    a = scaler(clock, workers=1, prefetch=2, memory_budget=350 * MIB)
    drive(a, clock, rate_per_worker=100, demand=450, seconds=60)
    assert a.workers == 3
    assert max(p["workers"] for p in a.timeline) <= 3
    assert any("RAM budget" in d["reason"] for d in a.policy.stats()["last"])
    assert a.last_measurement.ram_budget_bytes == 350 * MIB   # below half the (injected) free 16 GiB
    clock = FakeClock()
    free = scaler(clock, workers=1, prefetch=2)
    drive(free, clock, rate_per_worker=100, demand=450, seconds=60)
    assert free.workers in (5, 6)


def test_loader_hands_the_budget_to_the_balancer(parquet_ds):
    p = Pipeline({"format": "parquet", "path": str(parquet_ds)}, [Decode(), ResizeCenterCrop(resize=16, crop=16)],
                 batch_size=8, device="cpu", num_workers="auto")
    dl = DataLoader(p, worker_memory="100MiB")
    next(iter(dl))
    auto = dl.balancer
    assert auto.memory_budget == 100 * MIB * auto.policy.config.max_workers
    assert dl.stats()["balancer"]["memory_budget"] == auto.memory_budget


# -- a real worker -----------------------------------------------------------------------------------------
_USS_SCRIPT = """
import json, sys, threading
import psutil
from feedgpu import DataLoader, ParquetSource, Pipeline
from feedgpu.stages import Decode, ResizeCenterCrop
path, budget, cache = sys.argv[1], sys.argv[2], int(sys.argv[3])
src = ParquetSource(path, cache_bytes=cache) if cache else ParquetSource(path)
p = Pipeline(src, [Decode(), ResizeCenterCrop(resize=16, crop=16)], batch_size=16, num_workers=1,
             device="cpu", shuffle=False, worker_memory=budget)
dl = DataLoader(p, persistent_workers=True)
peak, done = [0], threading.Event()
def watch():   # the worker's USS, read over and over while the epoch runs: its peak
    while not done.is_set():
        pool = dl._backend.pool
        try:
            if pool is not None and pool.pids():
                peak[0] = max(peak[0], psutil.Process(pool.pids()[0]).memory_full_info().uss)
        except psutil.Error:
            pass
        done.wait(0.002)
t = threading.Thread(target=watch, daemon=True)
t.start()
labels = [int(y) for _, ys in dl for y in ys]
uss = psutil.Process(dl._backend.pool.pids()[0]).memory_full_info().uss
done.set()
t.join()
dl._backend.release_pool(force=True)
print(json.dumps({"uss": uss, "peak": max(peak[0], uss), "labels": labels}))
"""


def _worker_uss_after_epoch(path, worker_memory: str, cache_bytes: int = 0) -> tuple[int, int, list[int]]:
    """``(USS after the epoch, the highest USS read while it ran, labels)`` of one epoch with one
    persistent worker, in a fresh interpreter: a forked worker's USS also
    counts the pages of its parent it touches (reference counts), and those grow with whatever
    the test process ran before (in the full suite the same worker measured over the budget)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _USS_SCRIPT, str(path), worker_memory, str(cache_bytes)],
                         capture_output=True, text=True, timeout=240, env=env, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["uss"], r["peak"], r["labels"]


def test_parquet_worker_stays_under_a_small_budget(one_big_group):
    """One row group of ~61 MiB of images, read by one worker: with worker_memory=48MiB (a 24 MiB
    row-group cache, 6 MiB slices) the worker's USS stays under 48 MiB after the epoch and all
    through it (read over and over while it runs: a persistent worker starts the next epoch's
    first slices as soon as the epoch ends, so the end reading can land in a read); reading the
    group whole (an explicit 512 MiB cache) the same worker holds more than the group."""
    group = pq.ParquetFile(one_big_group).metadata.row_group(0).column(0).total_uncompressed_size
    assert group > 60 * MIB
    uss, peak, labels = _worker_uss_after_epoch(one_big_group, "48MiB")
    assert labels == [i % 8 for i in range(320)]        # every record, in order, with its label
    assert uss < 48 * MIB, f"worker USS {uss / MIB:.1f} MiB over its 48 MiB budget"
    assert peak < 48 * MIB, f"worker USS reached {peak / MIB:.1f} MiB during the epoch, over its 48 MiB budget"
    whole, _, labels = _worker_uss_after_epoch(one_big_group, "48MiB", cache_bytes=512 * MIB)
    assert labels == [i % 8 for i in range(320)]
    assert whole > group, f"reading the group whole: {whole / MIB:.1f} MiB"


_POOL_SCRIPT = """
import json, sys
import numpy as np
import pyarrow as pa
from feedgpu import ParquetSource
src = ParquetSource(sys.argv[1], cache_bytes=int(sys.argv[2]))
order = list(range(len(src))) + np.random.default_rng(0).permutation(len(src)).tolist()[:24]
for i in order:
    src.read(i)
print(json.dumps({"peak": pa.default_memory_pool().max_memory(), "cached": src._parts.cached}))
"""


def test_parquet_reads_hold_at_most_the_cache(one_big_group):
    """Arrow's peak allocation in a fresh interpreter that reads the ~61 MiB row group in order
    and then shuffled, with a 24 MiB cache (6 MiB slices): at most the cache, since the slices
    kept, the slice being read and the reader's buffers share it (a slice read as one batch
    peaked at three times its size, and dropping old slices after a read held the cache plus a
    slice: 40 MiB). No timing involved: the pool's own high-water mark."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _POOL_SCRIPT, str(one_big_group), str(24 * MIB)],
                         capture_output=True, text=True, timeout=240, env=env, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert 12 * MIB < r["cached"] <= 24 * MIB
    assert r["peak"] <= 24 * MIB, f"Arrow held {r['peak'] / MIB:.1f} MiB at its peak, over the 24 MiB cache"


# -- index memory per sample ---------------------------------------------------------------------------------
def test_index_bytes_per_sample_at_a_million_entries(sources):
    """The tar and Parquet index arrays of 1,000,000 synthetic entries (built directly, not read
    from files), in the dtypes the sources choose: Parquet at most 16 bytes a row (uint16 file ids
    and row groups, uint16 rows in a group, uint32 over 65,536 rows, int64 labels: 14 here); tar
    16 bytes a sample (uint32 offsets and sizes in shards under 4 GiB, int64 labels; the shard
    from each shard's first sample, 8 bytes per shard) plus its keys (the UTF-8 bytes and 4 bytes
    of offset each). Wider values fall back to wider dtypes."""
    from feedgpu import TarShardSource
    from feedgpu.sources.base import index_array

    n = 1_000_000
    rng = np.random.default_rng(0)
    t = TarShardSource.__new__(TarShardSource)
    keys = [f"s{i:07d}.jpg" for i in range(n)]
    shard = np.arange(n) // 1000                                    # 1,000 shards of 1,000
    sizes = rng.integers(20_000, 200_000, n)
    offsets = np.zeros(n, np.int64)
    for s in range(1000):                                           # members back to back, 512-aligned
        sl = slice(s * 1000, (s + 1) * 1000)
        offsets[sl] = np.cumsum(512 + (sizes[sl] + 511) // 512 * 512) - (sizes[sl] + 511) // 512 * 512
    t._store(keys, shard, offsets, sizes, rng.integers(0, 1000, n))
    per = sum(a.nbytes for a in (t.offsets, t.sizes, t.labels)) / n
    assert per == 16 and t.labels.dtype == np.int64
    assert t._shard_ids is None and t._shard_starts.nbytes == 8 * 1001      # one int64 per shard
    assert t.shard_ids.tolist() == shard.tolist()
    assert [t._shard_of(k) for k in (0, 999, 1000, 123_456, n - 1)] == [0, 0, 1, 123, 999]
    assert t.members.blob.nbytes == sum(len(k) for k in keys) and t.members.offsets.nbytes == 4 * (n + 1)
    assert t.members[123_456] == keys[123_456] and int(t.offsets[999]) == int(offsets[999])
    # Parquet: a million rows in 20 files of 10 row groups of 5,000
    i = np.arange(n)
    ids = [index_array(a) for a in (i // 50_000, i // 5000 % 10, i % 5000)]
    labels = rng.integers(0, 1000, n).astype(np.int64)
    assert (sum(a.nbytes for a in ids) + labels.nbytes) / n == 14
    assert index_array([0, 70_000]).dtype == np.uint32 and index_array([0, 2**33]).dtype == np.int64
    assert index_array([]).dtype == np.uint16
    # the sources use these dtypes
    tar, parquet = sources["tar"], sources["parquet"]
    assert {a.dtype for a in (tar.offsets, tar.sizes)} <= {np.dtype(np.uint16), np.dtype(np.uint32)}
    assert tar._shard_ids is None and len(tar.shard_ids) == len(tar)
    assert {a.dtype for a in (parquet.file_ids, parquet.row_groups, parquet.rows)} == {np.dtype(np.uint16)}
    assert tar.members.offsets.dtype == np.uint32 and tar.labels.dtype == parquet.labels.dtype == np.int64
