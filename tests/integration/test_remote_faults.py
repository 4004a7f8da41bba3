"""Remote data when the network misbehaves, against a real HTTP server on loopback
(tests/servers.py) that is stopped, restarted, slowed, made to answer 404/500 or HTML, or
changes its files: an outage served from the shard cache, errors named at open, changed bytes
never served, a server that stays down ending the epoch in bounded time.

Retry back-offs are injected (``backoff_s``): a test that must not wait on the back-off sets
one larger than its time bound, so the bound holds on a busy machine and a regression shows."""
from __future__ import annotations

import hashlib
import json
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
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_an_outage_after_a_complete_epoch_trains_from_the_shard_cache(data, served, tmp_path, kind, workers,
                                                                       persistent):
    # a back-off far over the bound: waiting on it even once fails the time bound below
    src = open_source(kind, index(served, kind), cache_in(tmp_path / "c", backoff_s=30.0, retries=4))
    ref_loader = DataLoader(pipe(local(data, kind), num_workers=workers))
    reference, second = clone_all(ref_loader), clone_all(ref_loader)   # epochs 0 and 1
    loader = DataLoader(pipe(src, num_workers=workers, persistent_workers=persistent))
    assert batches_equal(clone_all(loader), reference)
    served.stop()   # the server goes down for good
    requests_before = sum(served.requests.values())
    if not persistent:   # new workers (for 0 workers, a new process: the source unpickled)
        again = src if workers else pickle.loads(pickle.dumps(src))
        loader = DataLoader(pipe(again, num_workers=workers, persistent_workers=False))
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = clone_all(loader)
    assert time.monotonic() - t0 < 25.0, "no retry back-off for a verified cached shard"
    assert batches_equal(got, second if persistent else reference), "every sample once, in order"
    said = [str(w.message) for w in rec if "reached" in str(w.message)]
    if not persistent:   # processes that had not checked the store yet say why they do not
        assert len(said) == 1, said
        assert loader.stats()["network"]["unchecked"] >= 3   # each shard, in some process
    else:                # persistent workers checked the store in epoch 1: nothing to say
        assert said == []
    assert sum(served.requests.values()) == requests_before


# -- fail fast, by name, at open ---------------------------------------------------------------------
def slept_cache(path, retries=2, backoff_s=1.0, **kw):
    """A cache whose back-off sleeps are recorded, not slept (the bound is their sum)."""
    slept = []
    c = ShardCache(path, retries=retries, backoff_s=backoff_s, sleep=slept.append, **kw)
    c.slept = slept
    return c


@pytest.mark.parametrize("kind", ["tar", "pq"])
def test_unreadable_files_at_open_are_one_error_naming_each_url_and_cause(served, tmp_path, kind):
    urls = files(served, kind)
    typo = urls[0].replace("00000", "0000x")              # 404
    dns = f"http://feedgpu-nohost.invalid/{kind}/x"       # DNS
    folder = f"{served.url}/{kind}"                       # a folder URL: the server's HTML listing
    served.html.add(kind)
    served.status[urls[2].rpartition(f"{served.url}/")[2]] = 500
    cache = slept_cache(tmp_path / "c")
    with pytest.raises(Exception) as e:
        open_source(kind, [urls[1], typo, dns, folder, urls[2]], cache)
    msg = str(e.value)
    assert type(e.value).__name__ == "SourceError", msg
    assert "4 of 5 file(s) cannot be read" in msg, msg
    assert f"{typo}: request failed after 1 attempt(s): not found (HTTP 404)" in msg, "a 404 is not retried"
    assert f"{dns}: request failed after 3 attempt(s): DNS lookup failed" in msg
    assert f"{folder}: an HTML page (a server's folder listing or error page), not a data file" in msg
    assert "_index.json" in msg
    assert f"{urls[2]}: request failed after 3 attempt(s): the server answered HTTP 500" in msg
    assert urls[1] + ":" not in msg


@pytest.mark.parametrize("kind", ["tar", "pq"])
def test_a_skip_budget_of_whole_files_opens_without_them_each_named(data, served, tmp_path, kind):
    urls = files(served, kind)
    served.status[urls[1].rpartition(f"{served.url}/")[2]] = 404
    with pytest.raises(Exception, match="1 of 3 file"):
        open_source(kind, urls, slept_cache(tmp_path / "c"), max_bad_files=0)
    with pytest.warns(UserWarning, match="bad shard"):
        src = open_source(kind, urls, slept_cache(tmp_path / "c"), max_bad_files=1)
    assert src.rejected == [(urls[1], "bad shard")], "one entry per file, tar and Parquet alike"
    assert len(src) == N - 10


@pytest.mark.parametrize("kind", ["tar", "pq"])
def test_an_index_listing_a_missing_file_and_a_brace_pattern_naming_one_are_errors(served, tmp_path, kind):
    ext = KINDS[kind][1]
    missing = sorted((served.root / kind).glob(f"*{ext}"))[2]
    missing.unlink()
    url = f"{served.url}/{kind}/{missing.name}"
    with pytest.raises(Exception, match=f"{url}: request failed after 1 attempt.*not found"):
        open_source(kind, index(served, kind), slept_cache(tmp_path / "c"))
    stem = missing.name[:-len(ext) - 1]
    with pytest.raises(Exception, match=f"{url}: request failed after 1 attempt.*not found"):
        open_source(kind, f"{served.url}/{kind}/{stem}{{0..2}}{ext}", slept_cache(tmp_path / "c"))


@pytest.mark.parametrize("kind", ["tar", "pq"])
def test_a_server_down_at_open_fails_within_one_retry_chain(served, tmp_path, kind):
    served.stop()
    cache = slept_cache(tmp_path / "c", retries=3, backoff_s=1.0)
    with pytest.raises(Exception, match=r"cannot read the index file .*after 4 attempt\(s\): connection refused"):
        open_source(kind, index(served, kind), cache)
    assert cache.slept == [1.0, 2.0, 4.0]
    cache = slept_cache(tmp_path / "c2", retries=3, backoff_s=1.0)
    with pytest.raises(Exception, match="(?s)3 of 3 file.*connection refused") as e:
        open_source(kind, files(served, kind), cache)
    assert type(e.value).__name__ == "SourceError"
    # one retry chain's back-off, then the host is known down: the other files are tried once
    assert sum(cache.slept) == cache.retry_budget_s() == 7.0


@pytest.mark.parametrize("kind", ["tar", "pq"])
def test_a_5xx_at_open_is_retried_as_reads_are(data, served, tmp_path, kind):
    served.flaky[f"{kind}/_index.json"] = 2             # the index file: twice 503, then served
    first = sorted((served.root / kind).glob(f"*{KINDS[kind][1]}"))[0].name
    served.fail[f"{kind}/{first}"] = 2                  # ranged reads (Parquet's footer, a shard): twice 503
    cache = slept_cache(tmp_path / "c", retries=3)
    src = open_source(kind, index(served, kind), cache)
    assert len(src) == N and not src.rejected
    assert cache.slept[:2] == [1.0, 2.0] and cache.stats()["retries"] >= 2
    if kind == "pq":
        assert served.requests[("GET", f"{kind}/_index.json")] == 3


def test_parquet_on_a_server_without_byte_ranges_names_it(served, tmp_path):
    served.ranges = False
    with pytest.raises(Exception, match="does not serve byte ranges.*server with range requests") as e:
        open_source("pq", index(served, "pq"), slept_cache(tmp_path / "c"))
    assert type(e.value).__name__ == "SourceError"
    # a tar source needs no ranges: each shard is downloaded whole
    src = open_source("tar", index(served, "tar"), slept_cache(tmp_path / "t"))
    assert len(src) == N and src.read(N - 1).payload


@pytest.mark.parametrize("kind", ["tar", "pq"])
def test_a_checksum_mismatch_is_tried_twice_at_most_then_named(served, tmp_path, kind):
    name = f"{kind}/" + sorted((served.root / kind).glob(f"*{KINDS[kind][1]}"))[0].name
    src = open_source(kind, index(served, kind), slept_cache(tmp_path / "c", retries=4))
    before = served.gets(name)
    served.corrupt[name] = 10**6   # a flipped byte under a consistent ETag: the store's bytes are wrong
    from feedgpu.errors import DownloadError

    with pytest.raises(DownloadError, match="after 2 attempt.*checksum mismatch: SHA-256"):
        src.remote.local(0)
    assert served.gets(name) - before == 2, "downloaded twice, not once per retry"


# -- changed bytes are never served: detection that does not depend on the server's headers ---------
def rewrite_same_size_keeping_mtime(path: Path, at: int) -> bytes:
    """Flip a byte at ``at`` (inside a member's data), size and mtime kept (cp -p, rsync -t)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    import os

    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return bytes(data)


def test_no_etag_is_said_once_at_open_unless_content_is_checked(served, tmp_path):
    served.etag = False
    with pytest.warns(UserWarning, match=r"3 of 3 file\(s\) come without an ETag.*size and Last-Modified only") as rec:
        open_source("tar", files(served, "tar"), slept_cache(tmp_path / "a"))
    assert sum("without an ETag" in str(w.message) for w in rec) == 1
    served.last_modified = False
    with pytest.warns(UserWarning, match="seen by size only"):
        open_source("pq", files(served, "pq"), slept_cache(tmp_path / "b"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the index's SHA-256s, or verify="content", check the content
        open_source("tar", index(served, "tar"), slept_cache(tmp_path / "c"))
        open_source("pq", files(served, "pq"), slept_cache(tmp_path / "d", verify="content"))


def test_a_same_size_rewrite_keeping_last_modified_is_never_served_under_a_new_index(served, tmp_path):
    served.etag = False   # the server has Last-Modified only
    old = open_source("tar", index(served, "tar"), slept_cache(tmp_path / "c"))
    before = bytes(old.read(0).payload)
    shard = served.root / "tar/shard-000000.tar"
    new = rewrite_same_size_keeping_mtime(shard, int(old.offsets[0]) + 100)
    doc = json.loads((served.root / "tar/_index.json").read_text())
    doc["files"][0]["sha256"] = hashlib.sha256(new).hexdigest()   # the dataset's owner wrote a new index
    (served.root / "tar/_index.json").write_text(json.dumps(doc))
    fresh = open_source("tar", index(served, "tar"), slept_cache(tmp_path / "c"))   # the same shard cache
    got = bytes(fresh.read(0).payload)
    assert got != before and got == new[int(old.offsets[0]):int(old.offsets[0]) + int(old.sizes[0])]


def test_a_same_size_rewrite_is_caught_by_verify_content(served, tmp_path):
    served.etag = False
    urls = files(served, "tar")
    with pytest.warns(UserWarning, match="without an ETag"):
        old = open_source("tar", urls, slept_cache(tmp_path / "c"))
    before = bytes(old.read(0).payload)
    new = rewrite_same_size_keeping_mtime(served.root / "tar/shard-000000.tar", int(old.offsets[0]) + 100)
    with pytest.warns(UserWarning, match="without an ETag"):   # identity only: the headers cannot tell
        same = open_source("tar", urls, slept_cache(tmp_path / "c"))
    assert bytes(same.read(0).payload) == before
    checked = open_source("tar", urls, slept_cache(tmp_path / "c", verify="content"))   # a new run
    want = new[int(old.offsets[0]):int(old.offsets[0]) + int(old.sizes[0])]
    assert bytes(checked.read(0).payload) == want != before
    by_option = TarShardSource(urls, cache_dir=tmp_path / "v", verify="content")   # the source's option
    assert by_option.remote.cache.verify == "content" and bytes(by_option.read(0).payload) == want
    # the store's bytes no longer match the index that describes them: named, never served
    idx = open_source("tar", index(served, "tar"), slept_cache(tmp_path / "c", retries=4, verify="content"))
    from feedgpu.errors import SampleError

    with pytest.raises(SampleError, match="after 2 attempt.*checksum mismatch"):
        idx.read(0)


def test_the_index_sha256_wins_over_the_headers_for_any_file(served, tmp_path):
    served.etag = False
    url = files(served, "pq")[0]
    path = served.root / "pq" / url.rpartition("/")[2]
    cache = slept_cache(tmp_path / "c")
    expect = cache.stat(url)
    old = Path(cache.local_path(url, expect)).read_bytes()
    new = rewrite_same_size_keeping_mtime(path, len(old) // 2)
    again = slept_cache(tmp_path / "c")   # a new run
    assert Path(again.local_path(url, again.stat(url))).read_bytes() == old, "headers alone cannot tell"
    third = slept_cache(tmp_path / "c")
    got = Path(third.local_path(url, third.stat(url), sha256=hashlib.sha256(new).hexdigest())).read_bytes()
    assert got == new


# -- a server that stays down ends the epoch by name, in bounded time, with no duplicate -----------
@pytest.mark.parametrize("kind", ["tar", "pq"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_server_that_stays_down_ends_the_epoch_by_name_in_bounded_time(data, served, tmp_path, kind, workers):
    from feedgpu.errors import DownloadError, ShardFetchError

    last = f"{kind}/" + sorted((served.root / kind).glob(f"*{KINDS[kind][1]}"))[2].name
    served.delay[last] = 5.0   # the last file is still being sent when the server goes down
    cache = cache_in(tmp_path / "c", retries=3, backoff_s=0.5)   # 3.5 s of back-off at most
    src = open_source(kind, index(served, kind), cache)
    reference = clone_all(DataLoader(pipe(local(data, kind), num_workers=workers, shuffle=False)))
    loader = DataLoader(pipe(src, num_workers=workers, shuffle=False))
    it = iter(loader)
    got = [next(it)]
    served.stop()
    t0 = time.monotonic()
    with pytest.raises(ShardFetchError, match=f"{last}.*connection.*skip budget") as e:
        for b in it:
            got.append(b)
    elapsed = time.monotonic() - t0
    assert isinstance(e.value.__cause__, DownloadError)
    # one retry chain's back-off (the others are tried once: the host is known down), plus the
    # time the 5 s delay needs to be cut, plus a margin for a busy machine
    assert elapsed < cache.retry_budget_s() + 15.0, elapsed
    assert batches_equal([b for b in got], reference[:4]), "the samples before it, each once, no spare"


# -- no orphans --------------------------------------------------------------------------------------
SLOW_DATASET = '''
import os, time
import torch


class Slow(torch.utils.data.Dataset):
    """Each item waits as a sample in a long network retry chain would."""

    def __init__(self, marks):
        self.marks = marks

    def __len__(self):
        return 8

    def __getitem__(self, i):
        open(os.path.join(self.marks, str(os.getpid())), "w").close()
        time.sleep(300)
        return torch.zeros(1)
'''


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)   # a zombie
    except FileNotFoundError:
        return True


def test_workers_busy_with_a_task_exit_when_their_main_process_dies(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO

    (tmp_path / "slowds.py").write_text(SLOW_DATASET)
    marks = tmp_path / "marks"
    marks.mkdir()
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from slowds import Slow; "
            "from feedgpu import DataLoader; "
            f"next(iter(DataLoader(Slow({str(marks)!r}), batch_size=1, num_workers=2)))")
    main = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.monotonic() + 60
        while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(p.name) for p in marks.iterdir()]
        assert len(workers) == 2, "both workers are inside a task"
        main.send_signal(signal.SIGKILL)   # the main process dies; the workers' tasks run 300 s more
        main.wait(10)
        deadline = time.monotonic() + 20
        while not all(_gone(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in workers), "no orphan keeps working for a dead main process"
    finally:
        main.kill()
        for p in marks.iterdir():
            try:
                os.kill(int(p.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- what workers retried and gave up on is counted -------------------------------------------------
@pytest.mark.parametrize("kind", ["tar", "pq"])
def test_network_stats_count_what_workers_retried_and_failed_in_failing_batches(served, tmp_path, kind):
    import torch

    from feedgpu.errors import SkipBudgetExceeded

    name = f"{kind}/" + sorted((served.root / kind).glob(f"*{KINDS[kind][1]}"))[1].name
    src = open_source(kind, index(served, kind), cache_in(tmp_path / "c", retries=2))
    served.fail[name] = 10**6   # every download of the second file: 503
    # a user's sampler: no read-ahead in the main process, the workers download themselves
    loader = DataLoader(pipe(src, num_workers=2, shuffle=False, max_skipped=None),
                        sampler=torch.utils.data.SequentialSampler(range(N)))
    with warnings.catch_warnings(), pytest.raises(SkipBudgetExceeded):
        warnings.simplefilter("ignore", SkippedSampleWarning)
        list(loader)   # batch 2 is all of the second file: no spare can stand in, the batch fails
    net = loader.stats()["network"]
    assert net["failures"] >= 1 and net["retries"] >= 2, net


def test_only_shards_not_cached_wait_on_the_network_during_an_outage(data, served, tmp_path):
    from feedgpu.errors import ShardFetchError

    cache = cache_in(tmp_path / "c", retries=3, backoff_s=0.5)
    src = open_source("tar", index(served, "tar"), cache)
    reference = clone_all(DataLoader(pipe(local(data, "tar"), num_workers=2, shuffle=False)))
    assert batches_equal(clone_all(DataLoader(pipe(src, num_workers=2, shuffle=False))), reference)
    (tmp_path / "c" / f"{ShardCache.key(files(served, 'tar')[2])}.data").unlink()   # evicted
    served.stop()
    fresh = pickle.loads(pickle.dumps(src))   # a new process: nothing checked in it yet
    got = []
    t0 = time.monotonic()
    with warnings.catch_warnings(), pytest.raises(ShardFetchError, match="shard-000002.tar.*connection refused"):
        warnings.simplefilter("ignore")
        for b in DataLoader(pipe(fresh, num_workers=2, shuffle=False)):
            got.append(b)
    assert time.monotonic() - t0 < cache.retry_budget_s() + 15.0
    assert batches_equal(got, reference[:4]), "the cached shards' samples, each once; then the named error"


def test_a_failure_memo_is_shared_by_the_processes_of_a_run_not_by_a_new_run(served, tmp_path):
    from feedgpu.errors import DownloadError

    url = files(served, "tar")[1]
    name = url.rpartition(f"{served.url}/")[2]
    served.fail[name] = 10**6
    cache = slept_cache(tmp_path / "c", retries=2)
    with pytest.raises(DownloadError, match="after 3 attempt"):
        cache.local_path(url)
    gets = served.gets(name)
    worker = pickle.loads(pickle.dumps(cache))   # a worker of the same loader: the same run
    with pytest.raises(DownloadError, match="after 3 attempt"):
        worker.local_path(url)
    assert served.gets(name) == gets, "no second retry chain in a worker"
    served.fail.clear()
    assert Path(slept_cache(tmp_path / "c").local_path(url)).is_file(), "a new run tries again"


def test_a_server_back_within_the_back_off_costs_one_stall_and_nothing_else(served, tmp_path):
    import threading

    url = files(served, "tar")[0]
    cache = cache_in(tmp_path / "c", retries=4, backoff_s=0.5)   # 7.5 s of back-off
    served.stop()
    threading.Timer(1.0, served.start).start()   # back 1 s later
    assert Path(cache.local_path(url)).read_bytes() == (served.root / "tar/shard-000000.tar").read_bytes()
    st = cache.stats()
    assert st["failures"] == 0 and 1 <= st["retries"] <= 3


@pytest.mark.parametrize("kind", ["tar", "pq"])
@pytest.mark.parametrize("shuffle", [True, "shards"])
def test_a_server_down_before_the_first_batch_is_named_within_one_retry_chain(served, tmp_path, kind, shuffle):
    from feedgpu.errors import ShardFetchError

    cache = cache_in(tmp_path / "c", retries=3, backoff_s=0.5)
    src = open_source(kind, index(served, kind), cache)   # opened; nothing downloaded yet for Parquet images
    served.stop()
    loader = DataLoader(pipe(src, num_workers=2, shuffle=shuffle))
    t0 = time.monotonic()
    with warnings.catch_warnings(), pytest.raises(ShardFetchError, match="connection refused.*skip budget"):
        warnings.simplefilter("ignore")
        next(iter(loader))
    assert time.monotonic() - t0 < cache.retry_budget_s() + 15.0
