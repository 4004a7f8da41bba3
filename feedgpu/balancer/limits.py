"""The balancer policy's hard limits (rule 1 of :mod:`.policy`): the largest pool the
configured maximum and the memory budget allow, and whether memory is short. Pure: the
records of the settings measured and the last window in."""
from __future__ import annotations

import math

from .measurement import Measurement
from .policy_config import MEMORY_TIGHT, PolicyConfig
from .text import gib
from .window import Record

Key = tuple  # (workers, prefetch)


def pool_limit(c: PolicyConfig, records: dict[Key, Record], m: Measurement) -> tuple[int, str]:
    """The largest pool the hard limits allow (``c.max_workers``, and the RAM budget of ``m`` at
    :func:`rss_per_worker` bytes a worker), and in words which sets it."""
    limit, why = c.max_workers, f"the configured maximum ({c.max_workers} {c.unit})"
    if m.ram_budget_bytes is not None and m.rss_bytes > 0:
        per = rss_per_worker(records, m)
        fit = m.workers + math.floor((m.ram_budget_bytes - m.rss_bytes) / per)
        if fit < limit:
            limit = max(c.min_workers, fit)
            why = f"the RAM budget ({gib(m.ram_budget_bytes)}, ~{gib(per)} per worker)"
    return limit, why


def memory_tight(m: Measurement, limit: int, max_workers: int) -> bool:
    """Memory is short: the loader holds more than ``MEMORY_TIGHT`` of its budget, or the
    budget is what keeps the pool from a worker more (``limit < max_workers``)."""
    if m.ram_budget_bytes is None or m.rss_bytes <= 0:
        return False
    return m.rss_bytes > MEMORY_TIGHT * m.ram_budget_bytes or limit < max_workers


def rss_per_worker(records: dict[Key, Record], m: Measurement) -> float:
    """Bytes one more worker costs: the slope between the two farthest worker counts measured
    at ``m``'s prefetch depth, else (conservatively) all of ``m``'s memory over its workers."""
    pts = sorted((k[0], r.rss) for k, r in records.items() if k[1] == m.prefetch and r.rss > 0)
    if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
        slope = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
        if slope > 0:
            return slope
    return m.rss_bytes / m.workers
