#!/usr/bin/env python
"""The balancer's pure policy replayed on simulated training loops: how close to the best
setting it trains over a long run, how often it forgets its records, how often it changes.

The real benchmark (``bench/balancer.py``) resolves a few percent at best on a shared VM, and
a run lasts minutes; here the policy (:class:`feedgpu.exec.balancer.Policy`, deterministic)
decides on windows drawn from a throughput curve with the noise measured in real runs, so
thousands of windows and many seeds cost seconds, and two versions of the policy compare on the
same draws. No loader runs: this measures the policy's decisions, not the loader's speed.

A curve gives, per worker count, the samples/s the loop trains and the share of its step time
it waits (the prefetch depth changes neither). One window's rate is the curve's at the setting
decided, times the machine's speed (a slow mean-reverting walk), times AR(1) noise (relative
standard deviation ``--noise``, lag-one correlation ``--phi``: the windows of one setting in
``bench/results/balancer_long_run.json`` spread 10-21 % with correlations 0-0.6). The first
``--warmup`` windows train ``--dip`` slower (a run warms up); the window after a change is the
mean of the two settings (batches in flight), and after a worker more, one more window trains at
the old setting (the new worker starts cold).

Reported per curve and noise, over ``--seeds`` seeds of ``--windows`` windows: the mean share
of the best rate trained after the first ``--lead`` windows and within them, the forgets, the
changes, and the share of windows at each worker count.

    .venv/bin/python -m bench.policy_sim --out /tmp/sim        # writes policy_sim.{json,md}
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

from feedgpu.exec.balancer import Measurement, Policy, PolicyConfig

#: workers -> (samples/s trained, share of step time waiting, cores the workers use). From
#: bench/results/balancer_long_run.md and balancer_drift35.md (cnn-all, cnn-1t, busy-core) and a
#: sleeping consumer that one worker keeps fed.
CURVES = {
    "cnn-all": {1: (357, 0.29, 0.85), 2: (414, 0.035, 1.2), 3: (391, 0.02, 1.5), 4: (370, 0.02, 1.6)},
    "cnn-1t": {1: (715, 0.38, 0.95), 2: (870, 0.03, 1.5), 3: (850, 0.02, 1.7), 4: (820, 0.02, 1.8)},
    "busy-core": {1: (520, 0.30, 0.9), 2: (640, 0.03, 1.3), 3: (615, 0.02, 1.5), 4: (600, 0.02, 1.6)},
    "sleep-300": {1: (300, 0.01, 0.4), 2: (300, 0.005, 0.4), 3: (300, 0.005, 0.4), 4: (300, 0.005, 0.4)},
}


def run(curve: dict, noise: float, phi: float, windows: int, seed: int, warmup: int, dip: float,
        start: tuple[int, int] = (2, 2)) -> dict:
    """One simulated run; returns what :func:`summarise` needs."""
    rnd = random.Random(seed)
    cfg = PolicyConfig(max_workers=max(curve), max_prefetch=4)
    p = Policy(cfg)
    best = max(r for r, _, _ in curve.values())
    key, prev, cold = start, start, 0
    e, speed = 0.0, 1.0
    trained, workers = [], []
    sd_e = noise * math.sqrt(1 - phi * phi)
    for t in range(windows):
        e = phi * e + rnd.gauss(0.0, sd_e)
        speed = 1.0 + 0.97 * (speed - 1.0) + rnd.gauss(0.0, 0.01)
        rate, wait, cores = curve[key[0]]
        if cold:
            rate = curve[prev[0]][0]
            cold -= 1
        elif prev != key:
            rate = (rate + curve[prev[0]][0]) / 2
        trained.append(rate / best)
        workers.append(key[0])
        f = speed * max(0.2, 1.0 + e) * (1 - dip if t < warmup else 1.0)
        w = min(0.9, max(0.0, wait * (1 + rnd.gauss(0.0, 0.3))))
        r = rate * f
        d = p.decide(Measurement(t=float(t), workers=key[0], delivered_rate=r, demand_rate=r / (1 - w),
                                 wait_fraction=w, cpu_cores_used=cores, cpu_budget=2.0, prefetch=key[1]))
        new = (d.workers, d.prefetch)
        prev = key
        cold = 1 if new[0] > key[0] else 0
        key = new
    s = p.stats()
    return {"trained": trained, "workers": workers, "resets": s["resets"], "changes": s["changes"]}


def summarise(runs: list[dict], lead: int) -> dict:
    after = [statistics.fmean(r["trained"][lead:]) for r in runs]
    first = [statistics.fmean(r["trained"][:lead]) for r in runs]
    counts: dict[int, int] = {}
    for r in runs:
        for w in r["workers"][lead:]:
            counts[w] = counts.get(w, 0) + 1
    total = sum(counts.values())
    return {"after_lead": round(statistics.fmean(after), 4), "after_lead_min": round(min(after), 4),
            "first": round(statistics.fmean(first), 4),
            "resets_per_run": round(statistics.fmean(r["resets"] for r in runs), 2),
            "changes_per_run": round(statistics.fmean(r["changes"] for r in runs), 1),
            "workers_share": {str(k): round(v / total, 3) for k, v in sorted(counts.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--noise", type=float, action="append", help="relative noise of a window (repeatable)")
    ap.add_argument("--phi", type=float, default=0.3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dip", type=float, default=0.3)
    ap.add_argument("--lead", type=int, default=35)
    ap.add_argument("--curve", action="append", choices=sorted(CURVES))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    noises = a.noise or [0.06, 0.12, 0.18]
    rows = []
    for name in a.curve or list(CURVES):
        for nz in noises:
            runs = [run(CURVES[name], nz, a.phi, a.windows, seed, a.warmup, a.dip) for seed in range(a.seeds)]
            rows.append({"curve": name, "noise": nz, **summarise(runs, a.lead)})
            r = rows[-1]
            print(f"{name:10s} noise {nz:.2f}: after {a.lead} windows {r['after_lead']:.3f} of best "
                  f"(worst seed {r['after_lead_min']:.3f}), first {a.lead} {r['first']:.3f}, "
                  f"forgets {r['resets_per_run']}, changes {r['changes_per_run']}, workers {r['workers_share']}",
                  flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(a).items() if k not in ("out",)}
        settings["noise"], settings["curve"] = noises, a.curve or list(CURVES)
        doc = {"format": "feedgpu.bench.policy-sim/1", "settings": settings, "curves": CURVES, "rows": rows}
        (a.out / "policy_sim.json").write_text(json.dumps(doc, indent=1))
        lines = [f"# Balancer policy on simulated loops\n\n{a.note}\n",
                 f"{a.seeds} seeds x {a.windows} windows, AR(1) phi {a.phi}, warm-up {a.warmup} windows "
                 f"{a.dip:.0%} slower; share of the best curve rate trained.\n",
                 f"| curve | noise | after {a.lead} windows | worst seed | first {a.lead} | forgets/run | "
                 "changes/run | windows at 1/2/3/4 workers |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in rows:
            ws = " / ".join(f"{r['workers_share'].get(str(k), 0):.2f}" for k in (1, 2, 3, 4))
            lines.append(f"| {r['curve']} | {r['noise']:.2f} | {r['after_lead']:.3f} | {r['after_lead_min']:.3f} | "
                         f"{r['first']:.3f} | {r['resets_per_run']} | {r['changes_per_run']} | {ws} |")
        (a.out / "policy_sim.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
