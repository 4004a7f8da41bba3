"""Remote data when the network misbehaves, against a real HTTP server on loopback
(tests/servers.py) that is stopped, restarted, slowed, made to answer 404/500 or HTML, or
changes its files: an outage served from the shard cache, errors named at open, changed bytes
never served, a server that stays down ending the epoch in bounded time.

Retry back-offs are injected (``backoff_s``): a test that must not wait on the back-off sets
one larger than its time bound, so the bound holds on a busy machine and a regression shows."""
from __future__ import annotations

import pickle
import shutil
import time
import warnings
from pathlib import Path

import pytest

from conftest import PHOTOS, batches_equal, clone_all
from feedgpu import DataLoader, ParquetSource, Pipeline, SkippedSampleWarning, TarShardSource
from feedgpu.convert import folder_to_parquet, folder_to_tar
from feedgpu.remote import ShardCache
from feedgpu.sample_data import build_imagenet_like
from feedgpu.stages import Decode, ResizeCenterCrop
from servers import FileServer

pytestmark = pytest.mark.timeout(180)

N = 24   # 3 tar shards of 10, 10, 4; 3 Parquet files of 10, 10, 4 rows
KINDS = {"tar": (TarShardSource, ".tar"), "pq": (ParquetSource, ".parquet")}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    folder = build_imagenet_like(root / "train", N, photos_dir=PHOTOS, seed=2)
    folder_to_tar(folder, root / "tar", samples_per_shard=10)
    folder_to_parquet(folder, root / "pq", rows_per_file=10, row_group_bytes=3 * 40_000)
    return root


@pytest.fixture
def served(data, tmp_path):
    root = tmp_path / "www"
    shutil.copytree(data / "tar", root / "tar")
    shutil.copytree(data / "pq", root / "pq")
    srv = FileServer(root)
    yield srv
    srv.close()


def cache_in(path, backoff_s=0.01, retries=2, **kw):
    return ShardCache(path, retries=retries, backoff_s=backoff_s, **kw)


def files(served, kind) -> list[str]:
    ext = KINDS[kind][1]
    return [f"{served.url}/{kind}/{p.name}" for p in sorted((served.root / kind).glob(f"*{ext}"))]


def open_source(kind, spec, cache, **kw):
    return KINDS[kind][0](spec, cache=cache, **kw)


def index(served, kind) -> str:
    return f"{served.url}/{kind}/_index.json"


def pipe(src, **kw):
    opts = dict(batch_size=5, num_workers=0, shuffle=True, seed=3, device="cpu")
    opts.update(kw)
    return Pipeline(src, [Decode(), ResizeCenterCrop(32, 32)], **opts)


def local(data, kind):
    return KINDS[kind][0](data / kind)


# -- an outage: a fully cached dataset trains on ---------------------------------------------------
@pytest.mark.parametrize("kind", ["tar", "pq"])
@pytest.mark.parametrize("workers", [0, 2])
def test_an_outage_after_a_complete_epoch_trains_from_the_shard_cache(data, served, tmp_path, kind, workers):
    # a back-off far over the bound: waiting on it even once fails the time bound below
    src = open_source(kind, index(served, kind), cache_in(tmp_path / "c", backoff_s=30.0, retries=4))
    reference = clone_all(DataLoader(pipe(local(data, kind), num_workers=workers)))
    assert batches_equal(clone_all(DataLoader(pipe(src, num_workers=workers, persistent_workers=False))), reference)
    served.stop()   # the server goes down for good
    requests_before = sum(served.requests.values())
    # a new process (new workers; for 0 workers, the source as a new process unpickles it)
    again = src if workers else pickle.loads(pickle.dumps(src))
    loader = DataLoader(pipe(again, num_workers=workers, persistent_workers=False))
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="could not be reached|cannot be reached"):
        got = clone_all(loader)
    assert time.monotonic() - t0 < 25.0, "no retry back-off for a verified cached shard"
    assert batches_equal(got, reference), "every sample once, in order"
    net = loader.stats()["network"]
    assert net["unchecked"] >= 3, net   # each shard, in some process
    assert sum(served.requests.values()) == requests_before
