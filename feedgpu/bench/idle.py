"""Why is my GPU idle: the measurement behind ``feedgpu bench --model / --consumer-rate``.

Three phases, each ``duration_s`` long, in one run:

1. **model alone**: the consumer's step on a batch already on the device, repeated: ``T1``
   seconds per batch (CUDA events on a GPU, wall clock on the CPU);
2. **loader alone**: the loader (``num_workers="auto"`` unless set) feeding a consumer that does
   nothing: what the input pipeline can deliver;
3. **both**: the loader feeding the consumer, as in training.

GPU idle % = ``1 - n3 * T1 / wall3`` (``n3`` batches consumed in phase 3 in ``wall3`` seconds):
the share of the training time the model's step did not run. Phase 3 also gives the balancer's
choices over time, the stage costs (seconds per sample in the workers, from
``loader.stats()``) and the split of the workers' time between reading bytes and
preprocessing, and :func:`recommend` turns them into a sentence.

Consumers: :class:`RateConsumer` (a stand-in for a GPU that takes ``rate`` samples/s, for
machines without one), :class:`ModelConsumer` (a training step of a ``torch.nn.Module``: the
built-in :mod:`feedgpu.bench.models` or a user's ``module:callable``).
"""
from __future__ import annotations

import importlib
import logging
import math
import statistics
import time
from typing import Any, Callable

from ..errors import ConfigError
from ..balancer import diagnose
from ..metrics import cpu_seconds

log = logging.getLogger(__name__)

#: Idle share under which the GPU counts as fed (the project's target for ResNet-18).
FED_IDLE = 0.02


def _images(batch):
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class RateConsumer:
    """Takes ``rate`` samples/s: each step sleeps ``rows / rate`` seconds (no CPU used).

    Raises :class:`ConfigError` for a rate <= 0."""

    def __init__(self, rate: float):
        if not rate > 0:
            raise ConfigError(f"--consumer-rate must be > 0 samples/s, got {rate}")
        self.rate = float(rate)
        self.label = f"synthetic consumer at {self.rate:,.0f} samples/s"

    def prepare(self, batch) -> int:
        return len(_images(batch))

    def run(self, rows: int) -> None:
        time.sleep(rows / self.rate)

    def step(self, batch) -> None:
        self.run(self.prepare(batch))

    def sync(self) -> None:
        pass


class ModelConsumer:
    """One training step (forward, cross-entropy, backward, SGD) of ``model`` on ``device``.

    Batches may be uint8 or floating point, NCHW or NHWC: they are moved to ``device``, made
    float32 NCHW and scaled to [0, 1] when uint8 (normalization is not the point here)."""

    def __init__(self, model, device: str, label: str):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.model = model.to(self.device).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.label = label
        self.cuda = self.device.type == "cuda"

    def prepare(self, batch):
        torch = self.torch
        images, labels = batch[0], batch[1]
        x = images.to(self.device, non_blocking=True)
        if x.dim() == 4 and x.shape[1] != 3 and x.shape[-1] == 3:
            x = x.permute(0, 3, 1, 2)
        x = x.float().div_(255) if x.dtype == torch.uint8 else x.float()
        y = labels.to(self.device, non_blocking=True) % 1000
        return x.contiguous(), y

    def step(self, batch) -> None:
        self.run(self.prepare(batch))

    def run(self, prepared) -> None:
        x, y = prepared
        self.opt.zero_grad(set_to_none=True)
        loss = self.torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)


def load_model(spec: str) -> tuple[Any, str]:
    """``resnet18``/``resnet50`` (built in) or ``module:callable`` returning a ``torch.nn.Module``.

    Raises :class:`ConfigError` when the module or callable cannot be found, or it does not
    return a module."""
    from torch import nn

    from .models import MODELS

    if spec in MODELS:
        return MODELS[spec](), spec
    if ":" not in spec:
        raise ConfigError(f"--model {spec!r}: give one of {sorted(MODELS)} or module:callable")
    mod, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--model {spec!r}: {e}") from None
    model = fn()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model, spec


def time_model(consumer, batch, duration_s: float, warmup: int = 2, max_steps: int = 10_000) -> dict:
    """Phase 1: seconds per step on ``batch`` already prepared on the device."""
    prepared = consumer.prepare(batch)
    for _ in range(warmup):
        consumer.run(prepared)
    consumer.sync()
    steps, t0 = 0, time.perf_counter()
    while steps < max_steps and (steps < 3 or time.perf_counter() - t0 < duration_s):
        consumer.run(prepared)
        steps += 1
    consumer.sync()
    wall = time.perf_counter() - t0
    rows = len(_images(batch))
    return {"steps": steps, "seconds_per_step": wall / steps, "samples_per_s": rows * steps / wall}


def run_loader(loader, consumer, duration_s: float, warmup_s: float = 0.0) -> dict:
    """Phases 2 and 3: iterate ``loader`` (epoch after epoch) for ``warmup_s`` seconds untimed
    (the balancer settling), then ``duration_s`` seconds timed, giving each batch to
    ``consumer`` (None: phase 2). The clock starts with the first batch after the warm-up (worker
    start-up excluded); that batch and its step count, its wait does not. ``t_start`` in the
    result is that first batch's ``time.perf_counter()`` (the clock of the balancer's timeline)."""
    import psutil

    if warmup_s > 0:
        run_loader(loader, consumer, warmup_s)
    batches = samples = 0
    waits: list[float] = []
    t_first = None
    cpu0 = None
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        it = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            if t_first is None:
                t_first = now
                me = psutil.Process()
                cpu0 = cpu_seconds(loader.worker_pids(), me)
            else:
                waits.append(now - t)
            batches += 1
            samples += len(_images(batch))
            if consumer is not None:
                consumer.step(batch)
            del batch
            if time.perf_counter() - t_first >= duration_s:
                if consumer is not None:
                    consumer.sync()
                wall = time.perf_counter() - t_first
                cores = (cpu_seconds(loader.worker_pids(), me) - cpu0) / wall
                return {"batches": batches, "samples": samples, "wall_s": wall, "samples_per_s": samples / wall,
                        "cpu_cores": cores, "t_start": t_first,
                        "wait_s": sum(waits), "median_wait_ms": 1e3 * statistics.median(waits) if waits else 0.0}
        epoch += 1


#: The engines :func:`placement` compares: label -> the loader's ``engine=`` argument.
PLACEMENT_ENGINES = {"python": {"name": "python"}, "dali-cpu": {"name": "dali", "device": "cpu"},
                     "dali-gpu": {"name": "dali", "device": "gpu"}}


def engine_label(loader) -> tuple[str, int]:
    """The placement label of ``loader``'s engine (``python``, ``dali-cpu``, ``dali-gpu``) and
    its workers (processes, or DALI threads)."""
    eng = loader.stats()["engine"]
    if eng.get("name") == "dali":
        return f"dali-{eng.get('device', 'cpu')}", int(eng.get("threads") or 1)
    return "python", int(loader.num_workers)


def placement(make_loader: Callable[..., Any], alone: dict, duration_s: float, demand: float,
              on_gpu: bool, warmup_s: float = 0.0) -> dict:
    """Measure the loader alone on the other engines too (``python``, ``dali-cpu``; ``dali-gpu``
    on a GPU) and let :func:`~feedgpu.balancer.choose_placement` pick where the stages run:
    the rate each delivers (counted up to ``demand``) for the cores it uses (main process and
    workers). ``alone``: the configured loader measured alone, with its ``engine`` label and
    ``workers`` (:func:`engine_label`), so a pipeline configured for DALI is not reported as the
    Python engine. A Python loader that sizes its pool itself runs ``warmup_s`` untimed first."""
    from ..host import cpu_cores
    from ..balancer import EngineRate, choose_placement

    mine = alone.get("engine", "python")
    options = [EngineRate(mine, alone["samples_per_s"], alone["cpu_cores"], max(1, alone["workers"]))]
    measured, errors = {mine: alone}, {}
    for name, engine in PLACEMENT_ENGINES.items():
        if name == mine or (name == "dali-gpu" and not on_gpu):
            continue
        try:
            loader = make_loader(engine=engine)
            r = run_loader(loader, None, duration_s, warmup_s if loader.balancer is not None else 0.0)
            workers = engine_label(loader)[1] if name != "python" else loader.num_workers
            loader.shutdown()
        except Exception as e:  # noqa: BLE001 - an engine that cannot run this pipeline is no option
            errors[name] = f"{type(e).__name__}: {e}"
            continue
        measured[name] = r
        options.append(EngineRate(name, r["samples_per_s"], r["cpu_cores"], max(1, int(workers))))
    gpu_free = None
    if on_gpu:
        import torch

        gpu_free = int(torch.cuda.mem_get_info()[0])
    pick = choose_placement(options, cpu_budget=float(cpu_cores()), gpu_mem_free_bytes=gpu_free, demand_rate=demand)
    return {"configured": mine,
            "measured": {k: {"samples_per_s": v["samples_per_s"], "cpu_cores": v["cpu_cores"]}
                         for k, v in measured.items()},
            "not_measured": errors, "choice": pick.engine, "engine_settings": pick.engine_settings(),
            "reason": pick.reason}


def stage_costs(stats: dict) -> dict:
    """Seconds per sample of each stage in the workers, and the reading share of their time."""
    stage_s = dict(stats.get("stage_s") or {})
    n = max(1, stats.get("samples", 0))
    total = sum(stage_s.values())
    read = sum(v for k, v in stage_s.items() if k in ("read", "cache_read"))
    return {"ms_per_sample": {k: round(1e3 * v / n, 3) for k, v in stage_s.items()},
            "read_share": read / total if total else 0.0}


def recommend(idle: float, diag: dict | None, costs: dict, on_gpu: bool) -> str:
    """The finding in plain words (see the module doc)."""
    if idle <= FED_IDLE:
        return (f"GPU-bound: the model idles {100 * idle:.1f} % of the time; the loader keeps up"
                + (f" ({diag['delivered_rate']:,.0f} samples/s with {diag['workers']} workers)." if diag else "."))
    if diag is None:
        return f"The model idles {100 * idle:.1f} % of the time; too few windows to say why (run longer)."
    if diag["verdict"] == "network-bound":
        return (f"Network-bound: the model idles {100 * idle:.1f} %; the loader waited for shard downloads "
                f"{100 * diag['network_wait_fraction']:.1f} % of the time (waiting for the network). Fetch further "
                "ahead (more downloads in flight), keep the shards in the shard cache (later epochs read them "
                "locally), or use a faster link; more workers do not help.")
    read_share = costs.get("read_share", 0.0)
    if read_share > 0.5:
        return (f"Read-bound: the model idles {100 * idle:.1f} %; reading the bytes takes {100 * read_share:.0f} % "
                "of the workers' time. Cache the decoded images (cache.enabled: true), convert to fewer, larger "
                "files (feedgpu convert), or use faster storage.")
    if diag["verdict"] == "CPU-bound":
        decode = costs["ms_per_sample"].get("decode", 0.0)
        total = sum(costs["ms_per_sample"].values()) or 1.0
        gpu = (f", or decoding on the GPU (engine: dali, device: gpu; decode is {100 * decode / total:.0f} % of "
               "the workers' time)") if on_gpu and decode else ""
        extra = diag["extra_cores"]
        more = (f"{extra:.1f} more cores" if extra is not None and math.isfinite(extra)
                else "more cores than any machine has")
        return (f"CPU-bound: the loader delivers {diag['delivered_rate']:,.0f} samples/s on "
                f"{diag['cpu_cores_used']:.1f} cores ({diag['rate_per_core'] or 0:,.0f} per core) and the model "
                f"takes {diag['demand_rate']:,.0f}/s: {more}{gpu} would remove about {100 * idle:.0f} % of the "
                f"training time spent idle.")
    return (f"Input-bound: the model idles {100 * idle:.1f} % though the workers use {diag['cpu_cores_used']:.1f} of "
            f"{diag['cpu_budget']:.1f} cores: the main process's hand-off, the storage, or a prefetch depth too "
            "shallow limits it; see the balancer's decisions.")


def _fixed_diagnosis(both: dict, model: dict, workers: int) -> dict:
    """Without a balancer: :func:`diagnose` of phase 3 as one window (CPU of the main process
    and the workers against all cores)."""
    from ..host import cpu_cores
    from ..balancer import Measurement

    m = Measurement(t=0.0, workers=max(1, workers), delivered_rate=both["samples_per_s"],
                    demand_rate=model["samples_per_s"], wait_fraction=min(1.0, both["wait_s"] / both["wall_s"]),
                    cpu_cores_used=both["cpu_cores"], cpu_budget=float(cpu_cores()))
    return diagnose(m).as_dict()


def _diagnosis(ms: list) -> dict | None:
    """:func:`diagnose` of the windows at the latest setting measured at least twice (the
    window right after a change is not representative), else of the last window."""
    if not ms:
        return None
    by_setting: dict[tuple, list] = {}
    for m in ms:
        by_setting.setdefault((m.workers, m.prefetch), []).append(m)
    for m in reversed(ms):
        runs = by_setting[(m.workers, m.prefetch)]
        if len(runs) >= 2:
            return diagnose(runs[1:]).as_dict()
    return diagnose(ms[-1:]).as_dict()


def analyze(make_loader: Callable[..., Any], consumer, duration_s: float, on_gpu: bool,
            compare_engines: bool = False, warmup_s: float | None = None) -> dict:
    """Run the three phases; ``make_loader(**overrides)`` gives a fresh loader for phases 2 and
    3, each run ``warmup_s`` seconds untimed first (default: ``duration_s / 2`` when the loader
    sizes its pool itself, else 0), so the figures are the balancer's settled state; the
    timeline keeps the ramp-up. With ``compare_engines``, :func:`placement` also measures the
    other engines after phase 2."""
    loader = make_loader()
    first = next(iter(loader))
    sample = tuple(t.clone() for t in first[:2]) if isinstance(first, tuple) else first
    del first
    loader.shutdown()
    model = time_model(consumer, sample, duration_s)
    loader = make_loader()
    if warmup_s is None:
        warmup_s = duration_s / 2 if loader.balancer is not None else 0.0
    alone = run_loader(loader, None, duration_s, warmup_s)
    alone["workers"] = loader.num_workers
    alone["engine"], threads = engine_label(loader)
    loader.shutdown()
    placed = None
    if compare_engines:
        placed = placement(make_loader, {**alone, "workers": threads}, duration_s, model["samples_per_s"], on_gpu,
                           warmup_s)
    loader = make_loader()
    t_begin = time.perf_counter()
    both = run_loader(loader, consumer, duration_s, warmup_s)
    stats = loader.stats()
    loader.shutdown()
    idle = max(0.0, 1.0 - both["batches"] * model["seconds_per_step"] / both["wall_s"])
    bal = stats.get("balancer")
    scaler = loader.balancer
    ms = list(scaler.measurements) if scaler is not None else []
    diag = _diagnosis(ms) if ms else _fixed_diagnosis(both, model, loader.num_workers)
    costs = stage_costs(stats)
    return {
        "consumer": consumer.label, "duration_s": duration_s, "warmup_s": warmup_s,
        "model_alone": model, "loader_alone": alone, "together": both,
        "gpu_idle_fraction": idle,
        "demand_samples_per_s": model["samples_per_s"],
        "wait_split": {"read": idle * costs["read_share"], "preprocess": idle * (1 - costs["read_share"])},
        "stage_costs": costs, "diagnosis": diag,
        "network_wait_fraction": (diag or {}).get("network_wait_fraction", 0.0),
        "balancer": _balancer_log(scaler, bal, stats, t_begin, both["t_start"]),
        "placement": placed,
        "recommendation": recommend(idle, diag, costs, on_gpu)
        + (f" Placement measured: {placed['reason']}." if placed else ""),
    }


def _balancer_log(scaler, bal: dict | None, stats: dict, t_begin: float, t_timed: float) -> dict:
    """Phase 3's balancer: every window (``timeline``), every step it took or undid
    (``decisions``: the windows whose decision is not a hold or a settling window, from the start),
    where it ended, what it was still trying (``trying``, None when no step awaited its verdict),
    and the phase's clock: ``t_begin`` (the loader's start) and ``t_timed`` (the timed window's
    start; before it the balancer settles, untimed)."""
    timeline = list(scaler.timeline) if scaler is not None else []
    decisions = [{"t": p["t"], "kind": p["decision"], "workers": p["next_workers"], "prefetch": p["next_prefetch"],
                  "reason": p.get("reason", "")} for p in timeline if p["decision"] not in ("hold", "settle")]
    return {"timeline": timeline, "decisions": decisions, "final_workers": stats["num_workers"],
            "final_prefetch": stats["prefetch_factor"], "summary": (bal or {}).get("summary"),
            "trying": (bal or {}).get("trying"), "t_begin": t_begin, "t_timed": t_timed}


def plot(report: dict, path: str) -> bool:
    """Throughput, idle share and worker count over phase 3 as a PNG; False (and a warning in
    the log) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written (scripts/setup.sh installs it)")
        return False
    tl = report["balancer"]["timeline"]
    if not tl:
        log.warning("no balancer windows to plot (a fixed num_workers, or a run shorter than a window)")
        return False
    bal = report["balancer"]
    t0 = bal.get("t_begin", tl[0]["t"])
    t = [p["t"] - t0 for p in tl]
    fig, ax = plt.subplots(3, 1, figsize=(8, 7), sharex=True, layout="constrained")
    ax[0].plot(t, [p["delivered_rate"] for p in tl], label="delivered")
    ax[0].plot(t, [p["demand_rate"] if p["demand_rate"] and math.isfinite(p["demand_rate"]) else float("nan")
                   for p in tl], "--", label="demand")
    ax[0].set_ylabel("samples/s")
    ax[0].set_ylim(bottom=0)
    ax[1].plot(t, [100 * p["wait_fraction"] for p in tl], color="tab:red")
    ax[1].set_ylabel("consumer idle %")
    ax[1].set_ylim(0, 100)
    ax[2].step(t, [p["workers"] for p in tl], where="post", color="tab:green")
    ax[2].set_ylabel("workers")
    ax[2].set_ylim(0, max(p["workers"] for p in tl) + 1)
    ax[2].yaxis.get_major_locator().set_params(integer=True)
    end = report.get("warmup_s", 0.0) + report["duration_s"]
    ax[2].set_xlim(0, max(end, t[-1]))
    if bal.get("t_timed") is not None and bal["t_timed"] > t0:
        for a in ax:   # before the timed window: the balancer settling, not in the figures
            a.axvspan(0, bal["t_timed"] - t0, color="0.92", zorder=0, label="settling (untimed)" if a is ax[0] else None)
    # above the plot, not over the lines' ends
    ax[0].legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, frameon=False)
    settle = report.get("warmup_s", 0.0)
    ax[2].set_xlabel("seconds since phase 3's loader started ("
                     + (f"start-up + {settle:g} s settling, then " if settle else "start-up, then ")
                     + f"{report['duration_s']:g} s timed)")
    fig.suptitle(f"{report['consumer']}: GPU idle {100 * report['gpu_idle_fraction']:.1f} %")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
