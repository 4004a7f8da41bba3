"""Which batches a :class:`~feedgpu.DataLoader` reads: its own sharded order, a user's sampler,
and the torch samplers it shows to frameworks.

* feedgpu's own order is :class:`~feedgpu.order.sharded.ShardedOrder` (seeded, sharded, resumable on any
  world size). The loader exposes it to frameworks as torch samplers: ``loader.sampler`` is a
  :class:`OrderSampler` (a ``RandomSampler`` when shuffling, else a ``SequentialSampler``, so
  Lightning and accelerate recognise "the default sampler" and inject their distributed one) and
  ``loader.batch_sampler`` a plain ``torch.utils.data.BatchSampler`` over it.
* A plain ``torch.utils.data.DistributedSampler`` given as ``sampler`` (what Lightning injects
  when it re-creates a loader) is read, not iterated: :class:`~feedgpu.order.sampler_split.SamplerSplit`
  computes the same split from its ``seed``, ``epoch``, ``shuffle``, ``drop_last``, ``rank`` and
  ``num_replicas``, as a seekable order, so the loader gives torch's rows and keeps exact resume
  and the skip budget.
* A loader's own :class:`OrderSampler` given back as ``sampler`` over the same dataset (a framework
  re-creating the loader from its attributes) is read as that loader's order: its shuffle and
  seed (``MapBackend._read_order_view``).
* Any other ``sampler`` or ``batch_sampler`` is a :class:`~feedgpu.order.user.UserOrder`: iterated
  as torch does.
"""
from __future__ import annotations

import weakref

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
    """True for a plain ``DistributedSampler``, whose split :mod:`feedgpu.order.sampler_split` computes."""
    return type(sampler) is tud.DistributedSampler


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
