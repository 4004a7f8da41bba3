"""The one draw of spare samples: what stands in for the samples of a batch that get skipped.

Both orders draw their spares here (:class:`~feedgpu.order.sharded.ShardedOrder` from the rank's
whole-epoch shard, :class:`~feedgpu.order.user.UserOrder` from the dataset), so a spare depends
only on (seed, epoch, rank, the position where the batch starts) and on the pool it is drawn from:
the same however many workers run, and after a resume on the same world size.
"""
from __future__ import annotations

import numpy as np

__all__ = ["SEED_MASK", "spares"]

#: SeedSequence takes non-negative ints: a negative seed wraps (as in the stages' sample RNG)
SEED_MASK = 0xFFFFFFFFFFFFFFFF


def spares(order_seed: int, epoch: int, rank: int, pos: int, k: int, pool: int) -> np.ndarray:
    """``k`` positions in ``[0, pool)`` (int64) drawn with ``default_rng([seed, epoch, rank, pos, 1])``.

    The first ``min(k, pool)`` are distinct, so a small dataset's good samples are all among a
    batch's spares rather than one bad sample drawn again and again; the rest (``k > pool``) are
    drawn with replacement. A spare repeats a sample of the epoch."""
    rng = np.random.default_rng([int(order_seed) & SEED_MASK, int(epoch), int(rank), int(pos), 1])
    pick = rng.choice(pool, size=min(k, pool), replace=False)
    if k > pool:
        pick = np.concatenate([pick, rng.integers(0, pool, size=k - pool)])
    return pick
