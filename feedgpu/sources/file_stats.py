"""``stat`` many files: the sizes and mtimes of a folder source's files, in forked processes
when there are many.

A ``stat`` is one system call; from Python most of its cost is the call itself, and threads
serialise on the GIL around it (two threads stat slower than one), so the files are split
into ranges that forked processes stat side by side. The paths are inherited by the fork (no
copy is sent); each process sends back four int64 arrays of its range.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import stat as _stat
import sys

import numpy as np

from ..host import cpu_cores

log = logging.getLogger("feedgpu.sources")

#: Fewer files than this are stat-ed in this process (starting processes costs more).
PARALLEL_MIN = 100_000
#: With ``stat_files="auto"`` (a folder source's default) the listed files are stat-ed while
#: indexing when there are at most this many; above it a stat of every file would cost more than
#: the rest of a cold start (``bench/results/folder_index.md``), so the folders are only listed.
AUTO_MAX = 250_000
#: Processes at most (one per usable core up to this).
MAX_PROCESSES = 8
#: ``kinds`` value of a path whose ``stat`` (following links) gives something other than a
#: regular file; a failed ``stat`` gives its errno (> 0), a regular file 0.
NOT_REGULAR = -1

_JOB: tuple | None = None   # (prefix, blob, offsets) for the forked processes
_MASK = (1 << 64) - 1
_K_CTIME, _K_INO = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F


def change_stamp(st: os.stat_result) -> int:
    """One int64 of what a ``stat`` tells of a file beyond its size and mtime: its device,
    inode and ``st_ctime_ns`` (set by the kernel on every write, rename into place, ``chmod``
    and ``utime``, so a rewrite that keeps the size and sets the mtime back still changes it),
    mixed by multiplying with two odd 64-bit constants and adding (0 for no file)."""
    v = (st.st_ctime_ns * _K_CTIME + st.st_ino * _K_INO + st.st_dev) & _MASK
    return v - (1 << 64) if v >> 63 else v


def _can_fork() -> bool:
    """Linux (fork is the start method there; elsewhere it is unsafe or absent), and not in a
    daemonic process (a DataLoader worker), which may not have children."""
    return sys.platform.startswith("linux") and not multiprocessing.current_process().daemon


def stat_paths(prefix: bytes, blob: np.ndarray, offsets: np.ndarray, processes: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``os.stat`` (links followed) of each path ``prefix + blob[offsets[i]:offsets[i + 1]]``.

    Args:
        prefix: bytes put before every path (the root and a separator).
        blob, offsets: the paths as one uint8 byte buffer and ``n + 1`` offsets into it.
        processes: processes to stat in (default: one per usable core, at most
            :data:`MAX_PROCESSES`; 1, or fewer than :data:`PARALLEL_MIN` paths: this process).

    Returns:
        ``(sizes, mtimes, kinds, stamps)``, int64 arrays of ``n``: bytes and mtime in ns (-1 where
        the ``stat`` failed), 0 for a regular file, :data:`NOT_REGULAR`, or the errno of a
        failed ``stat``, and each file's :func:`change_stamp` (0 where the ``stat`` failed). Where processes cannot be started (not Linux, a daemonic process,
        out of processes), this process stats every path.
    """
    n = len(offsets) - 1
    job = (prefix, blob.tobytes(), offsets.tolist())
    procs = min(MAX_PROCESSES, cpu_cores()) if processes is None else max(1, processes)
    if procs > 1 and n >= PARALLEL_MIN and _can_fork():
        try:
            return _in_processes(job, n, procs)
        except Exception as e:  # noqa: BLE001 - out of processes or memory: the same stats, here
            log.debug("stat in %d processes failed (%s): stat-ing in this one", procs, e)
    return _arrays(_stat_range(job, 0, n))


def _in_processes(job: tuple, n: int, procs: int) -> tuple[np.ndarray, ...]:
    global _JOB
    ctx = multiprocessing.get_context("fork")
    parts = procs * 4   # ranges a few times the processes: a slow range does not hold the rest
    bounds = [(n * k // parts, n * (k + 1) // parts) for k in range(parts)]
    _JOB = job
    try:
        with ctx.Pool(procs) as pool:
            got = pool.map(_child, bounds, chunksize=1)
    finally:
        _JOB = None
    out = [np.concatenate([np.frombuffer(g[i], np.int64) for g in got]) if got else np.zeros(0, np.int64)
           for i in range(4)]
    return out[0], out[1], out[2], out[3]


def _child(bounds: tuple[int, int]) -> tuple[bytes, ...]:
    return tuple(np.asarray(x, np.int64).tobytes() for x in _stat_range(_JOB, *bounds))


def _stat_range(job: tuple, lo: int, hi: int) -> tuple[list, list, list, list]:
    prefix, blob, off = job
    sizes, mtimes, kinds, stamps = [], [], [], []
    stat_, isreg, stamp = os.stat, _stat.S_ISREG, change_stamp
    for i in range(lo, hi):
        try:
            st = stat_(prefix + blob[off[i]:off[i + 1]])
        except OSError as e:
            sizes.append(-1)
            mtimes.append(-1)
            kinds.append(e.errno or 1)
            stamps.append(0)
            continue
        sizes.append(st.st_size)
        mtimes.append(st.st_mtime_ns)
        kinds.append(0 if isreg(st.st_mode) else NOT_REGULAR)
        stamps.append(stamp(st))
    return sizes, mtimes, kinds, stamps


def _arrays(lists: tuple[list, ...]) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(x, np.int64) for x in lists)   # type: ignore[return-value]
