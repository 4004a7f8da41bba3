"""The balancer's record of what each setting measured: running means and spreads of the
windows seen at one ``(workers, prefetch)`` setting, and the noise of one window pooled over
all settings. Pure arithmetic (Welford's running mean and variance)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from .measurement import Measurement


@dataclass
class Record:
    """Means of the windows seen at one setting since the records were last forgotten.

    Attributes:
        n: windows seen.
        rate: mean samples/s consumed by the training loop.
        rate_m2: sum of squared deviations of the rate (Welford).
        wait: mean share of the loop's step time spent waiting for a batch.
        wait_m2: sum of squared deviations of that share (Welford).
        cores: mean cores the workers used.
        rss: mean bytes the loader held, over the windows that measured it (``rss_n``).
        demand: mean demand rate (samples / busy time) over windows where it was finite, 0
            when none was.
        demand_m2: sum of squared deviations of the demand (Welford).
    """

    n: int = 0
    rate: float = 0.0
    rate_m2: float = 0.0
    wait: float = 0.0
    wait_m2: float = 0.0
    cores: float = 0.0
    rss: float = 0.0
    rss_n: int = 0
    demand: float = 0.0
    demand_n: int = 0
    demand_m2: float = 0.0

    def add(self, m: Measurement) -> None:
        """Fold one window in."""
        self.n += 1
        k = 1.0 / self.n
        d = m.delivered_rate - self.rate
        self.rate += d * k
        self.rate_m2 += d * (m.delivered_rate - self.rate)
        d = m.wait_fraction - self.wait
        self.wait += d * k
        self.wait_m2 += d * (m.wait_fraction - self.wait)
        self.cores += (m.cpu_cores_used - self.cores) * k
        if m.rss_bytes > 0:   # 0: not measured in this window
            self.rss_n += 1
            self.rss += (m.rss_bytes - self.rss) / self.rss_n
        if m.demand_rate is not None and not math.isinf(m.demand_rate):
            self.demand_n += 1
            d = m.demand_rate - self.demand
            self.demand += d / self.demand_n
            self.demand_m2 += d * (m.demand_rate - self.demand)


def pooled_noise(records: Iterable[Record], prior: float, floor: float, prior_df: float = 4.0,
                 of: str = "rate") -> float:
    """Relative standard deviation of one window's rate (``of="demand"``: of the loop's demand),
    pooled over ``records`` (each setting's spread around its own mean, relative to it), shrunk
    towards ``prior`` with ``prior_df`` pseudo-windows, at least ``floor``."""
    ss, df = prior_df * prior ** 2, prior_df
    for r in records:
        n, mean, m2 = (r.n, r.rate, r.rate_m2) if of == "rate" else (r.demand_n, r.demand, r.demand_m2)
        if n >= 2 and mean > 0:
            ss += m2 / mean ** 2
            df += n - 1
    return max(floor, math.sqrt(ss / df))


def without(r: Record, last: Sequence[Measurement]) -> Record:
    """The rate and demand statistics of ``r`` before its last windows ``last`` (oldest first)
    were folded in: Welford's update in reverse. The other means are left as they are."""
    n, rate, m2, demand, dn, dm2 = r.n, r.rate, r.rate_m2, r.demand, r.demand_n, r.demand_m2
    for m in reversed(last):
        if n <= 1:
            break
        x, prev = m.delivered_rate, (n * rate - m.delivered_rate) / (n - 1)
        m2, rate, n = max(0.0, m2 - (x - prev) * (x - rate)), prev, n - 1
        if m.demand_rate is not None and not math.isinf(m.demand_rate) and dn > 1:
            x, prev = m.demand_rate, (dn * demand - m.demand_rate) / (dn - 1)
            dm2, demand, dn = max(0.0, dm2 - (x - prev) * (x - demand)), prev, dn - 1
    return replace(r, n=n, rate=rate, rate_m2=m2, demand=demand, demand_n=dn, demand_m2=dm2)


def drift_of(recent: Sequence[Measurement], records: Mapping[tuple, Record], key: tuple, config
             ) -> tuple[str, float] | None:
    """:func:`drifted` for the policy: the last ``config.drift_windows`` windows at ``key`` (the
    newest not folded into its record yet) against that record as it was before them, with the
    noise pooled over the records so (windows of a drift judged against a record that already
    holds some of them would move its mean and widen its noise towards them). The rate and the
    demand are each judged against their own noise: a loop's demand may spread more than its rate
    (a model trained on the CPU) or less (a loop that sleeps)."""
    if len(recent) < config.drift_windows:
        return None
    base = without(records[key], list(recent)[:-1])
    recs = [base if k == key else r for k, r in records.items()]
    noise = pooled_noise(recs, config.noise_prior, config.noise_floor)
    demand_noise = pooled_noise(recs, config.noise_prior, config.noise_floor, of="demand")
    return drifted(recent, base, config.drift_threshold, noise, config.drift_confidence, demand_noise)


def drifted(recent: Sequence[Measurement], r: Record, threshold: float, noise: float = 0.0,
            confidence: float = 0.0, demand_noise: float | None = None) -> tuple[str, float] | None:
    """Whether the windows ``recent`` (the last few at one unchanged setting) no longer look like
    the record ``r`` of that setting: each window's rate, or the loop's demand, is more than
    ``threshold`` away from the record's mean, all on the same side, and their mean (with the
    relative ``noise`` of one window's rate, ``demand_noise`` of its demand, default ``noise``)
    more than ``confidence`` standard errors away. Windows on both sides of the mean are noise,
    not drift.

    Returns (why in words, the relative move), or None."""
    k = len(recent)
    if k == 0:
        return None

    def bound(noise: float, n: int) -> float:   # how far the mean of the k windows must move
        return max(threshold, confidence * noise * math.sqrt(1 / k + 1 / max(n, 1)))

    rates = [m.delivered_rate for m in recent]
    moved = _moved(rates, r.rate, threshold, bound(noise, r.n))
    if moved is not None:
        return f"the rate moved from {r.rate:,.0f}/s to {sum(rates) / k:,.0f}/s", moved
    demands = [m.demand_rate for m in recent]
    if r.demand_n and all(d is not None and not math.isinf(d) for d in demands):
        moved = _moved(demands, r.demand, threshold,
                       bound(noise if demand_noise is None else demand_noise, r.demand_n))
        if moved is not None:
            return f"demand moved from {r.demand:,.0f}/s to {sum(demands) / k:,.0f}/s", moved
    return None


def _moved(values: list[float], base: float, each: float, bound: float) -> float | None:
    """The relative move of the mean of ``values`` from ``base`` when every value lies more
    than ``each`` from ``base`` on the same side and the mean more than ``bound``, else None."""
    if base <= 0:
        return None
    rel = [v / base - 1 for v in values]
    mean = sum(rel) / len(rel)
    same_side = all(x > each for x in rel) or all(x < -each for x in rel)
    return abs(mean) if same_side and abs(mean) > bound else None
