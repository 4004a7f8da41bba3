"""The throughput balancer: pure policy, measurements in, decisions out.

Nothing here starts a process, reads a clock or touches a GPU. The loader measures a window
(a few seconds of training), builds a :class:`Measurement`, asks :meth:`Policy.decide` and
applies the :class:`Decision` before the next window. Given the same measurements, the policy
makes the same decisions (no randomness, no wall clock).

Three parts, tested apart:

* :class:`Policy` sizes the pool (worker processes, or DALI threads) and the prefetch depth so
  that the loader delivers what the consumer takes, with the fewest workers. It moves one step at
  a time with hysteresis (the issue "Throughput balancer", ``docs/architecture.md``): a worker is
  added while the step gains more than ~7 %, removed while the loss stays under ~3 %, and the
  records are forgotten and re-checked when demand or speed drift by more than ~15 %.
* :func:`diagnose` says whether the loader meets demand, and if not whether it is CPU-bound
  (with the cores it would need) or limited by something else.
* :func:`choose_placement` and :func:`choose_dali_settings` pick where the stages run
  (``python`` pool, ``dali-cpu``, ``dali-gpu``), DALI's thread count and ``hw_decoder_load``
  from measured rates.

Every decision carries its reason in plain words and is logged on the ``feedgpu.balancer``
logger (INFO for changes, DEBUG for holds); :meth:`Policy.stats` is what ``loader.stats()``
shows under ``"balancer"``.

Units: rates in samples per second, times in seconds, CPU in cores (1.0 = one core busy for
the whole window), memory in bytes, fractions in [0, 1].
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Sequence

from ..errors import ConfigError

log = logging.getLogger("feedgpu.balancer")

#: Keep an add step when it raises the delivered rate by more than this (the issue: "add while
#: a step gains more than ~7 %").
GAIN_THRESHOLD = 0.07
#: Keep a remove step while the delivered rate stays within this of the best rate seen (the
#: issue: "remove while the loss stays under ~3 %").
LOSS_THRESHOLD = 0.03
#: Forget the records and re-check when demand, or the rate at unchanged settings, moves by
#: more than this (the issue: "re-check when demand or speed drifts"; 15 % is five times the
#: 3 % noise of a few-second window, so noise alone does not trigger it).
DRIFT_THRESHOLD = 0.15
#: The consumer "waits" when it spends more than this share of its wall time waiting for data.
#: Ours: equal to the loss threshold, so "does not wait" and "lost less than 3 %" agree.
WAIT_THRESHOLD = 0.03
#: In larger pools one worker can add at most ~1/w; a worker is also worth adding when it gains
#: at least this share of what an average worker gives (``EFFICIENCY / w``). Ours: without it the
#: 7 % rule would stop a linear pool at 14 workers on the 16-core reference machine.
EFFICIENCY = 0.5
#: An add step must gain more than this whatever the pool size (ours: one point above the loss
#: threshold, so that no pair of counts can be both "worth adding" and "fine to remove").
ADD_FLOOR = LOSS_THRESHOLD + 0.01
#: Workers whose CPU use is below this share of a core each are not kept busy; then a deeper
#: prefetch is tried (ours).
BUSY_THRESHOLD = 0.8
#: Head-room on the first estimate of the count needed (ours).
ESTIMATE_HEADROOM = 0.1
#: A step is judged once the measured difference is this many standard errors away from its
#: threshold, or after ``max_measure_windows`` windows (ours: two standard errors, ~95 %).
CONFIDENCE = 2.0
#: Relative noise of a window's rate assumed before enough windows are seen, and the least
#: assumed after (ours: a few-second window of a few hundred samples varies by ~1-3 %).
NOISE_PRIOR = 0.02
NOISE_FLOOR = 0.01

ENGINES = ("python", "dali-cpu", "dali-gpu")
KINDS = ("add", "remove", "revert", "prefetch", "probe", "hold", "settle", "measure", "remote-add", "remote-remove")


# -- measurements and decisions ---------------------------------------------------------------

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
        cpu_budget: cores the pool may use: the cores this process may run on, minus what the
            training process needs (and, where measured, what other processes take).
        rss_bytes: memory the loader holds (workers' unique set size plus its buffers); 0 when
            unknown.
        ram_budget_bytes: memory the loader may hold; ``None`` for no limit.
        gpu_mem_free_bytes: free device memory (head-room for DALI GPU buffers and device
            prefetch); ``None`` without a GPU.
        prefetch: batches in flight per worker (``prefetch_factor``).
        engine: ``"python"``, ``"dali-cpu"`` or ``"dali-gpu"``.
        hw_decoder_load: DALI GPU's share of JPEGs sent to the hardware decoder, if any.
        remote_workers: remote workers (Ray actors, ``executor: ray``) running during the
            window, besides the ``workers`` local ones (see :mod:`feedgpu.exec.remote_policy`).
        remote_started: how many of them Ray has started by the window's end (an actor waits
            for a free CPU on the cluster, and its process starts in seconds); ``None``: all.
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
        kind: ``"add"``, ``"remove"``, ``"revert"`` (undo the last step, or go back to measure
            the previous setting again), ``"prefetch"`` (prefetch depth changed), ``"probe"`` (a
            worker added to check again whether it helps now; see ``recheck_windows``),
            ``"hold"``, ``"settle"`` (the window after a change is not judged) or ``"measure"``
            (more windows are needed to judge a step).
        reason: why, in plain words, with the numbers.
        t: the measurement's ``t``.
        engine: where the stages run (unchanged by :class:`Policy`; see :func:`choose_placement`).
        dali_threads: DALI's thread count for the DALI engines (equal to ``workers``), else None.
        hw_decoder_load: for ``dali-gpu``, as measured.
        remote_workers: remote workers for the next window (``executor: ray``; 0 otherwise).
            ``"remote-add"`` and ``"remote-remove"`` change only this count.
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

    @property
    def changes(self) -> bool:
        """True when the loader has to resize the pool (local or remote) or change the prefetch
        depth."""
        return self.kind in ("add", "remove", "revert", "prefetch", "probe", "remote-add", "remote-remove")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PolicyConfig:
    """The constants of :class:`Policy` (defaults: the module constants, sources given there).

    Args:
        gain_threshold: keep an add step gaining more than this (0.07, the issue).
        loss_threshold: keep a remove step losing less than this against the best rate (0.03).
        drift_threshold: forget the records when demand or speed moves more than this (0.15).
        wait_threshold: the consumer waits when its wait fraction exceeds this (0.03).
        efficiency: an add step is also kept when it gains ``efficiency / workers`` (0.5).
        add_floor: an add step must gain more than this in any case (0.04).
        busy_threshold: workers using less than this share of a core are not kept busy (0.8).
        estimate_headroom: margin of the one-jump estimate of the count needed (0.1).
        min_workers, max_workers: bounds of the pool (1, 64).
        min_prefetch, max_prefetch: bounds of the prefetch depth (1, 8).
        settle_windows: windows skipped after each change (pool start-up, queues refilling) (1).
        measure_windows: windows averaged at least before a step is judged (1).
        base_windows: windows averaged at least at a setting before a step away from it (2).
        max_measure_windows: windows averaged at most: a close call (the difference within
            ``confidence`` standard errors of its threshold) is measured again until then (4).
        confidence: standard errors a difference must clear to be judged early (2.0).
        noise_prior, noise_floor: relative noise of one window's rate assumed before enough
            windows are seen, and the least assumed (0.02, 0.01).
        drift_windows: consecutive drifting windows needed to forget the records (2).
        recheck_windows, recheck_max_windows: while the consumer waits and adding a worker was
            found not worth it, try again after this many windows, doubling each time up to the
            maximum (120, 1920). Ours: a neighbour that stops taking cores changes nothing the
            loader can see when its budget does not count other processes; a failed add step
            costs no throughput, so an occasional one is cheap.
        estimate: allow one jump to an estimated count after each (re)start (True); all other
            moves are single steps.
        history: decisions kept for :meth:`Policy.stats` (200).
    """

    gain_threshold: float = GAIN_THRESHOLD
    loss_threshold: float = LOSS_THRESHOLD
    drift_threshold: float = DRIFT_THRESHOLD
    wait_threshold: float = WAIT_THRESHOLD
    efficiency: float = EFFICIENCY
    add_floor: float = ADD_FLOOR
    busy_threshold: float = BUSY_THRESHOLD
    estimate_headroom: float = ESTIMATE_HEADROOM
    min_workers: int = 1
    max_workers: int = 64
    min_prefetch: int = 1
    max_prefetch: int = 8
    settle_windows: int = 1
    measure_windows: int = 1
    max_measure_windows: int = 4
    base_windows: int = 2
    confidence: float = CONFIDENCE
    noise_prior: float = NOISE_PRIOR
    noise_floor: float = NOISE_FLOOR
    drift_windows: int = 2
    recheck_windows: int = 120
    recheck_max_windows: int = 1920
    estimate: bool = True
    history: int = 200

    def __post_init__(self):
        if not 0 < self.loss_threshold < self.add_floor <= self.gain_threshold:
            raise ConfigError("PolicyConfig: need 0 < loss_threshold < add_floor <= gain_threshold "
                              f"(got {self.loss_threshold}, {self.add_floor}, {self.gain_threshold})")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ConfigError(f"PolicyConfig: need 1 <= min_workers <= max_workers, got {self.min_workers}, "
                              f"{self.max_workers}")
        if not 1 <= self.min_prefetch <= self.max_prefetch:
            raise ConfigError("PolicyConfig: need 1 <= min_prefetch <= max_prefetch")
        if (self.settle_windows < 0 or not 1 <= self.measure_windows <= self.max_measure_windows
                or self.drift_windows < 1):
            raise ConfigError("PolicyConfig: need settle_windows >= 0, 1 <= measure_windows <= max_measure_windows, "
                              "drift_windows >= 1")

    def add_threshold(self, workers: int) -> float:
        """Gain an add step from ``workers`` must exceed: ``max(add_floor, min(gain_threshold,
        efficiency / workers))``."""
        return max(self.add_floor, min(self.gain_threshold, self.efficiency / workers))


# -- the policy -------------------------------------------------------------------------------

Key = tuple  # (workers, prefetch)


@dataclass
class _Record:
    """Averages of the windows seen at one setting since the records were last forgotten."""

    n: int = 0
    rate: float = 0.0
    rate_m2: float = 0.0     # sums of squared deviations (Welford)
    wait: float = 0.0
    wait_m2: float = 0.0
    cores: float = 0.0
    rss: float = 0.0

    def add(self, m: Measurement) -> None:
        self.n += 1
        k = 1.0 / self.n
        d = m.delivered_rate - self.rate
        self.rate += d * k
        self.rate_m2 += d * (m.delivered_rate - self.rate)
        d = m.wait_fraction - self.wait
        self.wait += d * k
        self.wait_m2 += d * (m.wait_fraction - self.wait)
        self.cores += (m.cpu_cores_used - self.cores) * k
        self.rss += (m.rss_bytes - self.rss) * k

    def wait_se(self, prior: float) -> float:
        """Standard error of the mean wait: this setting's own spread, shrunk towards
        ``prior`` (the pooled relative noise of the rates; two pseudo-windows), over sqrt(n).
        The wait is 0 whenever supply exceeds demand, so its spread differs from setting to
        setting and is not pooled."""
        var = (self.wait_m2 + 2 * prior ** 2) / (self.n - 1 + 2)
        return math.sqrt(var / self.n)


@dataclass(frozen=True)
class _Trial:
    src: Key
    dst: Key
    kind: str           # "add", "remove" or "prefetch"
    jump: bool = False
    phase: str = "dst"  # "dst": measuring the new setting; "src": measuring the old one again


def _round(x: float) -> int:
    """Half up (Python's ``round`` sends 4.5 to 4)."""
    return math.floor(x + 0.5)


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "unknown"
    return "unlimited" if math.isinf(x) else f"{x:,.0f}/s"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def start_workers(cpu_budget: float, config: PolicyConfig | None = None) -> int:
    """A starting pool size: half the CPU budget, rounded up, within the config's bounds.

    Half is a compromise: the first measurement lets :class:`Policy` jump to an estimate, up
    from the delivered rate per worker, or down from the cores actually used."""
    c = config or PolicyConfig()
    return max(c.min_workers, min(c.max_workers, math.ceil(cpu_budget / 2)))


class Policy:
    """Sizes the pool and the prefetch depth from measurements, one step at a time.

    Rules, applied to each window (``decide``):

    1. Budgets first: the pool never exceeds ``round(cpu_budget)`` workers, nor the count whose
       estimated memory (per-worker memory from the measurements) fits ``ram_budget_bytes``. A
       pool above either shrinks at once to the limit.
    2. The window after a change is skipped (``settle_windows``); a step is judged after
       ``measure_windows`` windows at the new setting.
    3. While the consumer waits (``wait_fraction > wait_threshold``) and the budgets allow, add
       a worker. Keep it when the delivered rate rose more than
       :meth:`PolicyConfig.add_threshold` (7 % in small pools), or when it rose more than the
       loss threshold and the consumer stopped waiting; else go back and do not try that step
       again (nor when a larger pool already measured did not deliver more). If adding is not
       possible or not worth it and the workers are idle part of the time (CPU used below
       ``busy_threshold`` cores per worker), try one more batch of prefetch (same rule), then
       fewer workers (the pool is past its knee: another process takes cores, or the main
       process's hand-off limits): keep the removal while the delivered rate stays within
       ``loss_threshold`` of the best rate seen. (With idle workers the prefetch step comes
       first: a queue too shallow to keep the workers busy is the cheaper fix.)
    4. While the consumer does not wait, remove a worker; keep the removal while the consumer
       still does not wait; else go back and stop removing.
    5. Once after each (re)start, the first move may jump to an estimate: up to
       ``demand / (rate per worker)`` while the consumer waits, or down to the cores the pool
       actually uses (plus head-room) while it does not. A jump that does not pay is undone.
    6. When demand moves by more than ``drift_threshold`` from its average, or the delivered rate
       at unchanged settings does (e.g. another process takes cores), for ``drift_windows``
       windows in a row, every record is forgotten and the rules start again from the current
       setting. While the consumer waits and adding was found not worth it, adding is tried
       again after ``recheck_windows``, then twice as long each time.
    7. A close call (the deciding difference within ``confidence`` standard errors of its
       threshold, the noise estimated from the windows themselves) is measured again, up to
       ``max_measure_windows`` at the new setting, then at the old one.

    The state is small: the average rate, wait, CPU and memory seen at each (workers, prefetch)
    setting, the steps found not worth it, the step being judged and the demand average.
    """

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self._history: deque[Decision] = deque(maxlen=self.config.history)
        self._decisions = 0
        self._changes = 0
        self._key: Key | None = None
        self._settle = self.config.settle_windows
        self._demand_n = 0
        self._demand_avg = 0.0
        self._demand_off = 0
        self._speed_off = 0
        self._forgotten = 0
        self._recheck_every = self.config.recheck_windows
        self._recheck_at: int | None = None
        self._budget: float | None = None
        self._forget_state()

    # -- public ---------------------------------------------------------------------------------
    def decide(self, m: Measurement) -> Decision:
        """The setting for the next window, given the window ``m`` just measured."""
        d = self._decide(m)
        self._decisions += 1
        if d.changes:
            self._changes += 1
            self._key = (d.workers, d.prefetch)
            self._settle = self.config.settle_windows
            self._speed_off = 0
        self._history.append(d)
        log.log(logging.INFO if d.changes else logging.DEBUG, "t=%.1f %s -> %d workers, prefetch %d: %s",
                d.t, d.kind, d.workers, d.prefetch, d.reason)
        return d

    def forget(self) -> None:
        """Forget every record (the next windows re-check from the current setting)."""
        self._forget_state()
        self._demand_n, self._demand_avg, self._demand_off, self._speed_off = 0, 0.0, 0, 0
        self._recheck_every, self._recheck_at = self.config.recheck_windows, None
        self._forgotten += 1

    @property
    def history(self) -> tuple[Decision, ...]:
        """The last ``config.history`` decisions, oldest first."""
        return tuple(self._history)

    def stats(self) -> dict:
        """For ``loader.stats()["balancer"]``: the current setting, counts of decisions, changes
        and resets (records forgotten on drift), the average demand (samples/s), the estimated
        relative noise of one window's rate, the mean rate (samples/s) seen at each setting
        (``"<workers>w/p<prefetch>"``) and the last 20 decisions."""
        w, p = self._key if self._key is not None else (None, None)
        return {
            "workers": w, "prefetch": p, "decisions": self._decisions, "changes": self._changes,
            "resets": self._forgotten,
            "demand_rate": self._demand_avg if self._demand_n else None,
            "noise": round(self._noise(), 4),
            "rates": {f"{k[0]}w/p{k[1]}": round(r.rate, 1) for k, r in sorted(self._records.items())},
            "last": [d.as_dict() for d in list(self._history)[-20:]],
        }

    def diagnose(self, m: Measurement) -> "Diagnosis":
        """:func:`diagnose` of ``m`` with this policy's wait threshold."""
        return diagnose([m], wait_threshold=self.config.wait_threshold)

    # -- internals ------------------------------------------------------------------------------
    def _forget_state(self) -> None:
        self._records: dict[Key, _Record] = {}
        self._no_add: dict[Key, str] = {}       # setting -> why adding a worker is not worth it
        self._no_remove: dict[Key, str] = {}    # setting -> why removing a worker is not
        self._no_prefetch: dict[Key, str] = {}
        self._trial: _Trial | None = None
        self._may_jump = self.config.estimate

    def _decision(self, m: Measurement, key: Key, kind: str, reason: str) -> Decision:
        w, p = key
        dali = m.engine.startswith("dali")
        return Decision(w, p, kind, reason, t=m.t, engine=m.engine, dali_threads=w if dali else None,
                        hw_decoder_load=m.hw_decoder_load, remote_workers=m.remote_workers)

    def _limit(self, m: Measurement) -> tuple[int, str]:
        """The largest pool the budgets allow, and which budget sets it."""
        c = self.config
        limit = min(c.max_workers, max(c.min_workers, _round(m.cpu_budget)))
        why = f"the CPU budget ({m.cpu_budget:.1f} cores)"
        if limit == c.max_workers:
            why = f"the configured maximum ({c.max_workers} workers)"
        if m.ram_budget_bytes is not None and m.rss_bytes > 0:
            per = self._rss_per_worker(m)
            fit = m.workers + math.floor((m.ram_budget_bytes - m.rss_bytes) / per)
            if fit < limit:
                limit = max(c.min_workers, fit)
                why = f"the RAM budget ({_gib(m.ram_budget_bytes)}, ~{_gib(per)} per worker)"
        return limit, why

    def _rss_per_worker(self, m: Measurement) -> float:
        """Memory one more worker costs: the slope between the two farthest worker counts
        measured at this prefetch depth, else (conservatively) all memory over the workers."""
        pts = sorted((k[0], r.rss) for k, r in self._records.items() if k[1] == m.prefetch and r.rss > 0)
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            slope = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
            if slope > 0:
                return slope
        return m.rss_bytes / m.workers

    def _decide(self, m: Measurement) -> Decision:
        notes: list[str] = []
        key = (m.workers, m.prefetch)
        if self._key is None:
            self._key = key
        elif key != self._key:
            notes.append(f"the loader runs {key[0]} workers / prefetch {key[1]}, not the "
                         f"{self._key[0]} / {self._key[1]} decided; going on from there")
            self._key, self._trial, self._settle = key, None, 0
        w, p = key

        limit, why = self._limit(m)
        if self._budget is not None and m.cpu_budget >= self._budget + 1 and self._no_add:
            notes.append(f"the CPU budget rose from {self._budget:.1f} to {m.cpu_budget:.1f} cores; "
                         "adding may pay again")
            self._no_add.clear()
        self._budget = m.cpu_budget
        if w > limit:
            self._trial = None
            return self._decision(m, (limit, p), "remove", f"{w} workers exceed {why}: down to {limit}")

        if self._demand_drift(m):
            notes.append(f"demand moved from {_fmt_rate(self._demand_avg)} to {_fmt_rate(m.demand_rate)}; "
                         "records forgotten")
            self.forget()
            self._track_demand(m)
        if self._settle > 0:
            self._settle -= 1
            return self._decision(m, key, "settle", "; ".join(notes + [f"letting {w} workers / prefetch {p} settle"]))

        rec = self._records.get(key)
        if self._trial is None and rec is not None and self._speed_drift(m, rec):
            notes.append(f"the rate at {w} workers moved from {_fmt_rate(rec.rate)} to "
                         f"{_fmt_rate(m.delivered_rate)} with demand unchanged; records forgotten")
            self.forget()
            self._track_demand(m)
            rec = None
        if rec is None:
            rec = self._records[key] = _Record()
        rec.add(m)

        if self._trial is not None:
            d = self._follow_trial(m, rec, notes)
            if d is not None:
                return d
        return self._next(m, notes, limit, why)

    def _follow_trial(self, m: Measurement, rec: _Record, notes: list[str]) -> Decision | None:
        """Judge the step being tried once enough windows are in. A close call (the verdict
        within ``confidence`` standard errors of its threshold) is measured again, first at the
        new setting, then at the old one. Returns the decision, or None to go on from here."""
        c = self.config
        t = self._trial
        key = self._key
        if rec.n < c.measure_windows:
            return self._decision(m, key, "measure", f"measuring {key[0]} workers / prefetch {key[1]} "
                                  f"({rec.n} of {c.measure_windows} windows)")
        ok, margin, se, verdict = self._verdict(t)
        step = f"{'jump' if t.jump else t.kind} to {t.dst[0]} workers / prefetch {t.dst[1]}"
        close = margin < c.confidence * se
        if close and rec.n < c.max_measure_windows:
            return self._decision(m, key, "measure", f"close call, measuring again ({verdict}; "
                                  f"{_pct(margin)} from the threshold, noise needs {_pct(c.confidence * se)})")
        if close and t.phase == "dst" and self._records[t.src].n < c.max_measure_windows:
            self._trial = replace(t, phase="src")
            return self._decision(m, t.src, "revert", "; ".join(notes + [
                f"close call on the {step} ({verdict}): measuring {t.src[0]} workers / prefetch "
                f"{t.src[1]} again before deciding"]))
        self._trial = None
        if not ok:
            if t.jump:
                self._may_jump = False
            else:
                {"add": self._no_add, "remove": self._no_remove, "prefetch": self._no_prefetch}[t.kind][t.src] = verdict
            if t.phase == "src":
                notes.append(f"measured both again, staying without the {step}: {verdict}")
                return None
            return self._decision(m, t.src, "revert", "; ".join(notes + [f"undid the {step}: {verdict}"]))
        if t.phase == "src":
            return self._decision(m, t.dst, t.kind,
                                  "; ".join(notes + [f"measured both again, back to the {step}: {verdict}"]))
        notes.append(f"kept the {step} ({verdict})")
        return None

    def _noise(self) -> float:
        """Relative standard deviation of one window's rate: pooled over the records, shrunk
        towards ``noise_prior`` while few windows are seen, at least ``noise_floor``."""
        c = self.config
        prior_df = 4.0
        ss = prior_df * c.noise_prior ** 2
        df = prior_df
        for r in self._records.values():
            if r.n >= 2 and r.rate > 0:
                ss += r.rate_m2 / r.rate ** 2
                df += r.n - 1
        return max(c.noise_floor, math.sqrt(ss / df))

    # drift --------------------------------------------------------------------------------------
    def _track_demand(self, m: Measurement) -> None:
        if m.demand_rate is not None and not math.isinf(m.demand_rate):
            self._demand_n += 1
            self._demand_avg += (m.demand_rate - self._demand_avg) / self._demand_n

    def _demand_drift(self, m: Measurement) -> bool:
        if m.demand_rate is None or math.isinf(m.demand_rate):
            return False
        if self._demand_n and abs(m.demand_rate / self._demand_avg - 1) > self.config.drift_threshold:
            self._demand_off += 1
            return self._demand_off >= self.config.drift_windows
        self._demand_off = 0
        self._track_demand(m)
        return False

    def _speed_drift(self, m: Measurement, rec: _Record) -> bool:
        if rec.rate > 0 and abs(m.delivered_rate / rec.rate - 1) > self.config.drift_threshold:
            self._speed_off += 1
            return self._speed_off >= self.config.drift_windows
        self._speed_off = 0
        return False

    # steps --------------------------------------------------------------------------------------
    def _best_rate(self) -> tuple[float, int]:
        """The best rate seen and its number of windows, each setting's mean lowered by one
        standard error (a setting seen once or twice must not set the bar with a lucky window)."""
        sigma = self._noise()
        return max(((r.rate * (1 - sigma / math.sqrt(r.n)), r.n) for r in self._records.values() if r.n),
                   default=(0.0, 1))

    def _verdict(self, t: _Trial) -> tuple[bool, float, float, str]:
        if t.kind == "remove":
            return self._remove_verdict(t.src, t.dst)
        return self._add_verdict(t.src, t.dst)

    def _add_verdict(self, src: Key, dst: Key) -> tuple[bool, float, float, str]:
        """Is the setting ``dst`` (one more worker, a deeper prefetch or a jump up) worth it over
        ``src``? Both must be recorded. Returns (worth it, distance of the deciding figure from
        its threshold, that figure's standard error, why)."""
        c = self.config
        a, b = self._records[src], self._records[dst]
        if b.wait <= c.wait_threshold and a.wait < 1:
            # dst meets demand, so its rate is the consumer's pace, noise included: compare the
            # share of demand served (1 - wait) instead, which the consumer's pace cancels from.
            gain = (1 - b.wait) / (1 - a.wait) - 1
            se = math.hypot(a.wait_se(self._noise()), b.wait_se(self._noise())) / (1 - a.wait)
        else:
            gain = b.rate / a.rate - 1 if a.rate > 0 else (math.inf if b.rate > 0 else 0.0)
            se = self._noise() * math.sqrt(1 / a.n + 1 / b.n)
        need = c.add_threshold(src[0])
        loss_without = 1 - 1 / (1 + gain) if gain > -1 else -math.inf
        by_gain = gain - need
        by_wait = min(loss_without - c.loss_threshold, c.wait_threshold - b.wait)
        what = (f"{dst[0]} workers / prefetch {dst[1]} vs {src[0]} / {src[1]}: "
                f"{_fmt_rate(b.rate)} vs {_fmt_rate(a.rate)}")
        if by_gain > 0:
            return True, by_gain, se, f"{what}, +{_pct(gain)} (more than {_pct(need)})"
        if by_wait > 0:
            return True, by_wait, se, f"{what}, +{_pct(gain)} and the consumer no longer waits"
        return (False, -max(by_gain, by_wait), se,
                f"{what}, {'+' if gain >= 0 else ''}{_pct(gain)} (needs more than {_pct(need)})")

    def _remove_verdict(self, src: Key, dst: Key) -> tuple[bool, float, float, str]:
        """Is ``dst`` (fewer workers) good enough? When the consumer did not wait at ``src``, it
        must still not wait (its wait fraction is the share of demand lost, and unlike the
        delivered rate it does not move with the consumer's own pace). When it waited, ``dst``
        must deliver within the loss threshold of the best rate seen."""
        c = self.config
        a, b = self._records[src], self._records[dst]
        what = f"{dst[0]} workers / prefetch {dst[1]} deliver {_fmt_rate(b.rate)}"
        if a.wait <= c.wait_threshold:
            by_wait = c.wait_threshold - b.wait
            se = b.wait_se(self._noise())
            if by_wait <= 0:
                return False, -by_wait, se, f"{what}: the consumer now waits {_pct(b.wait)}"
            return True, by_wait, se, f"{what}: the consumer still waits only {_pct(b.wait)}"
        best, best_n = self._best_rate()
        loss = 1 - b.rate / best if best > 0 else 0.0
        by_loss = c.loss_threshold - loss
        se = self._noise() * math.sqrt(1 / b.n + 1 / best_n)
        what += f", best {_fmt_rate(best)}"
        if by_loss <= 0:
            return False, -by_loss, se, f"{what}: loses {_pct(loss)} (limit {_pct(c.loss_threshold)})"
        return True, by_loss, se, f"{what}: loses {_pct(max(loss, 0.0))} (under {_pct(c.loss_threshold)})"

    def _try(self, m: Measurement, notes: list[str], dst: Key, kind: str, reason: str, jump: bool = False,
             label: str | None = None) -> Decision:
        n = self._records[self._key].n
        if n < self.config.base_windows:
            self._may_jump = self._may_jump or jump
            return self._decision(m, self._key, "measure", "; ".join(notes + [
                f"{reason}, after measuring {self._key[0]} workers / prefetch {self._key[1]} again "
                f"({n} of {self.config.base_windows} windows)"]))
        self._trial = _Trial(self._key, dst, kind, jump)
        return self._decision(m, dst, label or kind, "; ".join(notes + [reason]))

    def _next(self, m: Measurement, notes: list[str], limit: int, why_limit: str) -> Decision:
        c = self.config
        key = self._key
        w, p = key
        rec = self._records[key]
        waiting = rec.wait > c.wait_threshold
        state = (f"the consumer waits {_pct(rec.wait)} at {_fmt_rate(rec.rate)} "
                 f"(demand {_fmt_rate(m.demand_rate)})")

        if self._may_jump:
            self._may_jump = False
            target = self._estimate(m, rec, limit, waiting)
            if target is not None and abs(target - w) >= 2:
                kind = "add" if target > w else "remove"
                return self._try(m, notes, (target, p), kind, f"{state}; jumping to the estimated "
                                 f"{target} workers", jump=True)

        if waiting:
            busy = rec.cores / w if rec.cores > 0 else None
            idle = busy is not None and busy < c.busy_threshold
            if (idle and p < c.max_prefetch and key not in self._no_prefetch and (w, p + 1) not in self._records):
                return self._try(m, notes, (w, p + 1), "prefetch",
                                 f"{state}; workers busy {_pct(busy)} of the time: prefetch {p + 1}")
            up = (w + 1, p)
            probe = w < limit and key in self._no_add and self._recheck_due()
            if probe:
                notes.append(f"checking again whether a worker more helps (last found: {self._no_add.pop(key)})")
                for k in [k for k in self._records if k[1] == p and k[0] > w]:
                    del self._records[k]
            if w >= limit:
                blocked = f"{why_limit} allows no more than {limit} workers"
            elif key in self._no_add:
                blocked = f"adding a worker is not worth it ({self._no_add[key]})"
            elif up in self._records and self._records[up].n >= c.measure_windows:
                ok, _, _, verdict = self._add_verdict(key, up)
                if ok:
                    return self._decision(m, up, "add", "; ".join(notes + [f"{state}; measured before: {verdict}"]))
                self._no_add[key] = verdict
                blocked = f"adding a worker is not worth it ({verdict})"
            elif (higher := self._no_better_above(key)) is not None:
                self._no_add[key] = higher
                blocked = f"adding a worker is not worth it ({higher})"
            else:
                return self._try(m, notes, up, "add", f"{state}; adding a worker", label="probe" if probe else None)
            if idle and w > c.min_workers and key not in self._no_remove:
                down = self._plateau_target(m, rec)
                if (down, p) not in self._records:
                    return self._try(m, notes, (down, p), "remove",
                                     f"{state}; {blocked}; checking whether {down} workers deliver as much")
            return self._decision(m, key, "hold", "; ".join(notes + [f"{state}; {blocked}"]))

        if w > c.min_workers and key not in self._no_remove:
            down = (w - 1, p)
            if down in self._records and self._records[down].n >= c.measure_windows:
                ok, _, _, verdict = self._remove_verdict(key, down)
                if ok:
                    return self._decision(m, down, "remove",
                                          "; ".join(notes + [f"{state}; measured before: {verdict}"]))
                self._no_remove[key] = verdict
            else:
                return self._try(m, notes, down, "remove", f"{state}; removing a worker")
        floor = (f"removing one is not worth it ({self._no_remove[key]})" if key in self._no_remove
                 else f"{w} is the minimum")
        return self._decision(m, key, "hold", "; ".join(notes + [f"{state}; {floor}"]))

    def _recheck_due(self) -> bool:
        """True once every ``recheck`` interval (counted in decisions), the interval doubling."""
        c = self.config
        if self._recheck_at is None:
            self._recheck_at = self._decisions + self._recheck_every
            return False
        if self._decisions < self._recheck_at:
            return False
        self._recheck_every = min(2 * self._recheck_every, c.recheck_max_windows)
        self._recheck_at = None
        return True

    def _no_better_above(self, key: Key) -> str | None:
        """Why one more worker cannot be worth it, when a larger pool already measured at this
        prefetch depth did not deliver enough more (the rate is taken not to fall and then rise
        again with more workers); else None."""
        w, p = key
        base = self._records[key].rate
        need = self.config.add_threshold(w)
        for (k, q), r in sorted(self._records.items()):
            if q == p and k > w + 1 and r.n >= self.config.measure_windows and r.rate <= base * (1 + need):
                return f"{k} workers delivered {_fmt_rate(r.rate)}, within {_pct(need)} of {_fmt_rate(base)}"
        return None

    def _estimate(self, m: Measurement, rec: _Record, limit: int, waiting: bool) -> int | None:
        """The count the first measurement suggests, or None."""
        c = self.config
        w = m.workers
        if waiting:
            if m.demand_rate is None or rec.rate <= 0 or 0 < rec.cores < c.busy_threshold * w:
                return None  # unknown, or the workers are idle part of the time: not what limits
            if math.isinf(m.demand_rate):
                return limit
            return min(limit, math.ceil(m.demand_rate / (rec.rate / w)))
        if rec.cores <= 0:
            return None
        return max(c.min_workers, min(limit, math.ceil(rec.cores * (1 + c.estimate_headroom))))

    def _plateau_target(self, m: Measurement, rec: _Record) -> int:
        """Where to check for the same rate with fewer workers: the cores the pool really uses
        (plus head-room) when that is at least two workers fewer, else one fewer."""
        c = self.config
        w = m.workers
        if rec.cores > 0:
            target = max(c.min_workers, math.ceil(rec.cores * (1 + c.estimate_headroom)))
            if target <= w - 2:
                return target
        return w - 1


# -- diagnosis ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Diagnosis:
    """Whether the loader keeps up, and what it would take.

    Attributes:
        verdict: ``"meets demand"``, ``"CPU-bound"`` (the consumer waits and the pool uses its
            CPU budget) or ``"input-bound"`` (the consumer waits though cores are left: I/O, the
            main process's hand-off, or too few workers).
        demand_rate, delivered_rate: samples/s (means of the windows).
        wait_fraction: the consumer's share of time waiting.
        cpu_cores_used, cpu_budget: cores.
        rate_per_core: samples/s per core the pool delivers (``delivered / cores used``).
        cores_needed: cores the pool would need to meet demand at that rate (``inf`` for an
            unlimited consumer, ``None`` when unknown).
        extra_cores: ``cores_needed - cpu_budget`` when positive, else 0.
        workers, engine: the setting of the last window.
        message: the above as one sentence for ``feedgpu bench`` and logs.
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
    got = f"the loader delivers {_fmt_rate(delivered)} with {last.workers} workers on {cores:.1f} of {budget:.1f} cores"
    if wait <= wait_threshold:
        verdict = "meets demand"
        msg = f"meets demand: the consumer takes {_fmt_rate(demand)} and waits {_pct(wait)}; {got}"
    elif cores >= saturation * budget:
        verdict = "CPU-bound"
        msg = f"CPU-bound: the consumer would take {_fmt_rate(demand)} but waits {_pct(wait)}; {got}"
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
        msg = (f"input-bound: the consumer would take {_fmt_rate(demand)} but waits {_pct(wait)}; {got}, so "
               "the limit is not the CPU (I/O, the main process's hand-off, or too few workers)")
    return Diagnosis(verdict, demand, delivered, wait, cores, budget, per_core, needed, extra, last.workers,
                     last.engine, msg)


# -- placement ------------------------------------------------------------------------------------

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
#: chosen (the issue: "prefer fewer resources among those within 5 %").
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
    ``docs/anchors.md`` shows GPU preprocessing idling ResNet-18 8-10 %), then to the simpler
    engine (python, dali-cpu, dali-gpu).

    Raises :class:`ConfigError` when no option fits.
    """
    fit, dropped = [], []
    cores_limit = max(1, _round(cpu_budget)) * (1 + tolerance)
    gpu_free = None if gpu_mem_free_bytes is None else gpu_mem_free_bytes - gpu_mem_reserve_bytes
    for o in options:
        if o.cpu_cores > cores_limit:
            dropped.append(f"{o.engine}: {o.cpu_cores:.1f} cores > budget {cpu_budget:.1f}")
        elif o.uses_gpu and (gpu_free is None or o.gpu_mem_bytes > gpu_free):
            dropped.append(f"{o.engine}: needs {_gib(o.gpu_mem_bytes)} of GPU memory, "
                           + ("no GPU" if gpu_free is None else f"{_gib(gpu_free)} free"))
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
    others = ", ".join(f"{o.engine} {_fmt_rate(o.rate)} on {o.cpu_cores:.1f} cores" for o in fit if o is not pick)
    reason = (f"{pick.engine}: {_fmt_rate(pick.rate)} on {pick.cpu_cores:.1f} cores"
              + (f" (demand {_fmt_rate(demand_rate)})" if demand_rate is not None else "")
              + (f"; others: {others}" if others else "")
              + (f"; not fitting: {'; '.join(dropped)}" if dropped else ""))
    dali = pick.engine.startswith("dali")
    return Placement(pick.engine, pick.workers, pick.workers if dali else None, pick.hw_decoder_load,
                     pick.rate, pick.cpu_cores, reason)


@dataclass(frozen=True)
class DaliTrial:
    """One measured DALI GPU setting: threads, ``hw_decoder_load`` and the rate (samples/s)."""

    threads: int
    hw_decoder_load: float
    rate: float


def dali_gpu_candidates(cpu_budget: float) -> list[tuple[int, float]]:
    """Settings worth measuring for ``dali-gpu``: threads 2, 4 and 8 within the CPU budget, each
    with ``hw_decoder_load`` 0.75 and 0.9. ``docs/anchors.md``: 4 threads with 0.9 was fastest
    data-only (32,656/s), 8 threads with 0.75 about as fast end to end, and the defaults
    (8 threads, 0.75 on that run's earlier default) 24 % slower."""
    threads = [t for t in (2, 4, 8) if t <= max(2, _round(cpu_budget))]
    return [(t, load) for t in threads for load in (0.75, 0.9)]


def choose_dali_settings(trials: Sequence[DaliTrial], demand_rate: float | None = None,
                         tolerance: float = PLACEMENT_TOLERANCE) -> DaliTrial:
    """The DALI GPU setting to use: among trials within ``tolerance`` of the best rate (each
    counted up to ``demand_rate``), the fewest threads, then the highest ``hw_decoder_load``
    (the hardware decoder's engines are not the SMs the model needs), then the highest rate."""
    if not trials:
        raise ConfigError("choose_dali_settings: no trials")
    cap = demand_rate if demand_rate is not None else math.inf
    best = max(min(t.rate, cap) for t in trials)
    near = [t for t in trials if min(t.rate, cap) >= (1 - tolerance) * best]
    return min(near, key=lambda t: (t.threads, -t.hw_decoder_load, -t.rate))
