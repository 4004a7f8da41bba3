"""Batch memory that is reused: buffers handed to the training loop without a copy, that come back
when the last tensor viewing them is garbage-collected.

- :mod:`.shm`: :class:`~feedgpu.exec.buffers.shm.BatchSlots`, shared-memory slots the pool's
  workers write batches into.
- :mod:`.host`: :class:`~feedgpu.exec.buffers.host.HostBuffers`, host (optionally pinned)
  buffers an engine copies into, and the staging buffers of the copy to the GPU.
- :mod:`.recycled`: :class:`~feedgpu.exec.buffers.recycled.RecycledBuffers`, the free list and
  the ``weakref.finalize`` return both kinds share.
- :mod:`.handoff`: handing a batch to the training loop on a CUDA device (side stream, event).
"""
