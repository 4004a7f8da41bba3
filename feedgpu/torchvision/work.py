"""The torchvision backend's task: a batch of a recognised dataset, sample by sample.

Each sample is read with the dataset's own loader (torchvision's ``pil_loader``: the file
opened with PIL and converted to RGB), run through the compiled ops with feedgpu's per-sample
draws, then through the tail (the user's own transform objects) and ``target_transform``,
and the batch goes through ``collate_fn``, as the dataset's ``__getitem__`` and torch's loader
would. Results travel back as a plain Dataset's do (:class:`~feedgpu.exec.work.DatasetWork`).
"""
from __future__ import annotations

from ..exec import progress
from ..exec.work import DatasetWork
from ..stages.draws import Draws, stage_draw_ids

__all__ = ["TorchvisionWork"]


class TorchvisionWork(DatasetWork):
    """Tasks ``(tag, seq, epoch, indices)``; payload: ``collate_fn``'s batch of
    ``(sample, target)`` pairs.

    Args:
        found: the recognised dataset (:class:`~feedgpu.torchvision.recognise.Found`).
        compiled: its transform compiled (:class:`~feedgpu.torchvision.compile.Compiled`).
        collate_fn, seed, batched: as for :class:`DatasetWork`; ``seed`` keys the ops' draws.
    """

    def __init__(self, found, compiled, collate_fn, seed: int, batched: bool = True):
        super().__init__(found.outer, collate_fn, seed, batched)
        self.found = found
        self.base = found.base
        self.ops, self.tail = list(compiled.ops), list(compiled.tail)
        self.draw_ids = stage_draw_ids(self.ops)

    def item(self, i: int, epoch: int) -> tuple:
        """Sample ``i`` of the loader's dataset in ``epoch``: ``(sample, target)``."""
        j = self.found.base_index(i)
        path, target = self.base.samples[j]
        progress.at("read", i)
        x = self.base.loader(path)
        for op, draw_id in zip(self.ops, self.draw_ids):
            x = op.apply(x, Draws(self.seed, epoch, j, draw_id) if op.draws else None)
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

    def handle(self, task: tuple):
        epoch, keys = task[2], task[3].tolist()
        items = [self.item(i, epoch) for i in keys]
        progress.at("collate_fn", keys[0] if keys and isinstance(keys[0], int) else -1)
        return self.collate_fn(items)
