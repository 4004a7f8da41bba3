"""Data over HTTP: the shard cache and the tar / Parquet sources against a real HTTP server on
loopback (tests/servers.py), with injected faults."""
from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

from conftest import PHOTOS, REPO, batches_equal, clone_all
from feedgpu import Batch, DataLoader, ParquetSource, Pipeline, SkippedSampleWarning, TarShardSource
from feedgpu.convert import folder_to_parquet, folder_to_tar
from feedgpu.errors import CacheFullError, DownloadError, RemoteChangedError, SampleError, ShardFetchError, SourceError
from feedgpu.remote import ShardCache
from feedgpu.sample_data import build_imagenet_like
from feedgpu.stages import Decode, ResizeCenterCrop
from servers import FileServer

pytestmark = pytest.mark.timeout(120)

N = 24          # images: 3 tar shards of 10, 10, 4; 3 Parquet files


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote")
    folder = build_imagenet_like(root / "train", N, photos_dir=PHOTOS, seed=0)
    folder_to_tar(folder, root / "tar", samples_per_shard=10)
    folder_to_parquet(folder, root / "pq", rows_per_file=10, row_group_bytes=3 * 40_000)
    return root


@pytest.fixture
def served(data, tmp_path):
    """A copy of the data behind a fresh server (tests change files)."""
    import shutil

    root = tmp_path / "www"
    shutil.copytree(data / "tar", root / "tar")
    shutil.copytree(data / "pq", root / "pq")
    srv = FileServer(root)
    yield srv
    srv.close()


def shard_urls(srv, sub="tar", ext=".tar"):
    return [f"{srv.url}/{sub}/{p.name}" for p in sorted((srv.root / sub).glob(f"*{ext}"))]


def no_sleep():
    slept = []
    return slept, slept.append


def cache_in(tmp_path, budget=None, **kw):
    slept, sleep = no_sleep()
    kw.setdefault("retries", 2)
    c = ShardCache(tmp_path / "cache", budget, sleep=sleep, **kw)
    c.slept = slept
    return c


def same_records(a, b) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        ra, rb = a.read(i), b.read(i)
        assert bytes(ra.payload) == bytes(rb.payload) and ra.label == rb.label, i
    assert a.classes == b.classes


def pipe(src, **kw):
    opts = dict(batch_size=5, num_workers=0, shuffle=True, seed=3, device="cpu")
    opts.update(kw)
    return Pipeline(src, [Decode(), ResizeCenterCrop(32, 32)], **opts)


# -- sources over HTTP -----------------------------------------------------------------------------
def test_tar_over_http_holds_the_local_records(data, served, tmp_path):
    local = TarShardSource(data / "tar")
    by_list = TarShardSource(shard_urls(served), cache=cache_in(tmp_path))
    same_records(by_list, local)
    assert by_list.key(0) == f"{served.url}/tar/shard-000000.tar:{local.members[0]}"
    by_index = TarShardSource(f"{served.url}/tar/_index.json", cache=cache_in(tmp_path))
    same_records(by_index, local)
    assert by_index.identity() == by_list.identity() != local.identity()


def test_index_file_opens_a_tar_source_without_downloading_a_shard(served, tmp_path):
    src = TarShardSource(f"{served.url}/tar/_index.json", cache=cache_in(tmp_path))
    assert sum(served.gets(f"tar/{p.name}") for p in (served.root / "tar").glob("*.tar")) == 0
    src.read(len(src) - 1)   # the last shard only
    assert [served.gets(f"tar/shard-00000{k}.tar") for k in range(3)] == [0, 0, 1]


def test_http_cannot_list(served, tmp_path):
    for spec in (f"{served.url}/tar/*.tar", f"{served.url}/tar/"):
        with pytest.raises(SourceError, match="cannot list"):
            TarShardSource(spec, cache=cache_in(tmp_path))


def test_parquet_over_http_indexes_by_ranged_reads(data, served, tmp_path):
    urls = shard_urls(served, "pq", ".parquet")
    total = sum(p.stat().st_size for p in (served.root / "pq").glob("*.parquet"))
    src = ParquetSource(urls, cache=cache_in(tmp_path))
    assert served.bytes_sent < total / 2, "footers and labels only, not the images"
    assert len(src) == N and not src.rejected
    sent = served.bytes_sent
    same_records(src, ParquetSource(data / "pq"))
    # reads download each file whole, once, into the shard cache
    assert served.bytes_sent - sent == total
    assert src._remote.cache.stats()["misses"] == 3


def test_conservation_one_epoch_over_http(data, served, tmp_path):
    for src, local in ((TarShardSource(f"{served.url}/tar/_index.json", cache=cache_in(tmp_path)),
                        TarShardSource(data / "tar")),
                       (ParquetSource(f"{served.url}/pq/_index.json", cache=cache_in(tmp_path)),
                        ParquetSource(data / "pq"))):
        got = clone_all(DataLoader(pipe(src, num_workers=2)))
        want = clone_all(DataLoader(pipe(local, num_workers=2)))
        assert batches_equal(got, want)
        assert Counter(l for b in got for l in b.labels.tolist()) == Counter(local.labels.tolist())


def test_resume_on_a_fresh_cache_directory(served, tmp_path):
    url = f"{served.url}/tar/_index.json"
    reference = clone_all(DataLoader(pipe(TarShardSource(url, cache_dir=tmp_path / "a"))))
    first = DataLoader(pipe(TarShardSource(url, cache_dir=tmp_path / "a")))
    it = iter(first)
    head = [Batch(b.images.clone(), b.labels.clone()) for b in (next(it) for _ in range(2))]
    state = first.state_dict()
    first.shutdown()
    del it
    # preemption: a new machine, an empty cache directory
    fresh = TarShardSource(url, cache_dir=tmp_path / "b")
    assert not any((tmp_path / "b").glob("*.data"))
    again = DataLoader(pipe(fresh))
    again.load_state_dict(state)
    assert batches_equal(head + clone_all(again), reference)


# -- the shard cache -------------------------------------------------------------------------------
def test_failing_download_is_retried_with_backoff(served, tmp_path):
    url = shard_urls(served)[0]
    served.fail["tar/shard-000000.tar"] = 2
    cache = cache_in(tmp_path, retries=3, backoff_s=0.5)
    path = cache.local_path(url)
    assert Path(path).read_bytes() == (served.root / "tar/shard-000000.tar").read_bytes()
    assert cache.slept == [0.5, 1.0] and cache.stats()["retries"] == 2


def test_truncated_response_is_retried_never_served(served, tmp_path):
    url = shard_urls(served)[1]
    served.truncate["tar/shard-000001.tar"] = 1
    cache = cache_in(tmp_path)
    assert Path(cache.local_path(url)).read_bytes() == (served.root / "tar/shard-000001.tar").read_bytes()
    assert cache.stats()["retries"] == 1


def test_retries_exhausted_make_a_bad_shard_within_the_skip_budget(served, tmp_path):
    index = f"{served.url}/tar/_index.json"
    served.fail["tar/shard-000001.tar"] = 10**6
    src = TarShardSource(index, cache=cache_in(tmp_path, retries=1))
    with pytest.raises(SampleError) as e:
        src.read(10)
    assert e.value.reason == "bad shard" and "shard-000001.tar" in e.value.key
    gets = served.requests[("HEAD", "tar/shard-000001.tar")]
    with pytest.raises(SampleError):
        src.read(11)   # the failure is remembered: no new download for each sample
    assert served.requests[("HEAD", "tar/shard-000001.tar")] == gets
    loader = DataLoader(pipe(TarShardSource(index, cache=cache_in(tmp_path, retries=1)), max_skipped=10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSampleWarning)
        labels = [l for b in loader for l in b.labels.tolist()]
    stats = loader.stats()
    assert stats["skipped"] == {"bad shard": 10}
    assert all("shard-000001.tar:" in k for k, _ in stats["skipped_keys"])
    # every other record is delivered; the bad shard's rows are refilled from spares (repeats)
    assert set(labels) == set(src.labels[:10].tolist() + src.labels[20:].tolist()) and len(labels) == N
    over = DataLoader(pipe(TarShardSource(index, cache=cache_in(tmp_path, retries=1)), max_skipped=9))
    # the read-ahead finds the shard lost before its samples are read: the epoch ends, named
    with warnings.catch_warnings(), pytest.raises(ShardFetchError, match="shard-000001.tar.*skip budget"):
        warnings.simplefilter("ignore", SkippedSampleWarning)
        list(over)


def test_unreachable_shard_while_indexing_is_named(served, tmp_path):
    served.down.add("tar/shard-000002.tar")
    with pytest.raises(SourceError, match=r"1 of 3 file\(s\) cannot be read:\n.*shard-000002.tar: .*HTTP 503"):
        TarShardSource(shard_urls(served), cache=cache_in(tmp_path, retries=1))
    with pytest.warns(UserWarning, match="bad shard"):   # a budget of whole files: left out, named
        src = TarShardSource(shard_urls(served), cache=cache_in(tmp_path, retries=1), max_bad_files=1)
    assert len(src) == 20
    assert src.rejected == [(shard_urls(served)[2], "bad shard")]


def test_file_changed_between_epochs_is_detected(served, tmp_path):
    src = TarShardSource(f"{served.url}/tar/_index.json", cache_dir=tmp_path / "c")
    first = [src.read(i).payload for i in range(len(src))]
    shard = served.root / "tar/shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:-1024] + b"\0" * 2048)   # rewritten on the store
    # the next epoch's workers (a new process: the unpickled source) check the store again
    worker = pickle.loads(pickle.dumps(src))
    with pytest.raises(RemoteChangedError, match="shard-000000.tar changed"):
        worker.read(0)
    assert worker.read(15).payload == first[15]   # an unchanged shard still reads
    # without an expected identity the cache downloads the new file instead of serving the old
    cache = ShardCache(tmp_path / "c")
    assert Path(cache.local_path(shard_urls(served)[0])).read_bytes() == shard.read_bytes()
    assert cache.stats()["misses"] == 1


def test_file_changed_during_download_is_never_served(served, tmp_path):
    url = shard_urls(served)[0]
    name = "tar/shard-000000.tar"
    shard = served.root / name
    old = shard.read_bytes()
    served.after_get[name] = lambda: shard.write_bytes(old[::-1])   # replaced while being read
    cache = cache_in(tmp_path, chunk_bytes=len(old) // 3)
    expect = cache.stat(url)
    with pytest.raises(RemoteChangedError):
        cache.local_path(url, expect)   # ETag before != after: retried, then the store holds another file
    assert not list((tmp_path / "cache").glob("*.data*"))
    assert Path(cache.local_path(url)).read_bytes() == old[::-1]


def test_checksum_mismatch_is_never_served(served, tmp_path):
    url = f"{served.url}/tar/_index.json"
    served.corrupt["tar/shard-000000.tar"] = 10**6   # a flipped byte under a consistent ETag
    src = TarShardSource(url, cache=cache_in(tmp_path, retries=1))
    with pytest.raises(SampleError, match="SHA-256"):
        src.read(0)
    assert not list((tmp_path / "cache").glob("*.data*"))


def test_budget_smaller_than_a_shard_is_a_clear_error(served, tmp_path):
    url = shard_urls(served)[0]
    cache = cache_in(tmp_path, budget=1000)
    with pytest.raises(CacheFullError, match="budget of 1000 bytes"):
        cache.local_path(url)
    assert not list((tmp_path / "cache").glob("*.data*"))
    src = TarShardSource(f"{served.url}/tar/_index.json", cache=cache_in(tmp_path, budget="1KiB"))
    with pytest.raises(CacheFullError):
        src.read(0)   # an error, not a skipped sample


class FullDisk(ShardCache):
    """A disk that fills after ``room`` bytes (ENOSPC injected into the download's writes)."""

    room = 5000

    def _open_tmp(self, path):
        f = open(path, "wb")
        room = self.room

        class Writer:
            def __getattr__(self, name):
                return getattr(f, name)

            def write(self, data):
                nonlocal room
                if len(data) > room:
                    raise OSError(errno.ENOSPC, "No space left on device")
                room -= len(data)
                return f.write(data)

        return Writer()


def test_full_disk_leaves_nothing_half_written(served, tmp_path):
    cache = FullDisk(tmp_path / "cache", chunk_bytes=4096)
    with pytest.raises(CacheFullError, match="full"):
        cache.local_path(shard_urls(served)[0])
    assert [p.suffix for p in (tmp_path / "cache").iterdir() if p.name != ".lock"] == [".lock"]   # a lock only
    assert cache.stats()["retries"] == 0


def test_lru_eviction_under_a_budget_keeps_pinned_files(served, tmp_path):
    urls = shard_urls(served)
    sizes = [(served.root / "tar" / u.rpartition("/")[2]).stat().st_size for u in urls]
    cache = cache_in(tmp_path, budget=sizes[0] + sizes[1] + sizes[2] // 2)
    cache.local_path(urls[0])
    cache.local_path(urls[1])
    cache.local_path(urls[0])   # used again: urls[1] is now the least recently used
    cache.local_path(urls[2])
    left = {json.loads(p.read_text())["url"] for p in (tmp_path / "cache").glob("*.json")}
    assert left == {urls[0], urls[2]} and cache.stats()["evictions"] == 1
    cache.pin(urls[0])
    cache.local_path(urls[1])   # urls[0] is older but pinned: urls[2] goes
    left = {json.loads(p.read_text())["url"] for p in (tmp_path / "cache").glob("*.json")}
    assert left == {urls[0], urls[1]}
    assert cache.stats()["cached_bytes"] <= cache.budget_bytes


def test_fetch_async_downloads_concurrently(served, tmp_path):
    cache = cache_in(tmp_path, max_downloads=2)
    futures = [cache.fetch_async(u) for u in shard_urls(served)]
    paths = [f.result(timeout=30) for f in futures]
    assert [Path(p).read_bytes() for p in paths] == [(served.root / "tar" / p.name).read_bytes()
                                                      for p in sorted((served.root / "tar").glob("*.tar"))]
    assert cache.stats()["misses"] == 3 and cache.stats()["bytes_downloaded"] == sum(
        (served.root / "tar" / p.name).stat().st_size for p in (served.root / "tar").glob("*.tar"))
    cache.close()


def test_two_processes_download_a_shard_once(served, tmp_path):
    url = shard_urls(served)[0]
    served.delay["tar/shard-000000.tar"] = 1.0   # both processes ask while the first download runs
    code = ("import sys; from feedgpu.remote import ShardCache; "
            "print(ShardCache(sys.argv[1]).local_path(sys.argv[2]))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cache"), url], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] and Path(outs[0]).read_bytes() == (served.root / "tar/shard-000000.tar").read_bytes()
    assert served.gets("tar/shard-000000.tar") == 1


def test_yaml_source_section_reads_a_url(served, tmp_path):
    from feedgpu import ConfigError

    yaml_path = REPO / "feedgpu" / "pipelines" / "imagenet_val.yaml"
    p = Pipeline.from_yaml(yaml_path, source={"format": "tar", "path": f"{served.url}/tar/_index.json",
                                              "cache_dir": str(tmp_path / "y"), "cache_budget": "64MiB"})
    assert len(p.source) == N and p.source._remote.cache.budget_bytes == 64 << 20
    assert p.source._remote.cache.directory == str(tmp_path / "y")
    with pytest.raises(ConfigError, match="cache_budget"):
        Pipeline.from_yaml(yaml_path, source={"format": "tar", "path": f"{served.url}/tar/_index.json",
                                              "cache_budget": "lots"}).source
    with pytest.raises(ConfigError, match="not to a folder"):
        Pipeline.from_yaml(yaml_path, source={"format": "folder", "path": str(tmp_path),
                                              "cache_dir": str(tmp_path)}).source


def test_listed_tar_shards_are_indexed_once_then_from_the_cache(data, served, tmp_path):
    urls = shard_urls(served)
    first = TarShardSource(urls, cache=cache_in(tmp_path))
    assert [served.gets(f"tar/shard-00000{k}.tar") for k in range(3)] == [1, 1, 1]
    for p in (tmp_path / "cache").glob("*.data"):   # evicted, or a new machine sharing nothing but the index
        p.unlink()
    again = TarShardSource(urls, cache=cache_in(tmp_path))
    assert [served.gets(f"tar/shard-00000{k}.tar") for k in range(3)] == [1, 1, 1], "indexed without a download"
    assert again.identity() == first.identity()
    same_records(again, TarShardSource(data / "tar"))   # reads download again
    # a changed shard is indexed again, not from the kept index
    shard = served.root / "tar/shard-000002.tar"
    shard.write_bytes(shard.read_bytes() + b"\0" * 10240)
    changed = TarShardSource(urls, cache=cache_in(tmp_path))
    assert served.gets("tar/shard-000002.tar") == 3 and changed.identity() != first.identity()


def test_a_dataset_larger_than_the_budget_is_read_with_evictions(data, served, tmp_path, monkeypatch):
    import feedgpu.sources.tar.source as tar

    monkeypatch.setattr(tar, "MAX_OPEN_REMOTE", 1)   # each process keeps one shard open
    sizes = [(served.root / "tar" / p.name).stat().st_size for p in sorted((served.root / "tar").glob("*.tar"))]
    cache = cache_in(tmp_path, budget=max(sizes) * 2)
    src = TarShardSource(shard_urls(served), cache=cache)   # indexing holds one shard pinned at a time
    same_records(src, TarShardSource(data / "tar"))
    stats = cache.stats()   # named in a failure: which downloads, hits and evictions it saw
    assert stats["evictions"] >= 2 and stats["cached_bytes"] <= cache.budget_bytes, (
        stats, sizes, sorted(p.name for p in (tmp_path / "cache").iterdir()))


def test_pixel_cache_works_on_top_of_remote_shards(served, tmp_path):
    from feedgpu.stages import Resize

    url = f"{served.url}/tar/_index.json"

    def cached(shards_dir):
        return Pipeline(TarShardSource(url, cache_dir=tmp_path / shards_dir), [Decode(), Resize(40), ResizeCenterCrop(32, 32)],
                        batch_size=8, num_workers=0, shuffle=False, device="cpu", cache={"dir": str(tmp_path / "px")})

    first = clone_all(DataLoader(cached("s1")))   # epoch 1: downloads, fills the pixel cache
    gets = sum(served.gets(f"tar/shard-00000{k}.tar") for k in range(3))
    assert gets == 3
    # another machine's empty shard cache, the same pixel cache: its fingerprint holds URLs and ETags
    again = clone_all(DataLoader(cached("s2")))
    assert batches_equal(again, first)
    assert sum(served.gets(f"tar/shard-00000{k}.tar") for k in range(3)) == gets, "no shard read again"


def test_scan_and_convert_take_urls(data, served, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from feedgpu.cli.main import main

    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(tmp_path / "fc"))
    res = CliRunner().invoke(main, ["scan", f"{served.url}/tar/_index.json", "--workers", "0"])
    assert res.exit_code == 0 and f"scanned {N} samples" in res.output, res.output
    res = CliRunner().invoke(main, ["scan", f"{served.url}/tar/*.tar", "--workers", "0"])
    assert res.exit_code == 2 and "cannot list" in res.output
    out = tmp_path / "up"
    res = CliRunner().invoke(main, ["convert", str(data / "train"), f"file://{out}", "--to", "parquet",
                                    "--per-file", "10"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["_classes.txt", "_index.json", "part-000000.parquet",
                                                    "part-000001.parquet", "part-000002.parquet"]
    same_records(ParquetSource(f"file://{out}/_index.json", cache_dir=tmp_path / "c"), ParquetSource(data / "pq"))


def test_changed_shard_stops_the_next_epoch_with_a_typed_error(served, tmp_path):
    src = TarShardSource(f"{served.url}/tar/_index.json", cache_dir=tmp_path / "c")
    loader = DataLoader(pipe(src, num_workers=1, persistent_workers=False))
    assert sum(len(b.labels) for b in loader) == N
    shard = served.root / "tar/shard-000001.tar"
    shard.write_bytes(shard.read_bytes() + b"\0" * 10240)   # rewritten on the store between epochs
    with pytest.raises(RemoteChangedError, match="shard-000001.tar changed since the source was indexed"):
        list(loader)   # the new epoch's worker checks the store when it opens the shard


def test_a_source_fetches_its_shards_ahead(served, tmp_path):
    src = TarShardSource(f"{served.url}/tar/_index.json", cache=cache_in(tmp_path))
    assert TarShardSource(served.root / "tar").remote is None
    futures = [src.remote.fetch_async(k) for k in range(3)]
    assert all(Path(f.result(timeout=30)).is_file() for f in futures)
    gets = served.gets("tar/shard-000002.tar")
    src.read(len(src) - 1)   # served from the cache: no new download
    assert served.gets("tar/shard-000002.tar") == gets == 1


def test_a_url_named_twice_is_read_once_with_a_warning(served, tmp_path):
    urls = shard_urls(served)
    with pytest.warns(UserWarning, match="named more than once"):
        src = TarShardSource(urls + urls[:1], cache=cache_in(tmp_path))
    assert len(src) == N and src.shards == urls


def test_a_silent_server_is_a_failed_download_not_a_hang(served, tmp_path, monkeypatch):
    import feedgpu.remote.urls as urls

    monkeypatch.setattr(urls, "HTTP_READ_TIMEOUT_S", 0.3)
    served.delay["tar/shard-000000.tar"] = 3.0   # sends its headers, then nothing for 3 s
    cache = cache_in(tmp_path, retries=1)
    with pytest.raises(DownloadError, match="after 2 attempt"):
        cache.local_path(shard_urls(served)[0])
