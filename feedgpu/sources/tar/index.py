"""A local tar shard's saved index: one file per shard beside feedgpu's cache.

Where: ``<cache dir>/tar-index/<key>.idx``, the cache dir being the one feedgpu already uses
(``$FEEDGPU_CACHE_DIR``, else the user cache dir, :func:`feedgpu.host.default_cache_dir`).
The key hashes the shard's real path (``os.path.realpath``).

What the file holds: the shard's part of the index as :class:`~feedgpu.sources.tar.TarShardSource`
builds it (the images' names as one byte blob and their lengths, data offsets, sizes and labels,
-2 where a sample has no label, each array in the narrow integer dtype it has in memory), whether it has label members, its label-like
members feedgpu does not read, the records it rejected (key, reason, detail) and what the file is
checked against before it is used: the shard's ``(st_dev, st_ino, st_size, st_mtime_ns,
st_ctime_ns)``. A shard rewritten, replaced, grown or cut changes its size, mtime or ctime, and its
saved index is not used (and is overwritten when the shard is indexed again). That includes a
rewrite that keeps the size and sets the mtime back (``touch -r``, ``rsync -t``): the kernel sets
``st_ctime_ns`` on every write and ``utime``, and a file renamed over the shard has a new inode.

Never trusted across feedgpu versions (the version is in the file and must match), never read
when its checksum (xxh3-64 over everything after it) does not match: a corrupt, truncated or
foreign-version file is ignored with a warning and rebuilt. Written to a temporary file in the
same folder and renamed, so a reader sees a whole file or none. A shard whose mtime is within
:data:`RACY_NS` of the time it was indexed is not saved (a write in the same mtime tick would go
unnoticed): a shard written seconds before it is indexed is indexed again on the next run.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import warnings
from pathlib import Path

import numpy as np

from ..folder_index import write_index_file

INDEX_FORMAT = "feedgpu.tar-index/1"
_MAGIC = b"FEEDGPU-TAR-INDEX\n\0\0\0\0\0\0"  # 24 bytes: the arrays start 8-aligned
_HEAD = struct.Struct("<QQ")  # header length, xxh3-64 of everything after the magic and this
_ARRAYS = ("lens", "offsets", "sizes", "labels", "blob")   # each in its own integer dtype (the header names it)
_DTYPES = ("|u1", "<u2", "<u4", "<u8", "|i1", "<i2", "<i4", "<i8")
#: A shard whose mtime is this close (ns) to the time it is indexed, or later, is not saved.
RACY_NS = 2_000_000_000


def default_index_dir() -> Path:
    from ...host import default_cache_dir

    return default_cache_dir() / "tar-index"


def index_dir(given=None) -> Path:
    """The folder of the saved shard indexes: ``given`` (a path), else :func:`default_index_dir`."""
    return Path(given) if given not in (None, True) else default_index_dir()


def index_file(folder: Path, shard: str) -> Path:
    key = hashlib.blake2b(os.path.realpath(shard).encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
    return folder / f"{key}.idx"


def shard_sig(shard: str) -> list | None:
    try:
        st = os.stat(shard)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def save(path: Path, sig: list, meta: dict, arrays: dict, indexed_ns: int) -> bool:
    """Write one shard's index atomically; False (nothing written) when the shard is too recent
    (:data:`RACY_NS`). ``meta``: ``labeled``, ``other``, ``rejected``; ``arrays``: the :data:`_ARRAYS`."""
    if sig is None or sig[3] >= indexed_ns - RACY_NS:
        return False
    write(path, dict(meta, sig=sig), arrays)
    return True


def write(path: Path, head: dict, arrays: dict) -> None:
    """Write an index file atomically: ``head`` (JSON-able; the format and feedgpu's version are
    added) and the :data:`_ARRAYS` of ``arrays``."""
    from ..._version import __version__

    arrs = [np.ascontiguousarray(arrays[name]) for name in _ARRAYS]
    arrs = [a.astype(a.dtype.newbyteorder("<")) if a.dtype.str not in _DTYPES else a for a in arrs]
    header = dict(head, format=INDEX_FORMAT, feedgpu=__version__,
                  arrays=[[name, a.dtype.str, int(len(a))] for name, a in zip(_ARRAYS, arrs)])
    write_index_file(path, _MAGIC, json.dumps(header).encode("utf-8", "surrogateescape"), [a.data for a in arrs])


class Unusable(ValueError):
    """An index file that cannot be used: unreadable, corrupt, truncated, or of another format or
    feedgpu version (the message says which)."""


def load(path: Path, sig: list | None, warn=None) -> tuple[dict, dict] | None:
    """``(meta, arrays)`` of a saved shard index that is whole, of this feedgpu version and made
    from the shard as it is now (``sig``: :func:`shard_sig`); else None, with a warning when the
    file is corrupt or of another version (none when it is missing or the shard changed).
    ``warn``: called with the warning's text instead of :func:`warnings.warn`."""
    if sig is None:
        return None
    try:
        header, arrays = read(path)
    except FileNotFoundError:
        return None
    except Unusable as e:
        text = f"feedgpu: ignored the saved tar index {path}: {e}; indexing the shard afresh"
        if warn is None:
            warnings.warn(text, stacklevel=4)
        else:
            warn(text)
        return None
    if header.get("sig") != sig:
        return None
    return header, arrays


def read(path: Path) -> tuple[dict, dict]:
    """``(header, arrays)`` of an index file. Raises :class:`FileNotFoundError` when there is
    none, :class:`Unusable` when it cannot be read, is corrupt or truncated (its checksum), or
    is of another format or feedgpu version."""
    from ..._version import __version__

    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise Unusable(f"cannot read it ({e})") from None
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not a feedgpu tar index")
        n_head, check = _HEAD.unpack_from(data, len(_MAGIC))
        body = memoryview(data)[len(_MAGIC) + _HEAD.size:]
        import xxhash

        if xxhash.xxh3_64_intdigest(body) != check:
            raise ValueError("checksum mismatch (corrupt or truncated)")
        header = json.loads(bytes(body[:n_head]).decode("utf-8", "surrogateescape"))
        if header.get("format") != INDEX_FORMAT or header.get("feedgpu") != __version__:
            raise Unusable(f"written by feedgpu {header.get('feedgpu')!r} ({header.get('format')!r}), this is "
                           f"{__version__} ({INDEX_FORMAT})")
        arrays, pos = {}, n_head
        for name, (got, dt, n) in zip(_ARRAYS, header["arrays"], strict=True):
            if got != name or dt not in _DTYPES:
                raise ValueError(f"array {got!r} ({dt!r}) where {name!r} belongs")
            arrays[name] = np.frombuffer(body, dtype=dt, count=n, offset=pos)
            pos += n * np.dtype(dt).itemsize
        if pos != len(body):
            raise ValueError("length mismatch")
    except Unusable:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, struct.error, UnicodeError) as e:
        raise Unusable(str(e)) from None
    return header, arrays


def now_ns() -> int:
    return time.time_ns()
