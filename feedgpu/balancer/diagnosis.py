"""Whether the loader keeps the training loop fed, and if not why: CPU-bound (with the cores
it would need) or limited by something else. Pure: measurements in, a sentence out."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable

from ..errors import ConfigError
from .measurement import Measurement, count_unit
from .text import fmt_rate, pct

#: The consumer "waits" when it spends more than this share of its step time waiting for data.
WAIT_THRESHOLD = 0.03


@dataclass(frozen=True)
class Diagnosis:
    """Whether the loader keeps up, and what it would take.

    Attributes:
        verdict: ``"meets demand"``, ``"network-bound"`` (the consumer waits, and the loader
            waited for shard downloads at least half as long: "waiting for the network"),
            ``"CPU-bound"`` (the consumer waits and the pool uses its CPU budget) or
            ``"input-bound"`` (the consumer waits though cores are left: I/O, the main process's
            hand-off, or too few workers).
        demand_rate, delivered_rate: samples/s (means of the windows).
        wait_fraction: the consumer's share of time waiting.
        cpu_cores_used, cpu_budget: cores.
        rate_per_core: samples/s per core the pool delivers (``delivered / cores used``).
        cores_needed: cores the pool would need to meet demand at that rate (``inf`` for an
            unlimited consumer, ``None`` when unknown).
        extra_cores: ``cores_needed - cpu_budget`` when positive, else 0.
        workers, engine: the setting of the last window.
        message: the above as one sentence for ``feedgpu bench`` and logs.
        network_wait_fraction: the loader's share of time waiting for shard downloads (0 when
            nothing is fetched; the message names it only when it is not 0).
    """

    verdict: str
    demand_rate: float | None
    delivered_rate: float
    wait_fraction: float
    cpu_cores_used: float
    cpu_budget: float
    rate_per_core: float | None
    cores_needed: float | None
    extra_cores: float | None
    workers: int
    engine: str
    message: str
    network_wait_fraction: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def diagnose(measurements: Measurement | Iterable[Measurement], *, wait_threshold: float = WAIT_THRESHOLD,
             saturation: float = 0.9) -> Diagnosis:
    """Say whether the loader meets demand and, if not, why, from one or more windows.

    Args:
        measurements: windows at the same setting (their means are used).
        wait_threshold: above this wait fraction the consumer is short of data (0.03).
        saturation: the pool is CPU-bound when it uses at least this share of ``cpu_budget``
            (0.9, ours: a pool of busy single-threaded workers rarely shows more than ~95 %).
    """
    ms = [measurements] if isinstance(measurements, Measurement) else list(measurements)
    if not ms:
        raise ConfigError("diagnose: no measurements")
    n = len(ms)
    delivered = sum(m.delivered_rate for m in ms) / n
    wait = sum(m.wait_fraction for m in ms) / n
    network = sum(m.network_wait_fraction for m in ms) / n
    cores = sum(m.cpu_cores_used for m in ms) / n
    budget = sum(m.cpu_budget for m in ms) / n
    demands = [m.demand_rate for m in ms if m.demand_rate is not None]
    demand = (math.inf if any(math.isinf(d) for d in demands) else sum(demands) / len(demands)) if demands else None
    last = ms[-1]
    per_core = delivered / cores if cores > 0 else None
    needed = extra = None
    if per_core and demand is not None:
        needed = math.inf if math.isinf(demand) else demand / per_core
        extra = max(0.0, needed - budget)
    got = (f"the loader delivers {fmt_rate(delivered)} with {last.workers} {count_unit(last.engine)} on "
           f"{cores:.1f} of {budget:.1f} cores")
    if wait <= wait_threshold:
        verdict = "meets demand"
        msg = f"meets demand: the consumer takes {fmt_rate(demand)} and waits {pct(wait)}; {got}"
    elif network > wait_threshold and network >= 0.5 * wait:
        verdict = "network-bound"
        msg = (f"network-bound: the consumer would take {fmt_rate(demand)} but waits {pct(wait)}, and the "
               f"loader waited for the network {pct(network)} of the time (shard downloads); {got}: more "
               "workers do not help; fetch further ahead, keep the shards in the cache, or use a faster link")
    elif cores >= saturation * budget:
        verdict = "CPU-bound"
        msg = f"CPU-bound: the consumer would take {fmt_rate(demand)} but waits {pct(wait)}; {got}"
        if per_core:
            msg += f" ({per_core:,.0f} samples/s per core)"
        if needed is not None and math.isinf(needed):
            msg += "; the consumer takes everything, so more cores always help"
        elif needed is not None:
            msg += f"; meeting demand needs about {needed:.1f} cores, {extra:.1f} more than the budget"
        if last.engine != "dali-gpu":
            msg += "; or decode on the GPU (engine dali-gpu: hardware JPEG decoder)"
    else:
        verdict = "input-bound"
        msg = (f"input-bound: the consumer would take {fmt_rate(demand)} but waits {pct(wait)}; {got}, so "
               "the limit is not the CPU (I/O, the main process's hand-off, or too few workers)")
    if network > 0 and verdict != "network-bound":
        msg += f"; waiting for the network {pct(network)} of the time (shard downloads)"
    return Diagnosis(verdict, demand, delivered, wait, cores, budget, per_core, needed, extra, last.workers,
                     last.engine, msg, network)


