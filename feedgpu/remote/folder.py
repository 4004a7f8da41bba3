"""The shard cache's folder: lock files, what it holds, and eviction to a budget.

Entries are ``<key>.data`` with ``<key>.json`` beside it (whose modification time is the entry's
last use) and ``<key>.lock``; downloads in flight are ``<key>.data.part-<pid>-<thread>``, sized
to their file, so every process counts them against the budget.
"""
from __future__ import annotations

import fcntl
import os
import re
import threading
from contextlib import contextmanager

from ..errors import CacheFullError

_PART = re.compile(r"^(?P<key>[0-9a-f]{32})\.data\.part-(?P<pid>\d+)-\d+$")


_guard = threading.Lock()
_thread_locks: dict[str, threading.Lock] = {}


def _after_fork() -> None:
    global _guard
    _guard = threading.Lock()
    _thread_locks.clear()   # a parent thread may have held one at the fork: not ours


os.register_at_fork(after_in_child=_after_fork)


def _thread_lock(path: str) -> threading.Lock:
    """The lock that orders this process's threads on ``path`` (a record lock is the process's)."""
    with _guard:
        return _thread_locks.setdefault(path, threading.Lock())


@contextmanager
def locked(path: str):
    """An exclusive lock on ``path`` (created), released on exit; other processes, and other
    threads of this one, wait for it. A POSIX record lock (``lockf``) under a per-path thread
    lock: a process forked while it is held (a worker started while a download runs in a
    thread) does not inherit it, as it would an ``flock``, whose inherited copy would hold it
    for as long as the child lives."""
    with _thread_lock(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)   # releases the lock (this process has no other descriptor of it open)


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
    """Under the folder's lock: evict least recently used entries until ``size`` more bytes fit
    in ``budget``, never ``pinned`` keys or downloads in flight, and entries another thread or
    process holds the lock of (checking or serving them) only when the others are not enough
    (that holder then fetches its file again); returns the number evicted. Raises
    :class:`CacheFullError`."""
    if budget is None:
        return 0
    if size > budget:
        raise CacheFullError(f"{url}: {size} bytes do not fit in the shard cache's budget of "
                             f"{budget} bytes ({directory}); raise cache_budget")
    found = sorted(entries(directory))
    total = sum(e[2] for e in found)
    evicted, held = 0, []
    for used, key, nbytes in found:
        if total + size <= budget:
            return evicted
        if used == float("inf") or key in pinned:
            continue
        if not evict(directory, key):
            held.append((key, nbytes))
            continue
        total -= nbytes
        evicted += 1
    for key, nbytes in held:   # least recently used first, as found
        if total + size <= budget:
            break
        evict(directory, key, force=True)
        total -= nbytes
        evicted += 1
    if total + size > budget:
        raise CacheFullError(f"{url}: {size} bytes do not fit in the shard cache's budget of "
                             f"{budget} bytes ({directory}): {total} bytes are in use "
                             "(pinned or being downloaded); raise cache_budget")
    return evicted


@contextmanager
def try_locked(path: str):
    """:func:`locked` without waiting: yields True holding the lock, False (holding nothing)
    when another thread of this process or another process holds it. The same kind of lock as
    :func:`locked` (an ``flock`` would not see a ``lockf``), and its descriptor is opened only
    while no other thread here holds the lock: closing any descriptor of a file releases every
    record lock this process holds on it."""
    tl = _thread_lock(path)
    if not tl.acquire(blocking=False):
        yield False
        return
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except OSError:
            held = False
        yield held
    finally:
        if fd >= 0:
            os.close(fd)
        tl.release()


def evict(directory: str, key: str, force: bool = False) -> bool:
    """Remove an entry unless another thread or process holds its lock (checking or serving
    it); returns whether it was removed. ``force``: remove it whoever holds the lock (without
    opening the lock file, which would release this process's hold on it)."""
    if not force:
        with try_locked(os.path.join(directory, key + ".lock")) as held:
            if held:
                _remove_entry(directory, key)
            return held
    _remove_entry(directory, key)
    return True


def _remove_entry(directory: str, key: str) -> None:
    remove(os.path.join(directory, key + ".json"))
    remove(os.path.join(directory, key + ".data"))


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
