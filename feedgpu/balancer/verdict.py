"""The balancer policy's verdict on one step (rule 4 of :mod:`.policy`): is the setting a step
leads to better than the one it left, by how much, and how sure are the windows? Pure: the
records of the settings measured in, the verdict out."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

from .policy_config import PolicyConfig
from .text import fmt_rate, pct
from .window import Record

Key = tuple  # (workers, prefetch)
#: Steps that cost more CPU or memory than staying: kept only when they train faster.
COSTLIER = ("add", "prefetch-up")
#: Spread of one window's waiting share (of step time, absolute) assumed at a setting before its
#: own windows show it, and the pseudo-windows that assumption weighs.
WAIT_NOISE_PRIOR = 0.01
WAIT_PRIOR_DF = 2.0


class Verdict(NamedTuple):
    """``ok``: the step is better (kept); ``margin``: distance of the deciding ratio from its
    threshold (a relative rate, negative on the refused side); ``se``: that ratio's standard
    error; ``why``: in words; ``unexplained``: a costlier step refused because its waiting
    shares cannot explain the gain its rates show (:func:`waiting_gain`): the new setting's
    rate is the machine's or noise, and must not set the bar for other steps."""
    ok: bool
    margin: float
    se: float
    why: str
    unexplained: bool = False


def is_close(v: Verdict, confidence: float) -> bool:
    """The windows cannot tell the step's side of the threshold: ``|margin| < confidence * se``."""
    return abs(v.margin) < confidence * v.se


def best(records: dict[Key, Record], src: Key, noise: float, measure_windows: int) -> tuple[Key, Record, float]:
    """The best setting measured (at least ``measure_windows`` windows, or ``src``), its record,
    and its mean lowered by one standard error (``noise`` is the relative noise of one window):
    the highest of several noisy means is biased up, and a lucky window must not set the bar."""
    return max(((k, r, r.rate * (1 - noise / math.sqrt(r.n))) for k, r in records.items()
                if r.n >= measure_windows or k == src), key=lambda x: x[2])


def verdict(c: PolicyConfig, records: dict[Key, Record], src: Key, dst: Key, kind: str, noise: float,
            name: Callable[[Key], str]) -> Verdict:
    """Is ``dst`` better than staying at ``src``? A costlier step (``kind`` in :data:`COSTLIER`)
    must train more than ``c.tolerance`` faster than ``src`` on its rates, and its waiting shares
    must explain that much (:func:`waiting_gain`): when they cannot and their standard error is
    the smaller (a loop that waits almost all its step time does almost no work of its own, and
    its waiting shares then tell nothing), they decide; a cheaper one within
    ``c.tolerance`` of the best setting measured (:func:`best`). ``name`` words a setting.

    A cheaper step the windows cannot settle (a close call, :func:`is_close`) while the loop waits
    more than ``c.wait_threshold`` more of its step time at it than at ``src`` must also train
    within ``c.tolerance`` of ``src``'s mean: the lowered bar corrects the bias of picking the
    highest of settings that train alike, and the loop stalling on data at the cheaper setting
    is evidence that they do not (the loader limits it there), so the loss is measured against
    where the step came from, on equal terms."""
    a, b = records[src], records[dst]
    tol = c.tolerance
    if kind in COSTLIER:
        gain = b.rate / a.rate - 1 if a.rate > 0 else (math.inf if b.rate > 0 else 0.0)
        se = noise * math.sqrt(1 / a.n + 1 / b.n)
        why = f"{fmt_rate(b.rate)} vs {fmt_rate(a.rate)}, {gain:+.1%}"
        cap, cap_se = waiting_gain(a, b)
        unexplained = gain > tol >= cap and cap_se < se   # the rates say more; the waiting shares cannot
        if unexplained:
            why += (f", but waiting {pct(b.wait)} vs {pct(a.wait)} of the step time explains at most {cap:+.1%} "
                    "(more loader does not make the loop's own work faster: the rest is the machine or noise)")
            gain, se = cap, cap_se
        margin = gain - tol
        ok = margin > 0
        return Verdict(ok, margin, se, f"{why}: " + ("more" if ok else "not more") + f" than {pct(tol)} faster",
                       unexplained)
    best_key, top_rec, top = best(records, src, noise, c.measure_windows)
    if top <= 0:
        return Verdict(True, math.inf, 0.0, "nothing was trained at any setting")
    margin = b.rate * (1 + tol) / top - 1
    se = noise * math.sqrt(1 / b.n + 1 / top_rec.n)
    ok = margin >= 0
    loss = 1 - b.rate / top
    v = Verdict(ok, margin, se, f"{fmt_rate(b.rate)} vs the best {fmt_rate(top)} ({name(best_key)}), "
                                f"{-loss:+.1%}: " + ("within" if ok else "not within") + f" {pct(tol)}")
    if ok and is_close(v, c.confidence) and stalls_below(c, a, b):
        # refused, and still a close call (margin unchanged): the caller measures on before it decides
        v = v._replace(ok=False, why=v.why + (
            f", a close call while the loop waits {pct(b.wait)} of its step time there vs {pct(a.wait)} at "
            f"{name(src)}, and {b.rate / a.rate - 1:+.1%} vs {name(src)} ({fmt_rate(a.rate)}): "
            f"not within {pct(tol)} of it"))
    return v


def waiting_gain(a: Record, b: Record) -> tuple[float, float]:
    """The most the loop can train faster at ``b`` than at ``a`` by waiting less for batches, as
    a relative rate, and its standard error: ``(1 - b.wait) / (1 - a.wait) - 1``.

    A step's time is the loop's own work plus its wait for the next batch. A costlier loader
    setting (a worker more, a deeper prefetch) can only shorten the wait; the loop's own work
    per sample does not get shorter when the loader takes more CPU (it gets longer when they
    share cores). So a rate gain above this bound is the machine's speed or noise, not the step.
    The waiting shares' spreads are each setting's own (Welford, ``Record.wait_m2``), shrunk
    towards :data:`WAIT_NOISE_PRIOR` with :data:`WAIT_PRIOR_DF` pseudo-windows. Returns
    ``(inf, 0)`` when the loop waited all the time at ``a`` (nothing trained there)."""
    if a.wait >= 1 or a.n == 0 or b.n == 0:
        return math.inf, 0.0
    ratio = (1 - b.wait) / (1 - a.wait)

    def var(r: Record) -> float:   # variance of r's mean waiting share
        return (WAIT_PRIOR_DF * WAIT_NOISE_PRIOR ** 2 + r.wait_m2) / (WAIT_PRIOR_DF + r.n - 1) / r.n

    rel = var(a) / (1 - a.wait) ** 2 + (var(b) / (1 - b.wait) ** 2 if b.wait < 1 else 0.0)
    return ratio - 1, ratio * math.sqrt(rel)


def confirmation(c: PolicyConfig, v: Verdict, step: str, starts_with: str = "") -> str | None:
    """Why a costlier ``step`` (in words) with the verdict ``v`` is confirmed (A-B-A: where it
    came from measured afresh before it is kept), or None to judge it now. Confirmed: a close
    call (:func:`is_close`), and a step ``v`` keeps that a drift could explain: from a record that
    starts with windows the rest of the run may not train like (``starts_with`` names them:
    the run's first windows, the windows of a drift; "" for none), or gaining less than a drift
    must move, ``c.drift_threshold`` or ``c.drift_confidence`` standard errors of the ratio
    (``v.se``), whichever is more (at the noise of a real training loop's windows, a gain far
    above ``c.drift_threshold`` is one standard error or two)."""
    if is_close(v, c.confidence):
        return f"close call on the {step} ({v.why})"
    if not v.ok:
        return None
    looks = f"the {step} looks faster ({v.why})"
    if starts_with:
        return f"{looks}, against {starts_with}"
    gain, bar = v.margin + c.tolerance, max(c.drift_threshold, c.drift_confidence * v.se)
    if gain < bar:
        return (f"{looks}, by less than the {pct(bar)} a drift must move"
                + ("" if bar == c.drift_threshold else f" at this noise ({c.drift_confidence:g} standard errors)"))
    return None


def cheaper_confirmation(c: PolicyConfig, v: Verdict, step: str, starts_with: str) -> str | None:
    """Why a cheaper ``step`` (in words) that ``v`` keeps, or cannot settle yet, is confirmed
    (A-B-A: where it came from measured afresh before it is judged), or None to judge it as
    usual: only when the record it is judged against starts with windows the rest of the run
    may not train like (``starts_with``, as for :func:`confirmation`). A run's first windows
    train slower while it warms up, and the windows that showed a drift were chosen for lying
    on one side of the old mean, so a record that starts with them sets the bar low, and a
    cheaper step then looks as fast on windows that are not."""
    if not starts_with or not (v.ok or is_close(v, c.confidence)):
        return None
    looks = "looks within the tolerance" if v.ok else "is a close call"
    return f"the {step} {looks} ({v.why}), against {starts_with}"


def stalls_below(c: PolicyConfig, a: Record, b: Record) -> bool:
    """At ``b`` (a cheaper setting than ``a``) the loop waits more than ``c.wait_threshold``
    more of its step time for batches, and its mean trains more than ``c.tolerance`` below
    ``a``'s."""
    return b.wait - a.wait > c.wait_threshold and a.rate > 0 and b.rate < a.rate * (1 - c.tolerance)


def experiment(t: float, kind: str, src: Key, dst: Key, a: Record, b: Record, kept: bool, why: str,
               name: Callable[[Key], str]) -> dict:
    """One concluded experiment as :meth:`.Policy.stats` lists it: ``t`` (s), ``kind``,
    ``from``/``to`` (``"<workers>w/p<prefetch>"``), ``rate_from``/``rate_to`` (samples/s
    trained), ``change`` (relative), ``wait_from``/``wait_to`` (share of step time),
    ``windows`` ([at src, at dst]), ``kept``, ``why`` and ``text`` (all of it in words).
    ``a``, ``b``: the records of ``src`` and ``dst``."""
    change = b.rate / a.rate - 1 if a.rate > 0 else math.inf
    text = (f"tried {name(dst)} ({kind}) against {name(src)}: the loop trained "
            f"{fmt_rate(b.rate)} vs {fmt_rate(a.rate)} ({change:+.1%}) over {b.n} and {a.n} windows, "
            f"waiting {pct(b.wait)} vs {pct(a.wait)} of its step time; "
            + ("kept" if kept else "undone") + f": {why}")
    return {"t": t, "kind": kind, "from": f"{src[0]}w/p{src[1]}", "to": f"{dst[0]}w/p{dst[1]}",
            "rate_from": round(a.rate, 1), "rate_to": round(b.rate, 1), "change": round(change, 4),
            "wait_from": round(a.wait, 4), "wait_to": round(b.wait, 4), "windows": [a.n, b.n],
            "kept": kept, "why": why, "text": text}
