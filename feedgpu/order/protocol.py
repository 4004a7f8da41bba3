"""The :class:`Order` protocol: what the loader asks of the order of an epoch's batches, whoever
chooses them (feedgpu's :class:`~feedgpu.order.sharded.ShardedOrder` and its
:class:`~feedgpu.order.sampler_split.SamplerSplit`, or a user's sampler,
:class:`~feedgpu.order.user.UserOrder`)."""
from __future__ import annotations

from typing import Protocol

__all__ = ["Order"]


class Order(Protocol):
    """An order of batches.

    Attributes:
        seekable: positions are prefixes of the epoch order consumed by all ranks together
            (feedgpu's order: a resume on any world size seeks there, and the next epoch's first
            batches may be computed early); False: a position counts the batches a user's sampler
            gave, replayed on resume.
        seed: the seed of the order (and of its spares).
    """

    seekable: bool
    seed: int

    def view(self, epoch: int, start: int = 0):
        """The epoch's batches from position ``start``: ``first`` (the number of the first
        batch), ``num_batches`` (None: until the sampler is exhausted), ``batch(b)`` or iteration,
        ``position(b)`` and ``spares(b, k)``."""

    def known_len(self) -> int | None:
        """Batches per epoch (``len(loader)``), None for a sampler without a length."""

    def end(self) -> int | None:
        """The position past the epoch's last batch (None: unknown)."""

    def config(self) -> dict:
        """The settings a loader state records (and checks on resume)."""
