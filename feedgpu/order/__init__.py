"""The order: which batches of indices each rank reads in each epoch (no loader, no workers).

Rooms:

* ``sharded``: :class:`ShardedOrder`, feedgpu's seeded, sharded, resumable order, and the one
  draw of spare samples both orders use.
* ``shard_shuffle``: the shard-aware shuffle (``shuffle: shards``) the order may draw instead.
* ``sampler_split``: a ``DistributedSampler``'s split, computed as a seekable order.
* ``user``: :class:`~feedgpu.order.user.UserOrder`, a user's ``sampler`` or ``batch_sampler``.
* ``protocol``: :class:`~feedgpu.order.protocol.Order`, what the loader asks of both.
* ``distributed``: the rank and world size, and the ranks' agreement on data and seed.

It is a package of its own, not part of :mod:`feedgpu.loader`, because it is a pure function of
(seed, epoch, rank, world size) that the benchmarks, the table pipelines and the tests use without
a loader, and without importing torch's DataLoader.
"""
from .shard_shuffle import shard_order
from .sharded import ShardedOrder

__all__ = ["ShardedOrder", "shard_order"]
