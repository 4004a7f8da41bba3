"""Device prefetch: copy batches to the GPU ahead of the training loop.

Each batch is copied into a pinned host buffer (reused, one per batch in flight:
:class:`~feedgpu.exec.buffers.host.HostBuffers`, back once the copy out of it has completed),
sent to the device with ``non_blocking=True`` on a side CUDA stream ``depth`` batches ahead, and
the pipeline's batch stage (normalize) runs there, so uint8 NHWC crosses PCIe instead of float32.
The training loop's stream waits on an event recorded after the copy
(:mod:`feedgpu.exec.buffers.handoff`, shared with the DALI engine). Only built when CUDA is available.
"""
from __future__ import annotations

from collections import deque

from ..exec.buffers.handoff import SideStream, hand_over
from ..exec.buffers.host import HostBuffers
from ..exec.work import Batch


class CudaPrefetcher:
    """Wraps a CPU batch iterator; yields :class:`Batch` on ``device``.

    Args:
        it: iterator of CPU :class:`Batch` (``images`` uint8 NHWC or final dtype, ``labels`` int64).
        device: ``"cuda"`` or ``"cuda:N"``.
        batch_stage: run on the device after the copy (``None``: images arrive as produced).
        depth: batches copied ahead (default 2).
    """

    def __init__(self, it, device: str, batch_stage=None, depth: int = 2):
        import torch

        self.torch = torch
        self.it = it
        self.device = torch.device(device)
        self.batch_stage = batch_stage
        self.depth = max(1, depth)
        self.side = SideStream(self.device)
        self.queue: deque = deque()
        self.pinned: tuple[HostBuffers, HostBuffers] | None = None   # images', labels' (from the first batch)
        self.done = False
        for _ in range(self.depth):
            self._launch()

    def _buffers(self, batch: Batch):
        """Pinned ``(images, labels)`` for ``batch``, from the recycled buffers (sized by the first
        batch: a later batch of other shape or dtype, or with more rows, gets fresh ones):
        ``(images tensor, labels tensor, the arrays to give back or None)``."""
        torch = self.torch
        imgs, labels = batch.images, batch.labels
        if self.pinned is None:
            self.pinned = (HostBuffers(imgs.shape[0], imgs.shape[1:], str(imgs.dtype).replace("torch.", ""),
                                       pinned=True, count=self.depth),
                           HostBuffers(labels.shape[0], labels.shape[1:], str(labels.dtype).replace("torch.", ""),
                                       pinned=True, count=self.depth))
        fits = all(b.shape[0] >= t.shape[0] and b.shape[1:] == tuple(t.shape[1:]) and str(t.dtype) == f"torch.{b.dtype}"
                   for b, t in zip(self.pinned, (imgs, labels)))
        if not fits:
            return (torch.empty(imgs.shape, dtype=imgs.dtype, pin_memory=True),
                    torch.empty(labels.shape, dtype=labels.dtype, pin_memory=True), None)
        arrays = (self.pinned[0].take(), self.pinned[1].take())
        rows = imgs.shape[0]
        return torch.from_numpy(arrays[0][:rows]), torch.from_numpy(arrays[1][:rows]), arrays

    def _launch(self) -> None:
        if self.done:
            return
        try:
            cpu = next(self.it)
        except StopIteration:
            self.done = True
            return
        imgs, labels, arrays = self._buffers(cpu)
        imgs.copy_(cpu.images)
        labels.copy_(cpu.labels)
        del cpu  # the shared-memory slot goes back to the workers
        with self.side.use():
            d_imgs = imgs.to(self.device, non_blocking=True)
            d_labels = labels.to(self.device, non_blocking=True)
            copied = self.side.record()
            if self.batch_stage is not None:
                d_imgs = self.batch_stage.apply_batch(d_imgs)
            ev = self.side.record()
        if arrays is not None:   # reused once the copy out of them has completed
            for buffers, arr in zip(self.pinned, arrays):
                buffers.give_back_after(arr, copied)
        self.queue.append((d_imgs, d_labels, ev))

    def __len__(self) -> int:
        return len(self.it)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if not self.queue:
            raise StopIteration
        d_imgs, d_labels, ev = self.queue.popleft()
        hand_over(ev, d_imgs, d_labels)
        if hasattr(self.it, "commit"):
            self.it.commit()  # counts for state_dict() only now that the training loop has it
        self._launch()
        return Batch(d_imgs, d_labels)

    def close(self) -> None:
        if hasattr(self.it, "close"):
            self.it.close()
