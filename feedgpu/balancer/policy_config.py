"""The balancer policy's constants and bounds: :class:`PolicyConfig` and the module defaults,
:class:`WindowRules`, the window knobs the local and the remote policy share, and
:func:`start_workers`, the starting pool size (see :mod:`.policy` for the rules they tune)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from .diagnosis import WAIT_THRESHOLD

#: Settings whose throughputs are within this share are equal; the cheaper one is chosen.
TOLERANCE = 0.03
#: Forget the records when the rate or demand at an unchanged setting moves by more than this
#: (five times the noise of a few-second window, so noise alone does not trigger it).
DRIFT_THRESHOLD = 0.15
#: Workers using less than this share of a core each are idle part of the time: a deeper
#: prefetch is tried before a worker more.
BUSY_THRESHOLD = 0.8
#: Standard errors a difference must clear to be judged before ``max_measure_windows``.
CONFIDENCE = 2.0
#: Standard errors the mean of the last ``drift_windows`` windows must stand from its setting's
#: record to count as a drift. Higher than ``CONFIDENCE``: the test is made at every window of
#: a run that lasts thousands, so at 2 a loop whose windows are noisy forgets its records on
#: noise alone again and again, and each forget starts experiments that may keep a wrong step.
DRIFT_CONFIDENCE = 3.5
#: Relative noise of a window's rate assumed before enough windows are seen, and the least.
NOISE_PRIOR = 0.02
NOISE_FLOOR = 0.01

#: Share of the memory budget above which a shallower prefetch is tried (it frees batches).
MEMORY_TIGHT = 0.9


@dataclass(frozen=True)
class WindowRules:
    """The window knobs both policies take: how a step is measured and when it is judged, in
    windows. :class:`PolicyConfig` (the local pool) and
    :class:`~feedgpu.balancer.remote_policy.RemoteConfig` (remote workers) extend it; each states
    its own defaults.

    Args:
        wait_threshold: the loop waits when more than this share of its step time goes to
            waiting for a batch (default :data:`~.diagnosis.WAIT_THRESHOLD`).
        drift_threshold: a move of the rate or demand by more than this share counts as a
            drift (default :data:`DRIFT_THRESHOLD`).
        settle_windows: windows not judged after each change (>= 0).
        start_windows: windows allowed for a new worker to start after the pool grows.
        measure_windows: windows measured at least at a new setting before a verdict (>= 1).
        base_windows: windows at the current setting a step is compared with (>= 1).
        recheck_windows: windows after which a step found not worth it is tried again.

    Raises:
        ConfigError: on ``settle_windows < 0``, ``measure_windows < 1`` or ``base_windows < 1``.
    """

    wait_threshold: float = WAIT_THRESHOLD
    drift_threshold: float = DRIFT_THRESHOLD
    settle_windows: int = 1
    start_windows: int = 1
    measure_windows: int = 2
    base_windows: int = 2
    recheck_windows: int = 120

    def __post_init__(self):
        if self.settle_windows < 0 or self.measure_windows < 1 or self.base_windows < 1:
            raise ConfigError(f"{type(self).__name__}: need settle_windows >= 0, measure_windows >= 1 and "
                              f"base_windows >= 1, got {self.settle_windows}, {self.measure_windows}, "
                              f"{self.base_windows}")


@dataclass(frozen=True)
class PolicyConfig(WindowRules):
    """The constants of :class:`Policy` (defaults: the module constants); the window knobs come
    from :class:`WindowRules`, with the defaults below.

    Args:
        tolerance: throughputs within this share are equal (0.03): a costlier setting is kept
            when it trains more than this faster, a cheaper one when it trains within this of
            the best measured.
        wait_threshold: the loop waits when more than this share of its step time goes to
            waiting for a batch (0.03); more workers or prefetch are tried only then.
        drift_threshold, drift_windows: forget the records when the rate or demand at an
            unchanged setting moves more than this share (0.15) in each of this many windows
            (2), all in one direction, and their mean by more than ``drift_confidence``
            standard errors of that quantity's window noise (3.5: made at every window, the
            test must rarely fire on noise alone); steps refused by a wider margin than the move
            stay refused.
        busy_threshold: workers using less than this share of a core are idle part of the time
            (0.8): a deeper prefetch is tried first.
        min_workers, max_workers: bounds of the pool (1, 64); ``max_workers`` is a hard limit.
        min_prefetch, max_prefetch: bounds of the prefetch depth (1, 8).
        settle_windows: windows not judged after each change (1).
        start_windows: windows more not judged after a change that grows the pool (1): a new
            worker starts cold, and until its first batch arrives the batches after it wait in
            the in-order hand-off, so the loop trains below the old setting for about a second.
        measure_windows: windows measured at least at a new setting before a verdict (2).
        base_windows: windows measured at least at a setting before an experiment leaves it (2).
        max_measure_windows: windows measured at most on a close call, at each of the two
            settings (6).
        second_look_windows: windows at a kept costlier setting after which, unless it clearly
            trains faster than where it came from, that setting is measured afresh once more (24).
        confirm_first: a cheaper step judged against the run's first windows (a run trains
            slower while it warms up) is confirmed against where it came from measured afresh
            (True).
        confidence: standard errors a difference must clear to be judged early (2.0).
        noise_prior, noise_floor: relative noise of one window's rate assumed before enough
            windows are seen, and the least assumed (0.02, 0.01).
        recheck_windows, recheck_max_windows: a settled policy starts its experiments again
            after this many windows, the interval doubling up to the maximum (120, 1920).
        history: decisions kept for :meth:`Policy.stats` (200).
        unit: what the worker count counts, in the policy's words (``"workers"``; the DALI
            engine's balancer sizes DALI's CPU threads: ``"DALI threads"``).

    Raises:
        ConfigError: on bounds out of order or a tolerance outside (0, 0.5).
    """

    tolerance: float = TOLERANCE
    busy_threshold: float = BUSY_THRESHOLD
    min_workers: int = 1
    max_workers: int = 64
    min_prefetch: int = 1
    max_prefetch: int = 8
    max_measure_windows: int = 6
    second_look_windows: int = 24
    confirm_first: bool = True
    confidence: float = CONFIDENCE
    drift_confidence: float = DRIFT_CONFIDENCE
    noise_prior: float = NOISE_PRIOR
    noise_floor: float = NOISE_FLOOR
    drift_windows: int = 2
    recheck_windows: int = 120
    recheck_max_windows: int = 1920
    history: int = 200
    unit: str = "workers"

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.tolerance < 0.5:
            raise ConfigError(f"PolicyConfig: need 0 < tolerance < 0.5, got {self.tolerance}")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ConfigError(f"PolicyConfig: need 1 <= min_workers <= max_workers, got {self.min_workers}, "
                              f"{self.max_workers}")
        if not 1 <= self.min_prefetch <= self.max_prefetch:
            raise ConfigError("PolicyConfig: need 1 <= min_prefetch <= max_prefetch")
        if self.start_windows < 0 or self.measure_windows > self.max_measure_windows or self.drift_windows < 1:
            raise ConfigError("PolicyConfig: need start_windows >= 0, measure_windows <= max_measure_windows, "
                              "drift_windows >= 1")

    @property
    def loss_threshold(self) -> float:
        """Throughput a cheaper setting may lose and still be kept (``tolerance``)."""
        return self.tolerance

    def add_threshold(self, workers: int) -> float:
        """Gain a costlier setting must exceed to be kept (``tolerance``, whatever ``workers``)."""
        return self.tolerance


def start_workers(cores: float, config: PolicyConfig | None = None) -> int:
    """A starting pool size: one worker per core (what a user would set), within the bounds.
    Starting high costs the training loop nothing while the policy checks whether fewer
    workers train as fast; starting low starves it until the first experiments are in."""
    c = config or PolicyConfig()
    return max(c.min_workers, min(c.max_workers, math.ceil(cores)))
