"""A loader's shard read-ahead (:mod:`feedgpu.shard_ahead`) and its network totals, as one component.

The loader makes it once (:meth:`ReadAhead.for_loader`); a fetcher is attached there for a source
read from URLs (:func:`~feedgpu.remote.ahead_loader.remote_read_ahead`) or by the user through
:func:`feedgpu.shard_ahead.attach`. Each pass of the epoch runner asks it for the pass's
:class:`~feedgpu.shard_ahead.ShardAhead` (:meth:`for_view`) and hands it back when the pass closes
(:meth:`closed`); batch reports go through :meth:`note_report`.
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import ConfigError
from ..remote.ahead_loader import NetworkTotals, network_stats, remote_read_ahead
from ..shard_ahead import ShardAhead

__all__ = ["ReadAhead"]


class ReadAhead:
    """The read-ahead of one loader.

    Args:
        source: the pipeline's source (None for a torch Dataset).
        allowed: a fetcher may be attached (a pipeline read in feedgpu's own order).
        network: the loader's :class:`NetworkTotals` (a source read from URLs), else None.
    """

    def __init__(self, source=None, allowed: bool = False, network: NetworkTotals | None = None):
        self.source, self.allowed, self.network = source, allowed, network
        self.attached: tuple[Any, dict] | None = None   # (fetcher, ShardAhead options)
        self.on_wait: Callable[[float], None] | None = None   # the balancer's add_network_wait
        self.last_stats: dict | None = None   # the latest closed pass's stats()
        self.live: ShardAhead | None = None   # the running pass's

    @classmethod
    def for_loader(cls, pipeline, own_order: bool, cache_entry: Callable[[], Any]) -> "ReadAhead":
        """The read-ahead of a loader over ``pipeline`` (None: a torch Dataset) in its own order
        (``own_order``) or a user's sampler; ``cache_entry``: the pixel cache entry now."""
        source = pipeline.source if pipeline is not None else None
        if source is None or source.remote is None:   # nothing to fetch until a user attaches a fetcher
            return cls(source, source is not None and own_order)
        network, fetcher, options = remote_read_ahead(source, own_order, cache_entry)
        ra = cls(source, own_order, network)
        if fetcher is not None:
            ra.attach(fetcher, **options)
        return ra

    def attach(self, fetcher, **options) -> None:
        """Fetch through ``fetcher`` from the next pass on (None detaches); ``options`` as for
        :class:`ShardAhead`. Raises :class:`ConfigError` for a loader without a pipeline or with a
        user's sampler."""
        if fetcher is not None and not self.allowed:
            raise ConfigError("shard read-ahead needs a feedgpu Pipeline read in feedgpu's own order "
                              "(not a torch Dataset or a user's sampler)")
        self.attached = None if fetcher is None else (fetcher, dict(options))

    def for_view(self, view) -> ShardAhead | None:
        """The read-ahead of one pass (``view``: its :class:`~feedgpu.order.sharded.EpochShard`) when a
        fetcher is attached, else None."""
        if self.attached is None or getattr(view, "open_ended", False):
            return None
        fetcher, options = self.attached
        self.live = ShardAhead.for_view(view, self.source, fetcher, on_wait=self.on_wait, **options)
        return self.live

    def note_report(self, report) -> None:
        if self.network is not None:
            self.network.note_report(report)

    def closed(self, shards: ShardAhead) -> None:
        """The pass of ``shards`` closed: keep its figures, stop it, let its downloads go."""
        self.last_stats = shards.stats()
        shards.close()
        if self.live is shards:
            self.live = None
        if self.network is not None:
            self.network.closed(shards)

    def stats(self) -> dict | None:
        """``stats()["read_ahead"]``: the running pass's, else the latest closed one's (None before)."""
        return self.live.stats() if self.live is not None else self.last_stats

    def network_stats(self, workers: dict) -> dict | None:
        """``stats()["network"]`` (:func:`~feedgpu.remote.ahead_loader.network_stats`)."""
        return network_stats(self.network, workers, self.live)
