"""Where each worker is: the stage and the sample it runs, in shared memory.

The pool makes a :class:`Board` (one shared-memory file, mapped before the workers start: forked
workers inherit it, spawned ones get its descriptor, see :mod:`feedgpu.exec.buffers.shm`) and
each worker writes, before every stage, the stage's name, the sample's index and the time into
its own slot (:func:`at`, a few array writes), and before each task how many tasks it has taken
from its queue (:func:`took`: a worker that dies is blamed for that task without a message
per task). When no batch comes within ``timeout``, the main process reads
the slots and names the stuck stage and sample in the :class:`~feedgpu.errors.LoaderTimeout`,
without asking the (stuck) worker anything.
"""
from __future__ import annotations

import mmap
import struct
import time
import weakref

from .buffers.shm import close_fd, attach_fd, share_fd, shared_file

SLOT = 128
_HEAD = struct.Struct("<dq")          # monotonic time the stage started, sample index
_TAKEN = struct.Struct("<q")          # at the slot's end: how many queue items the worker has taken
_TAKEN_AT = SLOT - _TAKEN.size
_NAME = _TAKEN_AT - _HEAD.size - 1
MAX_WORKERS = 1024

_mine: tuple[mmap.mmap, int] | None = None   # (board, offset) in a worker process


class Board:
    """``slots`` progress slots of 128 bytes, shared by the main process and its workers (picklable
    while the pool starts a spawn or forkserver worker)."""

    def __init__(self, slots: int = MAX_WORKERS):
        self.slots = slots
        self._fd, self.mm = shared_file(slots * SLOT, "feedgpu-progress")
        weakref.finalize(self, close_fd, self._fd)

    def __getstate__(self) -> dict:
        return {"slots": self.slots, "shared": share_fd(self._fd)}

    def __setstate__(self, state: dict) -> None:
        self.slots = state["slots"]
        self._fd, self.mm = attach_fd(state["shared"], self.slots * SLOT)
        weakref.finalize(self, close_fd, self._fd)

    def attach(self, wid: int) -> None:
        """In a worker: :func:`at` writes to slot ``wid`` from now on (cleared first)."""
        global _mine
        if 0 <= wid < self.slots:
            self.mm[wid * SLOT:(wid + 1) * SLOT] = bytes(SLOT)
            _mine = (self.mm, wid * SLOT)

    def read(self, wid: int) -> tuple[str, int, float] | None:
        """``(stage, sample index, seconds in it)`` of worker ``wid``, or None if it wrote nothing."""
        if not 0 <= wid < self.slots:
            return None
        off = wid * SLOT
        t, idx = _HEAD.unpack_from(self.mm, off)
        if t == 0.0:
            return None
        n = self.mm[off + _HEAD.size]
        name = bytes(self.mm[off + _HEAD.size + 1:off + _HEAD.size + 1 + n]).decode("utf-8", "replace")
        return name, idx, time.monotonic() - t

    def taken(self, wid: int) -> int:
        """How many items worker ``wid`` has taken from its task queue (see :func:`took`); the last
        one is what it runs or ran last. 0 before its first."""
        if not 0 <= wid < self.slots:
            return 0
        return max(0, _TAKEN.unpack_from(self.mm, wid * SLOT + _TAKEN_AT)[0])

    def expect(self, wid: int) -> None:
        """Before worker ``wid``'s process starts: its slot reads as not started (see
        :meth:`started`) until the worker attaches to it."""
        if 0 <= wid < self.slots:
            self.clear(wid)
            _TAKEN.pack_into(self.mm, wid * SLOT + _TAKEN_AT, -1)

    def started(self, wid: int) -> bool:
        """Whether worker ``wid`` has run its first lines (attached to its slot) since
        :meth:`expect`; True for a slot this board does not have."""
        if not 0 <= wid < self.slots:
            return True
        return _TAKEN.unpack_from(self.mm, wid * SLOT + _TAKEN_AT)[0] >= 0

    def clear(self, wid: int) -> None:
        if 0 <= wid < self.slots:
            self.mm[wid * SLOT:(wid + 1) * SLOT] = bytes(SLOT)


def took(count: int) -> None:
    """In a worker: it has taken its ``count``-th item from its task queue and starts on it (the
    main process blames a death on that task, see :meth:`Board.taken`)."""
    if _mine is not None:
        mm, off = _mine
        _TAKEN.pack_into(mm, off + _TAKEN_AT, count)


def at(stage: str, index: int) -> None:
    """In a worker: it starts ``stage`` on sample ``index`` now (no-op outside a pool worker)."""
    if _mine is None:
        return
    mm, off = _mine
    name = stage.encode("utf-8", "replace")[:_NAME]
    _HEAD.pack_into(mm, off, time.monotonic(), int(index))
    mm[off + _HEAD.size] = len(name)
    mm[off + _HEAD.size + 1:off + _HEAD.size + 1 + len(name)] = name
