"""A folder source's saved index: one file per dataset root beside feedgpu's cache.

Where: ``<cache dir>/folder-index/<key>.idx``, the cache dir being the one feedgpu already uses
(``$FEEDGPU_CACHE_DIR``, else the user cache dir, :func:`feedgpu.host.default_cache_dir`).
The key hashes the root's real path (``os.path.realpath``) and the index settings (extensions,
``allow_empty``, ``flat``), so two spellings of one root share a file and other settings do not.

What the file holds: the arrays of the index (paths as one byte blob + int64 offsets, int64
labels, sizes and mtimes as they were when it was built), the classes, the index-time rejects,
and what it is checked against before it is used:

* every folder walked (the root, each class folder, each sub-folder, each folder a link leads
  to, the hidden top-level folders): its ``(st_dev, st_ino, st_mtime_ns)``. A folder's mtime
  changes whenever an entry in it is added, removed or renamed, so any added, removed or renamed
  file or folder anywhere in the tree makes the index stale;
* every indexed file that is a symbolic link, and every rejected entry: the full ``stat`` of
  what it points to (or the error), since its target may live outside the tree.

A file rewritten in place under the same name (same or other size) changes no folder mtime: the
saved index is still used, and it is :meth:`FolderSource.identity` (the cache's and a loader
state's fingerprint) that notices: on a source opened from a saved index it ``stat``-s every file
again before it hashes paths, sizes and mtimes, so the fingerprint is the one a fresh index would
give and a cache entry written before the rewrite is not used. When that finds a difference it
removes the saved file, so the next run indexes afresh.

Never trusted across feedgpu versions (the version is in the file and must match), never read
when its checksum (xxh3-64 over everything after it) does not match: a corrupt, truncated or
foreign-version file is ignored with a warning and rebuilt. It is written to a temporary file
in the same folder and renamed, so a reader sees a whole file or none. An index whose folders
changed within :data:`RACY_NS` of the walk is not saved (an entry added in the same mtime tick
as the listing would go unnoticed), so a tree written seconds before it is indexed is indexed
again on the next run.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from .extensions import IMAGE_EXTENSIONS

INDEX_FORMAT = "feedgpu.folder-index/1"
_MAGIC = b"FEEDGPU-FOLDER-INDEX\n\0\0\0"  # 24 bytes: the arrays start 8-aligned
_HEAD = struct.Struct("<QQ")  # header length, xxh3-64 of everything after the magic and this
_ARRAYS = (("offsets", np.int64), ("labels", np.int64), ("sizes", np.int64), ("mtimes", np.int64),
           ("blob", np.uint8))

#: Folders whose mtime is this close (ns) to the walk's start, or later, keep an index from
#: being saved (file systems stamp mtimes at a coarse tick; see the module docstring).
RACY_NS = 2_000_000_000


def default_index_dir() -> Path:
    from ..host import default_cache_dir

    return default_cache_dir() / "folder-index"


def index_key(root: str, settings: dict) -> str:
    payload = json.dumps({"root": os.path.realpath(root), "settings": settings}, sort_keys=True)
    return hashlib.blake2b(payload.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()


def _xxh(data) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def file_sig(path: str) -> list:
    """What a watched entry's check compares: its followed ``stat``, or the error number."""
    try:
        st = os.stat(path)
    except OSError as e:
        return ["error", e.errno]
    return [st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns]


def dir_sig(path: str) -> list | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_mtime_ns]


def save(path: Path, meta: dict, arrays: dict, walk_start_ns: int) -> bool:
    """Write the index atomically; False (nothing written) when a folder is too recent.

    ``meta`` holds ``dirs``: ``[[rel, dev, ino, mtime_ns], ...]``, ``watch``: ``[[rel, sig], ...]``
    and whatever the source needs back (classes, rejects); ``arrays`` the :data:`_ARRAYS`."""
    if any(d[3] >= walk_start_ns - RACY_NS for d in meta["dirs"]):
        return False
    from .._version import __version__

    header = dict(meta, format=INDEX_FORMAT, feedgpu=__version__,
                  arrays=[[name, len(arrays[name])] for name, _ in _ARRAYS])
    bufs = [np.ascontiguousarray(arrays[name], dtype=dt).data for name, dt in _ARRAYS]
    write_index_file(path, _MAGIC, json.dumps(header).encode(), bufs)
    return True


def write_index_file(path: Path, magic: bytes, head: bytes, bufs: list) -> None:
    """Write a saved index atomically (a temporary file renamed over ``path``): ``magic`` (24
    bytes), the header's length and the xxh3-64 of what follows, the JSON ``head`` padded with
    blanks to 8 bytes (so the arrays start 8-aligned), then the arrays' buffers ``bufs``."""
    import xxhash

    head += b" " * (-len(head) % 8)
    h = xxhash.xxh3_64()
    h.update(head)
    for b in bufs:
        h.update(b)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".idx", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(magic)
            f.write(_HEAD.pack(len(head), h.intdigest()))
            f.write(head)
            for b in bufs:
                f.write(b)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load(path: Path, root: str, key: str) -> tuple[dict, dict] | None:
    """``(meta, arrays)`` from a saved index that is whole, of this feedgpu version, for this
    key, and whose folders and watched entries are unchanged; else None (a warning when the file
    is corrupt or of another version; none when it is missing or merely stale)."""
    from .._version import __version__

    try:
        with open(path, "rb") as f:
            data = bytearray(f.read())
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"feedgpu: cannot read the saved folder index {path} ({e}); indexing afresh", stacklevel=4)
        return None
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not a feedgpu folder index")
        n_head, check = _HEAD.unpack_from(data, len(_MAGIC))
        body = memoryview(data)[len(_MAGIC) + _HEAD.size:]
        if _xxh(body) != check:
            raise ValueError("checksum mismatch (corrupt or truncated)")
        header = json.loads(bytes(body[:n_head]))
        if header.get("format") != INDEX_FORMAT or header.get("feedgpu") != __version__:
            warnings.warn(f"feedgpu: ignored the saved folder index {path}: written by feedgpu "
                          f"{header.get('feedgpu')!r} ({header.get('format')!r}), this is {__version__} "
                          f"({INDEX_FORMAT}); indexing afresh", stacklevel=4)
            return None
        arrays, pos = {}, n_head
        for (name, dt), (got, n) in zip(_ARRAYS, header["arrays"]):
            if got != name:
                raise ValueError(f"array {got!r} where {name!r} belongs")
            nbytes = n * np.dtype(dt).itemsize
            arrays[name] = np.frombuffer(body, dtype=dt, count=n, offset=pos)
            pos += nbytes
        if pos != len(body):
            raise ValueError("length mismatch")
    except (ValueError, KeyError, TypeError, struct.error) as e:
        warnings.warn(f"feedgpu: ignored the saved folder index {path}: {e}; indexing afresh", stacklevel=4)
        return None
    if header.get("key") != key:
        return None
    for rel, dev, ino, mtime in header["dirs"]:
        if dir_sig(os.path.join(root, rel) if rel else root) != [dev, ino, mtime]:
            return None
    for rel, sig in header["watch"]:
        if file_sig(os.path.join(root, rel)) != sig:
            return None
    return header, arrays


def discard(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def saved_indexes(folder: Path | None = None) -> list[Path]:
    """The saved index files in ``folder`` (default :func:`default_index_dir`), with the
    temporary files an interrupted save left, sorted by name."""
    folder = default_index_dir() if folder is None else Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix == ".idx" and p.is_file())


def clear_saved(folder: Path | None = None) -> tuple[int, int]:
    """Delete every saved index in ``folder`` (see :func:`saved_indexes`); returns ``(files,
    bytes)`` deleted. A source opened from one keeps its arrays (they were read); the next
    source opened on that root indexes afresh."""
    n = size = 0
    for p in saved_indexes(folder):
        try:
            b = p.stat().st_size
            p.unlink()
        except OSError:
            continue
        n, size = n + 1, size + b
    return n, size


def now_ns() -> int:
    return time.time_ns()


def saved_index_file(root, index_dir=None, extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
                     allow_empty: bool = False, flat: bool = False, stat_files: bool | str = "auto") -> Path:
    """Where :class:`~feedgpu.sources.folder.FolderSource` opened with these arguments keeps its saved index:
    ``<index_dir>/<key>.idx`` (``index_dir`` None or True: the ``folder-index`` folder of
    feedgpu's cache dir; the key: :func:`~feedgpu.sources.folderindex_key`)."""
    settings = {"extensions": [e.lower() for e in extensions], "allow_empty": bool(allow_empty), "flat": bool(flat),
                "stat_files": "auto" if stat_files == "auto" else bool(stat_files)}
    base = Path(index_dir) if index_dir not in (None, True) else default_index_dir()
    return base / f"{index_key(str(root), settings)}.idx"
