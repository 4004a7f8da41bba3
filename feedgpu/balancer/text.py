"""The balancer's numbers in words, for its decisions' reasons and its log lines.

Rates are samples per second, fractions in [0, 1], memory in bytes (see :mod:`.measurement`).
"""
from __future__ import annotations

import math

__all__ = ["fmt_rate", "gib", "pct", "round_half_up"]


def round_half_up(x: float) -> int:
    """Half up (Python's ``round`` sends 4.5 to 4)."""
    return math.floor(x + 0.5)


def fmt_rate(x: float | None) -> str:
    """A rate in samples per second: ``"1,234/s"``, ``"unlimited"`` (infinite) or ``"unknown"`` (None)."""
    if x is None:
        return "unknown"
    return "unlimited" if math.isinf(x) else f"{x:,.0f}/s"


def pct(x: float) -> str:
    """A fraction in [0, 1] as a percentage with one decimal: ``"12.5 %"``."""
    return f"{100 * x:.1f} %"


def gib(x: float) -> str:
    """Bytes in GiB with two decimals: ``"1.50 GiB"``."""
    return f"{x / 2**30:.2f} GiB"
