"""Buffers handed to the training loop without a copy and recycled once it lets go of them: the
scheme under :class:`~feedgpu.exec.buffers.shm.BatchSlots` and
:class:`~feedgpu.exec.buffers.host.HostBuffers`.

``torch.from_numpy`` keeps the numpy array it wraps alive for as long as any tensor shares its
storage, so a ``weakref.finalize`` on each array handed out runs when the last tensor (or view)
over it is garbage-collected; when the last of a buffer's arrays goes, the buffer returns to the
free list. A batch the consumer keeps is therefore never overwritten. The finalizers hold the
owner through a weak reference: a buffer that comes back after its owner is gone is dropped.
"""
from __future__ import annotations

import threading
import weakref


class RecycledBuffers:
    """A free list of buffers, each named by a key (a slot number, an array), under one lock.

    ``held``: buffers handed out (:meth:`return_when_gone`) that the consumer still holds.
    Subclasses fill the free list and decide what a key is."""

    def __init__(self):
        self._free: list = []
        self._lock = threading.Lock()
        self.held = 0

    @property
    def free(self) -> int:
        """Buffers on the free list."""
        return len(self._free)

    def _pop_free(self):
        """A buffer's key from the free list (the last one returned first), None when empty."""
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, key) -> None:
        """Put ``key``'s buffer back on the free list."""
        with self._lock:
            self._free.append(key)

    def return_when_gone(self, key, arrays) -> None:
        """Count ``key``'s buffer as held until every numpy array of ``arrays`` (and every
        tensor or view over it) is garbage-collected, then :meth:`release` it."""
        remaining = [len(arrays)]
        lock = self._lock

        def done(owner=weakref.ref(self)):
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            buffers = owner()
            if last and buffers is not None:
                with lock:
                    buffers.held -= 1
                buffers.release(key)

        with lock:
            self.held += 1
        for arr in arrays:
            weakref.finalize(arr, done)
