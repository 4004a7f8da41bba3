"""Remote sources' read-ahead in the loader, and its ``stats()["network"]``.

A loader whose pipeline reads a source from URLs (it has a ``remote``: tar shards or Parquet
files) in feedgpu's own order gets the shard read-ahead attached when it is made
(:func:`remote_read_ahead`): each pass runs a
:class:`~feedgpu.shard_ahead.ShardAhead` in the main process over the rank's view of the epoch
order (a resumed epoch: from its position on), and the epoch runner hands batch ``b`` to a worker
once its shards are in the node's shard cache, where the worker finds them through
``local_path`` (no download in the worker). The fetcher here, :class:`RemoteFetcher`, is the
source's ``remote.fetch_async(i)`` (checked against the file's indexed identity and checksum);
the time the runner blocks for a shard is "waiting for the network" (the balancer's
``add_network_wait``, and ``stats()["network"]["read_ahead_wait_s"]``).

A shard whose fetch fails for good ends the epoch with a
:class:`~feedgpu.errors.ShardFetchError` naming it before any of its samples is read, unless the
skip budget can hold every sample the epoch still reads from it
(:func:`~feedgpu.shard_ahead.fetch_batch`); then it is left to the worker, which meets the same
:class:`~feedgpu.errors.DownloadError` at once (the failure memo is shared through the shard
cache folder): its samples are named ``"bad shard"`` skips.

Sources without ``remote`` (local files, torch Datasets) get nothing attached and pay nothing.
With a pixel cache (``cache:``), a shard whose samples the cache all holds is not downloaded
(its fetch is done at once); a complete cache downloads nothing.

Counters: workers send their shard cache's :meth:`~feedgpu.remote.cache.ShardCache.counters`
with each batch's report (``BatchReport.network``); :func:`network_stats` sums the latest of
each process with the main process's own.
"""
from __future__ import annotations

import os
import socket
import threading
import warnings
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

_COUNTERS = ("bytes_downloaded", "hits", "misses", "retries", "evictions", "failures", "unchecked")
_host = socket.gethostname()


def process_counters(cache) -> tuple[str, dict]:
    """``("host:pid", cache.counters())``: what a worker's batch report carries."""
    return f"{_host}:{os.getpid()}", cache.counters()


class RemoteFetcher:
    """The :class:`~feedgpu.shard_ahead.Fetcher` of a loader whose source is read from URLs:
    shard names (``shard_names()``, index = the remote file) to ``remote.fetch_async(i)``. A
    fetched shard is pinned in the main process's shard cache until the read-ahead releases it
    (this process's own downloads do not evict it before its batches are read); a shard whose
    samples the loader's pixel cache all holds is not downloaded (its future is done at once,
    with None). ``cache_entry``: the loader's pixel cache entry now (None: no pixel cache, or
    none opened yet)."""

    def __init__(self, cache_entry: Callable[[], Any], remote, names, shard_of):
        self._cache_entry = cache_entry
        self.remote = remote
        self._id = {n: i for i, n in enumerate(names)}
        self._shard_of = shard_of
        self._lock = threading.Lock()
        self._pinned: set = set()
        self._memo = (None, None)   # (pixel cache state, per-shard: all samples cached)

    def _in_pixel_cache(self, i: int) -> bool:
        entry = self._cache_entry()
        if entry is None:
            return False
        state = (id(entry), entry.cached, len(entry.quarantined))
        if self._memo[0] != state:
            have = entry.part_of >= 0
            for index in entry.quarantined:
                have[index] = True
            n = len(self._id)
            total = np.bincount(self._shard_of, minlength=n)
            held = np.bincount(self._shard_of[have], minlength=n)
            self._memo = (state, held >= total)
        return bool(self._memo[1][i])

    def fetch_async(self, name) -> Future:
        i = self._id[name]
        if self._in_pixel_cache(i):
            fut: Future = Future()
            fut.set_result(None)
            return fut
        fut = self.remote.fetch_async(i)
        fut.add_done_callback(lambda f, name=name: self._done(name, f))
        return fut

    def _done(self, name, fut) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        with self._lock:
            if name in self._pinned:
                return
            self._pinned.add(name)
        self.remote.cache.pin(self.remote.urls[self._id[name]])

    def release(self, name) -> None:
        with self._lock:
            pinned = name in self._pinned
            self._pinned.discard(name)
        if pinned:
            self.remote.cache.unpin(self.remote.urls[self._id[name]])

    def close(self) -> None:
        """Unpin what it fetched, cancel downloads not started, let the shard cache's download
        threads end (a download in flight finishes first); the next pass starts them again."""
        with self._lock:
            names, self._pinned = list(self._pinned), set()
        for name in names:
            self.remote.cache.unpin(self.remote.urls[self._id[name]])
        self.remote.cache.close(wait=False)


class NetworkTotals:
    """A loader's network figures over its life: the read-ahead of each iteration (added when
    it closes, the live one on top) and the shard caches' counters of the main process."""

    def __init__(self, cache):
        self.cache = cache
        self.ahead = {"read_ahead_wait_s": 0.0, "read_ahead_waits": 0, "read_ahead_fetched": 0,
                      "read_ahead_failed": 0}
        self.warned_unchecked = False

    def add(self, st: dict) -> None:
        a = self.ahead
        a["read_ahead_wait_s"] += st["network_wait_s"]
        a["read_ahead_waits"] += st["waits"]
        a["read_ahead_fetched"] += st["fetched"]
        a["read_ahead_failed"] += st["failed"]

    def note_report(self, report) -> None:
        """A batch report arrived: the first time a worker says it served shards from the shard
        cache without checking the store (it could not be reached), say so in the main process (a
        worker's own warning goes to its stderr only)."""
        net = getattr(report, "network", None)
        if net is None or self.warned_unchecked:
            return
        proc, counters = net
        if counters.get("unchecked") and proc != f"{_host}:{os.getpid()}":
            self.warned_unchecked = True
            warnings.warn(f"feedgpu: the store could not be reached from a worker ({proc}); it serves shards "
                          f"verified earlier from the shard cache {self.cache.directory} without checking the store "
                          "for changes", stacklevel=5)

    def closed(self, ahead) -> None:
        """A pass's read-ahead ``ahead`` closed: add its figures and let the fetcher's downloads go."""
        self.add(ahead.stats())
        if isinstance(ahead.fetcher, RemoteFetcher):   # not a fetcher a user attached
            ahead.fetcher.close()


def remote_read_ahead(src, own_order: bool, cache_entry: Callable[[], Any]) -> tuple:
    """``(network, fetcher, options)`` for a loader over a source read from URLs (``src.remote``
    set): its :class:`NetworkTotals` and, in feedgpu's own order (``own_order``), a
    :class:`RemoteFetcher` and the shard cache's ``max_downloads`` in flight (with a user's
    sampler workers download what they read: no fetcher, no options).
    ``cache_entry``: see :class:`RemoteFetcher`."""
    remote = src.remote
    network = NetworkTotals(remote.cache)   # stats()["network"], read-ahead or not
    if not own_order:
        return network, None, {}
    fetcher = RemoteFetcher(cache_entry, remote, src.shard_names(), np.asarray(src.shard_of()))
    return network, fetcher, {"max_in_flight": remote.cache.max_downloads}


def network_stats(totals: NetworkTotals | None, workers: dict, live=None) -> dict | None:
    """``loader.stats()["network"]``, None for a loader without a source read from URLs
    (``totals`` None); ``workers``: each process's latest shard cache counters (``"host:pid"`` ->
    counters); ``live``: the running pass's read-ahead, if any. Keys:
    ``bytes_downloaded``, ``hits``, ``misses``, ``retries``, ``evictions``, ``failures``,
    ``unchecked`` (cached shards served while the store could not be reached) (summed
    over the main process and every worker's shard cache, workers as of their latest batch),
    ``network_wait_s`` (seconds the main process blocked for shards before handing a batch to a
    worker, ``read_ahead_wait_s``, plus seconds workers blocked downloading shards themselves,
    ``worker_wait_s``), ``read_ahead_waits`` (blocking waits), ``read_ahead_fetched`` and
    ``read_ahead_failed`` (shards, over all passes), ``processes`` (how many reported),
    ``cached_bytes`` (the shard cache folder now)."""
    if totals is None:
        return None
    main = f"{_host}:{os.getpid()}"
    per = dict(workers)
    per[main] = totals.cache.counters()   # inline batches report this process too: the latest wins
    out = {k: sum(int(c.get(k, 0)) for c in per.values()) for k in _COUNTERS}
    ahead = dict(totals.ahead)
    if live is not None:
        st = live.stats()
        ahead["read_ahead_wait_s"] += st["network_wait_s"]
        ahead["read_ahead_waits"] += st["waits"]
        ahead["read_ahead_fetched"] += st["fetched"]
        ahead["read_ahead_failed"] += st["failed"]
    worker_wait = sum(float(c.get("network_wait_s", 0.0)) for k, c in per.items() if k != main)
    out.update(ahead, worker_wait_s=worker_wait, network_wait_s=ahead["read_ahead_wait_s"] + worker_wait,
               processes=len(per), cached_bytes=totals.cache.stats()["cached_bytes"])
    return out
