"""The per-worker memory budget: one setting that sizes what a worker holds.

A worker of a :class:`~feedgpu.DataLoader` holds its own memory (its unique set size, USS: a
source's read cache, decode buffers, the Python heap it writes) and its share of the loader's
batch buffers (``prefetch_factor`` shared-memory slots of one batch each). The budget,
``worker_memory`` (bytes, or a string such as ``"2GiB"``, on the loader or under ``loader:`` in
the YAML), bounds both:

* a source's read cache is given :data:`CACHE_SHARE` of it (at most :data:`DEFAULT_CACHE_MAX` of a
  default budget; :meth:`Source.fit_memory`; a Parquet
  source then reads row groups larger than a quarter of that in slices of 1 MiB pieces, and its
  cached groups, the one being read and the reader's buffers stay within the cache together,
  whatever the row-group size, see :mod:`feedgpu.sources.parquet_parts`);
* the prefetch depth is capped so that a worker's batches in flight take at most
  :data:`SLOT_SHARE` of it (at least one batch per worker is always allowed);
* under ``num_workers="auto"`` the balancer's RAM limit is the budget times the largest pool it
  may run (it adds no worker whose memory, as measured, would take the loader over that; see
  :class:`~feedgpu.balancer.autoscale.Autoscaler`).

Default (``worker_memory=None`` or ``"auto"``): :data:`DEFAULT_SHARE` of the memory available
when the loader builds its workers (psutil's ``virtual_memory().available``) divided by the
largest number of workers it may run, and at least :data:`MIN_WORKER_BYTES`.
"""
from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError
from ..settings import parse_worker_memory

#: share of the memory available at start that the loader's workers may hold together (default)
DEFAULT_SHARE = 0.5
#: the smallest default budget per worker, bytes
MIN_WORKER_BYTES = 64 << 20
#: share of a worker's budget given to a source's read cache (Parquet row groups)
CACHE_SHARE = 0.5
#: the most a default budget gives a source's read cache (a budget the user sets is not capped)
DEFAULT_CACHE_MAX = 256 << 20
#: share of a worker's budget its batches in flight (shared-memory slots) may take
SLOT_SHARE = 0.25


class MemoryBudgetWarning(UserWarning):
    """A setting was lowered to keep the loader's workers within their memory budget."""


def memory_available() -> int | None:
    """Bytes of memory available now (psutil), None when it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no machine default when it cannot be read
        return None


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """A budget of ``worker_bytes`` per worker for up to ``workers`` workers.

    Attributes:
        worker_bytes: bytes one worker may hold (its USS plus its batches in flight).
        workers: the largest pool the budget is for (>= 1).
        given: True when the user set it, False for the machine's default.
    """

    worker_bytes: int
    workers: int = 1
    given: bool = False

    @classmethod
    def make(cls, value, workers: int, available: int | None = None) -> "MemoryBudget":
        """The budget for ``value`` (see :func:`parse_worker_memory`) and a pool of at most
        ``workers``; ``available`` (bytes) replaces the machine's available memory for the
        default (tests inject it)."""
        workers = max(1, int(workers))
        n = parse_worker_memory(value)
        if n is not None:
            return cls(n, workers, True)
        free = memory_available() if available is None else available
        if free is None:
            free = 8 << 30   # unreadable: assume a small machine
        return cls(max(MIN_WORKER_BYTES, int(DEFAULT_SHARE * free / workers)), workers, False)

    @property
    def total_bytes(self) -> int:
        """What the loader's workers may hold together: ``worker_bytes * workers``."""
        return self.worker_bytes * self.workers

    @property
    def cache_bytes(self) -> int:
        """A worker's source read cache: :data:`CACHE_SHARE` of its budget, and at most
        :data:`DEFAULT_CACHE_MAX` for the machine's default budget."""
        n = int(self.worker_bytes * CACHE_SHARE)
        return n if self.given else min(n, DEFAULT_CACHE_MAX)

    def max_prefetch(self, slot_bytes: int) -> int:
        """Batches in flight per worker that fit :data:`SLOT_SHARE` of the budget (>= 1)."""
        if slot_bytes <= 0:
            return 1 << 30
        return max(1, int(self.worker_bytes * SLOT_SHARE // slot_bytes))

    def describe(self) -> str:
        how = "set" if self.given else f"default: {DEFAULT_SHARE:.0%} of available memory / {self.workers} workers"
        return f"{_mib(self.worker_bytes)} per worker ({how})"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def slot_bytes(batch_size: int, sample_shape: tuple, dtype) -> int:
    """Bytes of one batch buffer: ``batch_size`` samples of ``sample_shape`` in ``dtype`` plus
    their int64 labels."""
    import numpy as np

    return int(batch_size) * (math.prod(int(s) for s in sample_shape) * np.dtype(dtype).itemsize + 8)


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What a loader's memory budget asks of it, before its workers start (the loader applies it).

    Attributes:
        budget: the :class:`MemoryBudget`.
        cache_bytes: a worker's source read cache (:meth:`Source.fit_memory`).
        slot_bytes: bytes of one batch buffer (0: the loader does not assemble batches in shared
            memory, and the prefetch depth is not capped).
        prefetch_cap: the most batches in flight per worker (``1 << 30``: no cap).
        total_bytes: what the loader's workers may hold together (the balancer's RAM limit).
    """

    budget: MemoryBudget
    cache_bytes: int
    slot_bytes: int
    prefetch_cap: int
    total_bytes: int

    def capped_warning(self, prefetch: int) -> str | None:
        """The warning for a prefetch depth ``prefetch`` over :attr:`prefetch_cap`, else None."""
        if prefetch <= self.prefetch_cap:
            return None
        return (f"prefetch_factor {prefetch} lowered to {self.prefetch_cap}: {prefetch} batches of "
                f"{_mib(self.slot_bytes)} per worker exceed {SLOT_SHARE:.0%} of the memory budget of "
                f"{self.budget.describe()}; raise worker_memory or lower batch_size")


def plan_budget(value, workers: int, batch_size: int, sample_shape: tuple | None = None, dtype=None) -> BudgetPlan:
    """The plan of a budget ``value`` (see :func:`parse_worker_memory`) for a pool of at most
    ``workers`` (the balancer's maximum under ``num_workers="auto"``): the source's read cache,
    the prefetch cap for batches of ``batch_size`` samples of ``sample_shape`` in ``dtype`` (when
    the loader assembles them in shared memory; None: no cap) and the balancer's RAM limit."""
    budget = MemoryBudget.make(value, workers)
    slot = slot_bytes(batch_size, sample_shape, dtype) if sample_shape is not None else 0
    cap = budget.max_prefetch(slot) if slot else 1 << 30
    return BudgetPlan(budget, budget.cache_bytes, slot, cap, budget.total_bytes)
