"""Integer labels up to 2**63 - 1 (tar ``.cls`` members, Parquet int64 columns): a source opens in
time and memory in proportion to its samples, never one class name per integer up to the
largest label, and delivers the labels exactly."""
from __future__ import annotations

import io
import pickle
import tarfile
import time
import tracemalloc
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import PHOTOS
from feedgpu import DataLoader, ParquetSource, Pipeline, TarShardSource
from feedgpu.convert import shards_to_parquet
from feedgpu.sources.class_names import ClassNames
from feedgpu.stages import Decode, ResizeCenterCrop

#: Labels over the whole int64 range, the largest ones in it.
BIG = [0, 7, 20_000_000, 3_000_000_000, 2**63 - 2, 2**63 - 1]
SMALL = list(range(len(BIG)))
#: CPU seconds an open of these few samples may take: generous, as the machine is shared (the
#: open it guards against made one name per integer, and ran out of memory).
OPEN_CPU_S = 1.0
#: Bytes the open of BIG may allocate beyond the open of SMALL (same samples, small labels).
EXTRA_BYTES = 1 << 20


def _photo() -> bytes:
    return sorted(PHOTOS.glob("*.jpg"))[0].read_bytes()


def _write(root, fmt: str, labels: list[int]):
    root.mkdir()
    data = _photo()
    if fmt == "tar":
        path = root / "s.tar"
        with tarfile.open(path, "w") as tf:
            for i, lab in enumerate(labels):
                for name, blob in ((f"s{i:02d}.jpg", data), (f"s{i:02d}.cls", str(lab).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
        return path
    path = root / "p.parquet"
    pq.write_table(pa.table({"image": pa.array([data] * len(labels), pa.binary()),
                             "label": pa.array(labels, pa.int64())}), path)
    return path


def _open(fmt: str, path):
    return TarShardSource(path, index_dir=False) if fmt == "tar" else ParquetSource(path)


def _measured_open(fmt: str, path):
    tracemalloc.start()
    t = time.process_time()
    try:
        src = _open(fmt, path)
        return src, time.process_time() - t, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_labels_up_to_int64_max_open_fast_in_flat_memory(tmp_path, fmt):
    """Before: a label of 3e9 raised MemoryError, 2**63 - 2 grew the process until it was killed."""
    small = _write(tmp_path / "small", fmt, SMALL)
    big = _write(tmp_path / "big", fmt, BIG)
    _open(fmt, small)   # imports and first-use set-up, not counted
    _, _, small_peak = _measured_open(fmt, small)
    src, cpu_s, big_peak = _measured_open(fmt, big)
    assert cpu_s < OPEN_CPU_S, f"open took {cpu_s:.2f} CPU s"
    assert big_peak <= small_peak + EXTRA_BYTES, (small_peak, big_peak)
    assert src.labels.dtype == np.int64 and src.labels.tolist() == BIG and src.rejected == []
    assert [src.read(i).label for i in range(len(src))] == BIG
    c = src.classes
    assert isinstance(c, ClassNames) and c.size == 2**63 and c.present.tolist() == BIG
    assert c[2**63 - 1] == str(2**63 - 1) and c[7] == "7" and c[8] == "8" and c[-1] == str(2**63 - 1)
    assert c.occurring() == [str(x) for x in BIG] and str(3_000_000_000) in c and "-1" not in c
    with pytest.raises(OverflowError, match="classes.size"):
        len(c)
    with pytest.raises(IndexError):
        c[2**63]
    assert pickle.loads(pickle.dumps(c)) == c
    assert src.describe() == f"{fmt} source, {len(BIG)} samples, {len(BIG)} distinct labels (largest {2**63 - 1})"


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_the_loader_delivers_the_large_labels_exactly(tmp_path, fmt):
    src = _open(fmt, _write(tmp_path / "d", fmt, BIG))
    p = Pipeline(src, [Decode(), ResizeCenterCrop(32, 32)], batch_size=4, shuffle=False, device="cpu",
                 num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [int(x) for b in DataLoader(p) for x in b.labels]
    assert got == BIG


def test_tar_to_parquet_keeps_large_labels_without_a_names_file(tmp_path):
    shard = _write(tmp_path / "d", "tar", BIG)
    out = shards_to_parquet(shard, tmp_path / "pq")
    assert out.samples == len(BIG) and not (tmp_path / "pq" / "_classes.txt").exists()
    back = ParquetSource(tmp_path / "pq")
    assert back.labels.tolist() == BIG and back.classes == TarShardSource(shard, index_dir=False).classes


def test_dense_labels_read_as_the_list_of_names():
    c = ClassNames(np.array([2, 0, 0, -1]))
    assert c == ["0", "1", "2"] and len(c) == 3 and list(c) == ["0", "1", "2"] and c[1:] == ["1", "2"]
    named = ClassNames(np.array([1]), ["cat", "dog", "eel"])
    assert named == ["cat", "dog", "eel"] and named.occurring() == ["dog"] and "eel" in named and "2" not in named
    assert ClassNames(np.zeros(0, np.int64)) == [] and ClassNames(np.array([-1])).size == 0
