"""Member tables written with tar shards: ``<shard>.feedgpu-index`` beside each shard.

:func:`~feedgpu.sources.tar.local.write_tables` (``feedgpu convert --to tar`` calls it) writes, beside each shard, the shard's
part of the index as :class:`~feedgpu.sources.tar.TarShardSource` builds it: the arrays and
rejected records of a saved index (:mod:`feedgpu.sources.tar.index`, same file layout, rejected
keys written relative to the shard so a copied dataset names its own path), and what the table is
checked against: the shard's size, its mtime (ns), its change stamp (device, inode and
``st_ctime_ns``: :func:`~feedgpu.sources.file_stats.change_stamp`), when the table was made, and
the xxh3-128 of the shard's bytes. A source opening a local shard without a valid saved index of its own (a new
machine, a new cache dir, a copy of the dataset) takes the table instead of indexing the shard
when (:func:`load_table`):

* the table is whole (its checksum), of this format and of this feedgpu version, else it is
  ignored, with a warning, and the shard indexed afresh;
* the shard has the recorded size, and either the recorded mtime and change stamp, the mtime not
  within :func:`racy_ns` of the time the table was made (a later write in the same mtime tick
  could go unnoticed), in which case nothing of the shard is read; or the recorded xxh3-128 of
  its bytes (one read of the whole shard: a copy, on this machine or another, with or without
  its mtimes; a file restored from a backup).

A shard changed after its table was written (another size, or other bytes) is indexed afresh,
also when the rewrite kept the size and set the mtime back (``touch -r``, ``rsync -t``): the
kernel gives the rewritten file a new ``st_ctime_ns`` (and a file renamed over it a new inode),
so its bytes are hashed. xxh3 is not a cryptographic hash: the table is trusted as far as the
folder it sits in (whoever can rewrite a shard can rewrite its table).
"""
from __future__ import annotations

import os
from pathlib import Path

from . import index as tar_index
from ..base import file_hash
from ..file_stats import change_stamp

SUFFIX = ".feedgpu-index"
#: The racy window of an mtime with a sub-second part: above the timestamp tick of file systems
#: with sub-second mtimes (a kernel clock tick, exFAT's hundredth of a second).
FINE_RACY_NS = 100_000_000


def table_path(shard: str) -> Path:
    """Where the table of ``shard`` is: ``<shard>.feedgpu-index`` beside it."""
    return Path(os.fspath(shard) + SUFFIX)


def racy_ns(mtime_ns: int) -> int:
    """How close a write after the table may come to ``mtime_ns`` and still keep it: 2 s
    (:data:`~feedgpu.sources.tar.index.RACY_NS`) for an mtime in whole seconds (a file system
    that keeps seconds, or FAT's 2 s), :data:`FINE_RACY_NS` for one with a sub-second part."""
    return tar_index.RACY_NS if mtime_ns % 1_000_000_000 == 0 else FINE_RACY_NS


def content_hash(path: str) -> str:
    """xxh3-128 (hex) of a file's bytes (:func:`~feedgpu.sources.base.file_hash`)."""
    return file_hash(path)


def relative_rejects(rejected, path: str) -> list:
    """``rejected`` entries with the shard's name in their keys replaced by ``""``."""
    out = []
    for key, reason, detail in rejected:
        if key == path or key.startswith(path + ":"):
            key = key[len(path):]
        else:
            raise ValueError(f"a rejected record of {path} named {key!r}")
        out.append([key, reason, detail])
    return out


def write_table(shard: str, part: dict, st_before: os.stat_result, content: str, made_ns: int) -> Path | None:
    """Write the table of one shard indexed as ``part`` (arrays, ``labeled``, ``other``,
    ``rejected``) from its bytes hashed as ``content`` while its stat was ``st_before``; None
    (nothing written) when the shard changed meanwhile."""
    st = os.stat(shard)
    if (st.st_size, st.st_mtime_ns, st.st_ino) != (st_before.st_size, st_before.st_mtime_ns, st_before.st_ino):
        return None
    head = {"labeled": bool(part["labeled"]), "other": int(part["other"]),
            "rejected": relative_rejects(part["rejected"], shard),
            "table": {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "stamp": change_stamp(st), "made_ns": made_ns,
                      "xxh3_128": content}}
    path = table_path(shard)
    tar_index.write(path, head, part)
    return path


def load_table(shard: str) -> tuple[dict | None, str | None, bool]:
    """``(part, problem, read)`` for a shard: its part of the index from the table beside it when
    that holds (module docstring), else None; ``problem``: why a table that is there was not used
    (corrupt, foreign, or the shard changed since), None when it was used or there is none;
    ``read``: whether the shard's bytes were hashed."""
    path = table_path(shard)
    try:
        header, arrays = tar_index.read(path)
        t = header["table"]
        size, mtime, made, content = int(t["size"]), int(t["mtime_ns"]), int(t["made_ns"]), str(t["xxh3_128"])
        stamp = t.get("stamp")
        rejected = [[shard + k, r, d] for k, r, d in header["rejected"]]
        part = dict(arrays, labeled=bool(header["labeled"]), other=int(header["other"]), rejected=rejected)
    except FileNotFoundError:
        return None, None, False
    except tar_index.Unusable as e:
        return None, f"{path}: {e}", False
    except (KeyError, TypeError, ValueError) as e:
        return None, f"{path}: not a member table ({type(e).__name__}: {e})", False
    try:
        st = os.stat(shard)
    except OSError:
        return None, None, False
    if st.st_size != size:
        return None, f"{shard} changed since its member table was written (size {st.st_size}, table: {size})", False
    if st.st_mtime_ns == mtime and stamp == change_stamp(st) and mtime < made - racy_ns(mtime):
        return part, None, False
    try:
        same = content_hash(shard) == content
    except OSError:
        return None, None, True
    if not same:
        return None, f"{shard} changed since its member table was written (its bytes differ)", True
    return part, None, True
