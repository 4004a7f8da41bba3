"""URLs of data that lives elsewhere, through fsspec.

fsspec (not ``pyarrow.fs``, which has no HTTP) gives one interface to ``s3://`` (s3fs),
``gs://`` (gcsfs), ``http(s)://`` (aiohttp) and ``file://``. Credentials are found the store's
own way (environment variables, its config files, instance roles); feedgpu never stores them.
``storage_options`` (a mapping) is passed to the store's filesystem as it is, for example
``{"client_kwargs": {"endpoint_url": "http://minio:9000"}}`` for s3fs or ``{"anon": True}``.

A file's identity (:class:`Identity`) is its URL, size and ETag (the modification time where the
store has no ETag): what the shard cache checks and what source fingerprints hold, so a state
saved on one machine resumes on another whatever its cache directory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, SourceError
from ..sources.base import braces

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
#: Stores that cannot list a folder: a shard list or an index file is needed.
UNLISTABLE = ("http", "https")
#: HTTP(S) without a ``client_kwargs.timeout`` of the user's: seconds to connect, and seconds a
#: response may stay silent, before the request fails (and is retried); no limit on the total.
HTTP_CONNECT_TIMEOUT_S = 30.0
HTTP_READ_TIMEOUT_S = 60.0


def is_url(value) -> bool:
    """True for a string ``scheme://...`` (``s3://``, ``gs://``, ``http(s)://``, ``file://`` ...)."""
    return isinstance(value, str) and _SCHEME.match(value) is not None


def has_url(spec) -> bool:
    """True if ``spec`` (a path, a URL or a list of them) names any URL."""
    if isinstance(spec, (list, tuple)):
        return any(has_url(s) for s in spec)
    return is_url(spec)


def scheme(url: str) -> str:
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else "file"


def filesystem(url: str, storage_options: dict | None = None):
    """``(fsspec filesystem, path within it)`` for ``url``. Raises :class:`ConfigError` when
    fsspec, or the store's package (s3fs, gcsfs, aiohttp), is not installed."""
    try:
        import fsspec.core
    except ImportError:   # pragma: no cover - fsspec is in the remote extra
        raise ConfigError(f"{url}: reading URLs needs fsspec: pip install 'feedgpu[remote]'") from None
    options = dict(storage_options or {})
    try:
        if scheme(url) in UNLISTABLE and "timeout" not in options.get("client_kwargs", {}):
            import aiohttp   # a server that stops sending is an error (retried), never a hang

            options["client_kwargs"] = {**options.get("client_kwargs", {}), "timeout": aiohttp.ClientTimeout(
                total=None, sock_connect=HTTP_CONNECT_TIMEOUT_S, sock_read=HTTP_READ_TIMEOUT_S)}
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as e:   # pragma: no cover - depends on the installed extras
        raise ConfigError(f"{url}: the {scheme(url)}:// store needs a package that is not installed ({e}); "
                          "pip install 'feedgpu[remote]' (s3fs, aiohttp) or gcsfs for gs://") from None


@dataclass(frozen=True)
class Identity:
    """What a remote file is: ``url``, ``size`` (bytes), ``etag`` (the store's, ``""`` if none)
    and ``mtime`` (the store's modification time as text, used only when there is no ETag)."""

    url: str
    size: int
    etag: str = ""
    mtime: str = ""

    def same(self, other: "Identity") -> bool:
        """Same size and ETag (or modification time when either has no ETag)."""
        if self.size != other.size:
            return False
        if self.etag and other.etag:
            return self.etag == other.etag
        return self.mtime == other.mtime

    def as_dict(self) -> dict:
        return {"url": self.url, "size": self.size, "etag": self.etag, "mtime": self.mtime}

    def describe(self) -> str:
        return f"{self.size} bytes, " + (f"ETag {self.etag}" if self.etag else f"modified {self.mtime or '?'}")


def identity_from_info(url: str, info: dict[str, Any]) -> Identity:
    """An :class:`Identity` from an fsspec ``info()`` entry (s3fs, gcsfs, HTTP, local)."""
    size = info.get("size")
    if size is None:
        raise SourceError(f"{url}: the store gives no size for it (an HTTP server without Content-Length?); "
                          "feedgpu needs it to verify downloads")
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or ""
    mtime = (info.get("LastModified") or info.get("Last-Modified") or info.get("updated")
             or info.get("mtime") or info.get("created") or "")
    return Identity(url, int(size), str(etag).strip('"').removeprefix("W/").strip('"'), str(mtime))


def store_path(url: str) -> str:
    """``url``'s path within its store, as fsspec's filesystem for its scheme names it
    (``fsspec.core.strip_protocol``: ``s3://bucket/key`` -> ``bucket/key``)."""
    import fsspec.core

    return fsspec.core.strip_protocol(url)


def stat(url: str, fs=None, storage_options: dict | None = None) -> Identity:
    """The current :class:`Identity` of ``url``; raises ``FileNotFoundError`` / ``OSError``
    as the store does."""
    if fs is None:
        fs, path = filesystem(url, storage_options)
    else:
        path = store_path(url)
    return identity_from_info(url, fs.info(path))


def join(base: str, name: str) -> str:
    """``name`` relative to the folder URL ``base`` (an absolute URL ``name`` is kept)."""
    if is_url(name):
        return name
    return base.rstrip("/") + "/" + name.lstrip("/")


def parent(url: str) -> str:
    """The folder URL holding ``url``."""
    return url.rstrip("/").rpartition("/")[0]


def expand_urls(spec, suffix: str, storage_options: dict | None = None) -> list[tuple[str, dict | None]]:
    """``[(url, info or None)]`` for a URL spec: a list of URLs, a brace pattern
    (``s3://b/train-{0000..0099}.tar``: each URL it names, in its order), a glob (``s3://b/train-*.tar``),
    a folder (its ``*<suffix>`` files), or one file; sorted within each item. ``info`` is the
    store's listing entry when the listing gave one (no second request for the ETag). Over HTTP,
    which cannot list, a glob or a folder raises :class:`SourceError`: give a list of URLs or
    an index file (``feedgpu convert`` writes ``_index.json``)."""
    if isinstance(spec, (list, tuple)):
        return [x for s in spec for x in expand_urls(s, suffix, storage_options)]
    url = str(spec)
    expanded = braces(url)
    if expanded != [url]:   # s3://b/train-{0000..0099}.tar: each URL it names, in its order
        return [x for s in expanded for x in expand_urls(s, suffix, storage_options)]
    glob = any(c in url.partition("://")[2] for c in "*[") or (scheme(url) not in UNLISTABLE and "?" in url)
    folder = url.endswith("/")
    if (glob or folder) and scheme(url) in UNLISTABLE:
        raise SourceError(f"{url}: an HTTP server cannot list files; give a list of shard URLs or the "
                          "dataset's index file (…/_index.json, written by `feedgpu convert`)")
    fs, path = filesystem(url, storage_options)
    if not glob and not folder:
        if scheme(url) in UNLISTABLE or not fs.isdir(path):
            return [(url, None)]
        folder = True
    pattern = path.rstrip("/") + f"/*{suffix}" if folder else path
    found = fs.glob(pattern, detail=True)
    out = [(fs.unstrip_protocol(p), dict(info)) for p, info in sorted(found.items())
           if info.get("type", "file") == "file"]
    return out
