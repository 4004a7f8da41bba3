"""The node-local shard cache: remote files downloaded whole into a directory on a disk budget.

One directory serves every rank and worker of a node: each file has a lock file (``fcntl``), so
one process downloads it and the others wait, then read the same local copy. For a URL the
directory holds ``<key>.data`` (the file), ``<key>.json`` (its remote identity: URL, size, ETag,
modification time; its modification time is the entry's last use) and ``<key>.lock``, with
``<key>`` a digest of the URL.

A download goes to ``<key>.data.part-<pid>-<thread>`` (sized to the file up front, so the budget
counts downloads in flight), in ranged reads of ``chunk_bytes``; it is checked (byte count, the
store's identity before and after, the index file's SHA-256 where there is one, and the ETag
where the store's ETag is a plain MD5: S3 and GCS single-part objects), then renamed into place.
A failed check is retried like a network error, with exponential backoff (a SHA-256 that does
not match is tried once more, no further); the bytes are never served. Faults that cannot
heal (HTTP 404, 403, a server without byte ranges) are not retried
(:mod:`~feedgpu.remote.faults`). After the last try a :class:`~feedgpu.errors.DownloadError`
names the URL and the cause, and the failure is remembered for ``failure_ttl_s`` seconds in the
folder (``<key>.fail``) for every process of the same run (the cache object and its copies in
workers), so a loader's workers do not each run the retry chain again; a memo does not expire
while a retry chain of this process runs. ``ENOSPC`` while writing, or a budget too small for the
file, raises :class:`~feedgpu.errors.CacheFullError` with the partial file removed.

An outage: a host whose retry chain ended with a fault that means the store could not be reached
(refused, DNS, timeout, reset, HTTP 5xx) is remembered for ``failure_ttl_s`` seconds; while it
is, a request to it is tried once, without back-off. A cached entry that is verified (its recorded
identity is the one the caller indexed, ``expect``, or its recorded SHA-256 is the index's) is
served when the store cannot be reached, instead of waiting on the network: counted in
``unchecked`` and named in one warning per process, since a change on the store is not seen
then.

Eviction: least recently used first, when a download needs room under ``budget_bytes``. Files
this process pins (:meth:`ShardCache.pin`: a source holds one while a shard is open) and files
another process is downloading are never evicted. A file another process has open may be
evicted: POSIX keeps its data readable through the open descriptor, and the space comes back
when it is closed.

A changed remote file: a cached entry is served only while its recorded identity equals the
store's, checked by each process when it first uses the entry (and again after
``revalidate_s`` seconds, when set); a different identity is downloaded again. When the caller
says what it expects (``expect=``, the identity the source was indexed on) and the store now
holds something else, :class:`~feedgpu.errors.RemoteChangedError` is raised instead. Every
download records the file's SHA-256: where the caller gives the index file's (``sha256=``), an
entry whose recorded SHA-256 differs is never served, whatever the store's headers say (a
same-size rewrite that keeps Last-Modified on a server without ETags). ``verify="content"``
downloads each cached entry again once per run (the first process of the run to use it) and
keeps no member table saved under the headers, for stores whose headers cannot show a change.
"""
from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import os
import re
import threading
import time
import uuid
from collections import Counter

from ..errors import CacheFullError, ConfigError, DownloadError, RemoteChangedError, RemoteError
from .faults import Mismatch as _Mismatch
from .faults import classify, unreachable_kind
from .memo import FailureMemo
from .folder import entries, locked, make_room, remove
from .urls import Identity, filesystem, identity_from_info, scheme, store_path

_MD5 = re.compile(r"[0-9a-f]{32}")
VERIFY = ("identity", "content")


def _parse_budget(value) -> int | None:
    from ..cache.settings import parse_size

    if isinstance(value, bool):
        raise ConfigError(f"cache_budget: expected bytes or a size such as '200GiB', got {value!r}")
    try:
        n = parse_size(value)
    except ConfigError as e:
        raise ConfigError(f"cache_budget: {e}") from None
    if n is not None and n <= 0:
        raise ConfigError(f"cache_budget: must be positive, got {value!r}")
    return n


class ShardCache:
    """Remote files in a local directory (module docstring).

    Args:
        directory: the cache folder (created); share it between the processes of a node.
        budget_bytes: disk budget of the folder (int bytes or ``"200GiB"``); ``None``: no limit
            (a full disk is still a :class:`~feedgpu.errors.CacheFullError`).
        storage_options: passed to fsspec's filesystem (credentials come the store's standard way).
        max_downloads: concurrent downloads of :meth:`fetch_async` (default 4).
        retries: retries after a failed attempt (default 4), waiting ``backoff_s * 2**k`` seconds
            (default 0.5 s, at most ``max_backoff_s`` = 30 s) before retry ``k``.
        chunk_bytes: bytes per ranged read (default 8 MiB).
        revalidate_s: re-check a cached entry's remote identity after this many seconds
            (default ``None``: once per process).
        failure_ttl_s: how long a failed URL fails at once without a new download, and a host
            that could not be reached is tried once per request without back-off (default 60 s).
        verify: ``"identity"`` (default: size and ETag, or Last-Modified without an ETag, plus
            the index file's SHA-256 where given) or ``"content"`` (also download each cached
            entry again once per run, replacing the copy and recording its SHA-256 anew).
        sleep, clock: injected for tests (``time.sleep``, ``time.monotonic``).

    The whole time a request can take before :class:`~feedgpu.errors.DownloadError` is about
    :meth:`retry_budget_s` (the back-offs) plus one attempt's timeouts per try.

    Raises :class:`~feedgpu.errors.ConfigError` for a bad budget or ``verify``.
    """

    def __init__(self, directory, budget_bytes=None, *, storage_options: dict | None = None,
                 max_downloads: int = 4, retries: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 chunk_bytes: int = 8 << 20, revalidate_s: float | None = None, failure_ttl_s: float = 60.0,
                 verify: str = "identity", sleep=time.sleep, clock=time.monotonic):
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        self.budget_bytes = _parse_budget(budget_bytes)
        self.storage_options = dict(storage_options or {})
        if max_downloads < 1 or retries < 0 or chunk_bytes < 1:
            raise ConfigError("ShardCache: max_downloads and chunk_bytes must be >= 1, retries >= 0")
        self.max_downloads, self.retries = int(max_downloads), int(retries)
        self.backoff_s, self.max_backoff_s, self.chunk_bytes = backoff_s, max_backoff_s, int(chunk_bytes)
        self.revalidate_s, self.failure_ttl_s = revalidate_s, failure_ttl_s
        if verify not in VERIFY:
            raise ConfigError(f"ShardCache: verify must be one of {VERIFY}, got {verify!r}")
        self.verify = verify
        self.sleep, self.clock = sleep, clock
        #: this run's token: the cache object and its copies in workers share failure memos and
        #: content checks through the folder
        self.run = uuid.uuid4().hex
        self._fresh()

    def _fresh(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._fs: dict = {}
        self._valid: dict[str, tuple[Identity, float]] = {}   # url -> (identity checked, when)
        self._memo = FailureMemo(self)
        self._pins: Counter = Counter()
        self._stats = Counter()
        self._wait_s = 0.0

    def __getstate__(self) -> dict:
        """Pickled (to a Ray worker) without threads, locks, pins or counters."""
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fresh()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():   # forked: threads and pins are the parent's
            self._fresh()

    # -- paths -------------------------------------------------------------------------------
    @staticmethod
    def key(url: str) -> str:
        return hashlib.blake2b(url.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()

    def _path(self, url: str, ext: str) -> str:
        return os.path.join(self.directory, f"{self.key(url)}.{ext}")

    def _filesystem(self, url: str):
        proto = scheme(url)
        fs = self._fs.get(proto)
        if fs is None:
            fs = self._fs[proto] = filesystem(url, self.storage_options)[0]
        return fs

    # -- public API --------------------------------------------------------------------------
    def stat(self, url: str) -> Identity:
        """The store's current identity of ``url``, retried as downloads are; raises
        :class:`~feedgpu.errors.DownloadError` after the last retry (``kind``: the fault)."""
        self._check_fork()
        return self._retrying(url, lambda: self._stat(url), what="request")

    def cat(self, url: str) -> bytes:
        """The whole (small) file at ``url`` (an index file), retried as downloads are; raises
        :class:`~feedgpu.errors.DownloadError` after the last retry."""
        self._check_fork()

        def attempt():
            fs = self._filesystem(url)
            return fs.cat_file(store_path(url))
        return self._retrying(url, attempt, what="request")

    def retrying(self, url: str, attempt, what: str = "request"):
        """``attempt()`` under this cache's retry policy (faults that may heal retried with
        back-off); raises :class:`~feedgpu.errors.DownloadError` naming ``url`` and the cause."""
        self._check_fork()
        return self._retrying(url, attempt, what=what)

    def retry_budget_s(self) -> float:
        """Seconds of back-off one request waits at most before it fails (``retries`` waits of
        ``backoff_s * 2**k``, each at most ``max_backoff_s``): with the defaults 7.5 s."""
        return sum(min(self.max_backoff_s, self.backoff_s * 2 ** k) for k in range(self.retries))

    def local_path(self, url: str, expect: Identity | None = None, sha256: str | None = None) -> str:
        """The local copy of ``url``, downloaded first if it is not cached (blocking; another
        process's download of it is waited for). ``expect``: the identity the caller indexed
        (a different one on the store raises :class:`~feedgpu.errors.RemoteChangedError`);
        ``sha256``: the file's checksum, checked after the download.

        Raises :class:`~feedgpu.errors.DownloadError` (after the retries),
        :class:`~feedgpu.errors.CacheFullError`, :class:`~feedgpu.errors.RemoteChangedError`."""
        self._check_fork()
        data = self._path(url, "data")
        now = self.clock()
        memo = self._valid.get(url)
        if memo is not None and (expect is None or expect.same(memo[0])) and os.path.exists(data) \
                and (self.revalidate_s is None or now - memo[1] < self.revalidate_s):
            self._touch(url)
            self._count("hits")
            return data
        failed = self._memo.failure(url)
        if failed is not None:
            if unreachable_kind(failed.kind) and self._memo.serve_cached(url, expect, sha256, str(failed)):
                return data
            raise failed
        if self._memo.offline(url) and self._memo.serve_cached(url, expect, sha256, "it could not be reached"):
            return data
        t0 = self.clock()
        try:
            with self._file_lock(url):
                self._retrying(url, lambda: self._ensure(url, expect, sha256),
                               fallback=lambda why: self._memo.serve_cached(url, expect, sha256, why))
        except DownloadError as e:
            self._memo.remember(url, e)
            raise
        finally:
            with self._lock:
                self._wait_s += self.clock() - t0
        self._memo.forget(url)
        return data

    def fetch_async(self, url: str, expect: Identity | None = None,
                    sha256: str | None = None) -> "concurrent.futures.Future[str]":
        """:meth:`local_path` on a pool of ``max_downloads`` threads: a future of the local path
        (its exception: what :meth:`local_path` raises)."""
        self._check_fork()
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.max_downloads,
                                                                   thread_name_prefix="feedgpu-fetch")
            pool = self._pool
        return pool.submit(self.local_path, url, expect, sha256)

    def forget(self, url: str) -> None:
        """Check the folder and the store again on the next :meth:`local_path` of ``url``."""
        self._valid.pop(url, None)

    def pin(self, url: str) -> None:
        """Keep ``url``'s file from eviction by this process until :meth:`unpin`."""
        with self._lock:
            self._pins[self.key(url)] += 1

    def unpin(self, url: str) -> None:
        with self._lock:
            k = self.key(url)
            self._pins[k] -= 1
            if self._pins[k] <= 0:
                del self._pins[k]

    def save_index(self, ident: Identity, kind: str, index: dict) -> None:
        """Keep a small index derived from a file (a tar shard's member table) in the folder,
        under its URL, size and ETag, so a later run indexes without downloading it (kept when
        the file is evicted). Written to a temporary name, then renamed."""
        path = self._path(ident.url, f"{kind}-index.json")
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
                json.dump({"identity": ident.as_dict(), "index": index}, f, ensure_ascii=False)
            os.replace(tmp, path)
        except OSError:   # a cache that cannot keep it indexes again next time
            remove(tmp)

    def load_index(self, ident: Identity, kind: str) -> dict | None:
        """The index :meth:`save_index` kept for this identity (same URL, size, ETag), else None
        (always None with ``verify="content"``: the headers cannot be trusted to tell)."""
        if self.verify == "content":
            return None
        try:
            with open(self._path(ident.url, f"{kind}-index.json"), encoding="utf-8", errors="surrogateescape") as f:
                doc = json.load(f)
            d = doc["identity"]
            saved = Identity(d["url"], int(d["size"]), d.get("etag", ""), d.get("mtime", ""))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return doc["index"] if saved.url == ident.url and saved.same(ident) else None

    def stats(self) -> dict:
        """This process's counters: ``bytes_downloaded``, ``hits`` (served from the folder),
        ``misses`` (downloaded), ``network_wait_s`` (seconds callers of :meth:`local_path` waited
        for downloads, their own or another process's), ``retries``, ``evictions``,
        ``failures`` (URLs given up on), ``unchecked`` (verified entries served while the store
        could not be reached), ``cached_bytes`` (the folder's files now)."""
        out = self.counters()
        out["cached_bytes"] = sum(size for *_, size in entries(self.directory))
        return out

    def counters(self) -> dict:
        """:meth:`stats` without ``cached_bytes`` (no look at the folder: cheap enough for every
        batch). In a forked child, its own counters from zero, not its parent's."""
        self._check_fork()
        with self._lock:
            out = {k: int(self._stats[k]) for k in ("bytes_downloaded", "hits", "misses", "retries",
                                                     "evictions", "failures", "unchecked")}
            out["network_wait_s"] = self._wait_s
        return out

    def close(self, wait: bool = True) -> None:
        """Stop the download threads (downloads in flight finish; ``wait=False``: without
        waiting for them, and downloads not started are cancelled). A later
        :meth:`fetch_async` starts new threads."""
        if self._pool is not None and self._pid == os.getpid():
            with self._lock:
                pool, self._pool = self._pool, None
            pool.shutdown(wait=wait, cancel_futures=not wait)

    # -- internals ---------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _stat(self, url: str) -> Identity:
        fs = self._filesystem(url)
        return identity_from_info(url, fs.info(store_path(url)))

    def _retrying(self, url: str, attempt, what: str = "download", fallback=None):
        """``attempt()`` with the retry policy; ``fallback(why)``, on a fault that means the store
        could not be reached, may end the chain (True: served some other way)."""
        last, fault, n, checks = None, None, 0, 0
        tries = 1 if self._memo.offline(url) else self.retries + 1   # a host known down: no back-off
        with self._memo.chain():
            for k in range(tries):
                if k:
                    self._count("retries")
                    self.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (k - 1)))
                n = k + 1
                try:
                    out = attempt()
                    self._memo.online(url)
                    return out
                except (RemoteError, ConfigError):
                    raise
                except Exception as e:   # noqa: BLE001 - network, store and check failures, by their fault
                    last, fault = e, classify(e)
                if fault.unreachable and fallback is not None and fallback(fault.text):
                    return None
                if not fault.retry:
                    break
                if fault.kind == "checksum":
                    checks += 1
                    if checks > 1:   # the same wrong bytes twice: the store holds them, not the network
                        break
        if fault.unreachable:
            self._memo.went_offline(url)
        self._count("failures")
        raise DownloadError(f"{url}: {what} failed after {n} attempt(s): {fault.text}", url, n,
                            fault.kind) from last

    def _file_lock(self, url: str):
        return locked(self._path(url, "lock"))

    def _dir_lock(self):
        return locked(os.path.join(self.directory, ".lock"))

    def _read_meta(self, url: str) -> tuple[Identity | None, str | None]:
        """The entry's recorded identity and SHA-256 (None, None when there is no entry)."""
        try:
            with open(self._path(url, "json"), encoding="utf-8") as f:
                d = json.load(f)
            return Identity(d["url"], int(d["size"]), d.get("etag", ""), d.get("mtime", "")), d.get("sha256")
        except (OSError, ValueError, KeyError, TypeError):
            return None, None

    def _content_checked(self, url: str) -> bool:
        try:
            with open(self._path(url, "json"), encoding="utf-8") as f:
                return json.load(f).get("checked_run") == self.run
        except (OSError, ValueError, AttributeError):
            return False

    def _touch(self, url: str) -> None:
        try:   # an explicit time: the kernel's own file times tick too coarsely to order uses
            now = time.time_ns()
            os.utime(self._path(url, "json"), ns=(now, now))
        except OSError:
            pass

    def _ensure(self, url: str, expect: Identity | None, sha256: str | None) -> None:
        """Under the URL's lock: check the store, serve the entry or download it."""
        remote = self._stat(url)
        if expect is not None and not expect.same(remote):
            raise RemoteChangedError(f"{url} changed since the source was indexed ({expect.describe()}, now "
                                     f"{remote.describe()}); its index no longer describes it, so it is not "
                                     "read: open the source again")
        data = self._path(url, "data")
        meta, recorded = self._read_meta(url)
        try:
            have = os.path.getsize(data)
        except OSError:
            have = -1
        fresh = meta is not None and meta.url == url and meta.same(remote) and have == remote.size
        if fresh and sha256 is not None and recorded is None:   # an entry from before SHA-256s were kept
            from .index import sha256_file

            recorded = sha256_file(data)
        if fresh and sha256 is not None and recorded != sha256:
            fresh = False   # the index's SHA-256 wins over the store's headers
        if fresh and self.verify == "content" and not self._content_checked(url):
            fresh = False   # downloaded again once per run: its SHA-256 is recorded anew
        if fresh:
            self._count("hits")
        else:
            self._download(url, remote, sha256)
            self._count("misses")
        self._valid[url] = (remote, self.clock())
        self._touch(url)

    def _open_tmp(self, path: str):
        """The file a download writes (a seam for tests that inject a full disk)."""
        return open(path, "wb")

    def _download(self, url: str, remote: Identity, sha256: str | None) -> None:
        data, meta_path = self._path(url, "data"), self._path(url, "json")
        for p in (data, meta_path):   # the old entry, if any, is stale
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        tmp = f"{data}.part-{os.getpid()}-{threading.get_ident()}"
        fs = self._filesystem(url)
        path = store_path(url)
        digest = hashlib.sha256()   # recorded with the entry: the index's SHA-256 is checked against it
        md5 = hashlib.md5() if _MD5.fullmatch(remote.etag) and scheme(url) in ("s3", "gs", "gcs") else None
        f = None
        meta_tmp = f"{meta_path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with self._dir_lock():
                with self._lock:
                    pinned = set(self._pins)
                self._count("evictions", make_room(self.directory, self.budget_bytes, url, remote.size, pinned))
                f = self._open_tmp(tmp)
                f.truncate(remote.size)   # reserves the file's size in the budget's count
            f.seek(0)
            done = 0
            while done < remote.size:
                block = fs.cat_file(path, start=done, end=min(remote.size, done + self.chunk_bytes))
                if not block:
                    raise _Mismatch(f"the store sent {done} of {remote.size} bytes")
                if done + len(block) > remote.size:
                    raise _Mismatch(f"the store sent more than {remote.size} bytes")
                f.write(block)
                done += len(block)
                self._count("bytes_downloaded", len(block))
                for h in (digest, md5):
                    if h is not None:
                        h.update(block)
            f.flush()
            os.fsync(f.fileno())
            f.close()
            after = self._stat(url)
            if not after.same(remote):
                raise _Mismatch(f"it changed during the download ({remote.describe()}, then {after.describe()})")
            if sha256 and digest.hexdigest() != sha256:
                raise _Mismatch(f"checksum mismatch: SHA-256 {digest.hexdigest()} is not the index file's {sha256}",
                                "checksum")
            if md5 is not None and md5.hexdigest() != remote.etag:
                raise _Mismatch(f"checksum mismatch: MD5 {md5.hexdigest()} is not its ETag {remote.etag}", "checksum")
            with open(meta_tmp, "w", encoding="utf-8") as m:
                json.dump(dict(remote.as_dict(), sha256=digest.hexdigest(), checked_run=self.run), m)
            os.replace(tmp, data)
            os.replace(meta_tmp, meta_path)
        except BaseException as e:
            if f is not None:
                f.close()
            for p in (tmp, meta_tmp, data):
                remove(p)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CacheFullError(f"{url}: the disk holding the shard cache {self.directory} is full "
                                     f"({e.strerror}); nothing was left half-written. Free space or lower "
                                     "cache_budget") from None
            raise
