"""The order of a ``torch.utils.data.DistributedSampler`` given to a loader as ``sampler``.

A :class:`~feedgpu.DataLoader` honours such a sampler as torch's loader does: each rank reads
``indices[rank:total_size:num_replicas]`` of the sampler's epoch list, where the list is
``torch.randperm(n)`` drawn from ``torch.Generator().manual_seed(sampler.seed + epoch)`` (index
order with ``shuffle=False``), padded by repeating its head up to a multiple of
``num_replicas`` (the sampler's ``drop_last=False``) or cut to one (``drop_last=True``). The
epoch is the sampler's ``epoch`` (``set_epoch``); the loader's ``batch_size`` and ``drop_last``
then batch each rank's share, so with the loader's ``drop_last=True`` each rank drops its own
incomplete last batch, as in torch. No process group is needed: ``rank`` and ``num_replicas``
are the sampler's.

The permutation is taken from torch's own ``DistributedSampler`` (one replica, so unpadded and
unsplit): a pure function of ``(seed, epoch)``, the same in every process.

Position and resume follow :mod:`feedgpu.order.sharded`: after ``k`` batches on every rank, the ranks
together have consumed the first ``min(k * num_replicas * batch_size, n)`` entries of the epoch's
permutation. A state records that prefix, so a resume on the same world size is a seek (exactly
the batches the run would have got), and a resume on another world size splits the rest of the
permutation over the new ranks with the same rules (its own padding or cut, then the loader's
``drop_last``): nothing of the epoch is delivered twice or lost beyond that padding or cut.
From the next epoch on, each rank reads the sampler's own split again.
"""
from __future__ import annotations

import math

import numpy as np
import torch.utils.data as tud

from ..errors import ConfigError
from .sharded import ShardedOrder


class SamplerSplit(ShardedOrder):
    """The batches one rank reads in one epoch under a ``DistributedSampler``'s split.

    Args:
        n: samples in the dataset (> 0).
        batch_size: the loader's batch size (> 0).
        drop_last: the loader's ``drop_last``: drop this rank's incomplete last batch.
        shuffle, seed, rank, world_size, split_drop_last: the sampler's ``shuffle``, ``seed``,
            ``rank``, ``num_replicas`` and ``drop_last``.

    Unlike :class:`~feedgpu.order.sharded.ShardedOrder`, an epoch may hold no batch (as in torch).
    """

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, seed: int, rank: int, world_size: int,
                 drop_last: bool, split_drop_last: bool):
        super().__init__(n, batch_size, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
                         drop_last=False)
        self.drop_last, self.split_drop_last = drop_last, bool(split_drop_last)
        self.per_rank = n // world_size if split_drop_last else math.ceil(n / world_size)
        self.num_batches = self.per_rank // batch_size if drop_last else math.ceil(self.per_rank / batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sampler's permutation of all ``n`` indices for ``epoch`` (int64), before its
        padding and split."""
        whole = tud.DistributedSampler(range(self.n), num_replicas=1, rank=0, shuffle=self.shuffle,
                                       seed=self.seed)
        whole.set_epoch(int(epoch))
        return np.fromiter(iter(whole), dtype=np.int64, count=self.n)

    def rank_share(self, full: np.ndarray, start: int) -> tuple[int, np.ndarray]:
        """``(batches, indices)`` of this rank: the sampler's padding or cut and split of what
        remains of ``full`` after ``start``, batched by the loader's rule."""
        w, bs = self.world_size, self.batch_size
        m = len(full) - start
        per_rank = m // w if self.split_drop_last else math.ceil(m / w)
        total = per_rank * w
        rest = full[start:start + total]
        if total > m:  # the sampler's padding: the head of the epoch's list, repeated as needed
            rest = np.concatenate([rest, np.resize(full, total - m)])
        mine = rest[self.rank::w]
        num_batches = per_rank // bs if self.drop_last else math.ceil(per_rank / bs)
        return num_batches, mine[:num_batches * bs]

    def config(self) -> dict:
        out = super().config()
        out.update(drop_last=self.drop_last, split="DistributedSampler", split_seed=self.seed,
                   split_drop_last=self.split_drop_last)
        return out


def split_order(sampler, n: int, batch_size: int, drop_last: bool, cached) -> SamplerSplit:
    """``cached`` when it is ``sampler``'s order with these settings, else a new one.

    Raises :class:`~feedgpu.errors.ConfigError` when the sampler was built for a dataset of
    another size than the loader's (torch's sampler would fail at its first epoch)."""
    made_for = getattr(sampler, "total_size", None)
    w = int(sampler.num_replicas)
    expected = (n // w if sampler.drop_last else math.ceil(n / w)) * w
    if made_for is not None and made_for != expected:
        raise ConfigError(f"the DistributedSampler was built for a dataset of another size ({made_for} indices over "
                          f"{w} replicas) than the loader's, which holds {n} samples; build it on the loader's dataset")
    order = SamplerSplit(n, batch_size, shuffle=bool(sampler.shuffle), seed=int(sampler.seed),
                         rank=int(sampler.rank), world_size=w, drop_last=drop_last,
                         split_drop_last=bool(sampler.drop_last))
    if cached is not None and cached.config() == order.config():
        return cached
    return order
