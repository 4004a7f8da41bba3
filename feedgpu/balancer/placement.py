"""Where the stages run (``python`` pool, ``dali-cpu``, ``dali-gpu``), chosen from measured
rates of each engine. Pure: measured options in, a :class:`Placement` out."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError
from .measurement import ENGINES
from .text import fmt_rate, gib, round_half_up


@dataclass(frozen=True)
class EngineRate:
    """The best measured setting of one engine.

    Args:
        engine: ``"python"``, ``"dali-cpu"`` or ``"dali-gpu"``.
        rate: samples/s delivered to the consumer (end to end, with training, where possible:
            GPU preprocessing slows the model, and only an end-to-end rate shows it).
        cpu_cores: cores it used at that rate.
        workers: worker processes (python) or DALI threads.
        hw_decoder_load: for ``dali-gpu``.
        gpu_mem_bytes: device memory it needs (DALI GPU buffers, device prefetch).
    """

    engine: str
    rate: float
    cpu_cores: float
    workers: int
    hw_decoder_load: float | None = None
    gpu_mem_bytes: int = 0

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ConfigError(f"EngineRate.engine {self.engine!r} is not one of {list(ENGINES)}")
        if not self.rate >= 0 or not self.cpu_cores >= 0 or self.workers < 1:
            raise ConfigError(f"EngineRate: rate and cpu_cores must be >= 0, workers >= 1 ({self})")

    @property
    def uses_gpu(self) -> bool:
        return self.engine == "dali-gpu"


@dataclass(frozen=True)
class Placement:
    """Where the stages run, chosen by :func:`choose_placement`."""

    engine: str
    workers: int
    dali_threads: int | None
    hw_decoder_load: float | None
    expected_rate: float
    cpu_cores: float
    reason: str

    def engine_settings(self) -> dict:
        """The loader's ``engine=`` argument for this placement (see ``EngineSettings``)."""
        if self.engine == "python":
            return {"name": "python"}
        d = {"name": "dali", "device": self.engine.split("-")[1], "threads": self.dali_threads}
        if self.hw_decoder_load is not None:
            d["hw_decoder_load"] = self.hw_decoder_load
        return d


#: Options whose rates are within this of each other are equal; the one using fewer resources is
#: chosen.
PLACEMENT_TOLERANCE = 0.05
_SIMPLER = {"python": 0, "dali-cpu": 1, "dali-gpu": 2}


def choose_placement(options: Sequence[EngineRate], cpu_budget: float, gpu_mem_free_bytes: int | None = None,
                     *, demand_rate: float | None = None, gpu_mem_reserve_bytes: int = 0,
                     tolerance: float = PLACEMENT_TOLERANCE) -> Placement:
    """Pick the engine from measured options.

    Options that do not fit the budgets are dropped: more cores than ``cpu_budget`` (rounded,
    plus ``tolerance`` for measuring noise), or
    more device memory than ``gpu_mem_free_bytes - gpu_mem_reserve_bytes`` (a GPU option with no
    free memory known, i.e. no GPU, is dropped too). Each rate counts up to ``demand_rate``
    (delivering more than the consumer takes gains nothing). Among the options within
    ``tolerance`` of the best such rate, the one with the fewest CPU cores is chosen; ties
    (cores within ``tolerance``) go to the option not using the GPU (its SMs are the model's:
    GPU preprocessing slows the model's step), then to the simpler
    engine (python, dali-cpu, dali-gpu).

    Raises :class:`ConfigError` when no option fits.
    """
    fit, dropped = [], []
    cores_limit = max(1, round_half_up(cpu_budget)) * (1 + tolerance)
    gpu_free = None if gpu_mem_free_bytes is None else gpu_mem_free_bytes - gpu_mem_reserve_bytes
    for o in options:
        if o.cpu_cores > cores_limit:
            dropped.append(f"{o.engine}: {o.cpu_cores:.1f} cores > budget {cpu_budget:.1f}")
        elif o.uses_gpu and (gpu_free is None or o.gpu_mem_bytes > gpu_free):
            dropped.append(f"{o.engine}: needs {gib(o.gpu_mem_bytes)} of GPU memory, "
                           + ("no GPU" if gpu_free is None else f"{gib(gpu_free)} free"))
        else:
            fit.append(o)
    if not fit:
        raise ConfigError("no engine fits the budgets: " + "; ".join(dropped))
    cap = demand_rate if demand_rate is not None else math.inf

    def useful(o: EngineRate) -> float:
        return min(o.rate, cap)

    best = max(useful(o) for o in fit)
    near = [o for o in fit if useful(o) >= (1 - tolerance) * best]
    fewest = min(o.cpu_cores for o in near)
    lean = [o for o in near if o.cpu_cores <= fewest * (1 + tolerance) + 1e-9]
    pick = min(lean, key=lambda o: (o.uses_gpu, _SIMPLER[o.engine], o.cpu_cores, -o.rate))
    others = ", ".join(f"{o.engine} {fmt_rate(o.rate)} on {o.cpu_cores:.1f} cores" for o in fit if o is not pick)
    reason = (f"{pick.engine}: {fmt_rate(pick.rate)} on {pick.cpu_cores:.1f} cores"
              + (f" (demand {fmt_rate(demand_rate)})" if demand_rate is not None else "")
              + (f"; others: {others}" if others else "")
              + (f"; not fitting: {'; '.join(dropped)}" if dropped else ""))
    dali = pick.engine.startswith("dali")
    return Placement(pick.engine, pick.workers, pick.workers if dali else None, pick.hw_decoder_load,
                     pick.rate, pick.cpu_cores, reason)
