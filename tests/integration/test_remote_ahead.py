"""The loader's read-ahead of remote shards (feedgpu/remote/ahead_loader.py) against a real HTTP
server on loopback (tests/servers.py): shards fetched ahead by the main process before their
batches are dispatched, stats()["network"], resume on a fresh cache, failures, threads."""
from __future__ import annotations

import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest

from conftest import PHOTOS, batches_equal, clone_all
from feedgpu import Batch, DataLoader, Pipeline, SkippedSampleWarning, TarShardSource
from feedgpu.convert import folder_to_tar
from feedgpu.remote import ShardCache
from feedgpu.sample_data import build_imagenet_like
from feedgpu.stages import Decode, ResizeCenterCrop
from servers import FileServer

pytestmark = pytest.mark.timeout(180)

N = 24   # 3 shards of 10, 10, 4
SHARDS = [f"tar/shard-00000{k}.tar" for k in range(3)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ahead")
    folder = build_imagenet_like(root / "train", N, photos_dir=PHOTOS, seed=1)
    folder_to_tar(folder, root / "tar", samples_per_shard=10)
    return root


@pytest.fixture
def served(data, tmp_path):
    root = tmp_path / "www"
    shutil.copytree(data / "tar", root / "tar")
    srv = FileServer(root)
    yield srv
    srv.close()


def cache_in(path, **kw):
    kw.setdefault("retries", 1)
    return ShardCache(path, sleep=lambda s: None, **kw)


def pipe(src, **kw):
    opts = dict(batch_size=5, num_workers=2, shuffle=False, seed=3, device="cpu")
    opts.update(kw)
    return Pipeline(src, [Decode(), ResizeCenterCrop(32, 32)], **opts)


def source(served, cache_dir, **kw):
    return TarShardSource(f"{served.url}/tar/_index.json", cache=cache_in(cache_dir, **kw))


def shard_bytes(served) -> int:
    return sum((served.root / s).stat().st_size for s in SHARDS)


def test_shards_are_requested_ahead_and_workers_find_them_in_the_cache(data, served, tmp_path):
    served.delay[SHARDS[0]] = 1.5          # the first batch waits for its shard, later ones do not
    loader = DataLoader(pipe(source(served, tmp_path / "c")))
    it = iter(loader)
    first = next(it)
    # by the time the first batch came, the read-ahead had fetched every later shard too
    assert [served.gets(s) for s in SHARDS] == [1, 1, 1]
    rest = clone_all_from(it)
    local = TarShardSource(data / "tar")
    assert batches_equal([first] + rest, clone_all(DataLoader(pipe(local))))
    net = loader.stats()["network"]
    # one download per shard, by the main process; the workers' reads are cache hits
    assert [served.gets(s) for s in SHARDS] == [1, 1, 1]
    assert net["misses"] == 3 and net["bytes_downloaded"] == shard_bytes(served)
    assert net["read_ahead_fetched"] == 3 and net["read_ahead_failed"] == 0
    assert net["hits"] >= 3 and net["retries"] == 0 and net["evictions"] == 0
    assert net["processes"] >= 2               # the main process and at least one worker reported
    assert net["read_ahead_wait_s"] >= 1.0     # the blocked wait for the delayed shard
    assert net["worker_wait_s"] < 1.0          # workers never downloaded: no delayed GET in a worker
    assert net["network_wait_s"] == pytest.approx(net["read_ahead_wait_s"] + net["worker_wait_s"])
    assert net["cached_bytes"] == shard_bytes(served)
    # epoch 2 from the shard cache: no GET, the byte count stays
    served.delay.clear()
    assert len(clone_all(loader)) == 5
    assert [served.gets(s) for s in SHARDS] == [1, 1, 1]
    net2 = loader.stats()["network"]
    assert net2["bytes_downloaded"] == net["bytes_downloaded"] and net2["misses"] == 3
    assert net2["read_ahead_fetched"] == 6 and net2["hits"] > net["hits"]


def clone_all_from(it) -> list:
    return [Batch(b.images.clone(), b.labels.clone()) for b in it]


def test_local_sources_have_no_network_stats(data):
    loader = DataLoader(pipe(TarShardSource(data / "tar"), num_workers=0))
    assert len(clone_all(loader)) == 5
    assert loader.stats()["network"] is None


def test_resume_mid_epoch_on_a_fresh_cache_fetches_only_what_is_left(served, tmp_path):
    reference = clone_all(DataLoader(pipe(source(served, tmp_path / "ref"))))
    first = DataLoader(pipe(source(served, tmp_path / "a")))
    it = iter(first)
    head = [Batch(b.images.clone(), b.labels.clone()) for b in (next(it) for _ in range(2))]
    state = first.state_dict()
    first.shutdown()
    del it
    before = [served.gets(s) for s in SHARDS]
    again = DataLoader(pipe(source(served, tmp_path / "b")))   # a new machine: an empty cache
    again.load_state_dict(state)
    tail = clone_all(again)
    assert batches_equal(head + tail, reference)
    # batches 0 and 1 were shard 0: the resumed read-ahead starts at the position, shard 1
    got = [served.gets(s) - b for s, b in zip(SHARDS, before)]
    assert got == [0, 1, 1]
    assert again.stats()["network"]["read_ahead_fetched"] == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_failing_during_read_ahead_is_named_bad_shard_skips(served, tmp_path, workers):
    served.fail[SHARDS[1]] = 10**6
    src = source(served, tmp_path / "c")
    loader = DataLoader(pipe(src, num_workers=workers, shuffle=True, max_skipped=10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSampleWarning)
        labels = [l for b in loader for l in b.labels.tolist()]
    stats = loader.stats()
    assert stats["skipped"] == {"bad shard": 10}
    assert sorted(k for k, _ in stats["skipped_keys"]) == sorted(src.key(i) for i in range(10, 20))
    assert len(labels) == N
    assert set(labels) == set(src.labels[:10].tolist() + src.labels[20:].tolist())
    net = stats["network"]
    assert net["read_ahead_failed"] == 1 and net["read_ahead_fetched"] == 2
    assert net["failures"] >= 1 and net["retries"] >= 1


def test_no_thread_is_left_after_shutdown(served, tmp_path):
    others = set(threading.enumerate())   # threads of caches other tests in this process left

    def ours():
        return [t.name for t in threading.enumerate()
                if t.name.startswith(("feedgpu-shard-ahead", "feedgpu-fetch")) and t not in others]

    assert ours() == []
    served.delay[SHARDS[2]] = 1.0   # a download still in flight when the loop stops
    loader = DataLoader(pipe(source(served, tmp_path / "c")))
    it = iter(loader)
    next(it)
    assert ours()
    loader.shutdown()
    deadline = time.monotonic() + 10
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours() == []
    # and after a complete epoch
    served.delay.clear()
    assert len(clone_all(loader)) == 5
    deadline = time.monotonic() + 10
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours() == []
