"""The remote files of one source: their URLs, identities, checksums and the shard cache.

A source given URLs (or an index file) holds a :class:`RemoteFiles`: it resolves the spec to a
list of files with the identity each was indexed on (:class:`~feedgpu.remote.urls.Identity`),
reads them through the :class:`~feedgpu.remote.cache.ShardCache` (whole files, one download per
node) or by ranged reads (:meth:`RemoteFiles.open`), and feeds source fingerprints with URL,
size and ETag only, so a new machine with an empty cache resumes a saved state exactly.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

from ..errors import DownloadError, SourceError
from .cache import ShardCache
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
    from ..sample_data import default_cache_dir as root

    return os.path.join(os.fspath(root()), "shards")


def make_cache(cache=None, cache_dir=None, cache_budget=None, storage_options=None) -> ShardCache:
    """A :class:`ShardCache` from a source's options (``cache``: one to share, used as is)."""
    if cache is not None:
        return cache
    return ShardCache(cache_dir or default_cache_dir(), cache_budget, storage_options=storage_options)


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

    Raises :class:`SourceError` when nothing matches, an index file is not one, or a listed
    file is smaller or larger than its index says."""

    def __init__(self, spec, suffix: str, kind: str, cache: ShardCache):
        self.cache = cache
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

    def _stated(self, f: RemoteFile) -> RemoteFile:
        if f.identity is None:
            try:
                f.identity = self.cache.stat(f.url)
            except DownloadError as e:
                f.error = str(e)
        return f

    def _from_index(self, url: str, kind: str) -> None:
        fs, path = filesystem(url, self.storage_options)
        try:
            text = fs.cat_file(path).decode("utf-8", "surrogateescape")
        except FileNotFoundError:
            raise SourceError(f"{kind} source: index file {url} not found") from None
        base = parent(url)
        for e in parse_index(text, url, kind):
            f = self._stated(RemoteFile(join(base, e["name"]), None, e.get("sha256"), e.get("samples")))
            if f.identity is not None and f.identity.size != e["size"]:
                raise SourceError(f"{kind} source: {f.url} is {f.identity.size} bytes, the index file {url} says "
                                  f"{e['size']}: the index does not describe it (written again?)")
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
