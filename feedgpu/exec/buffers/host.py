"""Reusable host buffers for batches: those an engine copies out of another library (DALI), and
the pinned staging buffers of the copy to the GPU (:class:`~feedgpu.prefetch.CudaPrefetcher`).

A fresh ``torch.empty`` of a batch is memory the kernel maps and zeroes page by page on the
first write, which makes the first copy into it several times slower than a copy into a buffer
written once (``bench/results/dali_cpu.md``, variants ``prep_thread`` and ``prep_thread_reused``).

A buffer comes back in one of two ways:

* handed to the training loop without a copy (:meth:`HostBuffers.hand_out`), it returns when the
  last tensor viewing it is garbage-collected (:class:`~feedgpu.exec.buffers.recycled.RecycledBuffers`,
  as for :class:`~feedgpu.exec.buffers.shm.BatchSlots`). A batch the consumer keeps is therefore
  never overwritten; when all buffers are held a fresh one is allocated;
* copied from on a CUDA stream (:meth:`HostBuffers.give_back_after`), it returns once the event
  recorded after the copy has completed.
"""
from __future__ import annotations

import numpy as np

from .recycled import RecycledBuffers


class HostBuffers(RecycledBuffers):
    """Up to ``count`` batch buffers of ``(batch_size, *sample_shape)`` in ``dtype``.

    Args:
        batch_size: rows of a buffer (the largest batch).
        sample_shape: shape of one sample, e.g. ``(3, 224, 224)``.
        dtype: ``"uint8"``, ``"float16"`` or ``"float32"``.
        pinned: page-locked memory (``torch.empty(pin_memory=True)``) so a later copy to the GPU
            is asynchronous; only where CUDA is available.
        count: buffers kept for reuse (default 4: the one being filled, the prefetched ones and
            the one the training step holds); beyond that, batches get fresh, untracked memory.
    """

    def __init__(self, batch_size: int, sample_shape: tuple, dtype: str, pinned: bool = False, count: int = 4):
        super().__init__()   # the free list's keys are the kept buffers themselves
        self.shape = (int(batch_size), *map(int, sample_shape))
        self.dtype, self.pinned, self.count = np.dtype(dtype), bool(pinned), int(count)
        self._made = 0
        self._kept: list[np.ndarray] = []   # the buffers kept for reuse (at most ``count``)
        self._pending: list[tuple[np.ndarray, object]] = []   # (buffer, CUDA event of its last copy)
        self.fresh = 0      # batches that found every kept buffer held

    def _allocate(self) -> np.ndarray:
        import torch

        t = torch.empty(self.shape, dtype=getattr(torch, self.dtype.name), pin_memory=self.pinned)
        arr = t.numpy()   # keeps ``t`` (and its pinned allocation) alive
        arr.fill(0)       # fault the pages in now, once, not during every batch's copy
        return arr

    def take(self) -> np.ndarray:
        """A whole buffer: a free one (one whose copy has completed counts), a new kept one, the
        oldest one still being copied from once its copy completes, or (all held) a fresh
        untracked one."""
        with self._lock:
            still = []
            for arr, event in self._pending:
                if event.query():
                    self._free.append(arr)
                else:
                    still.append((arr, event))
            self._pending = still
            if self._free:
                return self._free.pop()
            if self._pending and self._made >= self.count:
                arr, event = self._pending.pop(0)
                event.synchronize()
                return arr
            keep = self._made < self.count
            if keep:
                self._made += 1
            else:
                self.fresh += 1
        arr = self._allocate()
        if keep:
            with self._lock:
                self._kept.append(arr)
        return arr

    def _is_kept(self, arr: np.ndarray) -> bool:
        return any(arr is k for k in self._kept)

    def give_back(self, arr: np.ndarray) -> None:
        """Return a buffer that was never handed out (a failed batch)."""
        if self._is_kept(arr):
            self.release(arr)

    def give_back_after(self, arr: np.ndarray, event) -> None:
        """Return a buffer once ``event`` (a ``torch.cuda.Event`` recorded after the last copy
        out of it) has completed; :meth:`take` checks with ``event.query()``."""
        if self._is_kept(arr):
            with self._lock:
                self._pending.append((arr, event))

    def hand_out(self, arr: np.ndarray, rows: int):
        """A torch tensor over ``arr[:rows]``; ``arr`` returns to the free list when that tensor
        and every view of it are gone."""
        import torch

        view = arr[:rows]
        if self._is_kept(arr):
            self.return_when_gone(arr, (view,))
        return torch.from_numpy(view)


def pin(batch):
    """``batch`` with its tensors in pinned memory (tensors inside named tuples, tuples, lists
    and dicts; anything else as it is), as torch's ``pin_memory=True`` does."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(pin(x) for x in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(pin(x) for x in batch)
    if isinstance(batch, dict):
        return {k: pin(v) for k, v in batch.items()}
    return batch
