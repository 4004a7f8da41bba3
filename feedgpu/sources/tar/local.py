"""A local tar shard's part of the index, and many shards' parts at once in threads.

:func:`local_part` takes, in this order, the shard's saved index (:mod:`.index`), the member
table beside it (:mod:`.table`), else indexes it (:mod:`.scan` for a plain shard,
:mod:`.walk` for any other) and saves the result. It only reads the shard and writes its
saved index, so :class:`~feedgpu.sources.tar.TarShardSource` runs it for several shards at once
(:func:`ordered_map`: reading a shard and numpy's work on it release the GIL) and records
rejected records and warnings in shard order itself. :func:`write_tables` writes the member
tables beside shards.
"""
from __future__ import annotations

import os
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from . import index as _saved
from .members import IMAGE_SUFFIXES, LABEL_SUFFIXES, part_arrays
from .scan import scan_plain
from .table import content_hash, load_table, write_table
from .walk import index_with_tarfile

#: Threads that index local shards at once (one: in the calling thread).
INDEX_THREADS = min(2, os.cpu_count() or 1)


class LocalPart(NamedTuple):
    """One shard's part (arrays, ``labeled``, ``other``, ``rejected``) and how it was had:
    ``how`` is ``"saved"``, ``"table"`` or ``"indexed"``; ``notes``: warnings to give;
    ``table_problem``: why a member table beside the shard was not used (None: used or none)."""
    part: dict
    how: str
    notes: list
    table_problem: str | None


def index_local(path: str) -> dict:
    """A local shard's part, indexed: the numpy scan for a plain shard, :mod:`tarfile` for any other."""
    part = scan_plain(path, IMAGE_SUFFIXES, LABEL_SUFFIXES) if os.path.isfile(path) else None
    if part is not None:
        part.update(labeled=True, other=0, rejected=[])
        return part
    return part_arrays(index_with_tarfile(path, path))


def local_part(path: str, index_dir) -> LocalPart:
    """The part of the local shard ``path`` (module docstring); ``index_dir``: the saved indexes'
    folder, None for none. Raises what indexing raises (:class:`~feedgpu.errors.SourceError`)."""
    notes: list[str] = []
    sig = file = None
    if index_dir is not None:
        sig, file = _saved.shard_sig(path), _saved.index_file(index_dir, path)
        saved = _saved.load(file, sig, warn=notes.append)
        if saved is not None:
            meta, arrays = saved
            return LocalPart(dict(arrays, labeled=meta["labeled"], other=meta["other"], rejected=meta["rejected"]),
                             "saved", notes, None)
    start = _saved.now_ns()
    part, problem, read = load_table(path)
    how = "table"
    if part is None:
        part, how = index_local(path), "indexed"
    if file is not None and (how == "indexed" or read):   # a table taken on its mtime costs no read again
        try:
            _saved.save(file, sig, {k: part[k] for k in ("labeled", "other", "rejected")}, part, start)
        except OSError as e:
            notes.append(f"feedgpu: cannot save the tar index of {path} in {file.parent} ({e})")
    return LocalPart(part, how, notes, problem)


def ordered_map(fn, items: list, threads: int | None = None):
    """``fn(item)`` for each item, in order, computed up to ``threads`` at once (default
    :data:`INDEX_THREADS`) and at most twice that many ahead of the consumer; an exception is
    raised where its item comes."""
    threads = INDEX_THREADS if threads is None else threads
    if threads <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="feedgpu-index")
    try:
        ahead: deque = deque()
        rest = iter(items)
        for item in rest:
            ahead.append(pool.submit(fn, item))
            if len(ahead) >= 2 * threads:
                break
        while ahead:
            done = ahead.popleft()
            nxt = next(rest, _END)
            if nxt is not _END:
                ahead.append(pool.submit(fn, nxt))
            yield done.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_END = object()


def index_for_table(shard: str) -> tuple[dict, os.stat_result, str, int]:
    """``(part, stat, content, made_ns)`` of a local shard, the arguments after the shard of
    :func:`~feedgpu.sources.tar.table.write_table`: its part of the index (:func:`index_local`),
    its stat and xxh3-128 before it was read, and when (ns) that began. Raises what indexing
    raises (:class:`~feedgpu.errors.SourceError`, :class:`OSError`)."""
    made = _saved.now_ns()   # before the stat: a write while it is read gets a later mtime
    st = os.stat(shard)
    content = content_hash(shard)
    return index_local(shard), st, content, made


def write_tables(shards, threads: int | None = None) -> list[Path]:
    """Index each local shard (``shards``: paths) and write its table beside it; returns the
    tables written. A shard that changes while it is indexed gets none (a warning names it).
    Raises :class:`~feedgpu.errors.SourceError` for a shard that is not a readable tar (as
    :class:`~feedgpu.sources.tar.TarShardSource` would)."""
    def one(shard: str):
        return shard, write_table(shard, *index_for_table(shard))

    out = []
    for shard, table in ordered_map(one, [os.fspath(s) for s in shards], threads):
        if table is None:
            warnings.warn(f"feedgpu: {shard} changed while its member table was written; it has none",
                          stacklevel=2)
        else:
            out.append(table)
    return out
