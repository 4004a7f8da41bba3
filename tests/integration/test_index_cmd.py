"""``feedgpu index``: member tables for tar shards feedgpu did not write, a folder's saved index."""
from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from feedgpu.sources import prebuild
from feedgpu.sources.tar import local as tar_local
from feedgpu.sources.folder import FolderSource, saved_index_file
from feedgpu.sources.prebuild import index_folder, index_shards
from feedgpu.sources.tar import TarShardSource
from feedgpu.sources.tar.table import SUFFIX, table_path

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cli():
    from feedgpu.cli.main import main

    return main


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(tmp_path / "cache"))


def run(cli, *args):
    return CliRunner().invoke(cli, ["index", *map(str, args)])


def foreign(tar_ds: Path, to: Path) -> Path:
    """A copy of the shards (mtimes kept) without their member tables: shards from elsewhere."""
    shutil.copytree(tar_ds, to)
    for t in to.glob("*" + SUFFIX):
        t.unlink()
    assert sorted(to.glob("*.tar")) and not list(to.glob("*" + SUFFIX))
    return to


def facts(src):
    return [src.key(i) for i in range(len(src))], src.labels.tolist(), src.offsets.tolist(), src.sizes.tolist()


def no_scan(path):
    raise AssertionError(f"{path} was indexed: its member table should have been taken")


def table_stats(ds: Path) -> dict:
    return {t.name: (t.stat().st_ino, t.stat().st_mtime_ns) for t in sorted(ds.glob("*" + SUFFIX))}


def test_tables_for_foreign_shards_are_taken_by_a_fresh_source(cli, tar_ds, tmp_path, monkeypatch):
    ds = foreign(tar_ds, tmp_path / "ds")
    shards = sorted(ds.glob("*.tar"))
    want = facts(TarShardSource(ds, index_dir=False))        # the scan, no tables
    res = run(cli, ds, "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["tar"]
    assert (got["indexed"], got["up_to_date"], got["samples"], got["rejected"], got["failed"]) == (3, 0, 120, {}, [])
    assert got["tables"] == [str(table_path(str(s))) for s in shards]
    with monkeypatch.context() as mp:
        mp.setattr(tar_local, "index_local", no_scan)
        src = TarShardSource(ds, index_dir=tmp_path / "fresh")
    assert src.table_shards == 3 and src.saved_shards == 0
    assert facts(src) == want
    before = table_stats(ds)
    again = index_shards(ds)                                 # the library, on the same shards
    assert again.indexed == [] and again.up_to_date == [str(s) for s in shards] and again.samples == 120
    assert table_stats(ds) == before                         # nothing rewritten
    res = run(cli, ds)
    assert res.exit_code == 0 and "0 shard(s) indexed, 3 up to date, 120 samples" in res.stdout, res.output
    res = run(cli, shards[0], "--force", "--threads", "1")
    assert res.exit_code == 0 and "1 shard(s) indexed, 0 up to date, 50 samples" in res.stdout, res.output
    after = table_stats(ds)
    assert after[table_path(str(shards[0])).name] != before[table_path(str(shards[0])).name]
    assert {k: v for k, v in after.items() if not k.startswith(shards[0].name)} == \
        {k: v for k, v in before.items() if not k.startswith(shards[0].name)}


def write_shard(path: Path, members) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_the_library_counts_rejects_as_the_source_and_replaces_a_bad_table(folder_ds, tar_ds, tmp_path, monkeypatch):
    ds = foreign(tar_ds, tmp_path / "ds")
    photo = next(folder_ds.rglob("*.jpg")).read_bytes()
    odd = write_shard(ds / "zz-odd.tar", [("a.jpg", photo), ("a.cls", b"3"), ("b.jpg", photo),   # b: no label
                                          ("c.jpg", photo), ("c.png", photo), ("c.cls", b"4")])  # c: two images
    first = sorted(ds.glob("*.tar"))[0]
    table_path(str(first)).write_bytes(b"not a table")       # a table that does not hold
    rep = index_shards(str(ds / "*.tar"), threads=1)
    assert len(rep.indexed) == 4 and rep.failed == [] and [s for s, _ in rep.replaced] == [str(first)]
    assert "not a feedgpu tar index" in rep.replaced[0][1]
    assert rep.rejected == {"missing label": 1, "duplicate key": 2} and rep.samples == 121
    with monkeypatch.context() as mp:
        mp.setattr(tar_local, "index_local", no_scan)
        src = TarShardSource(ds, index_dir=False)
    assert src.table_shards == 4 and len(src) == rep.samples
    assert Counter(r for _, r in src.rejected) == rep.rejected
    assert src.key(len(src) - 1) == f"{odd}:a.jpg" and src.labels[-1] == 3


def test_a_damaged_shard_is_named_and_the_others_indexed(cli, tar_ds, tmp_path):
    ds = foreign(tar_ds, tmp_path / "ds")
    a, b, c = sorted(ds.glob("*.tar"))
    data = b.read_bytes()
    b.write_bytes(data[:len(data) // 2 + 100])             # cut inside a member's data
    junk = ds / "zz-junk.tar"
    junk.write_bytes(b"not a tar shard\n" * 300)
    res = run(cli, ds, "--json")
    assert res.exit_code == 2, res.output
    failed = dict(json.loads(res.stdout)["failed"])
    assert set(failed) == {str(b), str(junk)}
    assert "truncated shard" in failed[str(b)] and "not an uncompressed tar" in failed[str(junk)]
    assert f"failed: {b}: truncated shard" in res.stderr
    assert table_path(str(a)).is_file() and table_path(str(c)).is_file()
    assert not table_path(str(b)).exists() and not table_path(str(junk)).exists()
    assert json.loads(res.stdout)["tar"]["samples"] == len(TarShardSource([a, c], index_dir=False)) == 50 + 20
    assert not [p for p in ds.iterdir() if p.name.startswith(".tmp-")]   # nothing half-written


def test_a_read_only_shard_folder_is_named(cli, tar_ds, tmp_path, monkeypatch):
    """Tests run as root, for whom a mode bit does not make a folder read-only: the folder's
    refusal is what ``mkstemp`` raises there."""
    ds = foreign(tar_ds, tmp_path / "ds")
    real = prebuild.tempfile.mkstemp

    def refuse(*a, dir=None, **kw):
        if dir == str(ds):
            raise PermissionError(13, "Permission denied", dir)
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(prebuild.tempfile, "mkstemp", refuse)
    res = run(cli, ds)
    assert res.exit_code == 2
    assert f"failed: {ds}: cannot write member tables in the folder {ds} (Permission denied): 3 shard(s)" in res.stderr
    assert "0 shard(s) indexed" in res.stdout and not list(ds.glob("*" + SUFFIX))


def test_a_folder_index_is_saved_where_the_source_looks(cli, folder_ds, tmp_path, monkeypatch):
    root = tmp_path / "train"
    shutil.copytree(folder_ds, root)                        # folders written just now: saved after the wait
    idx = tmp_path / "idx"
    want = FolderSource(root, index_dir=False)
    res = run(cli, root, "--index-dir", idx)
    assert res.exit_code == 0, res.output
    assert f"folder {root}: indexed, 120 files, {len(want.classes)} classes, 0 rejected" in res.stdout
    file = saved_index_file(str(root), idx)
    assert file.is_file() and str(file) in res.stdout
    with monkeypatch.context() as mp:
        mp.setattr(FolderSource, "_build", lambda *a: no_scan(root))
        src = FolderSource(root, index_dir=idx)
    assert src.from_saved_index and src.classes == want.classes
    assert [src.key(i) for i in range(len(src))] == [want.key(i) for i in range(len(want))]
    assert src.labels.tolist() == want.labels.tolist()
    mtime = file.stat().st_mtime_ns
    again = index_folder(root, index_dir=idx)
    assert again.up_to_date and again.files == 120 and file.stat().st_mtime_ns == mtime
    listed = index_folder(root, index_dir=idx, stat_files=False)   # its own file, as the source keys it
    assert not listed.up_to_date and listed.index_file != file
    with monkeypatch.context() as mp:
        mp.setattr(FolderSource, "_build", lambda *a: no_scan(root))
        assert FolderSource(root, index_dir=idx, stat_files=False).from_saved_index
    res = run(cli, root, "--index-dir", idx, "--force", "--json")
    (rep,) = json.loads(res.stdout)["folders"]
    assert res.exit_code == 0 and not rep["up_to_date"] and rep["files"] == 120


def test_parquet_needs_no_index_and_a_missing_path_is_refused(cli, tmp_path):
    pq = tmp_path / "a.parquet"
    pq.write_bytes(b"")
    res = run(cli, pq)
    assert res.exit_code == 0 and f"parquet {pq}: needs no index" in res.stdout
    res = run(cli, tmp_path / "nothing-here")
    assert res.exit_code == 2 and "does not exist" in res.stderr
    res = run(cli, "s3://bucket/train/*.tar")
    assert res.exit_code == 2 and "_index.json" in res.stderr
