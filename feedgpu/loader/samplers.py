"""Which batches a :class:`~feedgpu.DataLoader` reads: its own sharded order, a user's sampler,
and the torch samplers it shows to frameworks.

* feedgpu's own order is :class:`~feedgpu.order.sharded.ShardedOrder` (seeded, sharded, resumable on any
  world size). The loader exposes it to frameworks as torch samplers: ``loader.sampler`` is a
  :class:`OrderSampler` (a ``RandomSampler`` when shuffling, else a ``SequentialSampler``, so
  Lightning and accelerate recognise "the default sampler" and inject their distributed one) and
  ``loader.batch_sampler`` a plain ``torch.utils.data.BatchSampler`` over it.
* A plain ``torch.utils.data.DistributedSampler`` given as ``sampler`` (what Lightning injects
  when it re-creates a loader) is read, not iterated: :class:`~feedgpu.sampler_split.SamplerSplit`
  computes the same split from its ``seed``, ``epoch``, ``shuffle``, ``drop_last``, ``rank`` and
  ``num_replicas``, as a seekable order, so the loader gives torch's rows and keeps exact resume
  and the skip budget.
* Any other ``sampler`` or ``batch_sampler`` is a :class:`UserOrder`: iterated as torch does.
"""
from __future__ import annotations

import itertools
import math
import operator
import weakref

import numpy as np
import torch.utils.data as tud

from ..order.sharded import ShardedOrder


class OrderSampler:
    """Mixin of the samplers a loader shows for its own order: iterating gives the indices of the
    loader's next epoch in its order (all ranks' indices, before sharding).

    It holds the loader weakly (the loader holds it: a cycle would keep a dropped loader's
    workers running until the garbage collector runs) and keeps the order's settings itself, so
    it goes on working once the loader is gone: accelerate's ``prepare()`` keeps only
    ``loader.batch_sampler`` and drops the loader. ``set_epoch(e)`` chooses the epoch (and sets
    the loader's, while it lives), as frameworks call it before each epoch."""

    def _bind(self, backend) -> None:
        self._loader = weakref.ref(backend)
        self.seed, self.epoch, self.shuffle = backend.seed, 0, backend.shuffle
        self._batch_size = backend.batch_size
        self._shards = shard_settings(backend.pipeline)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        loader = self._loader()
        if loader is not None:
            loader.set_epoch(epoch)

    def __iter__(self):
        loader = self._loader()
        if loader is not None:
            order = loader.order(collective=False)
            self.seed, self.epoch = loader.seed, loader.position.epoch
            return iter(order.epoch_order(self.epoch).tolist())
        window, shard_of = self._shards if self.shuffle else (None, None)
        order = ShardedOrder(len(self.data_source), self._batch_size, shuffle=self.shuffle, seed=self.seed,
                             shard_window=window, shard_of=shard_of)
        return iter(order.epoch_order(self.epoch).tolist())

    def __len__(self) -> int:
        loader = self._loader()
        return loader.num_samples() if loader is not None else len(self.data_source)


class OrderRandomSampler(OrderSampler, tud.RandomSampler):
    """``loader.sampler`` of a shuffling loader (a ``RandomSampler`` for frameworks' checks)."""

    def __init__(self, loader, generator=None):
        # RandomSampler's own __init__ would read len(dataset) now: a source that fails to open must
        # fail inside the loader's collective check instead, on every rank alike
        self.data_source, self.replacement, self._num_samples, self.generator = loader.dataset, False, None, generator
        self._bind(loader)


class OrderSequentialSampler(OrderSampler, tud.SequentialSampler):
    """``loader.sampler`` of a loader that does not shuffle."""

    def __init__(self, loader):
        tud.SequentialSampler.__init__(self, loader.dataset)
        self._bind(loader)


def reads_as_sharding(sampler) -> bool:
    """True for a plain ``DistributedSampler``, whose split :mod:`feedgpu.sampler_split` computes."""
    return type(sampler) is tud.DistributedSampler


class UserOrder:
    """Batches from a user's ``sampler`` or ``batch_sampler``. Resuming replays the sampler for
    the epoch (after ``set_epoch`` when it has one) and skips the batches already seen, so the
    sampler must give the same order for the same epoch. Otherwise the sampler's epoch is its
    owner's (``set_epoch_on`` is False): as torch, the loader does not call its ``set_epoch``.

    As in torch, an epoch is what iterating the sampler gives, until it is exhausted: its
    ``len()`` (which it need not have: a generator, an infinite sampler) only answers
    ``len(loader)``. Keys are passed to the dataset as the sampler gives them: integral ones as
    ints, any other (a string key, a float) unchanged."""

    def __init__(self, n: int, sampler, batch_sampler, batch_size: int, drop_last: bool, seed: int):
        self.n, self.sampler, self.batch_sampler = n, sampler, batch_sampler
        self.batch_size, self.drop_last, self.seed = batch_size, drop_last, seed
        self.set_epoch_on = False   # call the sampler's set_epoch(epoch) before iterating it (the loader decides)

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        k = len(self.sampler)
        return k // self.batch_size if self.drop_last else math.ceil(k / self.batch_size)

    def epoch_for(self, epoch: int, pinned: bool) -> int:
        """The epoch of the next iteration. The sampler keeps the epoch its owner gives it
        (``sampler.set_epoch``), as in torch: unless ``pinned`` (a mid-epoch state to replay, or
        the loader's ``set_epoch`` was called), the sampler's ``epoch`` attribute, when it has
        one, is the epoch, and its ``set_epoch`` is not called."""
        self.set_epoch_on = pinned
        e = getattr(self.batch_sampler if self.batch_sampler is not None else self.sampler, "epoch", None)
        if not pinned and isinstance(e, int) and not isinstance(e, bool):
            return e
        return epoch

    def known_len(self) -> int | None:
        """``len(self)``, or None when the sampler has no length."""
        try:
            return len(self)
        except TypeError:
            return None

    def view(self, epoch: int, start: int = 0) -> "UserView":
        """The epoch's batches after the first ``start`` ones (start counts batches here)."""
        return UserView(self, epoch, start)

    def batches(self, epoch: int):
        src = self.batch_sampler if self.batch_sampler is not None else self.sampler
        if self.set_epoch_on and hasattr(src, "set_epoch"):
            src.set_epoch(epoch)
        if self.batch_sampler is not None:
            for b in self.batch_sampler:
                yield as_keys(list(b))
            return
        it = iter(self.sampler)
        while True:
            chunk = list(itertools.islice(it, self.batch_size))
            if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                return
            yield as_keys(chunk)

    def config(self) -> dict:
        return {"sampler": type(self.batch_sampler or self.sampler).__name__, "n": self.n,
                "batch_size": self.batch_size, "drop_last": self.drop_last}


def as_keys(keys: list) -> np.ndarray:
    """A batch of a user sampler's keys: int64 when every key is integral (``int``, a numpy
    integer, a 0-d integer tensor), else an object array holding the keys as given."""
    try:
        return np.asarray([operator.index(k) for k in keys], dtype=np.int64)
    except TypeError:
        out = np.empty(len(keys), dtype=object)
        out[:] = keys
        return out


class UserView:
    """One epoch of a :class:`UserOrder`, read in order from batch ``start``.

    ``num_batches`` is None: the epoch ends where the sampler is exhausted (iterate the view);
    ``expected`` is the sampler's ``len()`` less ``start`` when it has one (informational)."""

    open_ended = True

    def __init__(self, order: UserOrder, epoch: int, start: int):
        self.order, self.epoch, self.start, self.first = order, epoch, start, start
        known = order.known_len()
        self.expected = None if known is None else max(0, known - start)
        self.num_batches = None
        self._it = itertools.islice(order.batches(epoch), start, None)

    def __iter__(self):
        """The epoch's batches from ``start`` (int64 or object arrays), until the sampler ends."""
        return self._it

    def position(self, b: int) -> int:
        """The position (batches of the epoch) once the batches before ``b`` were taken."""
        return b

    def spares(self, b: int, k: int) -> np.ndarray:
        pos = b
        return np.random.default_rng([self.order.seed & 0xFFFFFFFFFFFFFFFF, self.epoch, pos, 1]).integers(
            0, self.order.n, size=k)


def order_len(order) -> int | None:
    """``len(order)``; None for a user's sampler without a length."""
    return order.known_len() if isinstance(order, UserOrder) else len(order)


def shard_settings(pipeline) -> tuple:
    """``(shard_window, shard_of)`` for a pipeline with ``shuffle: shards`` (applied when the
    loader shuffles; :mod:`feedgpu.order.shard_shuffle`; ``shard_of`` is called when first needed), else
    ``(None, None)`` (a torch Dataset, or a plain shuffle)."""
    if pipeline is None or getattr(pipeline, "shard_window", None) is None:
        return None, None
    return pipeline.shard_window, lambda: pipeline.source.shard_of()


def sharded(n: int, batch_size: int, shuffle: bool, seed: int, rank: int, world_size: int,
            drop_last: bool, cached: ShardedOrder | None, shard_window: int | None = None,
            shard_of=None) -> ShardedOrder:
    """``cached`` when it has these settings, else a new :class:`ShardedOrder` (``shard_window``
    and ``shard_of``: a shard-aware shuffle, see :mod:`feedgpu.order.shard_shuffle`)."""
    want = {"n": n, "batch_size": batch_size, "shuffle": shuffle, "seed": seed, "rank": rank,
            "world_size": world_size, "drop_last": drop_last}
    if shuffle and shard_window is not None:
        want["shard_window"] = shard_window
    if cached is not None and cached.config() == want:
        return cached
    return ShardedOrder(n, batch_size, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
                        drop_last=drop_last, shard_window=shard_window if shuffle else None,
                        shard_of=shard_of)
