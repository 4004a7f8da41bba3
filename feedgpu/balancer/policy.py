"""The balancer's policy: find the setting at which the training loop trains fastest.

The objective is the training loop's throughput: samples consumed per second, measured where
the loop asks for batches (:attr:`Measurement.delivered_rate`). Of settings within
``tolerance`` of the best, the one with the fewest workers and then the shallowest prefetch
wins (the loader's CPU and memory are the tie-breaker). Nothing models what will be faster:
the policy tries a neighbouring setting, one step at a time, and keeps it only when the
measured throughput says so.

Rules, applied to each window (:meth:`Policy.decide`):

1. Hard limits first: ``max_workers`` (the cores, or the user's ``max_local_workers``) and the
   memory budget (per-worker memory from the measurements). A pool above a limit shrinks to it
   at once. The CPU the training loop or other processes use is *not* a limit: whether a
   worker more trains faster on busy cores is measured, not assumed.
2. The window after a change is not judged (``settle_windows``), nor, after a change that grows
   the pool, the next ``start_windows``: a new worker starts cold and its first batch holds up
   the in-order hand-off, so the loop trains below the old setting for about a second.
3. An experiment moves to a neighbour: while the loop waits for batches (more than
   ``wait_threshold`` of its step time), one worker more or one batch of prefetch more
   (prefetch first when the workers are idle part of the time); in any case one worker less,
   unless it cannot train within ``tolerance``: ``w`` workers using ``cores`` (at most one
   each) deliver ``rate``, so ``w - 1`` could deliver at most ``(w - 1) * rate / cores`` (a
   worker process or DALI thread runs on one core at a time: a bound, not a model of the
   speed, whether the loop waits or not); one batch of prefetch less only while memory is short (a shallower prefetch saves memory,
   not CPU). A worker step refused at one prefetch depth is not tried at another. A costlier
   neighbour is kept when it trains more than ``tolerance`` faster than where it came from, and
   its shorter wait for batches explains that much (the loader cannot make the loop's own work
   faster); a cheaper one when it trains within
   ``tolerance`` of the best setting measured (so the two verdicts never both hold: no
   oscillation). An experiment not kept is undone and not tried again; the reverse of a kept
   one is not tried either.
4. A verdict is reached once the deciding difference is ``confidence`` standard errors from
   its threshold (the noise of a window is estimated from the windows themselves) after at
   least ``measure_windows`` windows; a close call is measured again, up to
   ``max_measure_windows`` at the new setting, then at the old one, then judged on the means.
   A costlier step is confirmed (A-B-A) unless it gains more than a drift must move
   (``drift_threshold``, or ``drift_confidence`` standard errors of the ratio when the windows
   are noisier): the old setting is measured afresh after it and the step kept only if it still
   trains more than ``tolerance`` faster than that (windows are correlated in time: a run warms
   up, the machine's speed drifts, and a gain a drift could explain may be when the step was
   measured, not the step). Any step judged against a record starting with the windows of a
   drift, and a cheaper one against the run's first windows (``confirm_first``), that would be
   kept or is a close call, is confirmed the same way (a warming-up run trains slower, and the
   windows that showed a drift were chosen for lying on one side: either sets the bar low; a
   costlier step's gain from the first windows is confirmed as above, when a drift could
   explain it).
   A cheaper step still a close call then, while the loop waits more than ``wait_threshold``
   more of its step time at it, must also train within ``tolerance`` of where it came from
   (the loop stalling on data there is the evidence the rates could not give). A kept step is
   judged again as its windows add up: a cheaper one is undone once it clearly misses the bar; a
   cheaper one still a close call after ``2 * max_measure_windows`` windows while the loop waits
   more than ``wait_threshold`` longer there, and a costlier one that after
   ``second_look_windows`` windows does not clearly train faster, have the old setting measured
   afresh once more, and are kept or undone on that.
   A step that is clearly worse is undone sooner: a cheaper one whose settle window alone
   already misses the bar by that many standard errors (the batches in flight make a settle
   window look better than the cheaper setting will be), any step whose first measured
   window does. A step is never *kept* on fewer than ``measure_windows`` windows.
5. With no neighbour left to try, the policy holds (settled). When the rate, or the loop's
   demand, at an unchanged setting moves by more than ``drift_threshold`` in each of
   ``drift_windows`` windows, all in one direction, and their mean stands ``drift_confidence``
   standard errors out of that quantity's window noise (tested at every window, against the
   record as it was before them; another process took cores, the model changed),
   the records are forgotten and the experiments start again from there, except that a step
   refused by a wider margin than the move stays refused (a move that size cannot have made
   it good), and the first step tried is back to where a kept cheaper step, still judged
   again, came from. A settled policy also starts again after ``recheck_windows`` windows,
   the interval doubling up to ``recheck_max_windows``.

Every decision carries its reason in plain words and is logged on the ``feedgpu.balancer``
logger (INFO for changes, DEBUG for holds); :meth:`Policy.stats` is what ``loader.stats()``
shows under ``"balancer"``, with each experiment: what was tried, what it measured, whether
it was kept and why.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace

from .diagnosis import Diagnosis, diagnose
from .limits import memory_tight, pool_limit
from .measurement import Decision, Measurement, setting
from .neighbours import candidates, worker_step_refused
from .policy_config import PolicyConfig
from .second_look import AGAIN, DONE, WATCH, again_why, rejudge, settle_miss
from .text import fmt_rate, pct
from .verdict import COSTLIER as _COSTLIER
from .trial import DRIFT_WINDOWS, FIRST_WINDOWS, Refusal, Trial, decision_kind
from .verdict import Verdict, cheaper_confirmation, confirmation, experiment, verdict
from .window import Record, drift_of, pooled_noise

log = logging.getLogger("feedgpu.balancer")

Key = tuple  # (workers, prefetch)


class Policy:
    """Finds the worker count and prefetch depth at which the training loop trains fastest;
    see the module doc for the rules. Deterministic: the same measurements give the same
    decisions (no clock, no randomness)."""

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self._history: deque[Decision] = deque(maxlen=self.config.history)
        self._experiments: deque[dict] = deque(maxlen=self.config.history)
        self._decisions = self._changes = self._forgotten = 0
        self._key: Key | None = None
        self._settle = self.config.settle_windows
        self._recheck_every = self.config.recheck_windows
        self._held = 0
        self._pending: dict | None = None
        self._tight = False
        self._forget_state()

    # -- public ---------------------------------------------------------------------------------
    def decide(self, m: Measurement) -> Decision:
        """The setting for the next window, given the window ``m`` just measured."""
        d = self._decide(m)
        if self._pending is not None and d.experiment is None:
            d = replace(d, experiment=self._pending)
        self._pending = None
        self._decisions += 1
        if d.changes:
            self._changes += 1
            grew = self._key is not None and d.workers > self._key[0]
            self._key = (d.workers, d.prefetch)
            self._revisit = None
            self._settle = self.config.settle_windows + (self.config.start_windows if grew else 0)
            self._recent.clear()
        self._history.append(d)
        log.log(logging.INFO if d.changes else logging.DEBUG, "t=%.1f %s -> %d workers, prefetch %d: %s",
                d.t, d.kind, d.workers, d.prefetch, d.reason)
        return d

    def forget(self, keep_beyond: float | None = None) -> int:
        """Forget every record and verdict (the next windows experiment again from the current
        setting). With ``keep_beyond`` (a relative change of the rate, e.g. 0.2), a step refused
        by a margin larger than that stays refused: a move of the rate that size cannot have
        turned it into a good one. Returns how many refusals were kept."""
        kept = {} if keep_beyond is None else {k: r for k, r in self._refused.items() if r.margin > keep_beyond}
        watch = self._watch if (self._watch is not None and self._watch.dst == self._key
                                and self._watch.kind not in _COSTLIER) else None
        self._forget_state()
        if watch is not None:   # the kept cheaper step's second look: its reverse is tried first
            self._revisit = watch
            kept.pop((watch.dst, watch.src), None)
        for k, r in kept.items():
            self._refuse(k, f"{r.why}; refused before the records were forgotten", r.margin)
        self._recheck_every = self.config.recheck_windows
        self._forgotten += 1
        return len(kept)

    @property
    def history(self) -> tuple[Decision, ...]:
        """The last ``config.history`` decisions, oldest first."""
        return tuple(self._history)

    @property
    def experiments(self) -> tuple[dict, ...]:
        """The concluded experiments, oldest first (see :meth:`stats`)."""
        return tuple(self._experiments)

    def stats(self) -> dict:
        """For ``loader.stats()["balancer"]``.

        Returns a dict: ``workers``, ``prefetch`` (the current setting), ``settled`` (no
        experiment left to try), ``decisions``, ``changes``, ``resets`` (records forgotten),
        ``noise`` (relative noise of one window's rate), ``rates`` (mean samples/s trained at
        each setting measured, ``"<workers>w/p<prefetch>"``), ``waiting`` (mean share of step
        time spent waiting for a batch, same keys), ``demand_rate`` (samples/s the loop would
        take at the current setting if it never waited), ``experiments`` (the last 20, each
        with ``text``: in plain words what was tried, measured, and why it was kept or
        undone), ``summary`` (one sentence), ``trying`` (the setting on trial, in words, or None
        when no step awaits its verdict) and ``last`` (the last 20 decisions as dicts).
        """
        w, p = self._key if self._key is not None else (None, None)
        rec = self._records.get(self._key) if self._key is not None else None
        return {
            "workers": w, "prefetch": p, "settled": self._settled, "decisions": self._decisions,
            "changes": self._changes, "resets": self._forgotten, "noise": round(self._noise(), 4),
            "rates": {f"{k[0]}w/p{k[1]}": round(r.rate, 1) for k, r in sorted(self._records.items())},
            "waiting": {f"{k[0]}w/p{k[1]}": round(r.wait, 4) for k, r in sorted(self._records.items())},
            "demand_rate": rec.demand if rec is not None and rec.demand_n else None,
            "experiments": list(self._experiments)[-20:],
            "summary": self._summary(), "trying": self._setting(self._trial.dst) if self._trial is not None else None,
            "last": [d.as_dict() for d in list(self._history)[-20:]],
        }

    def diagnose(self, m: Measurement) -> Diagnosis:
        """:func:`diagnose` of ``m`` with this policy's wait threshold."""
        return diagnose([m], wait_threshold=self.config.wait_threshold)

    # -- state ----------------------------------------------------------------------------------
    def _forget_state(self) -> None:
        self._records: dict[Key, Record] = {}
        self._refused: dict[tuple[Key, Key], Refusal] = {}   # (from, to) -> why the step is not taken
        self._recent: deque[Measurement] = deque(maxlen=self.config.drift_windows)
        self._trial: Trial | None = None
        self._watch: Trial | None = None   # a kept cheaper step, judged again as its windows add up
        # (setting, what in words) while that setting's record starts with windows unlike the rest
        self._marked: tuple[Key, str] | None = None
        self._revisit: Trial | None = None  # a watched cheaper step whose records were forgotten
        self._settled = False
        self._held = 0

    def _refuse(self, step: tuple[Key, Key], why: str, margin: float) -> None:
        """Refuse ``step`` (from, to) because ``why``; ``margin``: by how much, as a relative
        rate (what :meth:`forget` compares with the size of a drift)."""
        self._refused[step] = Refusal(why, abs(margin))

    def _fresh(self, key: Key) -> None:
        """Start ``key``'s record afresh (it no longer starts with the windows ``_marked`` names)."""
        self._records[key] = Record()
        if self._marked is not None and self._marked[0] == key:
            self._marked = None

    def _noise(self) -> float:
        c = self.config
        return pooled_noise(self._records.values(), c.noise_prior, c.noise_floor)

    def _summary(self) -> str:
        if self._key is None:
            return "no window measured yet"
        r = self._records.get(self._key)
        s = (f"{self._setting(self._key)}: the loop trains {fmt_rate(r.rate)} and waits {pct(r.wait)} of its step "
             f"time ({r.n} windows)" if r is not None else f"{self._setting(self._key)}: no window measured there yet")
        kept = sum(e["kept"] for e in self._experiments)
        s += f"; {len(self._experiments)} experiments, {kept} kept"
        if self._trial is not None:
            s += f"; trying {self._setting(self._trial.dst)} against {self._setting(self._trial.src)}"
        elif self._settled:
            s += "; settled"
        return s

    def _setting(self, key: Key) -> str:
        return setting(key, self.config.unit)

    def _decision(self, m: Measurement, key: Key, kind: str, reason: str, experiment: dict | None = None,
                  tentative: bool = False) -> Decision:
        w, p = key
        dali = m.engine.startswith("dali")
        return Decision(w, p, kind, reason, t=m.t, engine=m.engine, dali_threads=w if dali else None,
                        hw_decoder_load=m.hw_decoder_load, remote_workers=m.remote_workers, experiment=experiment,
                        tentative=tentative)

    # -- one window -----------------------------------------------------------------------------
    def _decide(self, m: Measurement) -> Decision:
        c = self.config
        notes: list[str] = []
        key = (m.workers, m.prefetch)
        if self._key is None:   # the run's first record: the run warms up
            self._key = key
            if self.config.confirm_first:
                self._marked = (key, FIRST_WINDOWS)
        elif key != self._key:
            notes.append(f"the loader runs {self._setting(key)}, not the {self._setting(self._key)} decided; "
                         "going on from there")
            self._key, self._trial, self._settle = key, None, 0
            self._recent.clear()
        w, p = key
        limit, why = pool_limit(c, self._records, m)
        self._tight = memory_tight(m, limit, c.max_workers)
        if w > limit:
            self._trial = None
            return self._decision(m, (limit, p), "remove", f"{w} {c.unit} exceed {why}: down to {limit}")
        if self._settle > 0:
            self._settle -= 1
            early = self._early_undo(m, key, notes)
            if early is not None:
                return early
            return self._decision(m, key, "settle", "; ".join(notes + [f"letting {self._setting(key)} settle"]))
        rec = self._records.get(key)
        earlier: list[Measurement] = []   # windows before m that belong to a fresh record
        if self._trial is None and rec is not None and rec.n >= c.base_windows:
            self._recent.append(m)
            moved = drift_of(self._recent, self._records, key, c)
            if moved is not None:
                why, size = moved
                earlier = list(self._recent)[:-1]   # the windows that showed the drift are the new record's first
                kept = self.forget(keep_beyond=size)
                self._marked = (key, DRIFT_WINDOWS)
                notes.append(f"at unchanged {self._setting(key)} {why} over {len(earlier) + 1} windows; "
                             "records forgotten"
                             + (f" but {kept} refused step(s), each refused by more than the {size:.0%} move"
                                if kept else ""))
                rec = None
        else:
            self._recent.clear()
        if rec is None:
            rec = self._records[key] = Record()
            for x in earlier:
                rec.add(x)
        rec.add(m)
        if self._trial is not None:
            d = self._judge(m, rec, notes)
            if d is not None:
                return d
        elif self._watch is not None:
            d = self._rejudge(m, rec, notes)
            if d is not None:
                return d
        return self._next(m, notes, limit, why)

    def _rejudge(self, m: Measurement, rec: Record, notes: list[str]) -> Decision | None:
        """Judge the last kept step again as the windows at it add up, over up to
        ``recheck_windows`` of them (rule 4; :func:`.second_look.rejudge`): undone, or its old
        setting measured afresh once more."""
        c, t = self.config, self._watch
        src = self._records.get(t.src)
        if self._key != t.dst or src is None or src.n == 0 or rec.n > c.recheck_windows:
            self._watch = None
            return None
        v = self._verdict(t.src, t.dst, t.kind)
        look = rejudge(c, t.kind, src, rec, v)
        if look == WATCH:
            return None
        self._watch = None
        if look == DONE:
            return None
        if look == AGAIN:
            self._trial = replace(t, phase="src", before=src, looked=True)
            self._fresh(t.src)
            return self._decision(m, t.src, "revert", "; ".join(notes + [
                f"the {t.kind} from {self._setting(t.src)} to {self._setting(t.dst)} kept before "
                f"{again_why(t.kind, rec.n, v)}: measuring {self._setting(t.src)} afresh once more"]))
        why = v.why + f" over {rec.n} windows, kept on fewer"
        self._refused.pop((t.dst, t.src), None)
        self._refuse((t.src, t.dst), why, v.margin)
        return self._undo(m, t, notes, why, " kept before")

    def _early_undo(self, m: Measurement, key: Key, notes: list[str]) -> Decision | None:
        """Undo a cheaper step from its settle window when that window alone is already clearly
        below the bar (rule 4; :func:`.second_look.settle_miss`)."""
        t = self._trial
        if t is None or t.phase != "dst" or key != t.dst or t.kind not in ("remove", "prefetch-down"):
            return None
        miss = settle_miss(self.config, self._records, t.src, m.delivered_rate, self._noise(), self._setting)
        if miss is None:
            return None
        rec = self._records[key] = Record()
        rec.add(m)
        self._trial = None
        self._refuse((t.src, t.dst), miss.why, miss.margin)
        return self._undo(m, t, notes, miss.why)

    def _undo(self, m: Measurement, t: Trial, notes: list[str], why: str, what: str = "") -> Decision:
        """Back to ``t.src``: the step ``t`` (``what``, e.g. " kept before") is undone because ``why``."""
        exp = self._experiment(m, t, False, why)
        step = f"{t.kind} from {self._setting(t.src)} to {self._setting(t.dst)}"
        return self._decision(m, t.src, "revert", "; ".join(notes + [f"undid the {step}{what}: {why}"]), exp)

    def _judge(self, m: Measurement, rec: Record, notes: list[str]) -> Decision | None:
        """Judge the experiment once enough windows are in (rule 4). Returns the decision, or
        None to go on from the current setting."""
        c = self.config
        t = self._trial
        key = self._key
        v = self._verdict(t.src, t.dst, t.kind)
        ok, margin, se, verdict = v.ok, v.margin, v.se, v.why
        close = abs(margin) < c.confidence * se
        if rec.n < c.measure_windows and (ok or close or t.phase != "dst"):
            return self._decision(m, key, "measure", f"measuring {self._setting(key)} ({rec.n} of {c.measure_windows} "
                                                     "windows)")
        step = f"{t.kind} from {self._setting(t.src)} to {self._setting(t.dst)}"
        if rec.n < c.measure_windows:
            verdict += f", clear after {rec.n} window{'s' if rec.n > 1 else ''}"
        if close and rec.n < c.max_measure_windows:
            return self._decision(m, key, "measure", f"close call on the {step}, measuring again ({verdict}; "
                                                     f"{pct(abs(margin))} from the threshold, noise needs "
                                                     f"{pct(c.confidence * se)})")
        costlier = t.kind in _COSTLIER
        why = None
        if t.phase == "dst":
            confirm = confirmation if costlier else cheaper_confirmation
            why = confirm(c, Verdict(ok, margin, se, verdict), step, t.confirm)
        if why is not None:
            return self._measure_src_afresh(m, t, notes, why)
        if close and t.phase == "dst" and not costlier and self._records[t.src].n < c.max_measure_windows:
            self._trial = replace(t, phase="src")
            return self._decision(m, t.src, "revert", "; ".join(notes + [
                f"close call on the {step} ({verdict}): measuring {self._setting(t.src)} again before deciding"]))
        self._trial = None
        if t.before is not None:
            verdict += (f" ({self._setting(t.src)} measured again after the step; before it "
                        f"{fmt_rate(t.before.rate)} over {t.before.n} windows)")
        exp = self._experiment(m, t, ok, verdict)
        if ok:
            self._refuse((t.dst, t.src), f"the opposite step was kept ({verdict})", margin)
            self._watch = None if t.looked else t
            if t.phase == "src":
                return self._decision(m, t.dst, decision_kind(t.kind), "; ".join(
                    notes + [f"measured both again, back to {self._setting(t.dst)}: kept, {verdict}"]), exp)
            notes.append(f"kept the {step}: {verdict}")
            self._pending = exp
            return None
        self._refused.pop((t.dst, t.src), None)
        self._refuse((t.src, t.dst), verdict, margin)
        if v.unexplained:
            self._records.pop(t.dst)
        if t.phase == "src":
            notes.append(f"measured both again, staying at {self._setting(t.src)}: {verdict}")
            self._pending = exp
            return None
        return self._decision(m, t.src, "revert", "; ".join(notes + [f"undid the {step}: {verdict}"]), exp)

    def _measure_src_afresh(self, m: Measurement, t: Trial, notes: list[str], why: str) -> Decision:
        """A costlier step is kept only once ``src``, measured again after it, is still slower
        (A-B-A; rule 4): the windows of one setting are correlated in time (the machine's speed
        drifts, a run warms up), so a gain a drift could explain, or a close call, may be the
        time the step was measured at, not the step. ``src`` starts a fresh record."""
        self._trial = replace(t, phase="src", before=self._records[t.src])
        self._fresh(t.src)
        return self._decision(m, t.src, "revert", "; ".join(notes + [
            f"{why}: measuring {self._setting(t.src)} afresh before deciding"]))

    def _experiment(self, m: Measurement, t: Trial, kept: bool, verdict: str) -> dict:
        e = experiment(m.t, t.kind, t.src, t.dst, self._records[t.src], self._records[t.dst], kept, verdict,
                       self._setting)
        self._experiments.append(e)
        log.info("balancer experiment: %s", e["text"])
        return e

    def _verdict(self, src: Key, dst: Key, kind: str) -> Verdict:
        """Is ``dst`` better than staying at ``src``? (kept, distance of the deciding ratio from
        its threshold, the ratio's standard error, why in words): :func:`.verdict.verdict`."""
        return verdict(self.config, self._records, src, dst, kind, self._noise(), self._setting)

    # -- the next experiment --------------------------------------------------------------------
    def _candidates(self, key: Key, rec: Record, waiting: bool, limit: int, why_limit: str
                    ) -> tuple[list[tuple[Key, str]], list[str]]:
        return candidates(self.config, key, rec, waiting, limit, why_limit, self._tight)

    def _next(self, m: Measurement, notes: list[str], limit: int, why_limit: str) -> Decision:
        c = self.config
        key = self._key
        rec = self._records[key]
        waiting = rec.wait > c.wait_threshold
        state = f"{self._setting(key)} trains {fmt_rate(rec.rate)}, waiting {pct(rec.wait)} of the step time"
        label = None
        if self._settled:
            self._held += 1
            if self._held < self._recheck_every:
                return self._hold(m, notes, state, key, waiting, limit, why_limit)
            self._recheck_every = min(2 * self._recheck_every, c.recheck_max_windows)
            self._settled, self._held = False, 0
            first = next(iter(self._candidates(key, rec, waiting, limit, why_limit)[0]), None)
            if first is not None:   # the most promising step only: the others stay refused
                self._refused.pop((key, first[0]), None)
                self._records.pop(first[0], None)
                label = "probe"
                notes.append(f"settled for a while: checking {self._setting(first[0])} again")
        cands, _ = self._candidates(key, rec, waiting, limit, why_limit)
        cands = self._revisit_first(key, cands, notes)
        for dst, kind in cands:
            if (key, dst) in self._refused or worker_step_refused(self._refused, key, dst, kind):
                continue
            r = self._records.get(dst)
            if r is not None and r.n >= c.measure_windows:
                v = self._verdict(key, dst, kind)
                if not v.ok:
                    self._refuse((key, dst), v.why, v.margin)
                    if v.unexplained:
                        self._records.pop(dst)
                    continue
                self._refuse((dst, key), f"the opposite step was taken ({v.why})", v.margin)
                self._watch = Trial(key, dst, kind, decision_kind(kind))
                return self._decision(m, dst, decision_kind(kind), "; ".join(notes + [f"{state}; measured before: "
                                                                               f"{self._setting(dst)}, {v.why}"]))
            if rec.n < c.base_windows:
                return self._decision(m, key, "measure", "; ".join(notes + [
                    f"{state}; measuring it again before trying {self._setting(dst)} ({rec.n} of {c.base_windows} "
                    "windows)"]))
            starts = self._marked[1] if self._marked is not None and self._marked[0] == key else ""
            if kind in _COSTLIER and starts == FIRST_WINDOWS:
                starts = ""   # a costlier step's gain is confirmed when a drift could explain it
            self._trial = Trial(key, dst, kind, label or decision_kind(kind), confirm=starts)
            return self._decision(m, dst, label or decision_kind(kind),
                                  "; ".join(notes + [f"{state}; trying {self._setting(dst)}"]), tentative=True)
        self._settled, self._held = True, 0
        return self._hold(m, notes, state, key, waiting, limit, why_limit)

    def _revisit_first(self, key: Key, cands: list[tuple[Key, str]], notes: list[str]) -> list[tuple[Key, str]]:
        """After a forget, the step back from a kept cheaper step still judged again goes first
        (rule 5): its records went with the drift before they could undo it."""
        t = self._revisit
        if t is None or key != t.dst:
            return cands
        back = [c for c in cands if c[0] == t.src]
        if back:
            notes.append(f"the {t.kind} to {self._setting(t.dst)} was still being judged: "
                         f"{self._setting(t.src)} first")
        return back + [c for c in cands if c[0] != t.src]

    def _hold(self, m, notes, state, key, waiting, limit, why_limit) -> Decision:
        _, blocked = self._candidates(key, self._records[key], waiting, limit, why_limit)
        tried = [f"{self._setting(b)}: {r.why}" for (a, b), r in self._refused.items() if a == key]
        return self._decision(m, key, "hold", "; ".join(notes + [f"{state}; settled"] + blocked + tried))
