"""The shard cache's folder: lock files, what it holds, and eviction to a budget.

Entries are ``<key>.data`` with ``<key>.json`` beside it (whose modification time is the entry's
last use) and ``<key>.lock``; downloads in flight are ``<key>.data.part-<pid>-<thread>``, sized
to their file, so every process counts them against the budget.
"""
from __future__ import annotations

import fcntl
import os
import re
from contextlib import contextmanager

from ..errors import CacheFullError

_PART = re.compile(r"^(?P<key>[0-9a-f]{32})\.data\.part-(?P<pid>\d+)-\d+$")


@contextmanager
def locked(path: str):
    """An exclusive ``flock`` on ``path`` (created), released on exit; other processes, and other
    descriptors of this one, wait for it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # releases the lock


def entries(directory: str) -> list[tuple[float, str, int]]:
    """``[(last use, key, size)]`` of the folder's files, and of downloads in flight (last use
    ``inf``); a partial file of a process that is gone is removed."""
    out = []
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        p = os.path.join(directory, name)
        m = _PART.match(name)
        try:
            if m:
                if not alive(int(m.group("pid"))):
                    remove(p)
                    continue
                out.append((float("inf"), m.group("key"), os.path.getsize(p)))
            elif name.endswith(".data"):
                key = name[:-5]
                try:
                    used = os.path.getmtime(os.path.join(directory, key + ".json"))
                except OSError:
                    used = 0.0
                out.append((used, key, os.path.getsize(p)))
        except OSError:
            continue
    return out


def make_room(directory: str, budget: int | None, url: str, size: int, pinned: set) -> int:
    """Under the folder's lock: evict least recently used entries (not ``pinned`` keys, not
    downloads in flight, not entries another process holds the lock of) until ``size`` more
    bytes fit in ``budget``; returns the number evicted. Raises :class:`CacheFullError`."""
    if budget is None:
        return 0
    if size > budget:
        raise CacheFullError(f"{url}: {size} bytes do not fit in the shard cache's budget of "
                             f"{budget} bytes ({directory}); raise cache_budget")
    found = sorted(entries(directory))
    total = sum(e[2] for e in found)
    evicted = 0
    for used, key, nbytes in found:
        if total + size <= budget:
            return evicted
        if used == float("inf") or key in pinned or not evict(directory, key):
            continue
        total -= nbytes
        evicted += 1
    if total + size > budget:
        raise CacheFullError(f"{url}: {size} bytes do not fit in the shard cache's budget of "
                             f"{budget} bytes ({directory}): {total} bytes are in use "
                             "(pinned or being downloaded); raise cache_budget")
    return evicted


def evict(directory: str, key: str) -> bool:
    """Remove an entry unless another process holds its lock (downloading it)."""
    fd = os.open(os.path.join(directory, key + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        remove(os.path.join(directory, key + ".json"))
        remove(os.path.join(directory, key + ".data"))
        return True
    finally:
        os.close(fd)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
