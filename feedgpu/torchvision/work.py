"""The torchvision backend's task: a batch of a recognised dataset, sample by sample.

Each sample is read as the dataset's own loader reads it (torchvision's ``pil_loader``: the file
opened with PIL and converted to RGB; a recipe that starts with ``RandomResizedCrop`` decodes a
JPEG only down to the window's rows, the same pixels, :mod:`~feedgpu.torchvision.window`), run
through the compiled ops with feedgpu's per-sample draws, then through the tail (the user's own
transform objects) and ``target_transform``, and the batch goes through ``collate_fn``, as the
dataset's ``__getitem__`` and torch's loader would. Results travel back as a plain Dataset's do
(:class:`~feedgpu.exec.work.DatasetWork`); with workers and ``default_collate``,
:class:`~feedgpu.torchvision.slots.TorchvisionSlotWork` writes them into shared memory instead.
"""
from __future__ import annotations

import torch.utils.data as tud

from ..exec import progress
from ..exec.contract import Task
from ..exec.work import DatasetWork
from ..stages.draws import Draws, stage_draw_ids
from .fused import FusedConvert, fuse
from .ops import RandomResizedCropOp
from .window import load_rgb, load_window

__all__ = ["TorchvisionWork"]


class TorchvisionWork(DatasetWork):
    """Tasks ``(tag, seq, epoch, indices)``; payload: ``collate_fn``'s batch of
    ``(sample, target)`` pairs.

    Random ops draw from ``(seed, epoch, key, op)`` (:class:`~feedgpu.stages.draws.Draws`); the
    key is the sample's index in the loader's dataset, which feedgpu's own order gives once per
    epoch (so a sample's draws are the same for any worker count, world size or resume point).
    A user's sampler may give an index several times in an epoch (``WeightedRandomSampler``,
    replacement): with ``positional`` the key is then the index and its position in the rank's
    epoch (batch number and row), so each occurrence draws anew, as torch's RNG would.

    Args:
        found: the recognised dataset (:class:`~feedgpu.torchvision.recognise.Found`).
        compiled: its transform compiled (:class:`~feedgpu.torchvision.compile.Compiled`).
        collate_fn, seed, batched: as for :class:`DatasetWork`; ``seed`` keys the ops' draws.
        positional: key the draws by position too (a user's sampler).
    """

    def __init__(self, found, compiled, collate_fn, seed: int, batched: bool = True, positional: bool = False):
        super().__init__(found.outer, collate_fn, seed, batched)
        self.positional = positional
        self.found = found
        self.base = found.base
        self.ops, self.tail = fuse(compiled.ops), list(compiled.tail)
        self.draw_ids = stage_draw_ids(self.ops)
        # a first RandomResizedCrop on the loader's PIL image reads only the rows of its window
        self.window = bool(self.ops) and type(self.ops[0]) is RandomResizedCropOp
        fused = self.ops[-1] if self.ops and isinstance(self.ops[-1], FusedConvert) else None
        # the whole sample is compiled and torch's default_collate batches it: write the batch directly
        self.direct = fused if (fused is not None and not self.tail and batched and found.base.target_transform is None
                                and collate_fn is tud.default_collate) else None

    def item(self, i: int, epoch: int, position: int = 0, stop_before_direct: bool = False) -> tuple:
        """Sample ``i`` of the loader's dataset in ``epoch``: ``(sample, target)``; ``position``:
        its place in the rank's epoch, ``(batch number << 20) + row`` (used with ``positional``);
        ``stop_before_direct``: leave out the fused conversion (the batch writes it)."""
        j = self.found.base_index(i)
        path, target = self.base.samples[j]
        progress.at("read", i)
        key = int(i) % len(self.found.outer)
        if self.positional:
            key += (int(position) + 1) << 40   # indices below 2**40 keep their own keys
        ops, ids = self.ops, self.draw_ids
        if stop_before_direct and self.direct is not None:
            ops = ops[:-1]
        if self.window:
            x = load_window(path, ops[0], Draws(self.seed, epoch, key, ids[0]))
            ops, ids = ops[1:], ids[1:]
        else:
            x = load_rgb(path)
        for op, draw_id in zip(ops, ids):
            x = op.apply(x, Draws(self.seed, epoch, key, draw_id) if op.draws else None)
        for t in self.tail:
            x = t(x)
        if self.base.target_transform is not None:
            target = self.base.target_transform(target)
        return x, target

    def describe(self, index: int) -> str:
        """The sample's file, for messages."""
        try:
            return str(self.base.samples[self.found.base_index(index)][0])
        except (IndexError, TypeError, ValueError):
            return super().describe(index)

    def handle(self, task: Task):
        seq, epoch, keys = task.seq, task.epoch, task.indices.tolist()
        direct = self.direct is not None
        items = [self.item(i, epoch, (seq << 20) + row, direct) for row, i in enumerate(keys)]
        progress.at("collate_fn", keys[0] if keys and isinstance(keys[0], int) else -1)
        if direct:
            return self._assemble(items)
        return self.collate_fn(items)

    def _assemble(self, items: list):
        """``default_collate``'s ``[images, labels]`` for images still PIL before the fused
        conversion: in the main process (``num_workers=0``) each written into its row of one
        tensor, labels as int64; in a worker, or for images of different sizes or targets that
        are not ints, converted one by one and given to ``default_collate`` (which puts the batch
        in shared memory, and raises for different sizes, as with torch's loader)."""
        import torch

        fused = self.direct
        sizes = {img.size for img, _ in items}
        if len(sizes) != 1 or not all(type(t) is int for _, t in items) or tud.get_worker_info() is not None:
            # in a worker the batch must be in shared memory: default_collate allocates it there
            # (moving a finished tensor there would copy it again)
            return self.collate_fn([(fused.apply(img), t) for img, t in items])
        (w, h), = sizes
        out = torch.empty((len(items), 3, h, w), dtype=fused.dtype)
        rows = out.numpy()
        for k, (img, _) in enumerate(items):
            fused.write(img, rows[k])
        return [out, torch.tensor([t for _, t in items], dtype=torch.int64)]

