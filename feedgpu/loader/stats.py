"""``DataLoader.stats()``: the loader's counters gathered from its parts (the metrics, the
balancer, the live epoch's skip budget and shard read-ahead, the engine, the executor, the
cache), and the fingerprint a loader state names its records by."""
from __future__ import annotations

from ..remote.ahead_loader import network_stats

__all__ = ["loader_stats", "source_fingerprint"]


def loader_stats(loader) -> dict:
    """What :meth:`feedgpu.DataLoader.stats` returns (documented there)."""
    d = loader._stats.as_dict()
    d.update(num_workers=loader.num_workers, prefetch_factor=loader._prefetch, epoch=loader._position[0],
             batches_seen=loader._position[1])
    d["balancer"] = loader._autoscaler.stats() if loader._autoscaler is not None else None
    live = loader._live() if loader._live is not None else None
    ahead = getattr(live, "shards", None)   # shard read-ahead (feedgpu.shard_ahead.attach)
    d["read_ahead"] = ahead.stats() if ahead is not None and not live.closed else \
        getattr(loader, "_read_ahead_stats", None)
    d["skip_budget"] = live.budget.as_dict() if live is not None else None
    engine = loader._work.stats() if loader._work is not None else None
    d["engine"] = engine if engine is not None else {"name": loader._engine.name}
    pool = loader._pool
    live_pool = pool if pool is not None and not pool.closed and pool.stats() is not None else None
    d["executor"] = loader._executor_totals.report(loader._executor, live_pool.stats() if live_pool else None)
    entry = loader._work.cache_entry() if loader._work is not None else None
    if entry is not None:
        entry.refresh()
        d["cache"] = {"dir": str(entry.dir), "cached": entry.cached, "quarantined": len(entry.quarantined),
                      "samples": entry.n, "complete": entry.complete}
    else:
        d["cache"] = None
    d["network"] = network_stats(loader)
    return d


def source_fingerprint(pipeline, dataset) -> str:
    """Which records, in which order (not their bytes): a pipeline source's order identity, a
    table dataset's identity, else a torch Dataset's class and length."""
    if pipeline is not None:
        return pipeline.source.order_identity()
    size = len(dataset) if hasattr(dataset, "__len__") else "unsized"
    return dataset.identity() if hasattr(dataset, "make_work") else \
        f"{type(dataset).__module__}.{type(dataset).__qualname__}:{size}"
