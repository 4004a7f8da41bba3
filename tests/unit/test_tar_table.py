"""Member tables written with tar shards (``<shard>.feedgpu-index``) and indexing in threads."""
from __future__ import annotations

import os
import shutil
import tarfile
import warnings
from pathlib import Path

import pytest

import feedgpu
from feedgpu.errors import SourceError
from feedgpu.sources.tar import local as tar_local, table as tar_table
from feedgpu.sources.base import file_hash
from feedgpu.sources.tar import TarShardSource
from feedgpu.sources.tar.local import ordered_map, write_tables

from test_tar_index import OLD, index_of, odd_shards, pairs, write_tar


def open_src(path, index_dir, **kw):
    """A source and the warnings its open gave."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        src = TarShardSource(path, index_dir=index_dir, **kw)
    return src, [str(x.message) for x in w]


def facts(src):
    return ([src.members[i] for i in range(len(src))], src.offsets.tolist(), src.sizes.tolist(),
            src.labels.tolist(), sorted(src.rejected), src.identity())


def table_warnings(warned):
    return [w for w in warned if "member table" in w]


def no_hash(path):
    raise AssertionError(f"{path} was read: its table should have been taken on its mtime")


def test_convert_writes_tables_a_fresh_cache_dir_uses(tar_ds, tmp_path, monkeypatch):
    shards = sorted(tar_ds.glob("*.tar"))
    assert sorted(tar_ds.glob("*.tar" + tar_table.SUFFIX)) == [tar_table.table_path(str(s)) for s in shards]
    src, warned = open_src(tar_ds, tmp_path / "fresh")
    assert src.table_shards == len(shards) and src.saved_shards == 0 and not warned
    assert facts(src) == index_of(tar_ds)        # the index the scan gives, tables off
    assert [src.read(i).payload for i in (0, len(src) - 1)] == [index_src(tar_ds).read(i).payload
                                                                 for i in (0, len(src) - 1)]


def index_src(path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tar_local, "load_table", lambda p: (None, None, False))
        return TarShardSource(path, index_dir=False)


def test_an_old_shards_table_is_taken_on_its_mtime_and_a_copys_on_its_bytes(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    a = write_tar(tmp_path / "ds" / "a.tar", pairs(6))
    b = write_tar(tmp_path / "ds" / "b.tar", pairs(5, "t") + [("t0001.png", b"\x89PNG")])   # rejects a key
    assert write_tables([a, b]) == [tar_table.table_path(str(a)), tar_table.table_path(str(b))]
    want = index_of(tmp_path / "ds")
    with monkeypatch.context() as mp:
        mp.setattr(tar_table, "content_hash", no_hash)
        src, warned = open_src(tmp_path / "ds", tmp_path / "idx1")
    assert src.table_shards == 2 and facts(src) == want and not table_warnings(warned)
    assert any(k.startswith(f"{b}:") and r == "duplicate key" for k, r in src.rejected)
    assert not list((tmp_path / "idx1").glob("*.idx"))   # taken on its mtime: nothing to save
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in (tmp_path / "ds").iterdir():
        shutil.copyfile(f, copy / f.name)          # new mtimes: the bytes decide
    got, warned = open_src(copy, tmp_path / "idx2")
    assert got.table_shards == 2 and not table_warnings(warned)
    assert facts(got)[:4] == want[:4]
    assert sorted(got.rejected) == sorted((k.replace(str(tmp_path / "ds"), str(copy)), r) for k, r in src.rejected)
    kept = tmp_path / "kept"
    shutil.copytree(tmp_path / "ds", kept)         # copy2: mtimes kept, but new inodes: the bytes decide
    hashed = []
    with monkeypatch.context() as mp:
        mp.setattr(tar_table, "content_hash", lambda p: hashed.append(p) or file_hash(p))
        assert open_src(kept, tmp_path / "idx3")[0].table_shards == 2
    assert sorted(hashed) == [str(kept / "a.tar"), str(kept / "b.tar")]


def test_a_shard_changed_after_its_table_is_indexed_afresh(tmp_path):
    ds = tmp_path / "ds"
    ds.mkdir()
    a = write_tar(ds / "a.tar", pairs(6))
    b = write_tar(ds / "b.tar", pairs(6, "t"))
    write_tables([a, b])
    data = bytearray(a.read_bytes())
    with tarfile.open(a) as tf:
        cls = next(m for m in tf.getmembers() if m.name == "s0002.cls")
    assert data[cls.offset_data:cls.offset_data + cls.size] == b"74"
    data[cls.offset_data] = ord("9")               # the same size, another label, a new mtime
    a.write_bytes(bytes(data))
    write_tar(b, pairs(40, "t"))                   # another size, the old mtime
    src, warned = open_src(ds, tmp_path / "idx")
    assert src.table_shards == 0 and src.labels[2] == 94 and len(src) == 46
    assert facts(src) == index_of(ds)
    (w,) = [w for w in warned if "member tables" in w]
    assert "beside 2 shard(s)" in w and "its bytes differ" in w and "size" in w


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "foreign version", "a saved index"])
def test_a_corrupt_or_foreign_table_is_ignored_with_a_warning(tmp_path, damage, monkeypatch):
    shard = write_tar(tmp_path / "a.tar", pairs(5))
    open_src(shard, tmp_path / "idx0")              # a saved index of it (no table yet)
    if damage == "foreign version":
        monkeypatch.setattr(feedgpu._version, "__version__", "0.0.0-other")
    write_tables([shard])
    monkeypatch.undo()
    table = tar_table.table_path(str(shard))
    data = bytearray(table.read_bytes())
    if damage == "flipped byte":
        data[-3] ^= 0xFF
    elif damage == "truncated":
        data = data[:-8]
    elif damage == "a saved index":                # a saved index is not a table
        data = bytearray(next((tmp_path / "idx0").glob("*.idx")).read_bytes())
    table.write_bytes(bytes(data))
    src, warned = open_src(shard, tmp_path / "idx")
    assert src.table_shards == 0 and facts(src) == index_of(shard)
    assert any("did not use the member tables beside 1 shard(s)" in w and str(table) in w for w in warned), warned


def test_tables_give_the_index_of_every_odd_shard(tmp_path):
    shards = odd_shards(tmp_path)
    for name, (shard, _) in shards.items():
        try:
            write_tables([shard])
        except SourceError:
            assert not tar_table.table_path(str(shard)).exists()
            continue
        os.utime(shard, ns=(OLD * 10**9, OLD * 10**9))   # another mtime than the table's: its bytes decide
        try:
            want = index_of(shard)
        except SourceError:                        # no sample left: the same error through the table
            with pytest.raises(SourceError):
                index_of(shard, tables=True)
            continue
        assert index_of(shard, tables=True) == want, name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert TarShardSource(shard, index_dir=False).table_shards == 1, name


def test_a_shard_written_while_its_table_is_made_gets_none(tmp_path, monkeypatch):
    shard = write_tar(tmp_path / "a.tar", pairs(4))
    real = tar_table.content_hash

    def rewrite(path):
        out = real(path)
        write_tar(Path(path), pairs(9))            # changed after its bytes were hashed
        return out

    monkeypatch.setattr(tar_local, "content_hash", rewrite)
    with pytest.warns(UserWarning, match="changed while its member table was written"):
        assert write_tables([shard]) == []
    assert not tar_table.table_path(str(shard)).exists()


def test_racy_window():
    assert tar_table.racy_ns(5 * 10**9) == 2 * 10**9 and tar_table.racy_ns(5 * 10**9 + 1) < 10**9


# -- indexing in threads --------------------------------------------------------------------------
def test_ordered_map_keeps_the_order_and_raises_where_the_item_is():
    assert list(ordered_map(lambda x: x * x, list(range(50)), threads=3)) == [x * x for x in range(50)]

    def f(x):
        if x == 7:
            raise ValueError("seven")
        return x

    got = []
    with pytest.raises(ValueError, match="seven"):
        for x in ordered_map(f, list(range(20)), threads=2):
            got.append(x)
    assert got == list(range(7))


def test_threads_give_the_same_source_and_errors(tmp_path, monkeypatch):
    ds = tmp_path / "ds"
    ds.mkdir()
    for i in range(9):
        extra = [("x.png", b"\x89PNG"), ("x.jpg", b"\xff\xd8")] if i % 4 == 1 else []   # rejects in some
        write_tar(ds / f"s{i}.tar", pairs(3 + i, f"k{i}_") + extra)
    results = []
    for threads in (1, 2, 4):
        monkeypatch.setattr(tar_local, "INDEX_THREADS", threads)
        src, warned = open_src(ds, tmp_path / f"idx{threads}")
        results.append((facts(src), src.rejected, warned))
    assert results[0] == results[1] == results[2]
    rejected_in = [k.split(":")[0] for k, _ in results[0][1]]
    assert rejected_in == sorted(rejected_in) and {Path(k).name for k in rejected_in} == {"s1.tar", "s5.tar"}
    (ds / "s5.tar").write_bytes(b"\x1f\x8b" + bytes(2000))   # compressed: an error, whatever the threads
    for threads in (1, 2):
        monkeypatch.setattr(tar_local, "INDEX_THREADS", threads)
        with pytest.raises(SourceError, match="s5.tar is compressed"):
            TarShardSource(ds, index_dir=False)
