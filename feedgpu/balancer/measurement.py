"""What the balancer exchanges with the loader: one window's :class:`Measurement` in, a
:class:`Decision` out (their numbers in words: :mod:`.text`).

Units: rates in samples per second, times in seconds, CPU in cores (1.0 = one core busy for
the whole window), memory in bytes, fractions in [0, 1].
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import ConfigError

ENGINES = ("python", "dali-cpu", "dali-gpu")
KINDS = ("add", "remove", "revert", "prefetch", "probe", "hold", "settle", "measure", "remote-add", "remote-remove")


@dataclass(frozen=True)
class Measurement:
    """What the loader observed over one window.

    Args:
        t: end of the window, seconds on any monotonic clock (only differences matter).
        workers: the pool's size during the window: worker processes for ``engine="python"``,
            DALI threads for the DALI engines.
        delivered_rate: samples/s the loader handed to the consumer in the window.
        demand_rate: samples/s the consumer would take if it never waited: samples divided by
            the consumer's busy time (its wall time minus the time it waited in ``next()``).
            ``math.inf`` for a consumer that does no work (a loader-only benchmark); ``None``
            when unknown (then only ``wait_fraction`` steers, and demand drift is not seen).
        wait_fraction: share of the consumer's wall time spent waiting for data, in [0, 1].
        cpu_cores_used: cores the loader's workers (or DALI threads) used on average; 0 when
            unknown.
        cpu_budget: cores left to the pool: the cores this process may run on, minus what the
            training process and, where measured, other processes used. For :func:`diagnose`
            only; the policy does not limit the pool by it (over-subscribing the cores may train
            faster, and only the measured throughput can tell).
        rss_bytes: memory the loader holds (workers' unique set size plus its buffers); 0 when
            unknown.
        ram_budget_bytes: memory the loader may hold; ``None`` for no limit.
        gpu_mem_free_bytes: free device memory (head-room for DALI GPU buffers and device
            prefetch); ``None`` without a GPU.
        prefetch: batches in flight per worker (``prefetch_factor``).
        engine: ``"python"``, ``"dali-cpu"`` or ``"dali-gpu"``.
        hw_decoder_load: DALI GPU's share of JPEGs sent to the hardware decoder, if any.
        remote_workers: remote workers (Ray actors, ``executor: ray``) running during the
            window, besides the ``workers`` local ones (see :mod:`feedgpu.balancer.remote_policy`).
        remote_started: how many of them Ray has started by the window's end (an actor waits
            for a free CPU on the cluster, and its process starts in seconds); ``None``: all.
        network_wait_fraction: share of the window's wall time the loader waited for shard
            downloads ("waiting for the network": :mod:`feedgpu.shard_ahead`), in [0, 1]; 0 when
            nothing is fetched.
    """

    t: float
    workers: int
    delivered_rate: float
    demand_rate: float | None
    wait_fraction: float
    cpu_cores_used: float
    cpu_budget: float
    rss_bytes: int = 0
    ram_budget_bytes: int | None = None
    gpu_mem_free_bytes: int | None = None
    prefetch: int = 2
    engine: str = "python"
    hw_decoder_load: float | None = None
    remote_workers: int = 0
    remote_started: int | None = None
    network_wait_fraction: float = 0.0

    def __post_init__(self):
        if self.remote_workers < 0:
            raise ConfigError(f"Measurement.remote_workers must be >= 0, got {self.remote_workers}")
        if self.workers < 1:
            raise ConfigError(f"Measurement.workers must be >= 1, got {self.workers}")
        if self.prefetch < 1:
            raise ConfigError(f"Measurement.prefetch must be >= 1, got {self.prefetch}")
        if not self.delivered_rate >= 0 or math.isinf(self.delivered_rate):
            raise ConfigError(f"Measurement.delivered_rate must be finite and >= 0, got {self.delivered_rate}")
        if self.demand_rate is not None and not self.demand_rate > 0:
            raise ConfigError(f"Measurement.demand_rate must be > 0, inf or None, got {self.demand_rate}")
        if not 0.0 <= self.wait_fraction <= 1.0:
            raise ConfigError(f"Measurement.wait_fraction must be in [0, 1], got {self.wait_fraction}")
        if not 0.0 <= self.network_wait_fraction <= 1.0:
            raise ConfigError(f"Measurement.network_wait_fraction must be in [0, 1], got {self.network_wait_fraction}")
        if not self.cpu_cores_used >= 0:
            raise ConfigError(f"Measurement.cpu_cores_used must be >= 0, got {self.cpu_cores_used}")
        if not self.cpu_budget > 0:
            raise ConfigError(f"Measurement.cpu_budget must be > 0 cores, got {self.cpu_budget}")
        if self.engine not in ENGINES:
            raise ConfigError(f"Measurement.engine {self.engine!r} is not one of {list(ENGINES)}")


@dataclass(frozen=True)
class Decision:
    """What the loader should run during the next window.

    Attributes:
        workers: pool size (worker processes for ``python``, DALI threads for the DALI engines).
        prefetch: batches in flight per worker.
        kind: ``"add"``, ``"remove"``, ``"revert"`` (undo the last experiment, or go back to
            measure the previous setting again), ``"prefetch"`` (prefetch depth changed, either
            way), ``"probe"`` (an experiment started again on a settled setting; see
            ``recheck_windows``),
            ``"hold"``, ``"settle"`` (the window after a change is not judged) or ``"measure"``
            (more windows are needed to judge a step).
        reason: why, in plain words, with the numbers.
        t: the measurement's ``t``.
        engine: where the stages run (unchanged by :class:`Policy`; see
            :func:`~feedgpu.balancer.placement.choose_placement`).
        dali_threads: DALI's thread count for the DALI engines (equal to ``workers``), else None.
        hw_decoder_load: for ``dali-gpu``, as measured.
        remote_workers: remote workers for the next window (``executor: ray``; 0 otherwise).
            ``"remote-add"`` and ``"remote-remove"`` change only this count.
        experiment: when this window concluded an experiment, what it was, what it measured and
            whether it was kept (see :meth:`Policy.stats`, ``"experiments"``), else None.
        tentative: this change starts an experiment that the next windows may undo (a pool that
            shrinks for it may keep the worker it stops using, idle and warm, for a while).
    """

    workers: int
    prefetch: int
    kind: str
    reason: str
    t: float = 0.0
    engine: str = "python"
    dali_threads: int | None = None
    hw_decoder_load: float | None = None
    remote_workers: int = 0
    experiment: dict | None = None
    tentative: bool = False

    @property
    def changes(self) -> bool:
        """True when the loader has to resize the pool (local or remote) or change the prefetch
        depth."""
        return self.kind in ("add", "remove", "revert", "prefetch", "probe", "remote-add", "remote-remove")

    def as_dict(self) -> dict:
        return asdict(self)


def count_unit(engine: str) -> str:
    """What the balancer's count counts for ``engine``: ``"workers"`` (processes, ``"python"``)
    or ``"DALI threads"`` (``"dali-cpu"``, ``"dali-gpu"``)."""
    return "workers" if engine == "python" else "DALI threads"


def setting(key: tuple, unit: str = "workers") -> str:
    """``(workers, prefetch)`` in words; ``unit``: what the count counts (``"DALI threads"``
    under the DALI engine)."""
    return f"{key[0]} {unit} / prefetch {key[1]}"
