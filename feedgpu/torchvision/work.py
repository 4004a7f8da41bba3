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
        self.ops, self.tail = list(compiled.ops), list(compiled.tail)
        self.draw_ids = stage_draw_ids(self.ops)

    def item(self, i: int, epoch: int, position: int = 0) -> tuple:
        """Sample ``i`` of the loader's dataset in ``epoch``: ``(sample, target)``; ``position``:
        its place in the rank's epoch, ``(batch number << 20) + row`` (used with ``positional``)."""
        j = self.found.base_index(i)
        path, target = self.base.samples[j]
        progress.at("read", i)
        x = self.base.loader(path)
        key = int(i) % len(self.found.outer)
        if self.positional:
            key += (int(position) + 1) << 40   # indices below 2**40 keep their own keys
        for op, draw_id in zip(self.ops, self.draw_ids):
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

    def handle(self, task: tuple):
        seq, epoch, keys = task[1], task[2], task[3].tolist()
        items = [self.item(i, epoch, (seq << 20) + row) for row, i in enumerate(keys)]
        progress.at("collate_fn", keys[0] if keys and isinstance(keys[0], int) else -1)
        return self.collate_fn(items)
