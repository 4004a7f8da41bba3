"""``DataLoader.stats()`` of a map-style dataset: the counters gathered from the backend's parts
(the metrics, the balancer, the live pass's skip budget, the shard read-ahead, the engine, the
executor, the cache)."""
from __future__ import annotations

__all__ = ["loader_stats"]


def loader_stats(backend) -> dict:
    """What :meth:`feedgpu.DataLoader.stats` returns (documented there) for a
    :class:`~feedgpu.loader.mapped.MapBackend`."""
    d = backend.metrics.as_dict()
    d.update(num_workers=backend.num_workers, prefetch_factor=backend.prefetch, epoch=backend.position.epoch,
             batches_seen=backend.position.start)
    d["balancer"] = backend.autoscaler.stats() if backend.autoscaler is not None else None
    d["read_ahead"] = backend.read_ahead.stats()
    live = backend.live_iterator()
    d["skip_budget"] = live.budget.as_dict() if live is not None else None
    work = backend.work
    engine = work.stats() if work is not None else None
    d["engine"] = engine if engine is not None else {"name": backend.options.engine.name}
    pool = backend.pool
    live_pool = pool if pool is not None and not pool.closed and pool.stats() is not None else None
    d["executor"] = backend.executor_totals.report(backend.options.executor,
                                                   live_pool.stats() if live_pool else None)
    entry = work.cache_entry() if work is not None else None
    if entry is not None:
        entry.refresh()
        d["cache"] = {"dir": str(entry.dir), "cached": entry.cached, "quarantined": len(entry.quarantined),
                      "samples": entry.n, "complete": entry.complete}
    else:
        d["cache"] = None
    d["network"] = backend.read_ahead.network_stats(backend.metrics.network)
    return d
