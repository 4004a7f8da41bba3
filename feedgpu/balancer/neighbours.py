"""Which neighbouring settings the balancer's policy may try next (rule 3 of :mod:`.policy`),
and why the others are left out. Pure: a setting's record and the limits in, steps out."""
from __future__ import annotations

import math

from .policy_config import PolicyConfig
from .text import fmt_rate, pct
from .window import Record

Key = tuple  # (workers, prefetch)

#: A pool that reads at most this share above one core per worker is read as fully busy: the
#: workers' CPU time comes in clock ticks and the window's ends are read a moment apart, so a
#: pool busy on every core reads a little above it about half the time. Beyond this, the
#: workers run threads of their own and the one-core bound does not apply.
CORES_SLACK = 0.1


def candidates(config: PolicyConfig, key: Key, rec: Record, waiting: bool, limit: int, why_limit: str,
               memory_tight: bool) -> tuple[list[tuple[Key, str]], list[str]]:
    """Neighbours of ``key`` worth an experiment, most promising first, as ``(setting, kind)``
    (kind ``"add"``, ``"remove"``, ``"prefetch-up"`` or ``"prefetch-down"``), and in words why
    the others are not.

    ``rec``: what ``key`` measured; ``waiting``: the loop waits for batches there; ``limit``:
    the largest pool the hard limits allow (``why_limit`` says which); ``memory_tight``: the
    loader holds most of its memory budget (only then is a shallower prefetch tried)."""
    c = config
    w, p = key
    out, blocked = [], []
    if waiting:
        up, deeper = [], []
        if w < limit:
            up = [((w + 1, p), "add")]
        else:
            blocked.append(f"no worker more: {why_limit} allows no more than {limit}")
        if p < c.max_prefetch:
            deeper = [((w, p + 1), "prefetch-up")]
        idle = rec.cores > 0 and rec.cores < c.busy_threshold * w
        out += deeper + up if idle else up + deeper
    else:
        blocked.append(f"the loop waits only {pct(rec.wait)}: a worker more cannot train faster")
    if w > c.min_workers:
        # w workers on `cores` cores (one each at most) deliver rec.rate: w - 1 deliver at most this
        cores = min(rec.cores, w)
        cap = (w - 1) * rec.rate / cores if 0 < rec.cores <= w * (1 + CORES_SLACK) else math.inf
        if cap < (1 - c.tolerance) * rec.rate:
            blocked.append(f"no worker less: {w} workers deliver {fmt_rate(rec.rate)} on {cores:.1f} "
                           f"cores; {w - 1} at one core each deliver at most {fmt_rate(cap)}")
        else:
            out.append(((w - 1, p), "remove"))
    if memory_tight and p > c.min_prefetch:
        out.append(((w, p - 1), "prefetch-down"))
    elif p > c.min_prefetch:
        blocked.append("no shallower prefetch: it saves memory, not CPU, and memory is not short")
    return out, blocked


def worker_step_refused(refused, key: Key, dst: Key, kind: str) -> bool:
    """A worker more or less (``kind`` ``"add"`` or ``"remove"``, from ``key`` to ``dst``) refused
    at another prefetch depth (``refused``: the refused ``(from, to)`` steps) is refused here
    too: the depth does not change what a worker costs or gives (rule 3)."""
    if kind not in ("add", "remove"):
        return False
    return any(a[0] == key[0] and b[0] == dst[0] and a[1] == b[1] for a, b in refused if a != key)
