"""The balancer's record of what each setting measured: running means and spreads of the
windows seen at one ``(workers, prefetch)`` setting, and the noise of one window pooled over
all settings. Pure arithmetic (Welford's running mean and variance)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from .measurement import Measurement


@dataclass
class Record:
    """Means of the windows seen at one setting since the records were last forgotten.

    Attributes:
        n: windows seen.
        rate: mean samples/s consumed by the training loop.
        rate_m2: sum of squared deviations of the rate (Welford).
        wait: mean share of the loop's step time spent waiting for a batch.
        cores: mean cores the workers used.
        rss: mean bytes the loader held, over the windows that measured it (``rss_n``).
        demand: mean demand rate (samples / busy time) over windows where it was finite, 0
            when none was.
    """

    n: int = 0
    rate: float = 0.0
    rate_m2: float = 0.0
    wait: float = 0.0
    cores: float = 0.0
    rss: float = 0.0
    rss_n: int = 0
    demand: float = 0.0
    demand_n: int = 0

    def add(self, m: Measurement) -> None:
        """Fold one window in."""
        self.n += 1
        k = 1.0 / self.n
        d = m.delivered_rate - self.rate
        self.rate += d * k
        self.rate_m2 += d * (m.delivered_rate - self.rate)
        self.wait += (m.wait_fraction - self.wait) * k
        self.cores += (m.cpu_cores_used - self.cores) * k
        if m.rss_bytes > 0:   # 0: not measured in this window
            self.rss_n += 1
            self.rss += (m.rss_bytes - self.rss) / self.rss_n
        if m.demand_rate is not None and not math.isinf(m.demand_rate):
            self.demand_n += 1
            self.demand += (m.demand_rate - self.demand) / self.demand_n


def pooled_noise(records: Iterable[Record], prior: float, floor: float, prior_df: float = 4.0) -> float:
    """Relative standard deviation of one window's rate, pooled over ``records`` (each
    setting's spread around its own mean, relative to it), shrunk towards ``prior`` with
    ``prior_df`` pseudo-windows, at least ``floor``."""
    ss, df = prior_df * prior ** 2, prior_df
    for r in records:
        if r.n >= 2 and r.rate > 0:
            ss += r.rate_m2 / r.rate ** 2
            df += r.n - 1
    return max(floor, math.sqrt(ss / df))


def drifted(m: Measurement, r: Record, threshold: float) -> str | None:
    """Why the window ``m`` does not look like the record ``r`` of its own setting (its rate,
    or the loop's demand, more than ``threshold`` away from the mean), or None."""
    if r.rate > 0 and abs(m.delivered_rate / r.rate - 1) > threshold:
        return f"the rate moved from {r.rate:,.0f}/s to {m.delivered_rate:,.0f}/s"
    d = m.demand_rate
    if r.demand_n and d is not None and not math.isinf(d) and abs(d / r.demand - 1) > threshold:
        return f"demand moved from {r.demand:,.0f}/s to {d:,.0f}/s"
    return None
