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
import warnings

from ..errors import ConfigError

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


def parse_worker_memory(value) -> int | None:
    """``worker_memory`` as bytes: an int, a string with a unit (``"512MiB"``, ``"2GB"``), or
    ``None``/``"auto"`` for the machine's default (returns None). Raises :class:`ConfigError`
    for anything else or a budget under 1 MiB."""
    from ..cache.settings import parse_size

    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"worker_memory must be bytes (int), a size such as '2GiB', or 'auto'; got {value!r}")
    try:
        n = parse_size(value)
    except ConfigError:
        raise ConfigError(f"worker_memory {value!r}: expected a size such as 512MiB or 2GB, or 'auto'") from None
    if n < 1 << 20:
        raise ConfigError(f"worker_memory {value!r} is under 1 MiB: a worker cannot run in it")
    return n


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


def loader_budget(loader) -> MemoryBudget:
    """The budget of ``loader`` (its ``worker_memory``, else its pipeline's), for the largest
    pool it may run: the balancer's maximum under ``num_workers="auto"``, else its workers."""
    value = getattr(loader, "worker_memory", None)
    if value is None and loader.pipeline is not None:
        value = loader.pipeline.worker_memory
    auto = loader._autoscaler
    workers = auto.policy.config.max_workers if auto is not None else max(1, loader.num_workers)
    return MemoryBudget.make(value, workers)


def apply_budget(loader, sample_shape: tuple | None = None, dtype=None) -> MemoryBudget:
    """Size ``loader``'s worker-side memory by its budget, before its workers start: the source's
    read cache, the prefetch depth (batches of ``sample_shape`` in ``dtype``, when the loader
    assembles them in shared memory) and the balancer's RAM limit. A prefetch depth lowered
    from what was asked warns (:class:`MemoryBudgetWarning`) once per loader."""
    budget = loader_budget(loader)
    p = loader.pipeline
    if p is not None:
        p.source.fit_memory(budget.cache_bytes)
    auto = loader._autoscaler
    if sample_shape is not None:
        cap = budget.max_prefetch(slot_bytes(loader._batch_size, sample_shape, dtype))
        if auto is not None and auto.policy.config.max_prefetch > cap:
            c = auto.policy.config
            auto.policy.config = dataclasses.replace(c, max_prefetch=max(c.min_prefetch, cap))
            auto.prefetch = min(auto.prefetch, auto.policy.config.max_prefetch)
        if loader._prefetch > cap:
            if not getattr(loader, "_warned_prefetch_cap", False):
                loader._warned_prefetch_cap = True
                warnings.warn(
                    f"prefetch_factor {loader._prefetch} lowered to {cap}: {loader._prefetch} batches of "
                    f"{_mib(slot_bytes(loader._batch_size, sample_shape, dtype))} per worker exceed "
                    f"{SLOT_SHARE:.0%} of the memory budget of {budget.describe()}; raise worker_memory "
                    "or lower batch_size", MemoryBudgetWarning, stacklevel=4)
            loader._set_live(loader.num_workers, cap)
    if auto is not None:
        auto.memory_budget = budget.total_bytes
    loader._memory_budget = budget
    return budget
