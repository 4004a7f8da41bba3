"""``feedgpu bench``: feedgpu against torch's DataLoader + Pillow, same data, transforms and workers.

The measurement functions here are also what ``bench/cpu_loader.py`` (the recorded benchmark)
runs, so both report the same quantities the same way:

* samples/s: samples delivered after the warm-up batches divided by the time from the last
  warm-up batch to the last batch (worker start-up and pipeline fill are excluded);
* first batch: seconds from ``iter(loader)`` to the first batch (includes worker start-up);
* ms/batch: median time the consumer waits for a batch in ``next()`` (plus the copy to the
  device for the torch loader when ``--device`` is a GPU), after the warm-up;
* CPU %: CPU seconds of the main process and all its child processes (the workers) during the
  timed window, divided by its wall time (200 % = two cores busy);
* memory: peak resident set of every worker (VmHWM) and of the main process (sampled at every
  batch), and each worker's unique (USS) and proportional (PSS) memory sampled half-way through
  the timed window. Forked workers share pages with the main process, so RSS overstates what a
  worker adds; USS is what it alone holds;
* others' CPU %: what every other process used meanwhile (a busy neighbour skews the numbers).

``--engine`` picks the loaders, measured side by side in the same alternating rounds with the
same data, transforms, batch size and worker count: ``python`` (feedgpu's process pool),
``dali-cpu`` (feedgpu's DALI engine on DALI's CPU operators, ``device_id=None``, one DALI thread
per worker), ``dali-gpu`` (feedgpu's DALI engine on the GPU; only where CUDA is available) and
``torch`` (the torch DataLoader baseline). With the DALI engine there are no worker processes:
its threads live in the main process, whose CPU time the CPU % column includes.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import click

from ..exec.autoscale import cpu_cores
from ..metrics import cpu_seconds

LOADERS = ("feedgpu", "torch")
#: ``--engine`` choices -> loader kinds (keys of :data:`MAKERS`, and of the summary / JSON).
ENGINE_KINDS = {"python": "feedgpu", "dali-cpu": "feedgpu_dali_cpu", "dali-gpu": "feedgpu_dali_gpu",
                "torch": "torch"}
MB = 1 << 20


# -- what is measured on ----------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """CPUs, memory, OS, Python, torch and the active PIL build."""
    import psutil
    import torch

    from ..imaging import pil_build, pil_label

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    return {"cpu_count": os.cpu_count(), "cpus_usable": usable, "cpu_model": cpu_model(),
            "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "pil": pil_build(),
            "pil_label": pil_label(), "cuda_available": torch.cuda.is_available()}


def data_info(pipeline, path: str | None, sample: int | None = 256) -> dict:
    """Number of samples, mean encoded bytes and mean image size, over ``sample`` records spread
    evenly through the source (all when ``sample`` is None); only image headers are parsed."""
    import io

    from PIL import Image

    src = pipeline.source
    n = len(src)
    k = n if sample is None else min(n, sample)
    idx = sorted({int(i * n / k) for i in range(k)}) if k else []
    nbytes, w, h, mp = [], [], [], []
    for i in idx:
        rec = src.read(i)
        payload = rec.payload
        if isinstance(payload, (bytes, bytearray, memoryview)):
            nbytes.append(len(payload))
            try:
                size = Image.open(io.BytesIO(payload)).size
            except Exception:  # noqa: BLE001 - a bad sample does not stop the summary
                continue
        else:
            continue
        w.append(size[0])
        h.append(size[1])
        mp.append(size[0] * size[1] / 1e6)
    mean = statistics.fmean
    return {"path": path, "source": pipeline.source_label(), "images": n, "measured_on": len(idx),
            "mean_bytes": round(mean(nbytes)) if nbytes else None,
            "mean_width": round(mean(w)) if w else None, "mean_height": round(mean(h)) if h else None,
            "mean_megapixels": round(mean(mp), 4) if mp else None}


# -- the loaders under test --------------------------------------------------------------------
class Subject:
    """One loader as the measurement sees it: iterate, list its workers, fetch a batch, close."""

    def __init__(self, name: str, label: str, loader, pids: Callable[[], list[int]], device: str,
                 close: Callable[[], None], extra: Callable[[], dict] | None = None, to_device: bool = False):
        self.name, self.label, self.loader, self.device = name, label, loader, device
        self._pids, self._close, self._extra, self._to_device = pids, close, extra, to_device

    def __len__(self) -> int:
        return len(self.loader)

    def worker_pids(self) -> list[int]:
        return self._pids()

    def fetch(self, it):
        batch = next(it)
        if self._to_device:
            batch = [x.to(self.device, non_blocking=True) for x in batch]
        return batch

    def extra(self) -> dict:
        return self._extra() if self._extra else {}

    def close(self) -> None:
        self._close()


def feedgpu_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                    persistent: bool = False, engine=None, name: str = "feedgpu") -> Subject:
    """feedgpu's loader; ``engine`` overrides the pipeline's (``"python"``, or a DALI mapping:
    its thread count is ``workers``, as the loader does when ``engine.threads`` is unset)."""
    from ..imaging import pil_label
    from ..loader import DataLoader

    loader = DataLoader(pipeline, batch_size=batch_size, num_workers=workers, device=device,
                        persistent_workers=persistent and workers > 0, engine=engine)
    eng = loader.engine_settings
    if eng.name == "dali":
        dd = eng.dali_device()
        n = eng.threads or max(1, workers)
        label = f"feedgpu DALI {dd.upper()} ({n} thread{'' if n == 1 else 's'})"
    else:
        label = f"feedgpu ({pil_label()})"

    def extra() -> dict:
        st = loader.stats()
        n = max(1, st["samples"])
        budget = getattr(loader, "_memory_budget", None)
        return {"stage_ms_per_sample": {k: round(v / n * 1e3, 4) for k, v in st["stage_s"].items()},
                "worker_memory_mb": round(budget.worker_bytes / MB, 1) if budget is not None else None,
                "skipped": st["skipped_total"], "engine": st["engine"],
                **({"threads": st["engine"]["threads"]} if eng.name == "dali" else {})}

    return Subject(name, label, loader, loader.worker_pids, device, loader.shutdown, extra)


def python_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                   persistent: bool = False) -> Subject:
    return feedgpu_subject(pipeline, workers, batch_size, device, persistent, engine="python")


def dali_cpu_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                     persistent: bool = False) -> Subject:
    return feedgpu_subject(pipeline, workers, batch_size, device, persistent,
                           engine={"name": "dali", "device": "cpu"}, name="feedgpu_dali_cpu")


def dali_gpu_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                     persistent: bool = False) -> Subject:
    return feedgpu_subject(pipeline, workers, batch_size, device, persistent,
                           engine={"name": "dali", "device": "gpu"}, name="feedgpu_dali_gpu")


def torch_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                  persistent: bool = False) -> Subject:
    import psutil

    from ..baseline import torch_loader
    from ..imaging import pil_label

    gpu = device != "cpu"
    loader = torch_loader(pipeline, workers, batch_size, persistent_workers=persistent and workers > 0,
                          pin_memory=gpu)
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}

    def pids() -> list[int]:
        return [c.pid for c in me.children(recursive=True) if c.pid not in before]

    def close() -> None:
        it = getattr(loader, "_iterator", None)  # persistent workers live on the loader
        loader._iterator = None
        del it
        gc.collect()

    return Subject("torch", f"torch DataLoader + {pil_label()}", loader, pids, device, close, to_device=gpu)


MAKERS = {"feedgpu": python_subject, "feedgpu_dali_cpu": dali_cpu_subject, "feedgpu_dali_gpu": dali_gpu_subject,
          "torch": torch_subject}


# -- measuring one run ---------------------------------------------------------------------------
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


def measure(subject: Subject, batches: int, warmup: int, on_batch: Callable[[], None] | None = None) -> dict:
    """Consume ``warmup + batches`` batches from ``subject`` (crossing epochs when one epoch has
    fewer) and return the run's numbers (see the module docstring). Closes the loader and waits
    for its workers to exit before returning."""
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
        while got < needed:
            t0 = time.perf_counter()
            try:
                batch = subject.fetch(it)
            except StopIteration:
                if in_epoch == 0:
                    raise click.ClickException(f"the {subject.name} loader gave no batch in an epoch") from None
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
            click.echo(f"warning: {subject.name} workers still running after shutdown: "
                       f"{[p.pid for p in alive]}", err=True)
    wall = t_end - t_start
    worker_peaks = [peaks[p] for p in seen_pids if p in peaks]
    return {
        "loader": subject.name, "label": subject.label, "workers": len(seen_pids),
        "batches": len(waits), "warmup": warmup, "samples": samples, "epochs": epochs,
        "seconds": round(wall, 4), "samples_per_s": samples / wall if wall > 0 else 0.0,
        "first_batch_s": round(first_s, 4),
        "ms_per_batch_median": statistics.median(waits) * 1e3 if waits else None,
        "ms_per_batch_p90": _quantile(waits, 0.9) * 1e3 if waits else None,
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
    tail would weigh on the rate far more than it does on a real dataset."""
    rest = n_batches - warmup
    if rest < 1:
        raise click.UsageError(f"one epoch has {n_batches} batches, not more than --warmup {warmup}: lower "
                               "--batch-size or --warmup, or give --batches (runs then span epochs)")
    return rest // workers * workers if workers > 1 and rest >= workers else rest


def epoch_batches(pipeline, batch_size: int) -> int:
    from ..sampling import ShardedOrder

    return len(ShardedOrder(len(pipeline.source), batch_size, shuffle=False, drop_last=pipeline.drop_last))


def run_one(kind: str, pipeline, workers: int, batch_size: int, batches: int, warmup: int,
            device: str = "cpu", on_batch: Callable[[], None] | None = None) -> dict:
    """Build the ``kind`` loader (a key of :data:`MAKERS`: "feedgpu" (Python engine),
    "feedgpu_dali_cpu", "feedgpu_dali_gpu" or "torch") on ``pipeline`` and measure one run."""
    persistent = warmup + batches > epoch_batches(pipeline, batch_size)
    subject = MAKERS[kind](pipeline, workers, batch_size, device, persistent)
    return measure(subject, batches, warmup, on_batch)


def summarize(runs: list[dict]) -> dict:
    """Per loader: medians over its runs (rates, times, CPU, USS), peaks (RSS)."""
    out: dict[str, dict] = {}
    names = list(dict.fromkeys(r["loader"] for r in runs))
    med = statistics.median
    for name in names:
        rs = [r for r in runs if r["loader"] == name]
        uss = [u for r in rs for u in (r.get("uss_mb_per_worker") or [])]
        pss = [u for r in rs for u in (r.get("pss_mb_per_worker") or [])]
        rss = [u for r in rs for u in r["rss_peak_mb_per_worker"]]
        grew = [u for r in rs for u in (r.get("cow_growth_mb_per_worker") or [])]
        out[name] = {
            "label": rs[0]["label"], "workers": rs[0]["workers"], "threads": rs[0].get("threads"), "rounds": len(rs),
            "samples_per_s": med(r["samples_per_s"] for r in rs),
            "samples_per_s_runs": [round(r["samples_per_s"], 1) for r in rs],
            "ms_per_batch": med(r["ms_per_batch_median"] for r in rs),
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


def memory_notes(summary: dict, growth_mb: float | None = None) -> list[str]:
    """Lines on memory per worker: a loader whose workers copied more than ``growth_mb`` of the
    memory they share with the main process (default: the copy-on-read warning's threshold)
    between the run's first batch and its end (Python objects copied into each worker as it
    reads them), and a feedgpu loader whose workers
    hold more than their memory budget."""
    from ..exec.memory_watch import THRESHOLD_BYTES

    limit = THRESHOLD_BYTES / MB if growth_mb is None else growth_mb
    out = []
    for s in summary.values():
        grew, uss, budget = s.get("cow_growth_mb_per_worker"), s.get("uss_mb_per_worker"), s.get("worker_memory_mb")
        if grew is not None and grew > limit:
            out.append(f"{s['label']}: a worker copied {grew:,.0f} MB of the memory it shared with the main process "
                       f"during the run (more than {limit:,.0f} MB): copy-on-read, likely: the dataset holds Python objects that each worker "
                       "copies as it reads them; keep them in numpy arrays, a pyarrow table or a feedgpu source")
        if budget is not None and uss is not None and uss > budget:
            out.append(f"{s['label']}: USS per worker {uss:,.0f} MB is over its memory budget of {budget:,.0f} MB "
                       "(worker_memory)")
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(summary: dict, names: list[str] | None = None) -> str:
    """One row per loader: workers, samples/s, ms/batch, first batch, CPU %, memory per worker."""
    header = ("loader", "workers", "samples/s", "ms/batch", "1st batch s", "CPU %", "RSS/worker MB",
              "USS/worker MB")
    rows = [header]
    for name in names or list(summary):
        s = summary[name]
        workers = f"{s['threads']} threads" if s.get("threads") else str(s["workers"])
        rows.append((s["label"], workers, _fmt(s["samples_per_s"], ".0f"), _fmt(s["ms_per_batch"], ".1f"),
                     _fmt(s["first_batch_s"], ".2f"), _fmt(s["cpu_percent"], ".0f"),
                     _fmt(s["rss_peak_mb_per_worker"], ".0f"), _fmt(s["uss_mb_per_worker"], ".0f")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratio(summary: dict, a: str, b: str) -> float | None:
    if a in summary and b in summary and summary[b]["samples_per_s"]:
        return summary[a]["samples_per_s"] / summary[b]["samples_per_s"]
    return None


def progress_bar(total: int, desc: str):
    """A tqdm bar on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", leave=False, file=sys.stderr, disable=None)


# -- the command ---------------------------------------------------------------------------------
def default_pipeline_file() -> Path:
    from importlib import resources

    return Path(str(resources.files("feedgpu") / "pipelines" / "imagenet_train.yaml"))


def load_pipeline(pipeline_file: str | None, data: str | None, sets: tuple[str, ...], device: str,
                  images: int) -> tuple[Any, str, str]:
    """The pipeline to bench and where its data is: ``--data`` if given, else the file's
    ``source.path``, else the default sample (built once in the user's cache directory)."""
    from ..pipeline import Pipeline
    from ..sample_data import default_sample
    from .main import _parse_sets  # imported here: main imports this module to register the command

    file = Path(pipeline_file) if pipeline_file else default_pipeline_file()
    overrides = _parse_sets(sets)
    overrides["output.device"] = device
    if data:
        overrides["source.path"] = data
    p = Pipeline.from_yaml(file, **overrides)
    src = (p.definition or {}).get("source", {})
    if not src.get("path"):
        if src.get("format", "folder") != "folder":
            raise click.UsageError(f"{file} reads {src.get('format')} data and sets no source.path: pass --data PATH")
        path = str(default_sample(images, progress=True))
        overrides["source.path"] = path
        p = Pipeline.from_yaml(file, **overrides)
        return p, str(file), path
    path = src["path"]
    return p, str(file), path if isinstance(path, str) else ", ".join(path)


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


def pick_engines(engines: tuple[str, ...], pipeline, no_baseline: bool, device: str) -> tuple[list[str], list[str]]:
    """``--engine`` choices -> loader kinds to run, and notes on those left out. Default: the
    pipeline's own engine (python for the packaged pipelines) and the torch baseline."""
    from ..exec.dali_engine import dali_available

    if not engines:
        eng = pipeline.engine
        own = "python" if eng.name == "python" else f"dali-{eng.dali_device()}"
        engines = (own, "torch")
    kinds, notes = [], []
    for e in dict.fromkeys(engines):
        if e == "torch" and no_baseline:
            continue
        if e.startswith("dali") and not dali_available():
            notes.append(f"{e} skipped: NVIDIA DALI is not installed (pip install 'feedgpu[dali]')")
            continue
        if e == "dali-gpu":
            import torch

            if not torch.cuda.is_available():
                notes.append("dali-gpu skipped: torch sees no CUDA device")
                continue
        kinds.append(ENGINE_KINDS[e])
    if not kinds:
        raise click.UsageError("nothing to measure: " + "; ".join(notes or ["--no-baseline left no loader"]))
    return kinds, notes


@click.command()
@click.option("--pipeline", "pipeline_file", type=click.Path(exists=True, dir_okay=False),
              help="Pipeline file (default: the packaged imagenet_train.yaml).")
@click.option("--data", type=click.Path(exists=True), help="Dataset path (sets source.path).")
@click.option("--images", default=2000, show_default=True, type=click.IntRange(1),
              help="Images in the default sample dataset (when no data is given).")
@click.option("--workers", type=click.IntRange(0),
              help="Workers for both loaders (default: the pipeline's count; for 'auto', one per core, as the "
                   "loaders are the only work; with --model/--consumer-rate, feedgpu's balancer decides).")
@click.option("--batch-size", type=click.IntRange(1), help="Batch size (default: the pipeline's).")
@click.option("--batches", type=click.IntRange(1),
              help="Timed batches per run (default: the rest of one epoch after the warm-up, "
                   "rounded down to a multiple of the workers; more spans epochs).")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1),
              help="Runs per loader, alternating the loaders; medians are reported.")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(0),
              help="Batches per run left out of the timing (worker start-up, pipeline fill).")
@click.option("--engine", "engines", multiple=True, type=click.Choice(list(ENGINE_KINDS)),
              help="Loader to measure, repeatable: python (feedgpu's process pool), dali-cpu, dali-gpu "
                   "(feedgpu's DALI engine; DALI threads = --workers), torch (DataLoader + Pillow). "
                   "Default: the pipeline's engine and torch.")
@click.option("--no-baseline", is_flag=True, help="Leave out the torch baseline.")
@click.option("--device", default="cpu", show_default=True, help="Where batches are delivered (cpu, cuda, cuda:N).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Write results as JSON.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a pipeline key (dotted path).")
@click.option("--model", help="Why is my GPU idle: train this model on the batches (resnet18, resnet50 or "
                              "module:callable returning a torch.nn.Module).")
@click.option("--consumer-rate", type=click.FloatRange(min=0, min_open=True),
              help="Why is my GPU idle, without a GPU: a synthetic consumer taking this many samples/s.")
@click.option("--duration", default=20.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds of each phase (model alone, loader alone, both) with --model/--consumer-rate.")
@click.option("--compare-engines", is_flag=True,
              help="With --model/--consumer-rate: also measure DALI's engines alone and say where the stages "
                   "should run.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              help="With --model/--consumer-rate: write throughput, idle share and workers over time as PNG.")
def bench(pipeline_file, data, images, workers, batch_size, batches, rounds, warmup, engines, no_baseline, device,
          json_path, sets, model, consumer_rate, duration, compare_engines, plot_path) -> None:
    """Measure feedgpu against torch's DataLoader + Pillow on the same data and transforms.

    ``--engine`` (repeatable) compares feedgpu's engines (python, dali-cpu, dali-gpu) and the
    torch baseline side by side, in the same alternating rounds.

    With no argument, builds once (in the user's cache directory) an ImageNet-like sample from
    photographs shipped with feedgpu and runs imagenet_train.yaml on it. Prints samples/s,
    ms per batch, CPU use and memory per worker for each loader and the speed-up.

    With ``--model`` or ``--consumer-rate``, answers "why is my GPU idle" instead: it times the
    model alone, the loader alone (``num_workers`` auto unless ``--workers``) and both together,
    and reports the GPU idle share, its causes, the balancer's choices and a recommendation
    (see :mod:`feedgpu.idle`).
    """
    from ..errors import ConfigError
    from ..pipeline import resolve_device

    t0 = time.perf_counter()
    device = resolve_device(device)
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError(f"--device {device}: torch sees no CUDA device")
    p, file, path = load_pipeline(pipeline_file, data, sets, device, images)
    if model or consumer_rate:
        from .idle_report import idle_bench

        idle_bench(p, file, path, model, consumer_rate, duration, workers, batch_size, device, json_path, plot_path,
                   compare_engines)
        return
    if workers is None:  # a side-by-side comparison needs one fixed count for both loaders
        workers = cpu_cores() if p.num_workers == "auto" else p.num_workers
    batch_size = p.batch_size if batch_size is None else batch_size
    nb = epoch_batches(p, batch_size)
    batches = batches or default_batches(nb, warmup, workers)
    kinds, notes = pick_engines(engines, p, no_baseline, device)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if any(k.startswith("feedgpu_dali") for k in kinds):
        if p.cache is not None:
            raise click.UsageError("the DALI engine does not read a cache yet: --set cache.enabled=false, or "
                                   "measure --engine python")
        try:
            _with_engine(p, "dali").plan(device)  # names the stages DALI cannot run
        except ConfigError as e:
            raise click.UsageError(str(e)) from None
    if "torch" in kinds:
        from ..baseline import build_transforms

        try:
            build_transforms(p)
        except ConfigError as e:
            raise click.UsageError(str(e)) from None
    data_meta = data_info(p, path)
    machine = machine_info()
    settings = {"pipeline": file, "pipeline_name": p.name, "workers": workers, "batch_size": batch_size,
                "batches_per_epoch": nb, "timed_batches": batches, "warmup": warmup, "rounds": rounds,
                "device": device, "prefetch_factor": p.prefetch_factor, "shuffle": p.shuffle,
                "drop_last": p.drop_last, "overrides": list(sets), "loaders": kinds, "skipped_engines": notes}
    click.echo(f"feedgpu bench: {p.name} ({file}) on {data_meta['source']} at {path}", err=True)
    runs = run_rounds(kinds, rounds, lambda kind, r, on_batch: run_one(
        kind, p, workers, batch_size, batches, warmup, device, on_batch), warmup + batches)
    summary = summarize(runs)
    speedup = ratio(summary, "feedgpu", "torch")
    pairs = [(a, "torch") for a in kinds if a != "torch"] + [(a, "feedgpu") for a in kinds if a.startswith("feedgpu_")]
    speedups = {f"{a}_over_{b}": ratio(summary, a, b) for a, b in pairs if a in summary and b in summary}
    total_s = time.perf_counter() - t0

    click.echo(f"pipeline: {p.name} ({file})")
    click.echo(f"data:     {path}: {data_meta['images']} images, mean {data_meta['mean_width']}x"
               f"{data_meta['mean_height']} px ({data_meta['mean_megapixels']} MP), "
               f"{_fmt(data_meta['mean_bytes'] and data_meta['mean_bytes'] / 1024, '.0f')} KB")
    click.echo(f"machine:  {machine['cpus_usable']} CPUs ({machine['cpu_model']}), {machine['ram_gb']} GB, "
               f"PIL: {machine['pil_label']}, torch {machine['torch']}")
    click.echo(f"settings: {workers} workers, batch {batch_size}, {batches} timed batches after {warmup} warm-up "
               f"per run, {rounds} rounds (medians), prefetch {p.prefetch_factor}, device {device}")
    budgets = {s["worker_memory_mb"] for s in summary.values() if s.get("worker_memory_mb")}
    if budgets:
        click.echo(f"memory:   feedgpu's budget {', '.join(f'{b:,.0f}' for b in sorted(budgets))} MB per worker "
                   f"(worker_memory; USS/worker below is what each worker holds alone)")
    click.echo("")
    click.echo(format_table(summary))
    for line in memory_notes(summary):
        click.echo(f"note: {line}")
    lines = [f"{summary[a]['label']} / {summary[b]['label']}: {v:.2f}x"
             for key, v in speedups.items() if v is not None for a, b in [key.split("_over_")]]
    if lines:
        click.echo("\nspeed-up " + "\nspeed-up ".join(lines))
    for note in notes:
        click.echo(f"({note})")
    busy = max(s["others_cpu_percent"] for s in summary.values())
    if busy > 15:
        click.echo(f"warning: other processes used {busy:.0f} % CPU (of one core) during the timed runs; "
                   "the numbers are skewed, rerun on a quiet machine", err=True)
    outputs = {k: s["output"] for k, s in summary.items()}
    if len({json.dumps(o, sort_keys=True) for o in outputs.values()}) > 1:
        click.echo("warning: the loaders' batches differ: " + ", ".join(f"{k} {o}" for k, o in outputs.items()),
                   err=True)
    click.echo(f"({total_s:.0f} s in all)", err=True)
    if json_path:
        doc = {"format": "feedgpu.bench/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "machine": machine, "data": data_meta, "settings": settings, "summary": summary,
               "speedup_feedgpu_over_torch": speedup, "speedups": speedups, "runs": runs,
               "total_seconds": round(total_s, 1)}
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
        click.echo(f"wrote {json_path}", err=True)


def _with_engine(pipeline, name: str):
    """A shallow copy of ``pipeline`` running on engine ``name`` (for checking its plan)."""
    import copy

    from ..exec.engines import EngineSettings

    q = copy.copy(pipeline)
    q.engine = EngineSettings.make({"name": name, "device": "cpu"})
    return q
