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

    def delivered(self, rows: int, waited_s: float) -> None:
        self.batches += 1
        self.samples += rows
        self.wait_s += waited_s

    def add_report(self, report) -> None:
        self.stage_s.update(report.stage_seconds)
        for key, reason, detail in report.skipped:
            self.skip(key, reason, detail)

    def skip(self, key: str, reason: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        self.skipped_keys.append((key, reason))
        warnings.warn(f"feedgpu skipped {key}: {reason}" + (f" ({detail})" if detail else ""),
                      SkippedSampleWarning, stacklevel=4)

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
        }
