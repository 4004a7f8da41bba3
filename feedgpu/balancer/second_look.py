"""The balancer policy's later looks at a step (rule 4 of :mod:`.policy`): a cheaper step
undone from its settle window, and a kept step judged again as the windows at it add up. Pure:
the records and the verdict in, what to do out."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

from .policy_config import PolicyConfig
from .text import fmt_rate, pct
from .verdict import COSTLIER, Verdict, best, is_close
from .window import Record

Key = tuple  # (workers, prefetch)

#: What the second look at a kept step decides (:func:`rejudge`).
WATCH, DONE, UNDO, AGAIN = "watch", "done", "undo", "again"


class SettleMiss(NamedTuple):
    """A cheaper step's settle window already clearly below the bar: ``why`` in words, and
    ``margin``, by how much it was refused: its loss against the best's lowered mean, minus the
    tolerance."""
    why: str
    margin: float


def settle_miss(c: PolicyConfig, records: dict[Key, Record], src: Key, rate: float, noise: float,
                name: Callable[[Key], str]) -> SettleMiss | None:
    """Is a cheaper step from ``src`` clearly below the bar on its settle window alone (``rate``,
    samples/s)? While a worker retires or the prefetch drains, the batches in flight still
    arrive, so the settle window overstates the cheaper setting's rate: a window that misses the
    bar (``c.tolerance`` below the best's lowered mean, :func:`.verdict.best`) by more than
    ``c.confidence`` standard errors (``noise``: relative noise of one window) settles it."""
    best_key, top_rec, top = best(records, src, noise, c.measure_windows)
    bar = top * (1 - c.tolerance)
    if top <= 0 or rate >= bar * (1 - c.confidence * noise * math.sqrt(1 + 1 / top_rec.n)):
        return None
    loss = 1 - rate / top
    return SettleMiss(f"{fmt_rate(rate)} while settling vs the best {fmt_rate(top)} ({name(best_key)}), "
                      f"{-loss:+.1%}: not within {pct(c.tolerance)}, already while settling", loss - c.tolerance)


def rejudge(c: PolicyConfig, kind: str, src: Record, dst: Record, v: Verdict) -> str:
    """What the second look at a step kept from ``src`` to ``dst`` decides, given the verdict
    ``v`` on the records as they are now (``dst`` adds up, the policy being there):

    * a cheaper step (``kind`` not in :data:`.verdict.COSTLIER`) is undone (:data:`UNDO`) once
      it clearly misses its bar; once ``dst`` has ``2 * c.max_measure_windows`` windows, a close
      call (either side of the bar) while the loop waits more than ``c.wait_threshold`` more of
      its step time there than at ``src`` is :data:`AGAIN` (the loop stalling on data is evidence
      the rates could not give, and ``src``'s record may hold the run's warm-up or a swing of the
      machine's speed); else :data:`WATCH`;
    * a costlier step, once ``dst`` has ``c.second_look_windows`` windows: :data:`DONE` when it
      clearly trains more than ``c.tolerance`` faster, else :data:`AGAIN`.

    :data:`AGAIN`: ``src`` is measured afresh once more and the step judged on that (a close
    call kept on the means of a few windows each, and the windows of one setting correlated in
    time). The policy looks once: a step kept again on that is not watched any more.
    """
    close = is_close(v, c.confidence)
    if kind in COSTLIER:
        if dst.n < c.second_look_windows:
            return WATCH
        return DONE if v.ok and not close else AGAIN
    if not v.ok and not close:
        return UNDO
    if dst.n < 2 * c.max_measure_windows or dst.wait - src.wait <= c.wait_threshold:
        return WATCH
    return AGAIN if close else WATCH   # a miss here is a close call: a clear one was undone above


def again_why(kind: str, windows: int, v: Verdict) -> str:
    """Why a kept step of ``kind`` is looked at again after ``windows`` windows (``v``: its
    verdict now), in words."""
    if kind in COSTLIER:
        return f"is not clearly faster over {windows} windows ({v.why})"
    return f"is a close call over {windows} windows while the loop waits longer for batches there ({v.why})"
