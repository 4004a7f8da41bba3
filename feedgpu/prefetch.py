"""Device prefetch: copy batches to the GPU ahead of the training loop.

Each batch is copied into a pinned host buffer (reused, one per batch in flight), sent to the
device with ``non_blocking=True`` on a side CUDA stream ``depth`` batches ahead, and the
pipeline's batch stage (normalize) runs there, so uint8 NHWC crosses PCIe instead of float32.
The training loop's stream waits on an event recorded after the copy; ``record_stream`` keeps
the caching allocator from reusing the memory too early. Only built when CUDA is available.
"""
from __future__ import annotations

from collections import deque

from .exec.work import Batch


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
        self.stream = torch.cuda.Stream(device=self.device)
        self.queue: deque = deque()
        self.pinned: deque = deque()   # free (images, labels, event) pinned buffers
        self.done = False
        for _ in range(self.depth):
            self._launch()

    def _buffers(self, batch: Batch):
        torch = self.torch
        while self.pinned:
            imgs, labels, ev = self.pinned.popleft()
            if imgs.shape == batch.images.shape and imgs.dtype == batch.images.dtype:
                ev.synchronize()  # its previous copy has finished
                return imgs, labels
        return (torch.empty(batch.images.shape, dtype=batch.images.dtype, pin_memory=True),
                torch.empty(batch.labels.shape, dtype=batch.labels.dtype, pin_memory=True))

    def _launch(self) -> None:
        if self.done:
            return
        try:
            cpu = next(self.it)
        except StopIteration:
            self.done = True
            return
        torch = self.torch
        imgs, labels = self._buffers(cpu)
        imgs.copy_(cpu.images)
        labels.copy_(cpu.labels)
        del cpu  # the shared-memory slot goes back to the workers
        with torch.cuda.stream(self.stream):
            d_imgs = imgs.to(self.device, non_blocking=True)
            d_labels = labels.to(self.device, non_blocking=True)
            if self.batch_stage is not None:
                d_imgs = self.batch_stage.apply_batch(d_imgs)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.pinned.append((imgs, labels, ev))
        self.queue.append((d_imgs, d_labels, ev))

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if not self.queue:
            raise StopIteration
        d_imgs, d_labels, ev = self.queue.popleft()
        cur = self.torch.cuda.current_stream(self.device)
        cur.wait_event(ev)
        d_imgs.record_stream(cur)
        d_labels.record_stream(cur)
        if hasattr(self.it, "commit"):
            self.it.commit()  # counts for state_dict() only now that the training loop has it
        self._launch()
        return Batch(d_imgs, d_labels)

    def close(self) -> None:
        if hasattr(self.it, "close"):
            self.it.close()
