"""What went wrong with a request to a store, in words, and whether trying again can help.

fsspec hides the network's answer behind its own exceptions (a refused connection, a failed DNS
lookup and an HTTP 404 all read as ``FileNotFoundError: <url>`` from an HTTP ``info()``); the
real cause is in the exception's chain. :func:`classify` walks the chain and names the fault as
the network gave it:

=========================  ===========================================  ========  ===========
kind                       what it is                                   retried   unreachable
=========================  ===========================================  ========  ===========
``refused``                connection refused (server down)             yes       yes
``dns``                    the host name does not resolve               yes       yes
``timeout``                no answer within the timeouts                yes       yes
``reset``                  the connection closed mid-answer             yes       yes
``http 5xx`` / ``429``     the server's own error, or "slow down"       yes       yes
``not found``              HTTP 404 / no such object                    no        no
``denied``                 HTTP 401 / 403                               no        no
``http 4xx``               another client error                         no        no
``no ranges``              the server ignores Range requests            no        no
``checksum``               the bytes are not the index's SHA-256        once      no
``mismatch``               a short, long or changing download           yes       no
``error``                  anything else                                yes       no
=========================  ===========================================  ========  ===========

"Unreachable" faults are the ones where the store could not answer about the file at all: a
cached copy verified earlier may stand in for it (:class:`~feedgpu.remote.cache.ShardCache`).
"""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

#: fsspec's words for an HTTP server that answers a ranged read with the whole file.
_NO_RANGES = "support range requests"


@dataclass(frozen=True)
class Fault:
    """A failed request: ``kind`` (see the module table), ``text`` (the cause in words),
    ``retry`` (trying again may help), ``unreachable`` (the store could not be asked)."""

    kind: str
    text: str
    retry: bool = True
    unreachable: bool = False


class Mismatch(Exception):
    """A download whose bytes are not the file's (retried, never served); ``kind``:
    ``"checksum"`` (the index's SHA-256 or the store's MD5 ETag disagree: tried once more at
    most) or ``"mismatch"`` (short, long, or changed during the download)."""

    def __init__(self, text: str, kind: str = "mismatch"):
        super().__init__(text)
        self.kind = kind


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc) -> int | None:
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 100 <= status < 600:
        return status
    code = getattr(exc, "response", None)   # botocore ClientError
    if isinstance(code, dict):
        meta = code.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def classify(exc: BaseException) -> Fault:
    """The :class:`Fault` of ``exc`` (and the exceptions it was raised from)."""
    if isinstance(exc, Mismatch):
        return Fault(exc.kind, str(exc), retry=True)
    for e in _chain(exc):
        status = _status(e)
        if status is not None:
            if status == 404 or status == 410:
                return Fault("not found", f"not found (HTTP {status})", retry=False)
            if status in (401, 403):
                return Fault("denied", f"access denied (HTTP {status}): check the credentials", retry=False)
            if status >= 500 or status == 429:
                return Fault(f"http {status}", f"the server answered HTTP {status}", retry=True, unreachable=True)
            if status >= 400:
                return Fault(f"http {status}", f"the server answered HTTP {status}", retry=False)
        if isinstance(e, ValueError) and _NO_RANGES in str(e):
            return Fault("no ranges", "the server does not serve byte ranges (HTTP Range requests), which "
                         "reading Parquet footers and columns needs: serve the files from a server with range "
                         "requests (S3, GCS, nginx, Apache, ...)", retry=False)
        if isinstance(e, socket.gaierror) or "DNSError" in type(e).__name__:
            return Fault("dns", f"DNS lookup failed ({_words(e)})", retry=True, unreachable=True)
        if isinstance(e, ConnectionRefusedError):
            return Fault("refused", "connection refused (the server is down or not listening)", retry=True,
                         unreachable=True)
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in type(e).__name__:
            return Fault("timeout", f"timed out ({_words(e)})", retry=True, unreachable=True)
        if isinstance(e, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)) \
                or type(e).__name__ in ("ServerDisconnectedError", "ClientPayloadError", "ClientOSError"):
            return Fault("reset", f"the connection was closed mid-answer ({_words(e)})", retry=True,
                         unreachable=True)
    connector = next((e for e in _chain(exc) if "ClientConnector" in type(e).__name__), None)
    if connector is not None:   # aiohttp's, without a cause that says more
        return Fault("refused", f"cannot connect ({_words(connector)})", retry=True, unreachable=True)
    if isinstance(exc, FileNotFoundError):
        return Fault("not found", "not found", retry=False)
    if isinstance(exc, PermissionError):
        return Fault("denied", f"access denied ({_words(exc)})", retry=False)
    return Fault("error", _words(exc), retry=True)


def unreachable_kind(kind: str) -> bool:
    """True for a :attr:`Fault.kind` that means the store could not be reached."""
    return kind in ("refused", "dns", "timeout", "reset", "http 429") or kind.startswith("http 5")


def _words(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def host(url: str) -> str:
    """``scheme://host[:port]`` of ``url`` (the unit an outage is remembered for)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def looks_like_html(head: bytes) -> bool:
    """True when a file starts as an HTML page (a server's folder listing or error page)."""
    text = head[:512].lstrip().lower()
    return text.startswith((b"<!doctype html", b"<html", b"<head", b"<body", b"<title"))


HTML_HINT = ("an HTML page (a server's folder listing or error page), not a data file: an HTTP server "
             "cannot list a folder, so give the shard or file URLs, or the dataset's index file "
             "(<folder>/_index.json, written by `feedgpu convert`)")
