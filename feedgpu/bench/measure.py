"""Measuring loaders: one run (:func:`measure`), alternating rounds (:func:`run_rounds`) and their
medians (:func:`summarize`). ``feedgpu bench`` and the ``bench/`` scripts report these quantities
the same way:

* samples/s: samples delivered after the warm-up batches divided by the time from the last
  warm-up batch to the last batch (the timed window; worker start-up and pipeline fill are
  excluded);
* ms/batch: the same timed window divided by the batches delivered in it, so that samples/s
  times ms/batch is the batch size (:func:`summarize` derives it from the median samples/s);
* wait: the time the consumer spent inside ``next()`` per batch (median, p90, mean; plus the
  copy to the device for the torch loader when ``--device`` is a GPU): the time between two
  ``next()`` calls (reading the batch, sampling memory) is not in it, and workers deliver in
  bursts, so its median is not the rate's reciprocal;
* timed batches: ``batches``, and with ``min_seconds`` more until the window lasts that long;
* first batch: seconds from ``iter(loader)`` to the first batch (includes worker start-up);
* CPU %: CPU seconds of the main process and all its child processes (the workers) during the
  timed window, divided by its wall time (200 % = two cores busy);
* memory: peak resident set of every worker (VmHWM) and of the main process (sampled at every
  batch), and each worker's unique (USS) and proportional (PSS) memory sampled half-way through
  the timed window. Workers share pages with the main process and with each other (libraries,
  feedgpu's shared-memory batch buffers), so RSS counts those in every worker; USS is what a
  worker alone holds (what one more worker costs), PSS its share of everything it maps;
* others' CPU %: what every other process used meanwhile (a busy neighbour skews the numbers).
"""
from __future__ import annotations

import gc
import logging
import statistics
import sys
import time
from typing import Any, Callable

from ..errors import BenchRunError, BenchUsageError
from ..metrics import cpu_seconds
from .subjects import MAKERS, Subject

__all__ = ["MB", "default_batches", "epoch_batches", "measure", "progress_bar", "ratio", "run_one", "run_rounds",
           "summarize"]

log = logging.getLogger(__name__)
MB = 1 << 20


def _status_kb(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _peak_rss(pid: int) -> int | None:
    """Peak resident bytes of ``pid`` so far (VmHWM), or its current RSS where /proc lacks it."""
    kb = _status_kb(pid, "VmHWM:")
    if kb is not None:
        return kb * 1024
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


def _touch(batch) -> float:
    """Read a little of every batch, as a training step would; no heavy math."""
    images, labels = batch[0], batch[1]
    flat = images.reshape(-1)[:4096]
    return float(flat.float().sum().item()) + float(labels[:1].sum().item())


def _rows(batch) -> int:
    return int(batch[0].shape[0])


def measure(subject: Subject, batches: int, warmup: int, on_batch: Callable[[], None] | None = None,
            min_seconds: float = 0.0) -> dict:
    """Consume ``warmup + batches`` batches from ``subject`` (crossing epochs when one epoch has
    fewer), and more while the timed window is shorter than ``min_seconds`` (seconds, default 0),
    and return the run's numbers (see the module docstring). Closes the loader and waits
    for its workers to exit before returning. Raises :class:`~feedgpu.errors.BenchRunError` when
    an epoch gives no batch."""
    import psutil

    me = psutil.Process()
    children = lambda: [c.pid for c in me.children(recursive=True)]  # noqa: E731
    waits: list[float] = []
    peaks: dict[int, int] = {}
    main_peak = 0
    mid_mem: dict = {}
    first_mem: dict = {}
    end_mem: dict = {}
    samples = 0
    first_s = None
    shape = dtype = None
    epochs = 1
    t_start = cpu_start = sys_start = None
    needed = warmup + batches
    mid = warmup + batches // 2
    seen_pids: list[int] = []
    try:
        t_iter = time.perf_counter()
        if warmup == 0:
            t_start, cpu_start, sys_start = t_iter, cpu_seconds(children(), me), psutil.cpu_times()
        it = iter(subject.loader)
        got = in_epoch = 0
        while got < needed or (min_seconds > 0 and (t_start is None or time.perf_counter() - t_start < min_seconds)):
            t0 = time.perf_counter()
            try:
                batch = subject.fetch(it)
            except StopIteration:
                if in_epoch == 0:
                    raise BenchRunError(f"the {subject.name} loader gave no batch in an epoch") from None
                it = iter(subject.loader)
                epochs += 1
                in_epoch = 0
                continue
            t1 = time.perf_counter()
            _touch(batch)
            got += 1
            in_epoch += 1
            if first_s is None:
                first_s = t1 - t_iter
                shape, dtype = list(batch[0].shape), str(batch[0].dtype).replace("torch.", "")
            if got <= warmup:
                if got == warmup:
                    t_start, cpu_start = time.perf_counter(), cpu_seconds(children(), me)
                    sys_start = psutil.cpu_times()
            else:
                waits.append(t1 - t0)
                samples += _rows(batch)
            pids = subject.worker_pids()
            for pid in pids:
                if pid not in seen_pids:
                    seen_pids.append(pid)
                rss = _peak_rss(pid)
                if rss is not None:
                    peaks[pid] = max(peaks.get(pid, 0), rss)
            main_peak = max(main_peak, me.memory_info().rss)
            if got == mid:
                mid_mem = _full_memory(me, pids)
            if got == 1:
                first_mem = _full_memory(me, pids)
            del batch
            if on_batch is not None:
                on_batch()
        t_end = time.perf_counter()
        cpu_end = cpu_seconds(children(), me)
        sys_end = psutil.cpu_times()
        end_mem = _full_memory(me, subject.worker_pids())
        extra = subject.extra()
    finally:
        it = None
        procs = []
        for pid in subject.worker_pids() or seen_pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        subject.close()
        gc.collect()
        _, alive = psutil.wait_procs(procs, timeout=15)
        if alive:
            log.warning("warning: %s workers still running after shutdown: %s", subject.name,
                        [p.pid for p in alive])
    wall = t_end - t_start
    worker_peaks = [peaks[p] for p in seen_pids if p in peaks]
    return {
        "loader": subject.name, "label": subject.label, "workers": len(seen_pids),
        "batches": len(waits), "warmup": warmup, "samples": samples, "epochs": epochs,
        "seconds": round(wall, 4), "samples_per_s": samples / wall if wall > 0 else 0.0,
        "first_batch_s": round(first_s, 4),
        "ms_per_batch": 1e3 * wall / len(waits) if waits else None,
        "wait_ms_median": statistics.median(waits) * 1e3 if waits else None,
        "wait_ms_p90": _quantile(waits, 0.9) * 1e3 if waits else None,
        "wait_ms_mean": statistics.fmean(waits) * 1e3 if waits else None,
        "cpu_s": round(cpu_end - cpu_start, 3),
        "cpu_percent": 100.0 * (cpu_end - cpu_start) / wall if wall > 0 else 0.0,
        "rss_peak_mb_per_worker": [round(b / MB, 1) for b in worker_peaks],
        "rss_peak_mb_main": round(main_peak / MB, 1),
        "uss_mb_per_worker": mid_mem.get("uss"), "pss_mb_per_worker": mid_mem.get("pss"),
        "uss_mb_main": mid_mem.get("main_uss"), "steal_percent": _steal(sys_start, sys_end),
        "cow_growth_mb_per_worker": _growth(first_mem, end_mem),
        "others_cpu_percent": _others(sys_start, sys_end, cpu_end - cpu_start, wall),
        "output": {"shape": shape, "dtype": dtype}, **extra,
    }


def _steal(a, b) -> float | None:
    """Share of the machine's CPU time the hypervisor gave to others (``steal``), in percent."""
    if a is None or not hasattr(a, "steal"):
        return None
    total = sum(b) - sum(a)
    return round(100.0 * (b.steal - a.steal) / total, 1) if total > 0 else 0.0


def _others(a, b, ours: float, wall: float) -> float | None:
    """CPU use of everything else on the machine during the window (other processes, kernel
    threads), in percent of one CPU like ``cpu_percent``: a busy neighbour skews a benchmark."""
    if a is None or wall <= 0:
        return None
    fields = ("user", "nice", "system", "irq", "softirq", "steal")
    busy = sum(getattr(b, f, 0.0) - getattr(a, f, 0.0) for f in fields)
    return round(max(0.0, 100.0 * (busy - ours) / wall), 1)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _growth(first: dict, end: dict) -> list[float]:
    """Per worker seen at both readings, from its first batch to the end of the run: the growth
    of its USS minus that of its RSS (pages it shared that became its own: copy-on-read; see
    :mod:`feedgpu.exec.memory_watch`), MB, >= 0."""
    a, b = first.get("by_pid", {}), end.get("by_pid", {})
    return [round(max(0.0, (b[p][0] - a[p][0]) - max(0.0, b[p][1] - a[p][1])), 1) for p in a if p in b]


def _full_memory(me, pids: list[int]) -> dict:
    import psutil

    out: dict[str, Any] = {"uss": [], "pss": [], "by_pid": {}}
    for pid in pids:
        try:
            m = psutil.Process(pid).memory_full_info()
        except (psutil.Error, AttributeError):
            continue
        out["uss"].append(round(m.uss / MB, 1))
        out["by_pid"][pid] = (m.uss / MB, m.rss / MB)
        if hasattr(m, "pss"):
            out["pss"].append(round(m.pss / MB, 1))
    try:
        out["main_uss"] = round(me.memory_full_info().uss / MB, 1)
    except (psutil.Error, AttributeError):
        pass
    return out


def default_batches(n_batches: int, warmup: int, workers: int) -> int:
    """Timed batches when not given: the rest of one epoch after the warm-up, rounded down to
    a multiple of the worker count. Each worker fills whole batches, so the epoch's last
    batches come out with some workers idle; on a small sample (a few batches per epoch) that
    tail would weigh on the rate far more than it does on a real dataset. Raises
    :class:`~feedgpu.errors.BenchUsageError` when an epoch is not longer than the warm-up."""
    rest = n_batches - warmup
    if rest < 1:
        raise BenchUsageError(f"one epoch has {n_batches} batches, not more than --warmup {warmup}: lower "
                               "--batch-size or --warmup, or give --batches (runs then span epochs)")
    return rest // workers * workers if workers > 1 and rest >= workers else rest


def epoch_batches(pipeline, batch_size: int) -> int:
    from ..order.sharded import ShardedOrder

    return len(ShardedOrder(len(pipeline.source), batch_size, shuffle=False, drop_last=pipeline.drop_last))


def run_one(kind: str, pipeline, workers: int, batch_size: int, batches: int, warmup: int,
            device: str = "cpu", on_batch: Callable[[], None] | None = None, min_seconds: float = 0.0) -> dict:
    """Build the ``kind`` loader (a key of :data:`MAKERS`: "feedgpu" (Python engine),
    "feedgpu_dali_cpu", "feedgpu_dali_gpu" or "torch") on ``pipeline`` and measure one run
    (:func:`measure`; workers persist across epochs when the run may span more than one)."""
    persistent = min_seconds > 0 or warmup + batches > epoch_batches(pipeline, batch_size)
    subject = MAKERS[kind](pipeline, workers, batch_size, device, persistent)
    return measure(subject, batches, warmup, on_batch, min_seconds)


def summarize(runs: list[dict]) -> dict:
    """Per loader: medians over its runs (rates, waits, CPU, USS, PSS), peaks (RSS). ``ms_per_batch``
    is the median samples/s turned into time per batch (the runs' mean batch size over it), so
    the two always agree."""
    out: dict[str, dict] = {}
    names = list(dict.fromkeys(r["loader"] for r in runs))
    med = statistics.median
    for name in names:
        rs = [r for r in runs if r["loader"] == name]
        uss = [u for r in rs for u in (r.get("uss_mb_per_worker") or [])]
        pss = [u for r in rs for u in (r.get("pss_mb_per_worker") or [])]
        rss = [u for r in rs for u in r["rss_peak_mb_per_worker"]]
        grew = [u for r in rs for u in (r.get("cow_growth_mb_per_worker") or [])]
        rate = med(r["samples_per_s"] for r in rs)
        batches = sum(r["batches"] for r in rs)
        rows = sum(r["samples"] for r in rs) / batches if batches else None
        out[name] = {
            "label": rs[0]["label"], "workers": rs[0]["workers"], "threads": rs[0].get("threads"), "rounds": len(rs),
            "samples_per_s": rate,
            "samples_per_s_runs": [round(r["samples_per_s"], 1) for r in rs],
            "ms_per_batch": 1e3 * rows / rate if rows and rate else None,
            "wait_ms_median": med(r["wait_ms_median"] for r in rs if r["wait_ms_median"] is not None)
            if any(r["wait_ms_median"] is not None for r in rs) else None,
            "timed_batches": med(r["batches"] for r in rs),
            "timed_seconds": med(r["seconds"] for r in rs),
            "first_batch_s": med(r["first_batch_s"] for r in rs),
            "cpu_percent": med(r["cpu_percent"] for r in rs),
            "rss_peak_mb_per_worker": max(rss) if rss else None,
            "uss_mb_per_worker": med(uss) if uss else None,
            "cow_growth_mb_per_worker": max(grew) if grew else None,
            "worker_memory_mb": rs[0].get("worker_memory_mb"),
            "pss_mb_per_worker": med(pss) if pss else None,
            "rss_peak_mb_main": max(r["rss_peak_mb_main"] for r in rs),
            "others_cpu_percent": med(r.get("others_cpu_percent") or 0.0 for r in rs),
            "output": rs[0]["output"],
        }
    return out


def ratio(summary: dict, a: str, b: str) -> float | None:
    """``summary[a]``'s median samples/s over ``summary[b]``'s, or None when either is missing or zero."""
    if a in summary and b in summary and summary[b]["samples_per_s"]:
        return summary[a]["samples_per_s"] / summary[b]["samples_per_s"]
    return None


def progress_bar(total: int, desc: str):
    """A tqdm bar on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", leave=False, file=sys.stderr, disable=None)


def run_rounds(kinds: list[str], rounds: int, run: Callable[[str, int, Callable[[], None] | None], dict],
               batches_per_run: int | None = None) -> list[dict]:
    """``rounds`` rounds, each running every loader in ``kinds`` once, in turn (alternating, so
    drift in the machine's speed hits all loaders alike). ``run(kind, round, on_batch)`` does
    one measured run; with ``batches_per_run`` a progress bar counts its batches."""
    runs = []
    for r in range(rounds):
        for kind in kinds:
            if batches_per_run:
                with progress_bar(batches_per_run, f"{kind} round {r + 1}/{rounds}") as bar:
                    res = run(kind, r, lambda: bar.update(1))
            else:
                res = run(kind, r, None)
            res["round"] = r + 1
            runs.append(res)
    return runs
