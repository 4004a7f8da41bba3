"""Seeded, sharded, resumable sample order: a pure function of (seed, epoch, rank, world_size).

Rules (same as ``torch.utils.data.DistributedSampler`` where it has one):

* ``shuffle=True``: a permutation of all ``n`` indices drawn from
  ``numpy.random.default_rng([seed, epoch])`` (PCG64 seeded through SeedSequence), so it changes
  every epoch; ``shuffle=False`` keeps index order.
* Sharding: rank ``r`` of ``w`` takes every ``w``-th index of the epoch order starting at ``r``.
* ``drop_last=False`` (remainder rule): the order is padded by repeating its head up to a
  multiple of ``w``, so every rank holds ``ceil(n / w)`` samples; the last batch of each rank is
  partial when ``ceil(n / w)`` is not a multiple of ``batch_size`` (the same size on every rank).
  Up to ``w - 1`` samples appear twice per epoch, only when ``n`` is not a multiple of ``w``.
* ``drop_last=True``: only ``floor(n / (w * batch_size))`` full batches per rank are kept; the
  remaining ``n mod (w * batch_size)`` samples of that epoch's order are not used that epoch.

Every rank gets the same number of batches, and nothing here depends on the worker count.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import ConfigError

_SEED_MASK = 0xFFFFFFFFFFFFFFFF  # SeedSequence takes non-negative ints: a negative seed wraps, as in sample_rng


class ShardedOrder:
    """The batches of indices one rank reads in one epoch.

    Args:
        n: number of samples in the source (> 0).
        batch_size: samples per batch (> 0).
        shuffle: permute each epoch (default True).
        seed: base seed (int, default 0).
        rank, world_size: this process's shard (default 0 of 1).
        drop_last: drop the incomplete tail (rule in the module docstring).

    Raises :class:`ConfigError` for an empty source, a bad rank or a batch size < 1, and when
    ``drop_last=True`` leaves no full batch.
    """

    def __init__(self, n: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False):
        if n <= 0:
            raise ConfigError("sampler: the source holds no samples")
        if batch_size < 1:
            raise ConfigError(f"sampler: batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"sampler: rank {rank} is not in [0, world_size={world_size})")
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, int(seed)
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        if drop_last:
            self.num_batches = n // (world_size * batch_size)
            self.per_rank = self.num_batches * batch_size
            if self.num_batches == 0:
                raise ConfigError(
                    f"sampler: drop_last=True with {n} samples, batch_size={batch_size} and "
                    f"world_size={world_size} leaves no full batch; lower batch_size or set drop_last=False")
        else:
            self.per_rank = math.ceil(n / world_size)
            self.num_batches = math.ceil(self.per_rank / batch_size)
        self._cached: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_batches

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All ``n`` indices in this epoch's order (int64), before sharding."""
        if not self.shuffle:
            return np.arange(self.n, dtype=np.int64)
        return np.random.default_rng([self.seed & _SEED_MASK, int(epoch)]).permutation(self.n).astype(np.int64)

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's indices for ``epoch`` (int64, length ``num_batches * batch_size`` or less)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        order = self.epoch_order(epoch)
        total = self.per_rank * self.world_size
        if total > self.n:
            order = np.resize(order, total)  # repeats the head: the padding rule
        mine = order[:total][self.rank::self.world_size]
        self._cached = (epoch, mine)
        return mine

    def batch(self, epoch: int, b: int) -> np.ndarray:
        """Indices of batch ``b`` (0-based) of ``epoch`` for this rank."""
        if not 0 <= b < self.num_batches:
            raise IndexError(f"batch {b} out of range [0, {self.num_batches})")
        return self.shard(epoch)[b * self.batch_size:(b + 1) * self.batch_size]

    def spares(self, epoch: int, b: int, k: int) -> np.ndarray:
        """``k`` replacement indices for samples of batch ``b`` that get skipped: drawn from this
        rank's shard with ``default_rng([seed, epoch, rank, b, 1])``, so they are the same
        however many workers run. A replacement repeats a sample of the epoch. The first
        ``min(k, shard size)`` are distinct samples, so a small dataset's good samples are all
        among a batch's spares rather than one bad sample drawn again and again."""
        mine = self.shard(epoch)
        rng = np.random.default_rng([self.seed & _SEED_MASK, int(epoch), self.rank, int(b), 1])
        first = rng.choice(len(mine), size=min(k, len(mine)), replace=False)
        if k > len(mine):
            first = np.concatenate([first, rng.integers(0, len(mine), size=k - len(mine))])
        return mine[first]

    def config(self) -> dict:
        return {"n": self.n, "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed,
                "rank": self.rank, "world_size": self.world_size, "drop_last": self.drop_last}
