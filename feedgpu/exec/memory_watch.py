"""Copy-on-read: a torch Dataset of Python objects that grows every worker's memory.

Forked workers share the main process's memory until a page is written. Reading a Python object
writes its reference count, so a Dataset holding millions of Python objects (a list of path
strings, a list of ints, a dict of tuples) makes each worker copy the pages those objects live on
as it reads them: each worker ends up holding its own copy of the dataset's objects (torch's
loader does the same; pytorch/pytorch#13246 is the classic report). Numpy arrays, pyarrow
tables and feedgpu's sources keep their data in buffers whose pages are only read: they stay
shared.

:class:`CopyOnReadWatch` measures it during the first epoch a loader's forked workers run: each
worker's unique memory (USS, psutil's ``memory_full_info().uss``) and resident memory (RSS) when
the pool starts, half-way through the epoch and at its end (three readings per worker). A page
copied on write moves from shared to unique: USS grows, RSS does not; memory the worker
allocates grows both. So the copy-on-read growth is the USS growth minus the RSS growth, and
workers started with ``spawn`` or ``forkserver`` (which share nothing) are not watched. When a
worker's copy-on-read growth is over ``threshold_bytes`` (default :data:`THRESHOLD_BYTES`), it
warns once
(:class:`CopyOnReadWarning`), naming the growth, the dataset's large Python containers and the
fix.
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable

log = logging.getLogger("feedgpu.memory")

#: copy-on-read growth of one worker over its first epoch (USS growth minus RSS growth), in bytes,
#: that warns (64 MiB)
THRESHOLD_BYTES = 64 << 20
#: a Python container attribute of the dataset with at least this many entries is named
BIG_CONTAINER = 10_000


class CopyOnReadWarning(UserWarning):
    """A torch Dataset's workers grew as they read its Python objects (copy-on-read)."""


def _memory(pid: int) -> tuple[int, int] | None:
    """``(uss, rss)`` bytes of ``pid``, None when it cannot be read."""
    try:
        import psutil

        m = psutil.Process(pid).memory_full_info()
        return int(m.uss), int(m.rss)
    except Exception:  # noqa: BLE001 - a worker that exited, or no psutil: no reading
        return None


def big_containers(dataset, least: int = BIG_CONTAINER) -> list[str]:
    """``"name (list of 2,000,000)"`` for each attribute of ``dataset`` that is a list, tuple,
    dict or set of at least ``least`` entries (the usual cause of copy-on-read growth)."""
    out = []
    try:
        attrs = vars(dataset)
    except TypeError:
        return out
    for name, v in attrs.items():
        if isinstance(v, (list, tuple, dict, set, frozenset)) and len(v) >= least:
            out.append(f"{name} ({type(v).__name__} of {len(v):,})")
    return out


class CopyOnReadWatch:
    """Watches one loader's workers over their first epoch (see the module docstring).

    Args:
        dataset: the torch Dataset the workers read (named in the warning, its ``len()`` gives
            the growth per sample).
        threshold_bytes: copy-on-read growth of one worker that warns (default :data:`THRESHOLD_BYTES`,
            read when the watch is made).
        read_memory: ``pid -> (uss, rss) bytes or None`` (default: psutil); tests pass their own.
        forked: False for workers started with ``spawn`` or ``forkserver``: nothing is watched.

    Attributes:
        growth: ``{pid: bytes}`` of copy-on-read growth (USS growth minus RSS growth, >= 0) the
            last readings found, per worker.
        warned: True once it warned.
    """

    def __init__(self, dataset, threshold_bytes: int | None = None,
                 read_memory: Callable[[int], tuple[int, int] | None] | None = None, forked: bool = True):
        self.dataset = dataset
        self.threshold_bytes = THRESHOLD_BYTES if threshold_bytes is None else int(threshold_bytes)
        self._read = read_memory or _memory
        self._base: dict[int, tuple[int, int]] = {}
        self.growth: dict[int, int] = {}
        self.warned = False
        self.done = not forked
        self._epoch: int | None = None
        self._marks: set[int] = set()

    def start(self, pids: list[int], epoch: int) -> None:
        """A pool is running for ``epoch``: the first readings (the first epoch only)."""
        if self.done or (self._epoch is not None and epoch != self._epoch):
            return
        self._epoch = epoch
        for pid in pids:
            if pid not in self._base:
                u = self._read(pid)
                if u is not None:
                    self._base[pid] = u

    def on_batch(self, epoch: int, b: int, first: int, end: int, pids: list[int]) -> None:
        """Batch ``b`` of ``[first, end)`` was delivered: read again half-way and at the end."""
        if self.done or epoch != self._epoch:
            return
        mid = first + (end - first) // 2
        last = b >= end - 1
        if (b >= mid and "mid" not in self._marks) or last:
            self._marks.add("mid")
            self._measure(pids)
            if last:
                self.done = True
                self._base.clear()

    def _measure(self, pids: list[int]) -> None:
        for pid in pids:
            base = self._base.get(pid)
            now = self._read(pid) if base is not None else None
            if now is not None:
                self.growth[pid] = max(0, (now[0] - base[0]) - max(0, now[1] - base[1]))
        if not self.growth or self.warned:
            return
        worst = max(self.growth.values())
        if worst > self.threshold_bytes:
            self.warned = True
            warnings.warn(self.message(worst), CopyOnReadWarning, stacklevel=4)

    def message(self, worst: int) -> str:
        try:
            n = len(self.dataset)
        except Exception:  # noqa: BLE001 - a Dataset without len()
            n = 0
        per = f" ({worst / n:,.0f} bytes per sample of the dataset)" if n else ""
        big = big_containers(self.dataset)
        held = (f"; it holds {', '.join(big)}" if big else "")
        return (f"DataLoader workers copied up to {worst / 2**20:,.0f} MiB each of the memory they share with the "
                f"main process over their first epoch{per}, more "
                f"than {self.threshold_bytes / 2**20:,.0f} MiB: copy-on-read, likely. {type(self.dataset).__name__}"
                f"{held}: each worker writes the reference counts of the Python objects it reads, so the pages "
                "they live on are copied into every worker (torch's DataLoader does the same). Keep the data in numpy "
                "arrays (paths as one byte buffer plus offsets), a pyarrow table, or a feedgpu source "
                "(FolderSource, TarShardSource, ParquetSource) instead of Python lists or dicts of objects")

    def report(self) -> dict:
        """``{"growth_mb": [...per worker], "threshold_mb", "warned"}``."""
        return {"growth_mb": [round(g / 2**20, 1) for g in self.growth.values()],
                "threshold_mb": round(self.threshold_bytes / 2**20, 1), "warned": self.warned}
