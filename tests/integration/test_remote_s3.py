"""Data on S3: moto's S3 server on loopback, read through s3fs; `feedgpu convert` uploads."""
from __future__ import annotations

from collections import Counter

import pytest
from click.testing import CliRunner

from conftest import PHOTOS, batches_equal, clone_all
from feedgpu import DataLoader, ParquetSource, TarShardSource
from feedgpu.cli.main import main
from feedgpu.convert import folder_to_parquet, folder_to_tar
from feedgpu.errors import DownloadError
from feedgpu.remote import ShardCache
from feedgpu.sample_data import build_imagenet_like
from servers import S3Server, dummy_aws_env
from test_remote import pipe, same_records

pytest.importorskip("s3fs")
pytest.importorskip("moto")
pytestmark = pytest.mark.timeout(180)

N = 24


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    dummy_aws_env(mp)
    srv = S3Server()
    root = tmp_path_factory.mktemp("s3data")
    folder = build_imagenet_like(root / "train", N, photos_dir=PHOTOS, seed=1)
    folder_to_tar(folder, root / "tar", samples_per_shard=10)
    folder_to_parquet(folder, root / "pq", rows_per_file=10, row_group_bytes=3 * 40_000)
    srv.upload_dir(root / "tar", "data", "tar/")
    srv.upload_dir(root / "pq", "data", "pq/")
    srv.root = root
    yield srv
    srv.close()
    mp.undo()


def test_s3_glob_lists_the_shards_and_holds_the_local_records(s3, tmp_path):
    local = TarShardSource(s3.root / "tar")
    src = TarShardSource("s3://data/tar/shard-*.tar", cache_dir=tmp_path / "c", storage_options=s3.storage_options)
    assert src.shards == [f"s3://data/tar/shard-00000{k}.tar" for k in range(3)]
    same_records(src, local)
    folder = TarShardSource("s3://data/tar/", cache_dir=tmp_path / "c", storage_options=s3.storage_options)
    assert folder.identity() == src.identity()
    # identity holds S3's ETag: the MD5 of a single-part object, checked after each download
    etag = src._remote.files[0].identity.etag
    assert len(etag) == 32 and src._remote.cache.stats()["misses"] == 3


def test_s3_parquet_by_ranged_reads_and_conservation(s3, tmp_path):
    local = ParquetSource(s3.root / "pq")
    src = ParquetSource("s3://data/pq/_index.json", cache_dir=tmp_path / "c", storage_options=s3.storage_options)
    assert not list((tmp_path / "c").glob("*.data")), "indexed by ranged reads, nothing downloaded"
    same_records(src, local)
    assert len(list((tmp_path / "c").glob("*.data"))) == 3
    got = clone_all(DataLoader(pipe(src, num_workers=2)))
    assert batches_equal(got, clone_all(DataLoader(pipe(local, num_workers=2))))
    assert Counter(l for b in got for l in b.labels.tolist()) == Counter(local.labels.tolist())


def test_s3_tar_conservation_in_a_loader(s3, tmp_path):
    src = TarShardSource("s3://data/tar/_index.json", cache_dir=tmp_path / "c", storage_options=s3.storage_options)
    local = TarShardSource(s3.root / "tar")
    got = clone_all(DataLoader(pipe(src, num_workers=2)))
    assert batches_equal(got, clone_all(DataLoader(pipe(local, num_workers=2))))
    assert Counter(l for b in got for l in b.labels.tolist()) == Counter(local.labels.tolist())


def test_s3_missing_object_fails_at_once_by_name(s3, tmp_path):
    slept = []
    cache = ShardCache(tmp_path / "c", storage_options=s3.storage_options, retries=2, sleep=slept.append)
    with pytest.raises(DownloadError, match="nothing.tar: download failed after 1 attempt.*: not found") as e:
        cache.local_path("s3://data/tar/nothing.tar")
    assert slept == [] and e.value.kind == "not found"   # a missing object does not come back on a retry


def test_convert_uploads_to_s3(s3, tmp_path):
    import json

    opts = json.dumps(s3.storage_options)
    res = CliRunner().invoke(main, ["convert", str(s3.root / "train"), "s3://data/conv/", "--to", "tar",
                                    "--per-file", "10", "--storage-options", opts])
    assert res.exit_code == 0, res.output
    fs = s3.filesystem()
    assert sorted(p.rpartition("/")[2] for p in fs.ls("data/conv")) == [
        "_classes.txt", "_index.json", "shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    src = TarShardSource("s3://data/conv/_index.json", cache_dir=tmp_path / "c", storage_options=s3.storage_options)
    same_records(src, TarShardSource(s3.root / "tar"))


def test_convert_partial_upload_failure_exits_non_zero(s3, tmp_path, monkeypatch, request):
    import json

    import s3fs

    request.addfinalizer(s3fs.S3FileSystem.clear_instance_cache)   # no instance bound to the fake

    real = s3fs.S3FileSystem._put_file

    async def flaky(self, lpath, rpath, *a, **kw):   # the store fails on one shard, every attempt
        if rpath.endswith("shard-000001.tar"):
            raise OSError("injected: connection reset")
        return await real(self, lpath, rpath, *a, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", flaky)
    s3fs.S3FileSystem.clear_instance_cache()   # instances bind their sync methods when made
    monkeypatch.setattr("feedgpu.remote.upload.time.sleep", lambda s: None)
    res = CliRunner().invoke(main, ["convert", str(s3.root / "train"), "s3://data/broken/", "--to", "tar",
                                    "--per-file", "10", "--storage-options", json.dumps(s3.storage_options)])
    assert res.exit_code == 2
    assert "shard-000001.tar: OSError: injected" in res.output and "incomplete" in res.output
    names = [p.rpartition("/")[2] for p in s3.filesystem().ls("data/broken")]
    assert "_index.json" not in names and "shard-000001.tar" not in names


def test_s3_md5_etag_mismatch_is_never_served(s3, tmp_path, monkeypatch):
    from feedgpu.remote.urls import Identity

    real = ShardCache._stat

    def wrong_etag(self, url):   # the store's ETag (an MD5) does not match the bytes it sends
        ident = real(self, url)
        return Identity(ident.url, ident.size, "0" * 32, ident.mtime)

    monkeypatch.setattr(ShardCache, "_stat", wrong_etag)
    cache = ShardCache(tmp_path / "c", storage_options=s3.storage_options, retries=1, sleep=lambda s: None)
    with pytest.raises(DownloadError, match="MD5 .* is not its ETag"):
        cache.local_path("s3://data/tar/shard-000000.tar")
    assert not list((tmp_path / "c").glob("*.data*"))
