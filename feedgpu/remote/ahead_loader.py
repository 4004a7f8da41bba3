"""The loader's read-ahead of remote shards, and its ``stats()["network"]``.

For a pipeline whose source is read from URLs (it has a ``remote``: tar shards or Parquet
files), each iteration of the loader runs a :class:`~feedgpu.shard_ahead.ShardAhead` in the main
process over the rank's view of the epoch order (a resumed epoch: from its position on), with the
source's ``remote.fetch_async`` as the fetcher. The epoch runner (:mod:`feedgpu.epoch`) asks
:meth:`LoaderAhead.ready` before it dispatches batch ``b`` to a worker: the batch goes out once
every shard it reads is in the node's shard cache, where the worker finds it through
``local_path`` (no download in the worker). While other batches are in flight a batch that is
not ready waits its turn (the runner dispatches it later); only when the runner has nothing in
flight does it block, and that time is "waiting for the network": fed to the balancer
(:meth:`Autoscaler.add_network_wait <feedgpu.exec.autoscale.Autoscaler.add_network_wait>`) and
counted in ``stats()["network"]["read_ahead_wait_s"]``.

A shard whose fetch fails is not a failure here: the batch is dispatched, and the worker meets
the same :class:`~feedgpu.errors.DownloadError` reading it, so its samples are the named
``"bad shard"`` skips they are without read-ahead (within the skip budget).

Sources without ``remote`` (local files, torch Datasets) get no read-ahead and pay nothing:
:func:`start` returns None, and the runner's checks are ``if ahead is not None``.

Counters: workers send their shard cache's :meth:`~feedgpu.remote.cache.ShardCache.counters`
with each batch's report (``BatchReport.network``); :func:`network_stats` sums the latest of
each process with the main process's own.
"""
from __future__ import annotations

import os
import socket
import threading

import numpy as np

from ..errors import ShardFetchError

_COUNTERS = ("bytes_downloaded", "hits", "misses", "retries", "evictions", "failures")
_host = socket.gethostname()


def process_counters(cache) -> tuple[str, dict]:
    """``("host:pid", cache.counters())``: what a worker's batch report carries."""
    return f"{_host}:{os.getpid()}", cache.counters()


class _SourceFetcher:
    """The :class:`~feedgpu.shard_ahead.Fetcher` of a source read from URLs: shard names (its
    ``shard_names()``, index = the remote file) to ``remote.fetch_async(i)``. A fetched shard is
    pinned in the main process's cache until the read-ahead releases it, so this process's own
    downloads do not evict a shard before its batches are read."""

    def __init__(self, remote, names):
        self.remote = remote
        self._id = {n: i for i, n in enumerate(names)}
        self._lock = threading.Lock()
        self.landed: set = set()     # names fetched (or failed), not released
        self._pinned: set = set()

    def fetch_async(self, name):
        fut = self.remote.fetch_async(self._id[name])
        fut.add_done_callback(lambda f, name=name: self._done(name, f))
        return fut

    def _done(self, name, fut) -> None:
        ok = not fut.cancelled() and fut.exception() is None
        with self._lock:
            self.landed.add(name)
            if ok and name not in self._pinned:
                self._pinned.add(name)
                self.remote.cache.pin(self.remote.urls[self._id[name]])

    def release(self, name) -> None:
        with self._lock:
            self.landed.discard(name)
            pinned = name in self._pinned
            self._pinned.discard(name)
        if pinned:
            self.remote.cache.unpin(self.remote.urls[self._id[name]])

    def close(self) -> None:
        with self._lock:
            names, self._pinned = list(self._pinned), set()
        for name in names:
            self.remote.cache.unpin(self.remote.urls[self._id[name]])


class LoaderAhead:
    """One iteration's read-ahead (see the module docstring).

    Args:
        view: the rank's :class:`~feedgpu.sampling.EpochShard` (``order.view(epoch, start)``).
        source: the pipeline's source (with ``remote``, ``shard_of()``, ``shard_names()``).
        on_wait: called with the seconds each blocking wait took (the balancer's
            ``add_network_wait``), or None.
        max_in_flight: shard downloads requested at once (int >= 1; default: the shard cache's
            ``max_downloads``).
    """

    def __init__(self, view, source, on_wait=None, max_in_flight: int | None = None):
        from ..shard_ahead import ShardAhead

        remote = source.remote
        self.view, self.bs = view, view.order.batch_size
        self.fetcher = _SourceFetcher(remote, source.shard_names())
        self.ahead = ShardAhead.for_view(view, source, self.fetcher, on_wait=on_wait,
                                         max_in_flight=max_in_flight or remote.cache.max_downloads)
        self._names = self.ahead.names
        self._done: set[int] = set()

    def _span(self, b: int) -> tuple[int, int]:
        k = b - self.view.first
        return k * self.bs, min(len(self.view.indices), (k + 1) * self.bs)

    def ready(self, b: int, block: bool = False) -> bool:
        """Whether batch ``b``'s shards are all fetched (or failed: the worker reports them);
        ``block``: wait until they are (then True). A batch outside the view is ready."""
        lo, hi = self._span(b)
        if lo >= hi:
            return True
        firsts = np.unique(self.ahead.seq[lo:hi], return_index=True)[1] + lo
        landed = self.fetcher.landed
        if not block and all(self._names[int(self.ahead.seq[p])] in landed for p in firsts.tolist()):
            return True
        if not block:
            return False
        for p in firsts.tolist():
            try:
                self.ahead.acquire(p)
            except ShardFetchError:   # the worker meets the same failure: "bad shard" skips
                pass
        return True

    def done(self, b: int) -> None:
        """Batch ``b`` was delivered or failed: its reads are done (once per batch)."""
        if b in self._done:
            return
        self._done.add(b)
        lo, hi = self._span(b)
        for p in range(lo, hi):
            self.ahead.release(p)

    def stats(self) -> dict:
        """The :meth:`ShardAhead.stats <feedgpu.shard_ahead.ShardAhead.stats>` of this iteration."""
        return self.ahead.stats()

    def close(self) -> None:
        """Stop the read-ahead thread, unpin what it fetched, cancel downloads not started and
        let the shard cache's download threads end (downloads in flight finish first)."""
        self.ahead.close()
        self.fetcher.close()
        self.fetcher.remote.cache.close(wait=False)   # its threads end once their download is done


class NetworkTotals:
    """A loader's network figures over its life: the read-ahead of each iteration (added when
    it closes, the live one on top) and the shard caches' counters of the main process."""

    def __init__(self, cache):
        self.cache = cache
        self.ahead = {"read_ahead_wait_s": 0.0, "read_ahead_waits": 0, "read_ahead_fetched": 0,
                      "read_ahead_failed": 0}
        self.live: LoaderAhead | None = None

    def add(self, st: dict) -> None:
        a = self.ahead
        a["read_ahead_wait_s"] += st["network_wait_s"]
        a["read_ahead_waits"] += st["waits"]
        a["read_ahead_fetched"] += st["fetched"]
        a["read_ahead_failed"] += st["failed"]


def start(loader, order, view) -> LoaderAhead | None:
    """The read-ahead of one iteration of ``loader`` over ``view``, or None: no pipeline, a
    source without ``remote``, or an order that is not feedgpu's (a user's sampler)."""
    from ..sampling import ShardedOrder

    pipe = loader.pipeline
    remote = getattr(pipe.source, "remote", None) if pipe is not None else None
    if remote is None or not isinstance(order, ShardedOrder):
        return None
    totals = loader._network
    if totals is None:
        totals = loader._network = NetworkTotals(remote.cache)
    scaler = loader._autoscaler
    ahead = LoaderAhead(view, pipe.source, on_wait=scaler.add_network_wait if scaler is not None else None)
    totals.live = ahead
    return ahead


def stop(loader, ahead: LoaderAhead | None) -> None:
    """Close ``ahead`` and add its figures to the loader's totals (idempotent)."""
    if ahead is None:
        return
    ahead.close()
    totals = loader._network
    if totals is not None and totals.live is ahead:
        totals.add(ahead.stats())
        totals.live = None


def network_stats(loader) -> dict | None:
    """``loader.stats()["network"]``, None for a loader that never read a remote source:
    ``bytes_downloaded``, ``hits``, ``misses``, ``retries``, ``evictions``, ``failures`` (summed
    over the main process and every worker's shard cache, workers as of their latest batch),
    ``network_wait_s`` (seconds the loader's main process blocked for shards before dispatching a
    batch, ``read_ahead_wait_s``, plus seconds workers blocked downloading shards themselves,
    ``worker_wait_s``), ``read_ahead_waits`` (blocking waits), ``read_ahead_fetched`` and
    ``read_ahead_failed`` (shards), ``processes`` (how many reported), ``cached_bytes`` (the
    shard cache folder now)."""
    totals = loader._network
    if totals is None:
        return None
    main = f"{_host}:{os.getpid()}"
    per = dict(loader._stats.network)
    per[main] = totals.cache.counters()   # inline batches report this process too: the latest wins
    out = {k: sum(int(c.get(k, 0)) for c in per.values()) for k in _COUNTERS}
    ahead = dict(totals.ahead)
    if totals.live is not None:
        st = totals.live.stats()
        ahead["read_ahead_wait_s"] += st["network_wait_s"]
        ahead["read_ahead_waits"] += st["waits"]
        ahead["read_ahead_fetched"] += st["fetched"]
        ahead["read_ahead_failed"] += st["failed"]
    worker_wait = sum(float(c.get("network_wait_s", 0.0)) for k, c in per.items() if k != main)
    out.update(ahead, worker_wait_s=worker_wait, network_wait_s=ahead["read_ahead_wait_s"] + worker_wait,
               processes=len(per), cached_bytes=totals.cache.stats()["cached_bytes"])
    return out
