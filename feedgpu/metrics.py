"""Counters a loader keeps while it runs, read with ``loader.stats()``."""
from __future__ import annotations

import time
import warnings
from collections import Counter, deque


def cpu_seconds(pids, me=None) -> float:
    """CPU seconds (user + system) of the live processes ``pids`` and, when ``me`` (a
    ``psutil.Process``, usually this one) is given, of it (all its threads) and of its children
    already reaped (workers that exited meanwhile). Processes gone are skipped."""
    import psutil

    total = 0.0
    if me is not None:
        t = me.cpu_times()
        total += t.user + t.system + t.children_user + t.children_system
    for pid in pids:
        try:
            c = psutil.Process(pid).cpu_times()
            total += c.user + c.system
        except psutil.Error:  # exited (and then counted in children_*) or gone
            pass
    return total


class SkippedSampleWarning(UserWarning):
    """Issued once per skipped sample, naming where it came from and why."""


class LoaderStats:
    """Batches and samples delivered, time the consumer waited, seconds per stage (summed over
    workers), and skipped samples by reason (the last ``keep`` keys are listed)."""

    def __init__(self, keep: int = 1000):
        self.started = time.perf_counter()
        self.batches = 0
        self.samples = 0
        self.wait_s = 0.0
        self.stage_s: Counter = Counter()
        self.skipped: Counter = Counter()
        self.skipped_keys: deque = deque(maxlen=keep)
        self.index_skipped = 0
        self.network: dict = {}   # "host:pid" -> the latest shard-cache counters its batches carried

    def delivered(self, rows: int, waited_s: float) -> None:
        self.batches += 1
        self.samples += rows
        self.wait_s += waited_s

    def add_report(self, report) -> None:
        self.stage_s.update(report.stage_seconds)
        if getattr(report, "network", None) is not None:
            proc, counters = report.network
            self.network[proc] = counters
        for key, reason, detail in report.skipped:
            self.skip(key, reason, detail)

    def skip(self, key: str, reason: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        self.skipped_keys.append((key, reason))
        warnings.warn(f"feedgpu skipped {key}: {reason}" + (f" ({detail})" if detail else ""),
                      SkippedSampleWarning, stacklevel=4)

    def add_index_skips(self, source) -> None:
        """Count the records ``source`` left out while indexing (its ``rejected``: ``[(key,
        reason)]``) as skipped, once per loader (the source warned about each already, so no
        warning here); ``as_dict()["skipped_while_indexing"]`` holds their number."""
        rejected = list(getattr(source, "rejected", ()) or ())
        for key, reason in rejected:
            self.skipped[reason] += 1
            self.skipped_keys.append((key, reason))
        self.index_skipped += len(rejected)

    def as_dict(self) -> dict:
        elapsed = time.perf_counter() - self.started
        return {
            "batches": self.batches,
            "samples": self.samples,
            "elapsed_s": elapsed,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            "consumer_wait_s": self.wait_s,
            "stage_s": dict(self.stage_s),
            "skipped": dict(self.skipped),
            "skipped_total": sum(self.skipped.values()),
            "skipped_keys": list(self.skipped_keys),
            "skipped_while_indexing": self.index_skipped,
        }


class ExecutorTotals:
    """Counters of the remote executor over the loader's life: each pool's counters are added
    when it closes (non-persistent workers restart every epoch), the live pool's on top."""

    def __init__(self):
        self.batches = 0
        self.local_batches = 0
        self.retries = 0
        self.respawns = 0
        self.retry_reasons: Counter = Counter()
        self.retried: deque = deque(maxlen=100)

    def add(self, pool_stats: dict) -> None:
        self.batches += pool_stats["batches"]
        self.local_batches += pool_stats["local_batches"]
        self.retries += pool_stats["retries"]
        self.respawns += pool_stats["respawns"]
        self.retry_reasons.update(pool_stats["retry_reasons"])
        self.retried.extend(pool_stats["retried"])

    def report(self, settings, live: dict | None) -> dict:
        """``loader.stats()["executor"]``: ``{name}`` for the local executor; for Ray also
        ``address``, ``remote_workers``, ``remote_started`` (placed by Ray and running) and
        ``remote_names`` (live actors), ``local_workers``,
        ``remote_batches`` and ``local_batches`` (batches run on each side), ``retries`` (batches
        redone after a remote worker died), ``retry_reasons`` (count per reason), ``retried``
        (the last 100 as ``[tag, batch, worker, reason]``) and ``respawns`` (remote workers
        replaced)."""
        if not settings.remote:
            return {"name": settings.name}
        live = live or {}
        reasons = Counter(self.retry_reasons)
        reasons.update(live.get("retry_reasons", {}))
        return {"name": settings.name, "address": settings.address,
                "remote_workers": live.get("workers", 0), "remote_started": live.get("started", 0),
                "remote_names": live.get("names", []),
                "local_workers": live.get("local_workers", 0),
                "remote_batches": self.batches + live.get("batches", 0),
                "local_batches": self.local_batches + live.get("local_batches", 0),
                "retries": self.retries + live.get("retries", 0), "retry_reasons": dict(reasons),
                "retried": list(self.retried) + list(live.get("retried", [])),
                "respawns": self.respawns + live.get("respawns", 0)}
