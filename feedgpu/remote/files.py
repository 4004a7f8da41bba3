"""The remote files of one source: their URLs, identities, checksums and the shard cache.

A source given URLs (or an index file) holds a :class:`RemoteFiles`: it resolves the spec to a
list of files with the identity each was indexed on (:class:`~feedgpu.remote.urls.Identity`),
reads them through the :class:`~feedgpu.remote.cache.ShardCache` (whole files, one download per
node) or by ranged reads (:meth:`RemoteFiles.open`), and feeds source fingerprints with URL,
size and ETag only, so a new machine with an empty cache resumes a saved state exactly.

Opening fails fast, by name: every file the spec names is asked about (retried with the shard
cache's policy); the files that cannot be read (refused, DNS, 404, 5xx, not a tar / not
Parquet, an HTML page where a file should be, a server without byte ranges for Parquet) are
collected (:meth:`RemoteFiles.fail`) and :meth:`RemoteFiles.check_open` raises one
:class:`~feedgpu.errors.SourceError` naming each URL and its cause, unless ``max_bad_files``
allows that many to be lost (then the source leaves each out as ``"bad shard"``, named).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

from ..errors import DownloadError, SourceError
from .cache import ShardCache
from .faults import HTML_HINT, looks_like_html
from .index import is_index, parse_index
from .urls import Identity, expand_urls, filesystem, identity_from_info, is_url, join, parent


@dataclass
class RemoteFile:
    """One file of a source: ``url``, ``identity`` (``None`` when the store could not be reached
    while indexing), ``sha256`` and ``samples`` (from an index file, else ``None``)."""

    url: str
    identity: Identity | None
    sha256: str | None = None
    samples: dict | None = None
    error: str = field(default="", repr=False)


def default_cache_dir() -> str:
    from ..host import default_cache_dir as root

    return os.path.join(os.fspath(root()), "shards")


def make_cache(cache=None, cache_dir=None, cache_budget=None, storage_options=None,
               verify: str = "identity") -> ShardCache:
    """A :class:`ShardCache` from a source's options (``cache``: one to share, used as is; a
    ``verify`` other than its own raises :class:`~feedgpu.errors.ConfigError`)."""
    if cache is not None:
        if verify != "identity" and cache.verify != verify:
            from ..errors import ConfigError

            raise ConfigError(f"verify={verify!r} with a shard cache given (cache=) whose verify is "
                              f"{cache.verify!r}: set it on the ShardCache")
        return cache
    return ShardCache(cache_dir or default_cache_dir(), cache_budget, storage_options=storage_options, verify=verify)


def check_max_bad_files(value):
    from ..errors import ConfigError

    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"max_bad_files: expected an int >= 0 or None, got {value!r}")
    return value


def cause_of(e: DownloadError) -> str:
    """A :class:`DownloadError`'s message without its URL (the cause, and the attempts)."""
    return str(e).removeprefix(f"{e.url}: ")


def _as_url(spec):
    if isinstance(spec, (list, tuple)):
        return [_as_url(s) for s in spec]
    s = os.fspath(spec)
    return s if is_url(s) else "file://" + os.path.abspath(s)


class RemoteFiles:
    """Args:
        spec: URL(s), a glob URL, a folder URL or an index file (``.json``, URL or local path);
            local paths in a list with URLs are read as ``file://`` URLs.
        suffix: file suffix for folders (``".tar"``, ``".parquet"``); kind: ``"tar"``/``"parquet"``.
        cache: the :class:`ShardCache` to read through.
        max_bad_files: files that may be unreadable at open (int >= 0, default 0; None: any):
            see :meth:`check_open`.

    Raises :class:`SourceError` when nothing matches, the index file cannot be read (named
    with the cause) or is not one, or a listed file is smaller or larger than its index says."""

    def __init__(self, spec, suffix: str, kind: str, cache: ShardCache, max_bad_files: int | None = 0):
        self.cache = cache
        self.kind = kind
        self.max_bad_files = check_max_bad_files(max_bad_files)
        self.failures: dict[str, str] = {}   # url -> why it cannot be read (in the order met)
        self.storage_options = cache.storage_options
        spec = _as_url(spec)
        self.index_url = spec if is_index(spec) else None
        self.files: list[RemoteFile] = []
        if self.index_url is not None:
            self._from_index(self.index_url, kind)
        else:
            seen, repeats = set(), []
            for url, info in expand_urls(spec, suffix, self.storage_options):
                if url in seen:
                    repeats.append(url)
                    continue
                seen.add(url)
                ident = identity_from_info(url, info) if info and info.get("size") is not None else None
                self.files.append(self._stated(RemoteFile(url, ident)))
            if repeats:   # as for local paths: its records would otherwise come twice an epoch
                warnings.warn(f"feedgpu: {len(repeats)} file(s) named more than once, read once: "
                              + ", ".join(repeats[:5]) + (" ..." if len(repeats) > 5 else ""), stacklevel=4)
        if not self.files:
            raise SourceError(f"{kind} source: no files match {spec!r}")
        self._note_headers()

    def _stated(self, f: RemoteFile) -> RemoteFile:
        if f.identity is None:
            try:
                f.identity = self.cache.stat(f.url)
            except DownloadError as e:
                f.error = str(e)
                self.fail(f.url, cause_of(e))
        return f

    def fail(self, url: str, why: str) -> None:
        """File ``url`` cannot be read (``why``: the cause in words), found while opening."""
        self.failures.setdefault(url, why)

    def check_open(self) -> None:
        """Raise one :class:`SourceError` naming each file that cannot be read and why, when
        there are more than ``max_bad_files``; else return (the source leaves them out, named)."""
        bad = self.failures
        if not bad or self.max_bad_files is None or len(bad) <= self.max_bad_files:
            return
        lines = "\n".join(f"  {u}: {why}" for u, why in list(bad.items())[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise SourceError(f"{self.kind} source: {len(bad)} of {len(self.files)} file(s) cannot be read:\n{lines}{more}\n"
                          "Check the URLs (or the index file) and the server; max_bad_files=N opens the source "
                          "without up to N unreadable files (their samples are left out, named, as \"bad shard\")")

    @staticmethod
    def is_html(local_or_head) -> bool:
        """True when a downloaded file (a local path, or its first bytes) is an HTML page."""
        head = local_or_head
        if isinstance(local_or_head, str):
            try:
                with open(local_or_head, "rb") as f:
                    head = f.read(512)
            except OSError:
                head = b""
        return looks_like_html(head or b"")

    def unreadable(self, url: str, local_or_head, error: Exception) -> str:
        """Why a downloaded file (a local path, or its first bytes) is not a readable shard: an
        HTML page where a file should be is named as such."""
        if self.is_html(local_or_head):
            return HTML_HINT
        return " ".join(str(error).split()).removeprefix(f"{url}: ")

    def _note_headers(self) -> None:
        """Say once when the store's headers cannot show a change of a file (no ETag) and nothing
        else checks its content (no index SHA-256, ``verify="identity"``)."""
        blind = [f for f in self.files if f.identity is not None and not f.identity.etag and not f.sha256]
        if not blind or self.cache.verify == "content":
            return
        what = "size and Last-Modified" if any(f.identity.mtime for f in blind) else "size"
        warnings.warn(f"feedgpu: {len(blind)} of {len(self.files)} file(s) come without an ETag (first: {blind[0].url}): "
                      f"a change is seen by {what} only, so a same-size rewrite that keeps its "
                      "modification time (cp -p, rsync -t) would be served from the shard cache unseen. An index "
                      "file with SHA-256s (`feedgpu convert` writes _index.json), or verify=\"content\" (the "
                      "source's or cache's option: each cached file downloaded again once per run and compared) "
                      "checks the content", stacklevel=4)

    def _from_index(self, url: str, kind: str) -> None:
        try:
            text = self.cache.cat(url).decode("utf-8", "surrogateescape")
        except DownloadError as e:
            raise SourceError(f"{kind} source: cannot read the index file {url}: {cause_of(e)}") from None
        base = parent(url)
        for e in parse_index(text, url, kind):
            f = self._stated(RemoteFile(join(base, e["name"]), None, e.get("sha256"), e.get("samples")))
            if f.identity is not None and f.identity.size != e["size"]:
                f.error = (f"{f.identity.size} bytes, the index file {url} says {e['size']}: the index does not "
                           "describe it (written again?)")
                f.identity = None
                self.fail(f.url, f.error)
            self.files.append(f)

    def __len__(self) -> int:
        return len(self.files)

    @property
    def urls(self) -> list[str]:
        return [f.url for f in self.files]

    def local(self, i: int) -> str:
        """File ``i``'s local copy (downloaded through the cache; raises what
        :meth:`ShardCache.local_path` raises)."""
        f = self.files[i]
        return self.cache.local_path(f.url, f.identity, f.sha256)

    def fetch_async(self, i: int):
        """Start downloading file ``i`` into the cache (checked against the identity it was
        indexed on and its checksum): :meth:`ShardCache.fetch_async`'s future of the local path."""
        f = self.files[i]
        return self.cache.fetch_async(f.url, f.identity, f.sha256)

    def open_local(self, i: int, opener):
        """``opener(local path)`` of file ``i``, pinned in the cache (the caller unpins when it
        lets go). A file another process evicted between the download and the open is fetched
        again (twice at most, then :class:`~feedgpu.errors.DownloadError`)."""
        url = self.files[i].url
        for _ in range(3):
            path = self.local(i)
            self.cache.pin(url)
            try:
                return opener(path)
            except FileNotFoundError:
                self.cache.unpin(url)
                self.cache.forget(url)
        raise DownloadError(f"{url}: evicted from the shard cache by other processes three times before it "
                            "could be opened; raise cache_budget", url, 3)

    def open(self, i: int):
        """File ``i`` as an fsspec file for ranged reads (Parquet footers and columns)."""
        f = self.files[i]
        fs, path = filesystem(f.url, self.storage_options)
        kw = {"size": f.identity.size} if f.identity is not None else {}
        return fs.open(path, "rb", cache_type="none", **kw)   # footers and label columns: exact ranges

    def text_beside(self, name: str) -> str:
        """The text of ``name`` in the folder of the index file (or of the first file), ``""``
        when it is not there."""
        base = parent(self.index_url or self.files[0].url)
        fs, path = filesystem(join(base, name), self.storage_options)
        try:
            return fs.cat_file(path).decode("utf-8", "surrogateescape")
        except (OSError, ValueError):
            return ""
        except Exception:  # noqa: BLE001 - an HTTP 404 or a store error: no class names
            return ""

    def digest(self, h) -> None:
        """URL, size and ETag (or modification time) of each file: no local path."""
        for f in self.files:
            ident = f.identity
            h.update(f"{f.url}\0{ident.size if ident else -1}\0{ident.etag if ident else ''}\0"
                     f"{'' if ident is None or ident.etag else ident.mtime}\0".encode("utf-8", "surrogateescape"))
