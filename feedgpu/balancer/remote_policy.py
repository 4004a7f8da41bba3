"""The balancer's remote decision (``executor: ray``): when to borrow workers from the cluster.

Pure policy, like :mod:`feedgpu.balancer`: measurements in, decisions out, no clock, no
Ray. It sits in front of the local :class:`~feedgpu.balancer.Policy` and moves the count of
remote workers one step at a time:

1. **Add** a remote worker when the training loop waits (``wait_fraction > wait_threshold``) and
   the local policy holds (the local pool is at ``max_local_workers`` or its memory budget, or
   one more local worker was measured not to train faster), up to ``max_remote``. Keep it when the
   delivered rate rose more than the local rule's :meth:`PolicyConfig.add_threshold` for the
   pool's total size, or more than ``loss_threshold`` and the loop stopped waiting, in both cases
   counting no more of the rise than the loop's shorter wait explains
   (:func:`.balancer.verdict.waiting_gain`); else go back
   and do not try that step again until demand moves (the cluster's CPUs may be the same
   machine's, as on a one-node test cluster, or the network may be the limit). As with the
   local policy's costlier steps, an add that looks worth it by less than a drift must move
   (the local ``drift_threshold``, or ``drift_confidence`` standard errors of the ratio at the
   windows' noise) is confirmed (A-B-A): the remote worker is given back, the old count
   measured afresh for ``measure_windows`` windows, and the add made again only if the rate
   it measured still beats that by the same rule.
2. **Release** a remote worker when the loop has not waited for ``release_windows`` windows in a
   row (remote workers first: local ones cost no network and no cluster share). Keep the
   release while the loop still does not wait; else go back and stop releasing until demand
   moves.
3. After a remote change, the windows until the new worker has started (Ray places it where a
   CPU is free; its process starts in seconds) and ``settle_windows`` more are skipped; one not
   started within ``start_windows`` is given back (the cluster has no free CPU). The step is
   then judged on the mean of ``measure_windows`` windows; the local policy's records are
   forgotten after each kept or undone step (its rates were measured with another remote count).
4. An add found not worth it is tried again once the loop has stopped waiting and waits again,
   or after ``recheck_windows`` windows (other jobs may have left the cluster); a release found
   not worth it once demand (measurable while the loop does not wait) fell by more than
   ``drift_threshold`` since.

Everything else (local workers, prefetch) is the local policy's, consulted whenever no remote
step is being judged; a local change goes first and the remote count stays.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from ..errors import ConfigError
from .measurement import Decision, Measurement
from .policy import Policy
from .policy_config import WindowRules
from .text import fmt_rate, pct
from .verdict import Verdict, confirmation, waiting_gain
from .window import Record, pooled_noise

log = logging.getLogger("feedgpu.balancer")


@dataclass(frozen=True)
class RemoteConfig(WindowRules):
    """The remote policy's bounds; the window knobs come from :class:`~.policy_config.WindowRules`,
    with the defaults below.

    Args:
        max_remote: remote workers at most (``executor.max_remote_workers``; default 4).
        min_remote: remote workers at least (0).
        wait_threshold: the loop waits above this share of its time (0.03, as the local policy).
        settle_windows: windows skipped after a remote change (1: actors start, queues refill).
        measure_windows: windows averaged to judge a step (2).
        release_windows: windows in a row without waiting before a release is tried (2).
        base_windows: windows at the current setting averaged for the rate a step is compared
            with, at most (3).
        start_windows: windows a new remote worker may take to start before it is given back
            (20; ours: an actor's process takes seconds to start on a busy machine, windows are
            >= 1 s).
        recheck_windows: windows after which an add found not worth it is tried again (60).
        drift_threshold: demand falling by more than this re-opens a release (0.15).
    """

    max_remote: int = 4
    min_remote: int = 0
    release_windows: int = 2
    base_windows: int = 3
    start_windows: int = 20
    recheck_windows: int = 60

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.min_remote <= self.max_remote:
            raise ConfigError(f"RemoteConfig: need 0 <= min_remote <= max_remote, got {self.min_remote}, "
                              f"{self.max_remote}")
        if min(self.release_windows, self.start_windows, self.recheck_windows) < 1:
            raise ConfigError("RemoteConfig: need release_windows, start_windows, recheck_windows >= 1")


@dataclass(frozen=True)
class _Step:
    src: int
    dst: int
    kind: str          # "add" or "remove"
    base: Record       # the windows at src before the step
    base_demand: float  # their mean demand, inf when unknown
    phase: str = "dst"           # "dst": measuring the new count; "src": the old one afresh (A-B-A)
    at_dst: Record | None = None  # while phase is "src": what the new count measured


class RemotePolicy:
    """Decides the remote worker count; see the module doc for the rules.

    ``decide(m, local)`` takes the window's :class:`Measurement` (with ``remote_workers``) and
    the local :class:`Policy`, and returns the :class:`Decision` for the next window: a local
    one (with ``remote_workers`` unchanged) or a remote step (``"remote-add"``,
    ``"remote-remove"``, or ``"revert"`` of one; local workers and prefetch unchanged)."""

    def __init__(self, config: RemoteConfig | None = None):
        self.config = config or RemoteConfig()
        self._step: _Step | None = None
        self._judging: list[Measurement] = []
        self._recent: list[Measurement] = []
        self._settle = 0
        self._calm = 0
        self._no_add: dict[int, str] = {}
        self._no_remove: dict[int, tuple[str, float]] = {}   # count -> (why, demand then)
        self._starting = 0        # windows waited for an added worker to start
        self._since_no_add = 0    # windows since the last add found not worth it
        self.steps = 0

    def decide(self, m: Measurement, local: Policy) -> Decision:
        c = self.config
        r = m.remote_workers
        self._reopen(m)
        if r > c.max_remote:
            return self._change(m, local, r, c.max_remote, "remote-remove",
                                f"{r} remote workers exceed max_remote_workers={c.max_remote}", judge=False)
        started = r if m.remote_started is None else m.remote_started
        if started < r:
            self._starting += 1
            if self._starting <= c.start_windows:
                return self._same(m, "settle", f"waiting for Ray to start remote worker(s): {started} of {r} "
                                               f"running ({self._starting}/{c.start_windows} windows)")
            why = f"Ray did not start a remote worker within {c.start_windows} windows (no free CPU on the cluster?)"
            s, self._step = self._step, None
            if s is not None and s.kind == "add":
                self._no_add[s.src] = why
                self._since_no_add = 0
                return self._revert(m, s, f"undone: {s.src} -> {s.dst} remote workers: {why}")
            return self._change(m, local, r, started, "remote-remove", why, judge=False)
        self._starting = 0
        if self._settle > 0:
            self._settle -= 1
            return self._same(m, "settle", f"letting {r} remote worker(s) settle")
        if self._step is not None:
            return self._judge(m, local)
        self._recent = (self._recent + [m])[-c.base_windows:]
        waiting = m.wait_fraction > c.wait_threshold
        self._calm = 0 if waiting else self._calm + 1
        if not waiting and r > c.min_remote and r not in self._no_remove and self._calm >= c.release_windows:
            return self._change(m, local, r, r - 1, "remote-remove",
                                f"the training loop has not waited for {self._calm} windows "
                                f"({pct(m.wait_fraction)}); releasing a remote worker")
        d = local.decide(m)
        if d.changes:   # the windows before a local change are not the base of a remote step
            self._recent = []
            return replace(d, remote_workers=r)
        if waiting and d.kind == "hold" and r < c.max_remote:
            if r in self._no_add:
                return replace(d, reason=f"{d.reason}; a remote worker more is not worth it ({self._no_add[r]})",
                               remote_workers=r)
            return self._change(m, local, r, r + 1, "remote-add",
                                f"the training loop waits {pct(m.wait_fraction)} and the local pool cannot "
                                f"grow ({d.reason}); adding a remote worker")
        return replace(d, remote_workers=r)

    def _reopen(self, m: Measurement) -> None:
        """Forget steps found not worth it once conditions changed (rule 4)."""
        c = self.config
        if self._no_add:
            self._since_no_add += 1
            if m.wait_fraction <= c.wait_threshold or self._since_no_add >= c.recheck_windows:
                self._no_add.clear()
        demand = m.demand_rate
        if self._no_remove and m.wait_fraction <= c.wait_threshold and demand is not None and demand < float("inf"):
            for k, (_, then) in list(self._no_remove.items()):
                if demand < (1 - c.drift_threshold) * then:
                    del self._no_remove[k]

    # -- steps ----------------------------------------------------------------------------------
    def _change(self, m: Measurement, local: Policy, src: int, dst: int, kind: str, reason: str,
                judge: bool = True) -> Decision:
        if judge:   # the windows before the step are its base
            ms = self._recent or [m]
            demand = [x.demand_rate for x in ms if x.demand_rate is not None]
            self._step = _Step(src, dst, kind.split("-")[1], _record(ms),
                               sum(demand) / len(demand) if demand else float("inf"))
        else:
            self._step = None
        self._judging, self._recent, self._calm, self._starting = [], [], 0, 0
        self._settle = self.config.settle_windows
        self.steps += 1
        d = Decision(m.workers, m.prefetch, kind, f"{reason}: {src} -> {dst}", t=m.t, engine=m.engine,
                     remote_workers=dst)
        log.info("t=%.1f %s -> %d remote workers: %s", m.t, kind, dst, d.reason)
        return d

    def _same(self, m: Measurement, kind: str, reason: str) -> Decision:
        return Decision(m.workers, m.prefetch, kind, reason, t=m.t, engine=m.engine, remote_workers=m.remote_workers)

    def _judge(self, m: Measurement, local: Policy) -> Decision:
        c = self.config
        s = self._step
        self._judging.append(m)
        if len(self._judging) < c.measure_windows:
            return self._same(m, "measure", f"measuring {m.remote_workers} remote worker(s) "
                                            f"({len(self._judging)}/{c.measure_windows} windows)")
        judged = _record(self._judging)
        self._step, self._judging = None, []
        if s.kind == "add":
            return self._judge_add(m, local, s, judged)
        local.forget()   # its records were measured with another remote count
        rate, wait = judged.rate, judged.wait
        gain = rate / s.base.rate - 1 if s.base.rate > 0 else float("inf")
        got = (f"{s.src} -> {s.dst} remote workers: {fmt_rate(s.base.rate)} -> {fmt_rate(rate)} "
               f"({gain:+.1%}), wait {pct(s.base.wait)} -> {pct(wait)}")
        if wait <= c.wait_threshold:
            return self._same(m, "hold", f"kept: {got}; the loop still does not wait")
        self._no_remove[s.src] = (got, s.base_demand)
        return self._revert(m, s, f"undone: {got}; the loop waits again")

    def _judge_add(self, m: Measurement, local: Policy, s: _Step, judged: Record) -> Decision:
        """An add measured at ``s.dst`` (phase "dst", ``judged``) or its old count measured afresh
        (phase "src", ``judged``): keep, undo, or confirm first (rule 1)."""
        c, lc = self.config, local.config
        src, dst = (s.base, judged) if s.phase == "dst" else (judged, s.at_dst)
        local.forget()   # its records were measured with another remote count
        gain = dst.rate / src.rate - 1 if src.rate > 0 else math.inf
        got = (f"{s.src} -> {s.dst} remote workers: {fmt_rate(src.rate)} -> {fmt_rate(dst.rate)} "
               f"({gain:+.1%}), wait {pct(src.wait)} -> {pct(dst.wait)}")
        se = pooled_noise([src, judged], lc.noise_prior, lc.noise_floor) * math.sqrt(1 / src.n + 1 / dst.n)
        cap, cap_se = waiting_gain(src, dst)
        if cap < gain and cap_se < se:   # a worker more only shortens the wait (verdict.waiting_gain)
            gain = cap
            got += f"; the shorter wait explains at most {cap:+.1%}"
        need = lc.add_threshold(m.workers + s.src)
        ok = gain > need or (gain > lc.loss_threshold and dst.wait <= c.wait_threshold)
        if s.phase == "src":
            got += f" ({s.src} measured afresh after the add; before it {fmt_rate(s.base.rate)})"
        if ok and s.phase == "dst":
            # a gain a drift could explain is confirmed as the local policy's is: the old count
            # measured afresh (A-B-A)
            why = confirmation(lc, Verdict(True, gain - lc.tolerance, se, got), "remote add")
            if why is not None:
                self._step = replace(s, phase="src", at_dst=judged)
                self._settle = c.settle_windows
                self._recent = []
                self.steps += 1
                why += f": measuring {s.src} remote workers afresh before deciding"
                log.info("t=%.1f revert -> %d remote workers: %s", m.t, s.src, why)
                return Decision(m.workers, m.prefetch, "revert", why, t=m.t, engine=m.engine, remote_workers=s.src)
        if ok:
            if s.phase == "dst":
                return self._same(m, "hold", f"kept: {got}")
            self._settle, self._recent, self.steps = c.settle_windows, [], self.steps + 1
            log.info("t=%.1f remote-add -> %d remote workers: kept: %s", m.t, s.dst, got)
            return Decision(m.workers, m.prefetch, "remote-add", f"kept: {got}", t=m.t, engine=m.engine,
                            remote_workers=s.dst)
        self._no_add[s.src] = f"{got}, needed more than {pct(need)}"
        self._since_no_add = 0
        if s.phase == "src":   # already back at the old count
            return self._same(m, "hold", f"undone: {got}, needed more than {pct(need)}")
        return self._revert(m, s, f"undone: {got}, needed more than {pct(need)}")

    def _revert(self, m: Measurement, s: _Step, reason: str) -> Decision:
        self._settle = self.config.settle_windows
        self._recent = []
        self.steps += 1
        log.info("t=%.1f revert -> %d remote workers: %s", m.t, s.src, reason)
        return Decision(m.workers, m.prefetch, "revert", reason, t=m.t, engine=m.engine, remote_workers=s.src)

    def stats(self) -> dict:
        """``{steps, judging, not_worth_adding, not_worth_releasing}``: remote steps taken
        (reverts included), the step being judged (``phase`` ``"src"``: the old count measured
        afresh), and the counts found not worth a step, with why."""
        s = self._step
        return {"steps": self.steps,
                "judging": None if s is None else {"kind": s.kind, "from": s.src, "to": s.dst, "phase": s.phase},
                "not_worth_adding": dict(self._no_add),
                "not_worth_releasing": {k: why for k, (why, _) in self._no_remove.items()}}


def _record(ms: list[Measurement]) -> Record:
    """The windows ``ms`` as a :class:`~feedgpu.balancer.Record` (means and spread)."""
    r = Record()
    for x in ms:
        r.add(x)
    return r
