"""The torchvision backend's batches written straight into shared memory.

With ``default_collate`` and samples of one known shape (a compiled recipe ending in a crop or
a sized ``Resize``, then ``ToTensor``/``PILToTensor`` and per-pixel ops), workers write each
sample into its row of a batch buffer kept in shared memory across batches (the buffers a
pipeline's batches use, :class:`~feedgpu.exec.buffers.shm.BatchSlots`), instead of making a tensor per
sample and ``default_collate`` stacking them into fresh shared memory for every batch. The
training loop receives ``[images, labels]`` as from ``default_collate``: ``images`` (N, C, H, W)
of the recipe's dtype, ``labels`` int64 (N,).

A recipe with a tail (transforms run as the user's objects) writes the tail's tensors into the
rows the same way when they are plain tensors of the shape and dtype the recipe implies. A
batch where any sample does not fit (another shape or type, a target that is not an ``int``, more
samples than the buffer's rows) is collated by ``default_collate`` as before: the same values,
and ``default_collate``'s errors for samples it cannot stack.
"""
from __future__ import annotations

import numpy as np
import torch.utils.data as tud

from ..exec import progress
from ..exec.contract import Task
from ..exec.buffers.shm import BatchSlots
from .fused import FusedConvert
from .ops import CenterCropOp, FlipOp, RandomCropOp, RandomResizedCropOp, ResizeOp
from .work import TorchvisionWork

__all__ = ["TorchvisionSlotWork", "sample_layout", "slot_work"]

_SIZES = (RandomResizedCropOp, CenterCropOp, RandomCropOp)
_FLOAT_TAIL = ("ToTensor", "ConvertImageDtype", "ToDtype", "Normalize")
_UINT8_TAIL = ("PILToTensor", "ToImage")


def _size(ops: list) -> tuple[int, int] | None:
    """The (height, width) the ops give every sample, or None when it depends on the image."""
    size = None
    for op in ops:
        if isinstance(op, _SIZES):
            size = tuple(int(v) for v in op.t.size)
        elif isinstance(op, ResizeOp):
            s = op.t.size
            size = tuple(int(v) for v in s) if isinstance(s, (list, tuple)) and len(s) == 2 else None
        elif not isinstance(op, (FlipOp, FusedConvert)):
            return None
    return size if size is not None and len(size) == 2 else None


def sample_layout(ops: list, tail: list) -> tuple[tuple, np.dtype] | None:
    """``((C, H, W), numpy dtype)`` of every sample of a recipe compiled to ``ops`` (fused, see
    :func:`~feedgpu.torchvision.fused.fuse`) and ``tail``, or None when it is not known in
    advance. Without a tail the recipe must end in a :class:`FusedConvert`; with one, the tail's
    conversion names the dtype (float32 after ``ToTensor``/``ToDtype``/``Normalize``, uint8
    after ``PILToTensor``/``ToImage``): a guess that each batch checks."""
    size = _size(ops)
    if size is None:
        return None
    if not tail:
        if not ops or not isinstance(ops[-1], FusedConvert):
            return None
        try:
            dtype = np.dtype(str(ops[-1].dtype).replace("torch.", ""))
        except TypeError:   # bfloat16 and other dtypes numpy lacks
            return None
        return (3, *size), dtype
    if ops and isinstance(ops[-1], FusedConvert):
        return None   # a tail on tensors: its output is the user's
    names = [type(t).__name__ for t in tail]
    if any(n in _FLOAT_TAIL for n in names):
        return (3, *size), np.dtype(np.float32)
    if any(n in _UINT8_TAIL for n in names):
        return (3, *size), np.dtype(np.uint8)
    return None


class TorchvisionSlotWork(TorchvisionWork):
    """:class:`TorchvisionWork` with shared-memory batch buffers (module docstring). Tasks
    carry their ``slot`` (:class:`~feedgpu.exec.contract.Task`); payload: ``("rows", n)`` when the batch is in the
    slot, else ``("batch", collate_fn's batch)``.

    Args:
        found, compiled, collate_fn, seed, positional: as for :class:`TorchvisionWork`
            (``collate_fn`` is torch's ``default_collate``).
        batch_size: rows per buffer.
        layout: ``(sample shape, numpy dtype)`` from :func:`sample_layout`.
        inflight: batches in flight at most (workers x prefetch); ``keep_views`` more buffers
            let the training loop hold that many batches without a copy (see
            :meth:`~feedgpu.exec.buffers.shm.BatchSlots.hand_out`).

    Raises :class:`~feedgpu.errors.SharedMemoryError` when the buffers cannot be had."""

    def __init__(self, found, compiled, collate_fn, seed: int, batch_size: int, layout: tuple, inflight: int,
                 positional: bool = False, keep_views: int = 2):
        super().__init__(found, compiled, collate_fn, seed, batched=True, positional=positional)
        import torch

        shape, dtype = layout
        self.shape, self.keep_views = tuple(shape), keep_views
        self.torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        self.slots = BatchSlots(inflight + keep_views, batch_size, self.shape, dtype.str, populate=inflight)

    def can_submit(self) -> bool:
        return self.slots.free > 0

    def on_start(self) -> None:
        """In each worker: map the buffers in (:meth:`~feedgpu.exec.buffers.shm.BatchSlots.map_in`)."""
        self.slots.map_in()

    def task(self, tag: int, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> Task:
        return Task(tag, seq, epoch, indices, slot=self.slots.acquire())

    def discard(self, task: Task) -> None:
        self.slots.release(task.slot)

    def remote_handler(self):
        return super().handle   # away from the buffers: the collated batch travels back

    def land(self, task: tuple, payload):
        return ("batch", payload)

    def run_inline(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray):
        """In the main process: the batch made as :class:`TorchvisionWork` makes it (no buffer)."""
        return super().handle(Task(0, seq, epoch, indices)), None

    def handle(self, task: Task):
        seq, epoch, keys = task.seq, task.epoch, task.indices.tolist()
        images, labels = self.slots.arrays(task.slot)
        if len(keys) > len(labels):
            return ("batch", super().handle(task))
        direct = self.direct is not None
        items = []   # kept only once a sample does not fit
        for row, i in enumerate(keys):
            x, target = self.item(i, epoch, (seq << 20) + row, direct)
            if items or not self._put(x, target, images[row], labels, row):
                if not items:
                    items = [(self._row_tensor(images[k]), int(labels[k])) for k in range(row)]
                items.append((self.direct.apply(x) if direct else x, target))
        progress.at("collate_fn", keys[0] if keys and isinstance(keys[0], int) else -1)
        if items:
            return ("batch", self.collate_fn(items))
        return ("rows", len(keys))

    def _put(self, x, target, out: np.ndarray, labels: np.ndarray, row: int) -> bool:
        """Write sample ``x`` (the image before the fused conversion, or the tail's tensor) into
        ``out``, its target into ``labels[row]``; False (nothing written) when it does not fit."""
        import torch

        if type(target) is not int:
            return False
        if self.direct is not None:
            if (x.height, x.width) != self.shape[1:] or x.mode != "RGB":
                return False
            self.direct.write(x, out)
        else:
            if type(x) is not torch.Tensor or tuple(x.shape) != self.shape or x.dtype != self.torch_dtype:
                return False
            torch.from_numpy(out).copy_(x)
        labels[row] = target
        return True

    @staticmethod
    def _row_tensor(row: np.ndarray):
        import torch

        return torch.from_numpy(row.copy())

    def finish(self, task: Task, payload):
        kind, value = payload
        if kind == "batch":
            self.slots.release(task.slot)
            return value
        return list(self.slots.deliver(task.slot, value, self.keep_views))

    def close(self) -> None:
        self.slots.close()


def slot_work(found, compiled, *, collate, seed: int, batch_size: int, workers: int, prefetch: int,
              batched: bool, fixed_pool: bool, positional: bool) -> TorchvisionSlotWork | None:
    """A :class:`TorchvisionSlotWork` when a loader's batches can be written in place: ``workers``
    processes of its own (``fixed_pool``: no balancer, no remote workers), batches from a batch
    sampler (``batched``), torch's ``default_collate`` and a sample layout known in advance; slots
    for ``workers * prefetch`` batches of ``batch_size``. Else None (also when the shared memory
    cannot be had: the collated path needs none in advance)."""
    from ..errors import SharedMemoryError
    from .fused import fuse

    if workers <= 0 or not batched or collate is not tud.default_collate or not fixed_pool:
        return None
    layout = sample_layout(fuse(compiled.ops), list(compiled.tail))
    if layout is None:
        return None
    try:
        return TorchvisionSlotWork(found, compiled, collate, seed, batch_size, layout, workers * prefetch,
                                   positional=positional)
    except SharedMemoryError:
        return None
