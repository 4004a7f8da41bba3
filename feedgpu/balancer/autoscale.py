"""``num_workers="auto"``: measure the loader in windows and apply the balancer's decisions.

The loader calls :meth:`Autoscaler.on_batch` each time it hands a batch to the training loop.
When a window is complete (``window_s`` seconds and at least ``min_batches`` batches), the
autoscaler builds a :class:`~feedgpu.balancer.Measurement` from what it saw:

* the consumer's wait (time spent inside ``next()``) and busy time (the rest of the window's
  wall time), hence the delivered rate, the demand rate (samples / busy time) and the wait
  fraction;
* the CPU time of the worker processes (``psutil``), of the main process and of everything else
  on the cores this process may run on (reported, and used by the diagnosis; the policy does
  not limit the pool by it: it measures whether a worker more trains faster);
* the workers' unique memory (USS) plus the loader's batch buffers, and the RAM budget: what the
  loader holds plus half of the memory still available, and at most the workers' memory budget
  (:attr:`Autoscaler.memory_budget`, see :mod:`feedgpu.exec.memory_budget`; a hard limit);
* free GPU memory when the loader delivers to a CUDA device,

asks the pure :class:`~feedgpu.balancer.Policy` for a decision and returns it; the loader
resizes its pool and its prefetch depth accordingly, between two batches, without restarting
the epoch (the batch order and per-batch seeds do not depend on the worker count).
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Callable

from ..host import cpu_cores
from .diagnosis import diagnose
from .measurement import Decision, Measurement
from .policy import Policy
from .policy_config import PolicyConfig, start_workers
from .remote_policy import RemoteConfig, RemotePolicy

log = logging.getLogger("feedgpu.balancer")

#: Window length in seconds, and batches a window holds at least. The policy estimates the
#: noise of a window from the windows themselves and measures more of them where one is too
#: noisy to decide.
WINDOW_S = 1.0
MIN_BATCHES = 3


def fixed_workers(num_workers) -> int:
    """A fixed worker or thread count for ``num_workers`` (an int, or ``"auto"``: one per core
    but one, which is left to the training process)."""
    return max(1, cpu_cores() - 1) if num_workers == "auto" else int(num_workers)


def default_config(cores: int | None = None, max_prefetch: int = 4, max_workers: int | None = None,
                   unit: str = "workers") -> PolicyConfig:
    """The policy bounds used by the loader: 1 to ``max_workers`` workers (default one more than
    ``cores``: whether a worker more than the cores trains faster, because the training loop
    leaves cores idle between its steps, is measured, not assumed), prefetch 1 to
    ``max_prefetch`` batches per worker (4: the batch buffers are sized for the maximum);
    ``unit``: what the count counts (``"DALI threads"`` for the DALI engine)."""
    top = max_workers if max_workers is not None else (cores or cpu_cores()) + 1
    return PolicyConfig(min_workers=1, max_workers=top, min_prefetch=1, max_prefetch=max_prefetch, unit=unit)


def _memory_available() -> int | None:
    """Bytes of memory still available (psutil), None when it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no budget when it cannot be read
        return None


class _Probe:
    """CPU seconds and memory of a set of processes, by pid, between two calls."""

    def __init__(self):
        import psutil

        self._psutil = psutil
        self._procs: dict[int, object] = {}
        self._cpu: dict[int, float] = {}
        self._me = psutil.Process()
        self._my_cpu = self._cpu_of(self._me)
        try:
            self._cpus = sorted(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            self._cpus = None
        self._busy = self._machine_busy()

    def _machine_busy(self) -> float:
        """Busy CPU seconds of the cores this process may use, all processes together."""
        per = self._psutil.cpu_times(percpu=True)
        cpus = per if self._cpus is None else [per[i] for i in self._cpus if i < len(per)]
        return sum(sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
                   for t in cpus)

    @staticmethod
    def _cpu_of(p) -> float:
        t = p.cpu_times()
        return t.user + t.system

    def sample(self, pids: list[int], memory: bool) -> tuple[float, float, int, float]:
        """(worker CPU seconds, main-process CPU seconds, worker USS bytes, CPU seconds of other
        processes on our cores) since the last call; a worker seen for the first time counts from
        its start."""
        ps = self._psutil
        cpu, uss = 0.0, 0
        for pid in pids:
            p = self._procs.get(pid)
            if p is None:
                try:
                    p = self._procs[pid] = ps.Process(pid)
                except ps.Error:
                    continue
            try:
                now = self._cpu_of(p)
                if memory:
                    uss += p.memory_full_info().uss
            except ps.Error:
                continue
            cpu += now - self._cpu.get(pid, 0.0)
            self._cpu[pid] = now
        for pid in set(self._procs) - set(pids):
            self._procs.pop(pid, None)
            self._cpu.pop(pid, None)
        me = self._cpu_of(self._me)
        mine, self._my_cpu = me - self._my_cpu, me
        busy = self._machine_busy()
        others, self._busy = max(0.0, busy - self._busy - cpu - mine), busy
        return cpu, mine, uss, others


class Autoscaler:
    """Sizes the loader's worker pool and prefetch depth while it runs.

    Args:
        workers: the pool size to start with (default: one per core, see
            :func:`~feedgpu.balancer.start_workers`).
        prefetch: batches in flight per worker to start with.
        config: the policy's bounds and constants (default :func:`default_config`).
        window_s, min_batches: a window lasts at least this long and holds at least this many
            batches (1.0 s, 3).
        buffer_bytes: memory of the loader's batch buffers, counted in its RSS (bytes).
        device: where batches are delivered; on ``cuda[:N]`` free GPU memory is measured.
        callback: called as ``callback(event)`` after each window, ``event`` a dict with the
            window's ``measurement``, the ``decision`` (both as dicts) and ``t``; exceptions it
            raises are logged and otherwise ignored.
        clock: seconds, monotonic (default ``time.perf_counter``); tests pass their own.
        probe: an object with ``sample(pids, memory) -> (worker_cpu_s, main_cpu_s, uss_bytes,
            others_cpu_s)`` (default: psutil).
        max_remote: remote workers (``executor: ray``) the balancer may add, 0 for none (default);
            with more, a :class:`~feedgpu.balancer.remote_policy.RemotePolicy` decides them.
        remote: remote workers running at the start (0).
        cores: cores this process may run on (default :func:`cpu_cores`); sets the starting
            pool and the reported CPU budget.
        memory_available: ``() -> bytes`` of memory still available (default: psutil's
            ``virtual_memory().available``); None from it means no RAM budget. Tests pass
            their own, so that nothing reads the machine's load.
        memory_budget: bytes the workers and the batch buffers may hold together (the
            per-worker budget times the largest pool, set by the loader from ``worker_memory``;
            None: only the available memory limits the pool).
        engine: ``"python"`` (default: the count is worker processes) or ``"dali-cpu"`` /
            ``"dali-gpu"`` (the count is DALI's CPU threads, in the main process; ``pids`` are
            then empty and the main process's CPU time holds DALI's).
    """

    def __init__(self, workers: int | None = None, prefetch: int = 2, config: PolicyConfig | None = None,
                 window_s: float = WINDOW_S, min_batches: int = MIN_BATCHES, buffer_bytes: int = 0,
                 device: str = "cpu", callback: Callable[[dict], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, probe=None, cores: int | None = None,
                 max_remote: int = 0, remote: int = 0, memory_available: Callable[[], int | None] | None = None,
                 memory_budget: int | None = None, engine: str = "python"):
        self.cores = cores or cpu_cores()
        self.engine = engine
        self.policy = Policy(config or default_config(self.cores))
        self.max_remote = max_remote
        self.remote_policy = RemotePolicy(RemoteConfig(max_remote=max_remote)) if max_remote > 0 else None
        self.remote = min(remote, max_remote)
        c = self.policy.config
        self.workers = max(c.min_workers, min(c.max_workers, workers or start_workers(self.cores, c)))
        self.prefetch = max(c.min_prefetch, min(c.max_prefetch, prefetch))
        self.window_s, self.min_batches = window_s, min_batches
        self.buffer_bytes, self.device, self.callback = buffer_bytes, device, callback
        self.clock = clock
        self._probe = probe
        self._memory_available = memory_available or _memory_available
        self.memory_budget = memory_budget
        self.timeline: deque[dict] = deque(maxlen=100_000)
        self.measurements: deque[Measurement] = deque(maxlen=1000)
        self._reset_window(None)
        self._cpu_t = 0.0            # the clock at the last CPU reading
        self._skip = 0
        self._memory_every = 5      # USS reads smaps: every 5th window is enough to see a trend
        self._windows = 0
        self._uss = 0
        self._uss_workers, self._uss_reads = None, 0   # the pool size of the last USS readings
        self._remote_started: int | None = None
        self._resets = 0

    def _reset_window(self, now: float | None) -> None:
        self._t0, self._rows, self._batches, self._wait, self._network = now, 0, 0, 0.0, 0.0

    @property
    def last_measurement(self) -> Measurement | None:
        """The last window's measurement, None before the first."""
        return self.measurements[-1] if self.measurements else None

    def start(self, pids: list[int]) -> None:
        """A pool is running. The loader's first pool starts the first window, which is not judged
        (it holds the start-up). Later, the same pool in a new epoch, or a new pool of
        non-persistent workers, goes on with the open window: windows span epochs, so short
        epochs are measured too, and restarting workers counts as the wait it is."""
        if self._t0 is not None:
            return
        if self._probe is None:
            self._probe = _Probe()
        self._sample(pids, memory=False)
        self._skip = 1  # the first window holds the pool's start-up: not judged
        self._reset_window(self.clock())

    def _sample(self, pids: list[int], memory: bool) -> tuple[tuple, float]:
        """The probe's sample and the seconds since the last one: CPU time is divided by the time
        between the two CPU readings, not by the window's wall time (the policy's decision and
        the callback run between a window's end and the next one's start)."""
        t = self.clock()
        out = self._probe.sample(pids, memory)
        span, self._cpu_t = t - self._cpu_t, t
        return out, span

    def add_network_wait(self, seconds: float) -> None:
        """The loader waited ``seconds`` for shard downloads (:mod:`feedgpu.shard_ahead`): counted
        in the window's ``network_wait_fraction``, "waiting for the network"."""
        self._network += max(0.0, float(seconds))

    def on_batch(self, rows: int, waited_s: float, pids: list[int], remote_started: int | None = None) -> Decision | None:
        """A batch of ``rows`` samples was handed out after the consumer waited ``waited_s``
        seconds; ``pids`` are the pool's local workers, ``remote_started`` how many remote workers
        Ray has started (None: all). Returns the decision when a window closes."""
        now = self.clock()
        self._remote_started = remote_started
        if self._t0 is None:
            self.start(pids)
            return None
        self._rows += rows
        self._batches += 1
        self._wait += waited_s
        wall = now - self._t0
        if wall < self.window_s or self._batches < self.min_batches:
            return None
        if self._skip:
            self._skip -= 1
            self._sample(pids, memory=False)
            self._reset_window(self.clock())
            return None
        m = self._measure(now, wall, pids)
        d = self.policy.decide(m) if self.remote_policy is None else self.remote_policy.decide(m, self.policy)
        self.workers, self.prefetch, self.remote = d.workers, d.prefetch, d.remote_workers
        self.measurements.append(m)
        point = {"t": round(m.t, 3), "workers": m.workers, "prefetch": m.prefetch,
                 "delivered_rate": m.delivered_rate, "demand_rate": m.demand_rate,
                 "wait_fraction": m.wait_fraction, "cpu_cores_used": m.cpu_cores_used,
                 "cpu_budget": m.cpu_budget, "rss_bytes": m.rss_bytes, "decision": d.kind,
                 "next_workers": d.workers, "next_prefetch": d.prefetch}
        resets = self.policy.stats()["resets"]
        point["resets"] = resets   # times the records were forgotten so far
        if d.kind != "hold" or self.remote_policy is not None or resets != self._resets:
            point["reason"] = d.reason   # a plain hold's reason repeats: policy.history keeps it
        self._resets = resets
        if m.network_wait_fraction:
            point["network_wait_fraction"] = m.network_wait_fraction
        if self.remote_policy is not None:
            point.update(remote_workers=m.remote_workers, next_remote_workers=d.remote_workers)
        if d.experiment is not None:
            point["experiment"] = d.experiment["text"]
        self.timeline.append(point)
        if self.callback is not None:
            try:
                self.callback({"t": m.t, "measurement": m.__dict__.copy(), "decision": d.as_dict(),
                               "waiting_share": m.wait_fraction, "experiment": d.experiment,
                               "report": self.report(d)})
            except Exception:  # noqa: BLE001 - a user's logger must not stop training
                log.exception("feedgpu balancer callback failed")
        self._reset_window(self.clock())
        return d

    def _measure(self, now: float, wall: float, pids: list[int]) -> Measurement:
        self._windows += 1
        # USS every 5th window, and in the two windows after the pool changed size (a reading
        # taken at another size would give the policy the wrong memory per worker)
        resized = self._uss_workers != self.workers
        if resized:
            self._uss_workers, self._uss_reads = self.workers, 0
        memory = self._windows % self._memory_every == 1 or self._uss_reads < 2
        (worker_cpu, main_cpu, uss, others), span = self._sample(pids, memory)
        span = span if span > 0 else wall
        if memory:
            self._uss = uss
            self._uss_reads += 1
        busy = max(wall - self._wait, 0.0)
        demand = self._rows / busy if busy > 1e-6 else float("inf")
        rss = self._uss + self.buffer_bytes
        free = self._memory_available()
        ram_budget = None if free is None else int(rss + 0.5 * free)
        if self.memory_budget is not None:
            ram_budget = self.memory_budget if ram_budget is None else min(ram_budget, int(self.memory_budget))
        return Measurement(
            t=now, workers=self.workers, delivered_rate=self._rows / wall, demand_rate=demand,
            wait_fraction=min(1.0, self._wait / wall), cpu_cores_used=max(0.0, worker_cpu / span),
            cpu_budget=max(1.0, self.cores - (main_cpu + others) / span), rss_bytes=int(rss) if self._uss else 0,
            ram_budget_bytes=ram_budget, gpu_mem_free_bytes=self._gpu_free(), prefetch=self.prefetch,
            remote_workers=self.remote, remote_started=self._remote_started,
            network_wait_fraction=min(1.0, self._network / wall) if wall > 0 else 0.0, engine=self.engine)

    def _gpu_free(self) -> int | None:
        if not self.device.startswith("cuda"):
            return None
        import torch

        idx = int(self.device.split(":")[1]) if ":" in self.device else torch.cuda.current_device()
        return int(torch.cuda.mem_get_info(idx)[0])

    def report(self, d: Decision | None = None) -> str:
        """The last window and decision in plain words: the loop's throughput, its waiting
        share of step time, and what the balancer does next and why."""
        m = self.last_measurement
        if m is None:
            return "no window measured yet"
        d = d or (self.policy.history[-1] if self.policy.history else None)
        s = (f"the training loop took {m.delivered_rate:,.0f} samples/s with {m.workers} {self.policy.config.unit} "
             f"/ prefetch {m.prefetch} and waited for batches {100 * m.wait_fraction:.1f} % of its step time")
        if m.network_wait_fraction:
            s += f"; the loader waited for the network {100 * m.network_wait_fraction:.1f} % of the window"
        if d is not None:
            s += f"; next: {d.kind} ({d.workers} {self.policy.config.unit} / prefetch {d.prefetch}): {d.reason}"
        return s

    def stats(self) -> dict:
        """``loader.stats()["balancer"]``: the policy's state, experiments and decisions (see
        :meth:`Policy.stats`), the last window's measurement and diagnosis, the windows measured
        so far, ``waiting_share`` (the last window's share of the loop's step time spent
        waiting for a batch), ``waiting_share_mean`` (over all windows measured) and ``report``
        (:meth:`report`)."""
        d = self.policy.stats()
        d.update(workers=self.workers, prefetch=self.prefetch, windows=self._windows, engine=self.engine,
                 unit=self.policy.config.unit,
                 cores=self.cores, window_s=self.window_s, remote_workers=self.remote,
                 memory_budget=self.memory_budget)
        ms = self.measurements
        d["waiting_share"] = ms[-1].wait_fraction if ms else None
        d["waiting_share_mean"] = sum(x.wait_fraction for x in ms) / len(ms) if ms else None
        d["report"] = self.report()
        d["remote"] = self.remote_policy.stats() if self.remote_policy is not None else None
        m = self.last_measurement
        d["last_window"] = None if m is None else dict(m.__dict__)
        d["diagnosis"] = None if m is None else diagnose(m).as_dict()
        return d
