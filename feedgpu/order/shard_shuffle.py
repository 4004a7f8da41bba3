"""Shard-aware shuffle: an epoch order that keeps only about ``window`` shards open at a time.

A plain shuffle (:mod:`feedgpu.order.sharded`) draws every sample of the epoch from anywhere: a source
whose shards are fetched from the network then needs every shard from the first batch on. This
order draws from a window that moves along a shuffled sequence of shards, so a shard is needed
for a bounded span of the epoch and can be fetched shortly before and released after it
(:mod:`feedgpu.shard_ahead`).

The rule (:func:`shard_order`), for ``S`` shards (``n`` samples in all) and a window of ``w``
shards:

1. the shards are permuted: ``default_rng([seed, epoch, 2]).permutation(S)``, and laid end to end
   in that order: the shard at place ``j`` of this sequence covers ``[s_j, e_j)``;
2. each sample of the shard at place ``j`` gets a key drawn uniformly from
   ``[s_(j - h), e_(j + w - 1 - h))``, ``h = (w - 1) // 2``: its shard's span widened to the
   ``h`` shards before and the ``w - 1 - h`` after it (clipped at the ends of the sequence);
3. the epoch order is the samples sorted by key (ties, rare, in index order).

It is the idea of MosaicML Streaming's ``py1e`` (each shard's samples placed at random in a
range wider than the shard), with ranges that end on shard boundaries so that the bound below
holds for any shard sizes. WebDataset's shard shuffle and sample buffer mix the same way but as
a stream (no position to resume from); fixed blocks (Streaming's ``py1b``) open a whole block's
shards at once.

What it does to randomness:

* At most ``w`` shards are open at any point, whatever their sizes: at a key inside the span of
  the shard at place ``k``, only the shards at places ``k - w + 1 + h ... k + h`` can have keys
  (:func:`max_open` measures it for a given order). Each shard is needed for a stretch of about
  ``w`` shards' samples; shards open and close one after another, not in bursts.
* Within the window, samples are mixed uniformly: a sample's place within its shard says
  nothing about its place in the epoch (every key of a shard is drawn from the same range).
* Neighbouring samples are correlated: two consecutive samples come from the same shard with
  probability about ``1 / w`` (``1 / S`` for a plain shuffle); ``tests/unit/test_shard_order.py``
  measures it against a bound. At the start and end of the epoch the window is clipped to about
  ``w / 2`` shards (for about ``w / 2`` shards' worth of samples). ``w = 1`` reads one shard at a
  time, its samples in random order. Shards written in class order (a class per shard) give
  batches of about ``w`` classes: write shards shuffled, or raise ``w``, when that matters.
* The shard sequence changes every epoch; so do the keys.

A window of at least ``S`` shards (a source of one shard, such as a folder) is the plain
shuffle: :func:`shard_order` then returns exactly ``default_rng([seed, epoch]).permutation(n)``,
the order of ``shuffle: true``.

The order depends on ``(seed, epoch, shard of each sample, window)`` only: not on the rank,
world size or worker count. :class:`~feedgpu.order.sharded.ShardedOrder` shards it over ranks with
its usual rules (rank ``r`` of ``W`` takes every ``W``-th position, the same padding or drop), so
every rank reads from the same window of shards at the same time, and a loader state (a global
position) resumes exactly on any world size. On one node, one download per shard then serves
every rank (a node-local shard cache); on several nodes, each node fetches every shard and reads
its ranks' share of it: the network carries the dataset once per node and epoch (partitioning
shards over nodes, as MosaicML Streaming does, would carry it once, at the price of an order that
depends on the node count). The padding under ``drop_last=False`` repeats the head of the epoch
order, so the last batch may reopen one of the epoch's first shards.

Cost: one sort of ``n`` int64 (the key above, the sample index below; numpy's vectorised sort)
and a few O(n) passes; ``bench/shard_order.py`` times it beside the plain permutation.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError

_SEED_MASK = 0xFFFFFFFFFFFFFFFF


def group_by_shard(shard_of: np.ndarray, shards: int | None = None) -> tuple[np.ndarray | None, np.ndarray]:
    """``(members, starts)``: the sample indices grouped by shard (index order within a shard,
    int64; ``None`` when that is ``range(n)``, as for tar shards and Parquet files, whose samples
    are indexed shard by shard) and where each shard's group begins (int64, ``S + 1`` entries)."""
    shard_of = np.asarray(shard_of)
    sizes = np.bincount(shard_of, minlength=shards or 0).astype(np.int64)
    starts = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    if len(shard_of) < 2 or bool((shard_of[1:] >= shard_of[:-1]).all()):
        members = None
    else:
        members = np.argsort(shard_of, kind="stable").astype(np.int64)
    return members, starts


def shard_order(shard_of: np.ndarray, seed: int, epoch: int, window: int) -> np.ndarray:
    """The epoch order of the samples (int64, a permutation of ``range(n)``) under the rule of
    the module docstring.

    Args:
        shard_of: the shard of each sample (int array of length ``n``, ids in ``[0, S)``); shards
            without samples are allowed.
        seed: base seed (any int; negative seeds wrap as in :mod:`feedgpu.order.sharded`).
        epoch: the epoch (int >= 0).
        window: shards open at a time (int >= 1).

    Raises :class:`ConfigError` for ``window < 1``, an empty ``shard_of`` or a negative shard id.
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ConfigError(f"shard_window must be an int >= 1, got {window!r}")
    shard_of = np.asarray(shard_of)
    n = len(shard_of)
    if n == 0:
        raise ConfigError("shard_order: no samples")
    if shard_of.min() < 0:
        raise ConfigError("shard_order: shard ids must be >= 0")
    members, starts = group_by_shard(shard_of)
    sizes = np.diff(starts)
    present = np.flatnonzero(sizes)
    if window >= len(present):   # the window holds every shard: the plain shuffle
        return np.random.default_rng([int(seed) & _SEED_MASK, int(epoch)]).permutation(n).astype(np.int64)
    rng = np.random.default_rng([int(seed) & _SEED_MASK, int(epoch), 2])
    seq = present[rng.permutation(len(present))]        # the shard sequence
    m = sizes[seq]
    e = np.cumsum(m)
    a = e - m                                             # where each shard starts in it
    places = np.arange(len(seq))
    h = (window - 1) // 2
    lo = a[np.maximum(places - h, 0)]
    span = e[np.minimum(places + window - 1 - h, len(seq) - 1)] - lo   # each shard's key range
    # the samples in shard-sequence order: members of seq[0], then of seq[1], ...
    src = np.repeat(starts[seq] - a, m) + np.arange(n, dtype=np.int64)
    laid = src if members is None else members[src]
    # one int64 per sample: its key (in units of 1/q sample) above, its index below; a single
    # sort of those gives the order (ties, rare, in index order)
    ib = max(1, (n - 1).bit_length())
    q = ((1 << (63 - ib)) - 1) // (n + 1)
    if q < 1:   # pragma: no cover - over ~3e9 samples: float keys, an argsort
        keys = np.repeat(lo, m) + rng.random(n) * np.repeat(span, m)
        return laid[np.argsort(keys, kind="stable")]
    u = rng.random(n)
    u *= np.repeat(span * q, m)
    u += np.repeat(lo * q, m)
    packed = u.astype(np.int64)
    packed <<= ib
    packed |= laid
    packed.sort()
    packed &= (1 << ib) - 1
    return packed


def open_shards(order: np.ndarray, shard_of: np.ndarray) -> np.ndarray:
    """How many shards are open at each position of ``order`` (int64, one per position): those
    with a sample at or before the position and one at or after it."""
    order = np.asarray(order)
    seq = np.asarray(shard_of)[order]
    n = len(seq)
    S = int(seq.max()) + 1 if n else 0
    pos = np.arange(n, dtype=np.int64)
    first = np.full(S, n, np.int64)
    np.minimum.at(first, seq, pos)
    last = np.full(S, -1, np.int64)
    np.maximum.at(last, seq, pos)
    used = last >= 0
    delta = np.zeros(n + 1, np.int64)
    np.add.at(delta, first[used], 1)
    np.add.at(delta, last[used] + 1, -1)
    return np.cumsum(delta[:n])


def max_open(order: np.ndarray, shard_of: np.ndarray) -> int:
    """The most shards open at once along ``order`` (see :func:`open_shards`)."""
    counts = open_shards(order, shard_of)
    return int(counts.max()) if len(counts) else 0


def same_shard_neighbours(order: np.ndarray, shard_of: np.ndarray) -> float:
    """The share of consecutive pairs of ``order`` whose two samples are in the same shard."""
    seq = np.asarray(shard_of)[np.asarray(order)]
    return float((seq[1:] == seq[:-1]).mean()) if len(seq) > 1 else 0.0
