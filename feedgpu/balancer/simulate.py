"""Simulated producers and consumers for the balancer's tests and benchmarks.

A deterministic model, not a measurement: a pool of workers whose rate is
``per_worker_rate * min(workers, free cores) ** scaling`` (capped), a consumer with a demand rate
that may change over time, optional CPU contention from another process, and seeded noise. Each
:meth:`Simulation.measure` call is one window and returns the :class:`Measurement` the loader
would build. :func:`run` drives a :class:`~feedgpu.balancer.Policy` over windows.

Nothing here sleeps or reads a clock: a thousand windows take milliseconds.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Sequence, Union

from .measurement import Decision, Measurement
from .policy import Policy

#: A value constant over time, or steps ``((t0, v0), (t1, v1), ...)``: ``v_i`` from ``t_i`` on
#: (before ``t0``, ``v0``).
Schedule = Union[float, Sequence[tuple[float, float]]]

MIB = 2**20


def at(schedule: Schedule, t: float) -> float:
    """The value of ``schedule`` at time ``t`` (seconds)."""
    if isinstance(schedule, (int, float)):
        return float(schedule)
    value = schedule[0][1]
    for t0, v in schedule:
        if t >= t0:
            value = v
    return float(value)


@dataclass(frozen=True)
class Producer:
    """A pool of single-threaded workers.

    Args:
        per_worker_rate: samples/s of one worker with a core to itself.
        cores: cores the machine gives the pool (before contention).
        scaling: rate grows as ``effective_workers ** scaling``: 1 linear, below 1 diminishing
            returns (memory bandwidth, the main process's share of the work).
        cap_rate: a ceiling no worker count passes (the main process's hand-off, the disk).
        min_prefetch: below this depth workers idle waiting for the consumer to take batches in
            order: the rate is multiplied by ``prefetch / min_prefetch``.
        rss_base_bytes, rss_per_worker_bytes: memory of the loader with no worker and per worker.
    """

    per_worker_rate: float
    cores: float
    scaling: float = 1.0
    cap_rate: float = math.inf
    min_prefetch: int = 1
    rss_base_bytes: int = 512 * MIB
    rss_per_worker_bytes: int = 256 * MIB

    def busy_cores(self, workers: int, contention: float = 0.0) -> float:
        """Cores the workers get: all they want, or what the other process leaves them."""
        return min(float(workers), max(self.cores - contention, 0.25))

    def capacity(self, workers: int, prefetch: int, contention: float = 0.0) -> float:
        """Samples/s the pool can deliver (noise-free)."""
        full = min(self.per_worker_rate * self.busy_cores(workers, contention) ** self.scaling, self.cap_rate)
        return full * min(1.0, prefetch / self.min_prefetch)

    def rss(self, workers: int) -> int:
        return self.rss_base_bytes + workers * self.rss_per_worker_bytes


@dataclass
class Simulation:
    """A producer feeding a consumer, one window per :meth:`measure`.

    Args:
        producer: the pool model.
        demand: samples/s the consumer takes when never starved (``math.inf``: loader-only).
        contention: cores another process takes (a :data:`Schedule`).
        noise: relative standard deviation of the producer's rate and of the demand per window.
        window_s: seconds per window.
        seed: seeds the noise (same seed, same windows).
        cpu_budget: the budget reported to the policy (default: the producer's cores).
        budget_sees_contention: report ``cpu_budget - contention`` (a loader that measures other
            processes' CPU use) instead of the fixed budget.
        ram_budget_bytes: reported RAM budget (None: no limit).
        engine: reported engine name.
    """

    producer: Producer
    demand: Schedule
    contention: Schedule = 0.0
    noise: float = 0.0
    window_s: float = 1.0
    seed: int = 0
    cpu_budget: float | None = None
    budget_sees_contention: bool = False
    ram_budget_bytes: int | None = None
    engine: str = "python"

    def __post_init__(self):
        self.t = 0.0
        self.expected = math.nan   # the last window's noise-free delivered rate
        self._rng = random.Random(self.seed)

    def _noisy(self, x: float) -> float:
        if self.noise <= 0 or math.isinf(x):
            return x
        return x * max(0.05, 1.0 + self._rng.gauss(0.0, self.noise))

    def budget_at(self, t: float) -> float:
        b = self.producer.cores if self.cpu_budget is None else self.cpu_budget
        return max(0.5, b - at(self.contention, t)) if self.budget_sees_contention else b

    def delivered(self, workers: int, prefetch: int, t: float | None = None) -> float:
        """Noise-free samples/s delivered at ``t`` (default: now) with this setting."""
        t = self.t if t is None else t
        return min(self.producer.capacity(workers, prefetch, at(self.contention, t)), at(self.demand, t))

    def best_fixed(self, t: float | None = None, prefetch: int | None = None, tolerance: float = 0.01,
                   max_workers: int = 64) -> tuple[int, float]:
        """The best fixed setting at ``t``: the fewest workers within ``tolerance`` of the highest
        noise-free delivered rate any count allowed by the budgets gives, and that rate."""
        t = self.t if t is None else t
        p = prefetch if prefetch is not None else self.producer.min_prefetch
        limit = min(max_workers, max(1, math.floor(self.budget_at(t) + 0.5)))
        if self.ram_budget_bytes is not None:
            fit = (self.ram_budget_bytes - self.producer.rss_base_bytes) // self.producer.rss_per_worker_bytes
            limit = max(1, min(limit, int(fit)))
        rates = {w: self.delivered(w, p, t) for w in range(1, limit + 1)}
        top = max(rates.values())
        w = min(w for w, r in rates.items() if r >= (1 - tolerance) * top)
        return w, top

    def measure(self, workers: int, prefetch: int) -> Measurement:
        """Advance one window with this setting and return what the loader would measure."""
        self.t += self.window_s
        t = self.t
        contention = at(self.contention, t)
        self.expected = self.delivered(workers, prefetch, t)
        cap = self._noisy(self.producer.capacity(workers, prefetch, contention))
        demand = self._noisy(at(self.demand, t))
        delivered = min(cap, demand)
        wait = 0.0 if math.isinf(demand) else max(0.0, 1.0 - delivered / demand)
        if math.isinf(demand):
            wait = 1.0 - 1e-3  # a consumer doing nothing waits all the time
        # CPU per sample is what the pool's full speed implies: workers held back by the cap, a
        # shallow prefetch or a slow consumer sit idle and use no CPU.
        busy = self.producer.busy_cores(workers, contention)
        full = self.producer.per_worker_rate * busy ** self.producer.scaling
        cores = busy * min(1.0, delivered / full)
        return Measurement(t=t, workers=workers, delivered_rate=delivered, demand_rate=demand, wait_fraction=wait,
                           cpu_cores_used=cores, cpu_budget=self.budget_at(t), rss_bytes=self.producer.rss(workers),
                           ram_budget_bytes=self.ram_budget_bytes, prefetch=prefetch, engine=self.engine)


@dataclass
class Curve:
    """A training loop whose throughput is a given function of the loader's setting, as a
    model trained on the CPU next to the workers gives: it may rise with the workers, stay
    flat, or fall past an optimum (workers take the cores the model needs).

    One window trains ``rate(workers, prefetch)`` samples/s, changed by the start-up and settle
    effects below (:attr:`expected`: what the policy's setting trained, to score it by), times
    the warm-up dip and the machine's speed (``speed_walk``), times ``1 + e`` with ``e`` the
    window noise: AR(1) with relative standard deviation ``noise`` and lag-one correlation
    ``phi`` (each factor at least 0.05).

    Args:
        rate: ``rate(workers, prefetch) -> samples/s`` the loop trains (noise-free).
        wait: ``wait(workers, prefetch) -> share of step time waiting`` (default: the share
            the loop's rate falls short of the best that up to 8 workers more or 4 batches of
            prefetch more reach, at least 0.01: the loop waits while the loader limits it, and a
            step's gain is its shorter wait, as in a real loop).
        noise: relative standard deviation of each window's rate.
        phi: lag-one correlation of the window noise (0: independent windows; real windows of
            one setting correlate, ``bench/results/archive/balancer_long_run.json``).
        speed_walk: standard deviation per window of the machine's speed, a walk reverting to 1
            by 3 % a window (0: a constant speed; a shared VM's other tenants move it).
        wait_noise: relative standard deviation of each window's waiting share (0).
        cores: ``cores(workers, prefetch) -> cores the workers use`` (default: the model under
            ``cores_per_worker``).
        cores_per_worker: cores a worker uses while busy (1.0). The cores reported are what the
            rate needs at the cost per sample of one busy worker (``rate(1, prefetch)`` samples/s
            on ``cores_per_worker``), at most every worker busy: a worker the loop does not keep
            busy uses less than its core, as a real pool's does.
        cpu_budget: the CPU budget reported (1.0 cores).
        window_s, seed: seconds per window; seeds the noise.
        start_dip, start_windows: after the worker count grows, the next ``start_windows``
            windows train ``start_dip`` (a share) below the setting before it, as a real pool
            does while a new worker starts and its first batch holds up the in-order hand-off
            (0, 0: no start-up cost).
        settle_mix: the first window after a change that does not grow the pool trains the mean
            of the two settings' rates (batches of the old setting still in flight; False).
        warmup_windows, warmup_dip: the first ``warmup_windows`` windows train ``warmup_dip``
            (a share) slower, as a run does while it warms up (0, 0).
    """

    rate: Callable[[int, int], float]
    wait: Callable[[int, int], float] | None = None
    noise: float = 0.0
    phi: float = 0.0
    speed_walk: float = 0.0
    wait_noise: float = 0.0
    cores: Callable[[int, int], float] | None = None
    cores_per_worker: float = 1.0
    cpu_budget: float = 1.0
    window_s: float = 1.0
    seed: int = 0
    start_dip: float = 0.0
    start_windows: int = 0
    settle_mix: bool = False
    warmup_windows: int = 0
    warmup_dip: float = 0.0

    def __post_init__(self):
        if not -1.0 < self.phi < 1.0:
            raise ValueError(f"Curve: need -1 < phi < 1, got {self.phi}")
        self.t = 0.0
        self.expected = math.nan                    # the last window's rate before speed and noise
        self._rng = random.Random(self.seed)
        self._last: tuple[int, int] | None = None   # the setting of the last window
        self._starting = 0                          # windows of the start-up dip left
        self._before = 0.0                          # the rate before the pool grew
        self._windows = 0
        self._e = 0.0                               # the AR(1) noise of the last window
        self._speed = 1.0

    def waiting(self, workers: int, prefetch: int) -> float:
        if self.wait is not None:
            return self.wait(workers, prefetch)
        # the loop's own work trains the best rate a bigger pool or deeper prefetch reaches; below
        # that it waits for the rest of its step (at least 1 %)
        r, top = self.rate(workers, prefetch), 0.0
        for w in range(workers, workers + 9):
            for p in range(prefetch, prefetch + 5):
                try:
                    top = max(top, self.rate(w, p))
                except (KeyError, IndexError):   # a table that ends there
                    continue
        return max(0.01, 1.0 - r / top) if top > 0 else 0.01

    def best(self, max_workers: int, prefetch: int = 2, tolerance: float = 0.03) -> tuple[int, float]:
        """The fewest workers training within ``tolerance`` of the best rate, and the best rate."""
        rates = {w: self.rate(w, prefetch) for w in range(1, max_workers + 1)}
        top = max(rates.values())
        return min(w for w, r in rates.items() if r >= (1 - tolerance) * top), top

    def _trained(self, workers: int, prefetch: int) -> float:
        """This window's rate before the machine's speed and the noise."""
        r = self.rate(workers, prefetch)
        last = self._last
        if last is not None and workers > last[0]:
            self._starting = self.start_windows
            self._before = self.rate(*last)
        if self._starting > 0:
            self._starting -= 1
            r = self._before * (1 - self.start_dip)
        elif self.settle_mix and last is not None and last != (workers, prefetch):
            r = (r + self.rate(*last)) / 2
        return r

    def measure(self, workers: int, prefetch: int) -> Measurement:
        """Advance one window with this setting and return what the loader would measure."""
        self.t += self.window_s
        r = self.expected = self._trained(workers, prefetch)
        if self._windows < self.warmup_windows:
            r *= 1 - self.warmup_dip
        self._windows += 1
        self._last = (workers, prefetch)
        if self.noise > 0:
            self._e = self.phi * self._e + self._rng.gauss(0.0, self.noise * math.sqrt(1 - self.phi ** 2))
            r *= max(0.05, 1.0 + self._e)
        if self.speed_walk > 0:
            self._speed = 1.0 + 0.97 * (self._speed - 1.0) + self._rng.gauss(0.0, self.speed_walk)
            r *= max(0.05, self._speed)
        wait = self.waiting(workers, prefetch)
        if self.wait_noise > 0:
            wait *= 1 + self._rng.gauss(0.0, self.wait_noise)
        wait = min(1.0, max(0.0, wait))
        demand = r / (1 - wait) if wait < 1 else math.inf
        if self.cores is not None:
            cores = self.cores(workers, prefetch)
        else:
            one = self.rate(1, prefetch)
            busy = self.cores_per_worker * workers
            cores = min(busy, self.cores_per_worker * r / one) if one > 0 else busy
        return Measurement(t=self.t, workers=workers, delivered_rate=r, demand_rate=demand, wait_fraction=wait,
                           cpu_cores_used=cores, cpu_budget=self.cpu_budget, prefetch=prefetch)


@dataclass(frozen=True)
class Step:
    """One window of a run: what was measured, what the policy decided, and the rate the
    setting trained before noise (``expected``, samples/s: the simulation's :attr:`expected`)."""

    measurement: Measurement
    decision: Decision
    expected: float = math.nan


def run(policy: Policy, sim: Simulation | Curve, windows: int, workers: int, prefetch: int = 2) -> list[Step]:
    """Drive ``policy`` over ``windows`` windows of ``sim``, starting from ``workers`` and
    ``prefetch``; each decision is applied before the next window."""
    steps = []
    for _ in range(windows):
        m = sim.measure(workers, prefetch)
        d = policy.decide(m)
        steps.append(Step(m, d, sim.expected))
        workers, prefetch = d.workers, d.prefetch
    return steps
