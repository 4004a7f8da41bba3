"""Seeded, sharded, resumable sample order: a pure function of (seed, epoch, rank, world_size).

Rules (same as ``torch.utils.data.DistributedSampler`` where it has one):

* ``shuffle=True``: a permutation of all ``n`` indices drawn from
  ``numpy.random.default_rng([seed, epoch])`` (PCG64 seeded through SeedSequence), so it changes
  every epoch; ``shuffle=False`` keeps index order. With a ``shard_window`` (``shuffle: shards``),
  the epoch order is :func:`feedgpu.order.shard_shuffle.shard_order` instead: about ``shard_window``
  shards open at a time; everything below applies to it unchanged.
* Sharding: rank ``r`` of ``w`` takes every ``w``-th index of the epoch order starting at ``r``.
* ``drop_last=False`` (remainder rule): the order is padded by repeating its head up to a
  multiple of ``w``, so every rank holds ``ceil(n / w)`` samples; the last batch of each rank is
  partial when ``ceil(n / w)`` is not a multiple of ``batch_size`` (the same size on every rank).
  Up to ``w - 1`` samples appear twice per epoch, only when ``n`` is not a multiple of ``w``.
* ``drop_last=True``: only ``floor(n / (w * batch_size))`` full batches per rank are kept; the
  remaining ``n mod (w * batch_size)`` samples of that epoch's order are not used that epoch.

Every rank gets the same number of batches, and nothing here depends on the worker count.

Global position (resume on any world size): after ``k`` batches on every rank, the ranks together
have consumed exactly the first ``min(k * w * batch_size, n)`` indices of the epoch order (a
prefix: rank ``r`` takes positions ``r, r + w, ...``). A loader's state records that prefix length
(``samples_seen``), not a rank's cursor. :meth:`ShardedOrder.view` shards what remains of the epoch
order after such a prefix over this loader's ranks with the same rules (padding with the head of
the epoch order, or dropping the incomplete tail), so a run resumed on another world size
delivers the rest of the epoch exactly once (plus the documented padding), and a run resumed on
the same world size gets exactly the batches it would have got.

Spare samples (what stands in for the samples of a batch that get skipped) are drawn by one
function, :func:`draw_spares`, for this order (from the rank's whole-epoch shard) and for a user's
sampler (:class:`~feedgpu.order.user.UserOrder`, from the dataset): a spare depends only on
(seed, epoch, rank, the position where the batch starts) and on the pool it is drawn from, the
same however many workers run, and after a resume on the same world size.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from .shard_shuffle import shard_order

__all__ = ["SEED_MASK", "ShardedOrder", "draw_spares"]

#: SeedSequence takes non-negative ints: a negative seed wraps (as in the stages' sample RNG)
SEED_MASK = 0xFFFFFFFFFFFFFFFF


def draw_spares(order_seed: int, epoch: int, rank: int, pos: int, k: int, pool: int) -> np.ndarray:
    """``k`` positions in ``[0, pool)`` (int64) drawn with ``default_rng([seed, epoch, rank, pos, 1])``.

    The first ``min(k, pool)`` are distinct, so a small dataset's good samples are all among a
    batch's spares rather than one bad sample drawn again and again; the rest (``k > pool``) are
    drawn with replacement. A spare repeats a sample of the epoch."""
    rng = np.random.default_rng([int(order_seed) & SEED_MASK, int(epoch), int(rank), int(pos), 1])
    pick = rng.choice(pool, size=min(k, pool), replace=False)
    if k > pool:
        pick = np.concatenate([pick, rng.integers(0, pool, size=k - pool)])
    return pick


class ShardedOrder:
    """The batches of indices one rank reads in one epoch.

    Args:
        n: number of samples in the source (> 0).
        batch_size: samples per batch (> 0).
        shuffle: permute each epoch (default True).
        seed: base seed (int, default 0).
        rank, world_size: this process's shard (default 0 of 1).
        drop_last: drop the incomplete tail (rule in the module docstring).
        shard_window: with ``shuffle``, draw the order shard-aware with this many shards open
            (int >= 1, :mod:`feedgpu.order.shard_shuffle`); None (default): the plain permutation.
        shard_of: the shard of each sample (int array of length ``n``, or a callable giving it,
            called once when first needed); needed with ``shard_window``.

    Raises :class:`ConfigError` for an empty source, a bad rank or a batch size < 1, and when
    ``drop_last=True`` leaves no full batch; for a ``shard_window`` < 1 or without ``shard_of``.
    """

    def __init__(self, n: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False,
                 shard_window: int | None = None, shard_of=None):
        if n <= 0:
            raise ConfigError("sampler: the source holds no samples")
        if batch_size < 1:
            raise ConfigError(f"sampler: batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"sampler: rank {rank} is not in [0, world_size={world_size})")
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, int(seed)
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        if shard_window is not None and (isinstance(shard_window, bool) or not isinstance(shard_window, int)
                                         or shard_window < 1):
            raise ConfigError(f"sampler: shard_window must be an int >= 1, got {shard_window!r}")
        if shard_window is not None and shard_of is None:
            raise ConfigError("sampler: shard_window needs the shard of each sample (shard_of)")
        self.shard_window = shard_window if shuffle else None
        self._shard_of = shard_of
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

    #: positions are prefixes of the epoch order (:class:`~feedgpu.order.protocol.Order`)
    seekable = True

    def __len__(self) -> int:
        return self.num_batches

    def known_len(self) -> int:
        return self.num_batches

    def end(self) -> int:
        """The position past the epoch's end: ``n``."""
        return self.n

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All ``n`` indices in this epoch's order (int64), before sharding."""
        if not self.shuffle:
            return np.arange(self.n, dtype=np.int64)
        if self.shard_window is not None:
            return shard_order(self.shard_of(), self.seed, epoch, self.shard_window)
        return np.random.default_rng([self.seed & SEED_MASK, int(epoch)]).permutation(self.n).astype(np.int64)

    def shard_of(self) -> np.ndarray:
        """The shard of each sample (with a ``shard_window``; raises :class:`ConfigError` when
        it does not hold ``n`` entries)."""
        if callable(self._shard_of):
            self._shard_of = self._shard_of()
        shards = np.asarray(self._shard_of)
        if shards.shape != (self.n,):
            raise ConfigError(f"sampler: shard_of holds {shards.shape} entries for {self.n} samples")
        return shards

    def view(self, epoch: int, start: int = 0) -> "EpochShard":
        """This rank's batches of ``epoch`` after the first ``start`` indices of the epoch order
        were consumed by all ranks together (``0 <= start <= n``; see the module docstring)."""
        if self._cached is not None and self._cached[0] == (epoch, start):
            return self._cached[1]
        v = EpochShard(self, int(epoch), int(start))
        self._cached = ((epoch, start), v)
        return v

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's indices for ``epoch`` (int64, length ``num_batches * batch_size`` or less)."""
        return self.view(epoch).indices

    def batch(self, epoch: int, b: int) -> np.ndarray:
        """Indices of batch ``b`` (0-based) of ``epoch`` for this rank."""
        return self.view(epoch).batch(b)

    def spares(self, epoch: int, b: int, k: int) -> np.ndarray:
        """``k`` replacement indices for samples of batch ``b`` that get skipped (see
        :meth:`EpochShard.spares`)."""
        return self.view(epoch).spares(b, k)

    def position(self, batches: int) -> int:
        """Indices of the epoch order consumed by all ranks after ``batches`` batches each (from
        the epoch's start)."""
        return min(batches * self.world_size * self.batch_size, self.n)

    def rank_share(self, full: np.ndarray, start: int) -> tuple[int, np.ndarray]:
        """``(batches, indices)`` of this rank in the epoch order ``full`` after ``start`` (the
        sharding, padding and drop rules of the module docstring)."""
        w, bs = self.world_size, self.batch_size
        rest = full[start:]
        m = len(rest)
        if self.drop_last:
            num_batches = m // (w * bs)
            per_rank = num_batches * bs
        else:
            per_rank = math.ceil(m / w)
            num_batches = math.ceil(per_rank / bs)
        total = per_rank * w
        if total > m:  # the padding rule: repeat the head of the epoch order
            rest = np.concatenate([rest, np.resize(full, total - m)])
        return num_batches, rest[:total][self.rank::w]

    def config(self) -> dict:
        """The order's settings (``shard_window`` only when set, so states of plain orders keep
        their settings)."""
        out = {"n": self.n, "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed,
               "rank": self.rank, "world_size": self.world_size, "drop_last": self.drop_last}
        if self.shard_window is not None:
            out["shard_window"] = self.shard_window
        return out


class EpochShard:
    """One rank's batches of one epoch, after the first ``start`` indices of the epoch order.

    Attributes:
        indices: this rank's indices (int64), ``num_batches`` batches of ``batch_size`` (the last
            one partial under ``drop_last=False`` when the remainder requires it).
        num_batches: this rank's batches (the same on every rank; 0 when ``start == n``).
        start: the global position this view begins at.
        first: the number of its first batch: batches are numbered ``first, first + 1, ...``
            (``start // (world_size * batch_size)``: a view from a position saved on the same
            world size numbers its batches as the whole epoch does).
    """

    def __init__(self, order: ShardedOrder, epoch: int, start: int):
        if not 0 <= start <= order.n:
            raise ValueError(f"sampler: position {start} is not in [0, {order.n}]")
        self.order, self.epoch, self.start = order, epoch, start
        w, bs = order.world_size, order.batch_size
        self.first = start // (w * bs)
        full = order.epoch_order(epoch)
        self.num_batches, self.indices = order.rank_share(full, start)
        # this rank's whole-epoch shard (the spares' pool), from the same order: no second permutation
        self._full: np.ndarray | None = self.indices if start == 0 else None
        self._order_of_epoch = None if start == 0 else full

    def __len__(self) -> int:
        return self.num_batches

    def batch(self, b: int) -> np.ndarray:
        """Indices of batch ``b`` (numbered from :attr:`first`)."""
        k = b - self.first
        if not 0 <= k < self.num_batches:
            raise IndexError(f"batch {b} out of range [{self.first}, {self.first + self.num_batches})")
        bs = self.order.batch_size
        return self.indices[k * bs:(k + 1) * bs]

    def position(self, b: int) -> int:
        """The global position once every rank took the batches before batch ``b``."""
        o = self.order
        return min(self.start + (b - self.first) * o.world_size * o.batch_size, o.n)

    def spares(self, b: int, k: int) -> np.ndarray:
        """``k`` replacement indices for samples of batch ``b`` that get skipped: drawn from this
        rank's whole-epoch shard by :func:`draw_spares` at the position where
        the batch starts, so they are the same however many workers run and
        after a resume on the same world size. A replacement repeats a sample of the epoch. The
        first ``min(k, shard size)`` are distinct samples, so a small dataset's good samples are
        all among a batch's spares rather than one bad sample drawn again and again."""
        o = self.order
        if self._full is None:
            self._full = o.rank_share(self._order_of_epoch, 0)[1]
            self._order_of_epoch = None
        pos = self.start + (b - self.first) * o.world_size * o.batch_size
        return self._full[draw_spares(o.seed, self.epoch, o.rank, pos, k, len(self._full))]

