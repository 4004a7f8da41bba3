"""The skip budget: how many bad samples one epoch may skip before training stops.

``max_skipped`` (a DataLoader argument and the YAML key ``loader.max_skipped``) is

* a float in ``[0, 1]``: a share of the samples this rank reads in one epoch (default ``0.01``,
  1 %); the limit is ``floor(max_skipped * samples)``, so with fewer than 100 samples per rank
  the default allows none;
* an int ``>= 0``: an absolute number of samples per epoch and rank (``0``: none);
* ``None``: no limit (each batch is still limited by its spares).

``True``/``False`` are refused (they would read as 1 and 0). The main process counts skips as
batch reports arrive, in batch order, from where the iteration started (a run resumed mid-epoch
counts from the resumed batch). One skip over the limit raises :class:`SkipBudgetExceeded`
with the counts by reason and the first skipped samples; batches delivered before stay
delivered.
"""
from __future__ import annotations

import math
from collections import Counter

from ..errors import ConfigError, SkipBudgetExceeded
from ..settings import max_skipped_problem

#: Sample names listed in the error message (all of them are in ``SkipBudgetExceeded.keys``
#: up to this many too).
LISTED = 20


def check_max_skipped(value, where: str = "max_skipped"):
    """Return ``value`` if it is a valid ``max_skipped`` (float in [0, 1], int >= 0 or None);
    else raise :class:`ConfigError`."""
    problem = max_skipped_problem(value)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    return value


def skip_limit(max_skipped, samples: int) -> int | None:
    """Skips allowed in an epoch of ``samples`` samples (None: unlimited)."""
    if max_skipped is None:
        return None
    if isinstance(max_skipped, float):
        return int(math.floor(max_skipped * samples + 1e-9))
    return int(max_skipped)


def epoch_samples(order) -> int:
    """Samples one rank reads per epoch: a ShardedOrder's ``per_rank``, else batches x batch size
    (a sampler without ``len()``: the dataset's sample count)."""
    per_rank = getattr(order, "per_rank", None)
    if per_rank is not None:
        return int(per_rank)
    known = order.known_len() if hasattr(order, "known_len") else len(order)
    return int((order.n or 0) if known is None else known * order.batch_size)


class SkipBudget:
    """Counts one epoch's skips and raises when they pass the limit.

    Args:
        max_skipped: see the module docstring.
        samples: samples in the epoch on this rank (the base of a share).
        epoch: for the message.
    """

    def __init__(self, max_skipped, samples: int, epoch: int = 0):
        self.max_skipped, self.samples, self.epoch = max_skipped, int(samples), int(epoch)
        self.limit = skip_limit(max_skipped, self.samples)
        self.counts: Counter = Counter()
        self.keys: list[tuple[str, str]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, skipped) -> None:
        """Count a batch's ``[(key, reason, detail)]``; raises :class:`SkipBudgetExceeded` past the limit."""
        for key, reason, *_ in skipped:
            self.counts[reason] += 1
            if len(self.keys) < LISTED:
                self.keys.append((key, reason))
        if self.limit is not None and self.total > self.limit:
            raise SkipBudgetExceeded(self.summary(), self.counts, self.keys, self.limit)

    def summary(self) -> str:
        share = (f"{self.max_skipped:g} of {self.samples} samples = {self.limit}"
                 if isinstance(self.max_skipped, float) else f"{self.limit}")
        reasons = ", ".join(f"{r}: {c}" for r, c in self.counts.most_common())
        names = "\n".join(f"  {k} ({r})" for k, r in self.keys)
        more = self.total - len(self.keys)
        return (f"{self.total} samples skipped in epoch {self.epoch}, over the skip budget "
                f"(max_skipped={share}); by reason: {reasons}. First skipped:\n{names}"
                + (f"\n  ... and {more} more" if more > 0 else "")
                + "\nFind them all before training with `feedgpu scan DATA`; raise max_skipped "
                "(or None) to go on.")

    def as_dict(self) -> dict:
        return {"max_skipped": self.max_skipped, "limit": self.limit, "epoch": self.epoch,
                "skipped": self.total, "by_reason": dict(self.counts)}
