"""``feedgpu bench``'s two runs: the side-by-side comparison of loaders (:func:`compare`) and
"why is my GPU idle" (:func:`why_idle`), from a pipeline file and its data to the result document.

``compare`` runs the loaders chosen by ``--engine`` side by side in the same alternating rounds
with the same data, transforms, batch size and worker count: ``python`` (feedgpu's process pool),
``dali-cpu`` (feedgpu's DALI engine on DALI's CPU operators, ``device_id=None``, one DALI thread
per worker), ``dali-gpu`` (feedgpu's DALI engine on the GPU; only where CUDA is available) and
``torch`` (the torch DataLoader baseline). With the DALI engine there are no worker processes:
its threads live in the main process, whose CPU time the CPU % column includes. The quantities
are those of :mod:`feedgpu.bench.measure`.

Options that do not fit the pipeline, data or machine raise
:class:`~feedgpu.errors.BenchUsageError`; progress and notes go to ``note`` (one line each).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import BenchUsageError, ConfigError
from .machine import data_info, machine_info
from .measure import default_batches, epoch_batches, ratio, run_one, run_rounds, summarize
from .subjects import ENGINE_KINDS

__all__ = ["check_device", "compare", "default_pipeline_file", "load_pipeline", "pick_engines", "why_idle"]

Note = Callable[[str], None]


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")


def default_pipeline_file() -> Path:
    """The packaged ``imagenet_train.yaml``."""
    from importlib import resources

    return Path(str(resources.files("feedgpu") / "pipelines" / "imagenet_train.yaml"))


def load_pipeline(pipeline_file: str | None, data: str | None, overrides: dict, device: str,
                  images: int) -> tuple[Any, str, str]:
    """The pipeline to bench and where its data is: ``data`` if given, else the file's
    ``source.path``, else the default sample of ``images`` images (built once in the user's cache
    directory). ``overrides`` are dotted keys (``--set``); ``device`` sets ``output.device``.
    Returns ``(pipeline, file, data path)``."""
    from ..pipeline import Pipeline
    from ..sample_data import default_sample

    file = Path(pipeline_file) if pipeline_file else default_pipeline_file()
    overrides = dict(overrides)
    overrides["output.device"] = device
    if data:
        overrides["source.path"] = data
    p = Pipeline.from_yaml(file, **overrides)
    src = (p.definition or {}).get("source", {})
    if not src.get("path"):
        if src.get("format", "folder") != "folder":
            raise BenchUsageError(f"{file} reads {src.get('format')} data and sets no source.path: pass --data PATH")
        path = str(default_sample(images, progress=True))
        overrides["source.path"] = path
        p = Pipeline.from_yaml(file, **overrides)
        return p, str(file), path
    path = src["path"]
    return p, str(file), path if isinstance(path, str) else ", ".join(path)


def pick_engines(engines: tuple[str, ...], pipeline, no_baseline: bool, device: str) -> tuple[list[str], list[str]]:
    """``--engine`` choices -> loader kinds to run, and notes on those left out. Default: the
    pipeline's own engine (python for the packaged pipelines) and the torch baseline."""
    from ..exec.dali.graph import dali_available

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
        raise BenchUsageError("nothing to measure: " + "; ".join(notes or ["--no-baseline left no loader"]))
    return kinds, notes


def check_device(device: str) -> str:
    """``device`` resolved (``auto`` -> cuda or cpu); a CUDA device torch cannot see raises."""
    from ..pipeline import resolve_device

    device = resolve_device(device)
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise BenchUsageError(f"--device {device}: torch sees no CUDA device")
    return device


def _check_kinds(p, kinds: list[str], device: str) -> None:
    """Refuse before measuring what a chosen loader cannot run (DALI: a cache or a stage it lacks;
    torch: a stage without a baseline equivalent)."""
    if any(k.startswith("feedgpu_dali") for k in kinds):
        if p.cache is not None:
            raise BenchUsageError("the DALI engine does not read a cache yet: --set cache.enabled=false, or "
                                  "measure --engine python")
        try:
            _with_engine(p, "dali").plan(device)  # names the stages DALI cannot run
        except ConfigError as e:
            raise BenchUsageError(str(e)) from None
    if "torch" in kinds:
        from .torch_baseline import build_transforms

        try:
            build_transforms(p)
        except ConfigError as e:
            raise BenchUsageError(str(e)) from None


def compare(p, file: str, path: str, *, workers: int | None, batch_size: int | None, batches: int | None,
            rounds: int, warmup: int, engines: tuple[str, ...], no_baseline: bool, device: str,
            sets: tuple[str, ...] = (), note: Note = _stderr, progress: bool = True, min_seconds: float = 0.0) -> dict:
    """Measure the loaders of ``engines`` on pipeline ``p`` (read from ``file``, data at ``path``):
    ``rounds`` alternating rounds of ``warmup`` + ``batches`` batches each (default: the rest of
    one epoch, see :func:`~feedgpu.bench.measure.default_batches`), timed for at least
    ``min_seconds`` (more batches, across epochs, until then) at ``workers`` workers (default:
    the pipeline's count, one per core for ``auto``). ``sets`` are recorded as the overrides.
    Returns the ``feedgpu.bench/1`` document (machine, data, settings, summary, speed-ups, runs)."""
    t0 = time.perf_counter()
    if workers is None:  # a side-by-side comparison needs one fixed count for both loaders
        from ..host import cpu_cores

        workers = cpu_cores() if p.num_workers == "auto" else p.num_workers
    batch_size = p.batch_size if batch_size is None else batch_size
    nb = epoch_batches(p, batch_size)
    batches = batches or default_batches(nb, warmup, workers)
    kinds, notes = pick_engines(engines, p, no_baseline, device)
    for n in notes:
        note(f"note: {n}")
    _check_kinds(p, kinds, device)
    data_meta = data_info(p, path)
    machine = machine_info()
    settings = {"pipeline": file, "pipeline_name": p.name, "workers": workers, "batch_size": batch_size,
                "batches_per_epoch": nb, "timed_batches": batches, "min_seconds": min_seconds, "warmup": warmup,
                "rounds": rounds,
                "device": device, "prefetch_factor": p.prefetch_factor, "shuffle": p.shuffle,
                "drop_last": p.drop_last, "overrides": list(sets), "loaders": kinds, "skipped_engines": notes}
    note(f"feedgpu bench: {p.name} ({file}) on {data_meta['source']} at {path}")
    runs = run_rounds(kinds, rounds, lambda kind, r, on_batch: run_one(
        kind, p, workers, batch_size, batches, warmup, device, on_batch, min_seconds),
        (warmup + batches) if progress else None)
    summary = summarize(runs)
    pairs = [(a, "torch") for a in kinds if a != "torch"] + [(a, "feedgpu") for a in kinds if a.startswith("feedgpu_")]
    speedups = {f"{a}_over_{b}": ratio(summary, a, b) for a, b in pairs if a in summary and b in summary}
    return {"format": "feedgpu.bench/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine, "data": data_meta, "settings": settings, "summary": summary,
            "speedup_feedgpu_over_torch": ratio(summary, "feedgpu", "torch"), "speedups": speedups, "runs": runs,
            "total_seconds": round(time.perf_counter() - t0, 1)}


def why_idle(p, file: str, path: str, *, model: str | None, consumer_rate: float | None, duration: float,
             workers: int | None, batch_size: int | None, device: str, compare_engines: bool = False,
             note: Note = _stderr) -> dict:
    """"Why is my GPU idle": :func:`feedgpu.bench.idle.analyze` with a training step of ``model``
    (see :func:`~feedgpu.bench.idle.load_model`) or a synthetic consumer of ``consumer_rate``
    samples/s, three phases of ``duration`` seconds timed (phases 2 and 3 after ``duration / 2``
    seconds untimed when the balancer sizes the pool), ``workers`` (default ``auto``). Returns the
    ``feedgpu.idle/1`` report. Both or neither of ``model``/``consumer_rate`` raise
    :class:`~feedgpu.errors.BenchUsageError`."""
    from ..loader.front import DataLoader
    from . import idle

    if model and consumer_rate:
        raise BenchUsageError("give --model or --consumer-rate, not both")
    if not (model or consumer_rate):
        raise BenchUsageError("give --model or --consumer-rate")
    try:
        if model:
            m, label = idle.load_model(model)
            consumer = idle.ModelConsumer(m, device if device != "cpu" else "cpu", f"model {label} on {device}")
        else:
            consumer = idle.RateConsumer(consumer_rate)
    except ConfigError as e:
        raise BenchUsageError(str(e)) from None
    nw = "auto" if workers is None else workers
    bs = batch_size or p.batch_size

    def make_loader(**over):
        return DataLoader(p, batch_size=bs, num_workers=nw, device=device, **over)

    settle = duration / 2 if nw == "auto" else 0.0   # the balancer sizes the pool: let it settle first
    phases = (f"model alone {duration:g} s; loader alone, then loader + consumer: start-up and {settle:g} s settling (untimed) "
              f"+ {duration:g} s timed each" if settle else f"3 phases of {duration:g} s")
    note(f"feedgpu bench: why is the GPU idle? {consumer.label}; {p.name} on {path}; {phases}")
    t0 = time.perf_counter()
    report = idle.analyze(make_loader, consumer, duration, on_gpu=device != "cpu", compare_engines=compare_engines,
                          warmup_s=settle)
    report.update(pipeline=file, data=path, batch_size=bs, num_workers=nw, device=device, machine=machine_info(),
                  created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), format="feedgpu.idle/1",
                  total_seconds=round(time.perf_counter() - t0, 1))
    return report


def _with_engine(pipeline, name: str):
    """``pipeline`` running on engine ``name`` (for checking its plan): raises
    :class:`ConfigError` when that engine cannot run its stages."""
    return pipeline.replace(engine={"name": name, "device": "cpu"})
