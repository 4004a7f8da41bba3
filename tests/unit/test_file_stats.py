"""``stat`` of many files in forked processes (:mod:`feedgpu.sources.file_stats`) gives what a
``stat`` here gives, and a folder source indexed that way has the same index and rejects."""
from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import PHOTOS
from feedgpu import FolderSource
from feedgpu.sources import file_stats

PIC = sorted(PHOTOS.glob("*.jpg"))[0].read_bytes()


@pytest.fixture
def tree(tmp_path) -> Path:
    """Two classes of photos, and in class b: a zero-byte file, a FIFO, a link to nothing and a
    link to itself."""
    root = tmp_path / "data"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(5):
            (root / cls / f"{cls}{i}.jpg").write_bytes(PIC[: 1000 + 97 * i])
    (root / "b" / "empty.jpg").write_bytes(b"")
    os.mkfifo(root / "b" / "fifo.jpg")
    os.symlink(root / "nowhere.jpg", root / "b" / "dangling.jpg")
    os.symlink(root / "b" / "loop.jpg", root / "b" / "loop.jpg")
    return root


def table(paths: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    blob = np.frombuffer(b"".join(paths), np.uint8)
    offsets = np.zeros(len(paths) + 1, np.int64)
    np.cumsum([len(p) for p in paths], out=offsets[1:])
    return blob, offsets


def test_processes_stat_as_this_process_does(tree, monkeypatch):
    names = sorted(os.listdir(tree / "a")) + ["missing.jpg"]
    paths = [f"a/{n}".encode() for n in names] + [f"b/{n}".encode() for n in sorted(os.listdir(tree / "b"))]
    blob, offsets = table(paths * 7)                     # more paths than ranges, each range short
    prefix = os.fsencode(str(tree)) + b"/"
    here = file_stats.stat_paths(prefix, blob, offsets, processes=1)
    monkeypatch.setattr(file_stats, "PARALLEL_MIN", 1)
    there = file_stats.stat_paths(prefix, blob, offsets, processes=3)
    for a, b in zip(here, there):
        assert a.dtype == b.dtype == np.int64 and a.tolist() == b.tolist()
    sizes, mtimes, kinds, stamps = here
    by_name = {p.decode(): (int(s), int(k)) for p, s, k in zip(paths, sizes, kinds)}
    assert by_name["a/a1.jpg"] == (1097, 0)
    assert by_name["a/missing.jpg"] == (-1, errno.ENOENT)
    assert by_name["b/empty.jpg"] == (0, 0)
    assert by_name["b/fifo.jpg"][1] == file_stats.NOT_REGULAR
    assert by_name["b/dangling.jpg"] == (-1, errno.ENOENT)
    assert by_name["b/loop.jpg"] == (-1, errno.ELOOP)
    assert (mtimes[kinds == 0] > 0).all()
    assert (stamps[kinds == 0] != 0).all() and (stamps[sizes == -1] == 0).all()


def test_a_folder_indexed_in_processes_is_the_same_index(tree, monkeypatch):
    def index():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return FolderSource(tree, index_dir=False)
    here = index()
    monkeypatch.setattr(file_stats, "PARALLEL_MIN", 1)
    monkeypatch.setattr(file_stats, "cpu_cores", lambda: 2)
    there = index()
    assert [here.key(i) for i in range(len(here))] == [there.key(i) for i in range(len(there))]
    assert here.labels.tolist() == there.labels.tolist() == [0] * 5 + [1] * 5
    assert here.sizes.tolist() == there.sizes.tolist() == [1000 + 97 * i for i in range(5)] * 2
    assert here.rejected == there.rejected and here.rejected_details == there.rejected_details
    assert here.identity() == there.identity()
    assert sorted((Path(k).name, r) for k, r in here.rejected) == [
        ("dangling.jpg", "dangling link"), ("empty.jpg", "empty"), ("fifo.jpg", "not a regular file"),
        ("loop.jpg", "symlink loop")]


def test_an_empty_file_listed_then_found_empty_keeps_its_class(tmp_path):
    """A class folder whose only image is zero-byte is a class with its file rejected, not an
    empty class (as when the walk stat-ed each file): the labels after it do not move."""
    root = tmp_path / "data"
    for cls in ("a", "b", "c"):
        (root / cls).mkdir(parents=True)
    (root / "a" / "x.jpg").write_bytes(PIC)
    (root / "b" / "only.jpg").write_bytes(b"")
    (root / "c" / "y.jpg").write_bytes(PIC)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = FolderSource(root, index_dir=False)
    assert src.classes == ["a", "b", "c"] and src.labels.tolist() == [0, 2]
    assert [(Path(k).name, r) for k, r in src.rejected] == [("only.jpg", "empty")]
