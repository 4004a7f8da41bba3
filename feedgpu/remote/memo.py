"""A shard cache's memory of failures: failed URLs (in this process and, through the cache
folder, in every process of the same run) and hosts that could not be reached.

A failed URL's memo is ``<key>.fail`` in the folder (JSON: the run's token, when, the error),
written when a retry chain gives up and removed when the URL is read again; it holds for
``failure_ttl_s`` seconds, and does not expire while a retry chain of this process is running.
Only processes of the same run (the :class:`~feedgpu.remote.cache.ShardCache` object and its
copies in workers, which share its ``run`` token) read each other's memos: a new loader tries
again.

A host is "offline" for ``failure_ttl_s`` seconds after a retry chain ended on a fault that
means it could not be reached; while it is, a request to it is tried once, without back-off,
and a verified cached copy is served without asking it.
"""
from __future__ import annotations

import json
import os
import threading
import time
import warnings
from contextlib import contextmanager

from ..errors import DownloadError
from .faults import host
from .urls import Identity
from .folder import remove


class FailureMemo:
    """The failure memos of one :class:`~feedgpu.remote.cache.ShardCache` (module docstring)."""

    def __init__(self, cache):
        self.cache = cache
        self._lock = threading.Lock()
        self._failed: dict[str, tuple[DownloadError, float]] = {}
        self._offline: dict[str, float] = {}   # host -> when a retry chain found it unreachable
        self._chains = 0                       # retry chains running in this process
        self._warned_offline = False

    @contextmanager
    def chain(self):
        """Held while a retry chain runs (memos do not expire meanwhile)."""
        with self._lock:
            self._chains += 1
        try:
            yield
        finally:
            with self._lock:
                self._chains -= 1

    def offline(self, url: str) -> bool:
        at = self._offline.get(host(url))
        return at is not None and self.cache.clock() - at < self.cache.failure_ttl_s

    def went_offline(self, url: str) -> None:
        self._offline[host(url)] = self.cache.clock()

    def online(self, url: str) -> None:
        self._offline.pop(host(url), None)

    def remember(self, url: str, e: DownloadError) -> None:
        self._failed[url] = (e, self.cache.clock())
        path = self.cache._path(url, "fail")
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"run": self.cache.run, "at": time.time(), "message": str(e), "attempts": e.attempts,
                           "kind": e.kind}, f)
            os.replace(tmp, path)
        except OSError:
            remove(tmp)

    def forget(self, url: str) -> None:
        self._failed.pop(url, None)
        path = self.cache._path(url, "fail")
        if os.path.exists(path):
            remove(path)

    def failure(self, url: str) -> DownloadError | None:
        """The remembered failure of ``url`` in this run (this process's, or another's through
        the folder) while it lasts, else None."""
        ttl = self.cache.failure_ttl_s
        mine = self._failed.get(url)
        if mine is not None and (self._chains > 0 or self.cache.clock() - mine[1] < ttl):
            return mine[0]
        try:
            with open(self.cache._path(url, "fail"), encoding="utf-8") as f:
                d = json.load(f)
            if d["run"] == self.cache.run and (self._chains > 0 or time.time() - float(d["at"]) < ttl):
                return DownloadError(d["message"], url, int(d["attempts"]), d.get("kind", ""))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def serve_cached(self, url: str, expect: Identity | None, sha256: str | None, why: str) -> bool:
        """Serve the cached entry of ``url`` without the store (it cannot be reached: ``why``)
        when it is verified: its recorded identity is ``expect`` or its SHA-256 is ``sha256``."""
        c = self.cache
        meta, recorded = c._read_meta(url)
        try:
            have = os.path.getsize(c._path(url, "data"))
        except OSError:
            return False
        if meta is None or meta.url != url or have != meta.size:
            return False
        if sha256 is not None and recorded is not None and recorded != sha256:
            return False   # the index's SHA-256 wins
        if not ((sha256 is not None and recorded == sha256) or (expect is not None and expect.same(meta))):
            return False
        c._touch(url)
        c._count("hits")
        c._count("unchecked")
        if not self._warned_offline:
            self._warned_offline = True
            warnings.warn(f"feedgpu: {host(url)} cannot be reached ({why}); serving shards verified earlier from "
                          f"the shard cache {c.directory} without checking the store for changes (first: {url})",
                          stacklevel=3)
        return True
