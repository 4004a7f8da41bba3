"""What the balancer policy holds about a step while it runs (:class:`Trial`) and about a step
it will not take (:class:`Refusal`). Plain data: :mod:`.policy` applies the rules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .window import Record

Key = tuple  # (workers, prefetch)

#: What a record may start with that the rest of the run may not train like (``Trial.confirm``).
FIRST_WINDOWS = "the run's first windows"
DRIFT_WINDOWS = "the windows of a drift"


@dataclass(frozen=True)
class Trial:
    """An experiment in progress: the step from ``src`` to ``dst`` (each ``(workers, prefetch)``).

    Attributes:
        kind: ``"add"``, ``"remove"``, ``"prefetch-up"`` or ``"prefetch-down"``.
        label: the decision kind that started it (``"add"``, ``"remove"``, ``"prefetch"``,
            ``"probe"``).
        phase: ``"dst"`` while the new setting is measured, ``"src"`` while the old one is
            measured again.
        before: ``src``'s record before the step, while ``src`` is measured afresh (A-B-A).
        confirm: what ``src``'s record starts with, in words (:data:`FIRST_WINDOWS` for a
            cheaper step, :data:`DRIFT_WINDOWS` for any), or ``""``: a step judged against such
            a record is confirmed.
        looked: the second look at a kept costlier step (``src`` measured afresh once more).
    """
    src: Key
    dst: Key
    kind: str
    label: str
    phase: str = "dst"
    before: Record | None = None
    confirm: str = ""
    looked: bool = False


class Refusal(NamedTuple):
    """A step not taken: ``why`` in words, and ``margin``, by how much it missed its bar as a
    relative rate (what a drift is compared with)."""
    why: str
    margin: float


def decision_kind(kind: str) -> str:
    """The :class:`~.measurement.Decision` kind that takes a step of ``kind``."""
    return "prefetch" if kind.startswith("prefetch") else kind
