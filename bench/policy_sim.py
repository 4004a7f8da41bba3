#!/usr/bin/env python
"""The balancer's pure policy replayed on simulated training loops: how close to the best
setting it trains over a long run, how often it forgets its records, how often it changes.

The real benchmark (``bench/balancer.py``) resolves a few percent at best on a shared VM, and
a run lasts minutes; here the policy (:class:`feedgpu.balancer.Policy`, deterministic)
decides on windows drawn from a throughput curve with the noise measured in real runs, so
thousands of windows and many seeds cost seconds, and two versions of the policy compare on the
same draws. No loader runs: this measures the policy's decisions, not the loader's speed.

A curve gives, per worker count, the samples/s the loop trains, the share of its step time it
waits and the cores the workers use (the prefetch depth changes none). The windows are drawn by
:class:`feedgpu.balancer.simulate.Curve` and the policy driven by :func:`feedgpu.balancer.simulate.run`,
as the policy tests do: a window's rate is the curve's at the setting decided, times the
machine's speed (a slow mean-reverting walk), times AR(1) noise (relative standard deviation
``--noise``, lag-one correlation ``--phi``: the windows of one setting in
``bench/results/archive/balancer_long_run.json`` spread 10-21 % with correlations 0-0.6). The first
``--warmup`` windows train ``--dip`` slower (a run warms up); the window after a change is the
mean of the two settings (batches in flight), and after a worker more, one more window trains at
the old setting (the new worker starts cold).

Reported per curve and noise, over ``--seeds`` seeds of ``--windows`` windows: the mean share
of the best rate trained (before the machine's speed and the noise) after the first ``--lead``
windows and within them, the forgets, the changes, and the share of windows at each worker
count. ``--compare LABEL=policy_sim.json`` puts the rows of runs made at other commits beside
this one's (the same seeds draw the same windows while the policies decide alike).

    .venv/bin/python -m bench.policy_sim --out /tmp/sim        # writes policy_sim.{json,md}
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from feedgpu.balancer import simulate
from feedgpu.balancer import Policy, PolicyConfig
from feedgpu.balancer.simulate import Curve

#: workers -> (samples/s trained, share of step time waiting, cores the workers use). From
#: bench/results/archive/balancer_long_run.md and balancer_drift35.md (cnn-all, cnn-1t, busy-core) and a
#: sleeping consumer that one worker keeps fed.
CURVES = {
    "cnn-all": {1: (357, 0.29, 0.85), 2: (414, 0.035, 1.2), 3: (391, 0.02, 1.5), 4: (370, 0.02, 1.6)},
    "cnn-1t": {1: (715, 0.38, 0.95), 2: (870, 0.03, 1.5), 3: (850, 0.02, 1.7), 4: (820, 0.02, 1.8)},
    "busy-core": {1: (520, 0.30, 0.9), 2: (640, 0.03, 1.3), 3: (615, 0.02, 1.5), 4: (600, 0.02, 1.6)},
    "sleep-300": {1: (300, 0.01, 0.4), 2: (300, 0.005, 0.4), 3: (300, 0.005, 0.4), 4: (300, 0.005, 0.4)},
    # cnn-all as bench/results/archive/balancer_cores.md and balancer_paired_cores.md measured it: one
    # worker a close call below two while the loop waits 14 % of its step time there
    "cnn-all-close": {1: (690, 0.14, 0.75), 2: (735, 0.035, 0.8), 3: (700, 0.02, 0.85), 4: (680, 0.02, 0.9)},
    # the guard: one worker trains faster while the loop waits longer (the model gets the core
    # the second worker took)
    "fewer-faster": {1: (760, 0.12, 0.9), 2: (735, 0.035, 0.87), 3: (700, 0.02, 0.85), 4: (680, 0.02, 0.85)},
}
#: Loops whose curve changes shape during the run: name -> (curve before, curve after, window of
#: the change). "cnn-all, then one worker": another process takes a core, and one worker now
#: trains fastest (the cost of a sample, cores per samples/s, stays what it was at one worker).
CHANGES = {
    "cnn-all, then one worker": ("cnn-all", {1: (357, 0.05, 0.85), 2: (280, 0.03, 0.67), 3: (250, 0.02, 0.6),
                                             4: (240, 0.02, 0.57)}, 300),
}


def curve(table: dict | list, noise: float, phi: float, seed: int, warmup: int, dip: float) -> Curve:
    """The simulated loop of one ``CURVES`` table (or of ``table[0]`` of a list, which the
    caller may swap between windows)."""
    now = table if isinstance(table, list) else [table]
    return Curve(rate=lambda w, p: now[0][w][0], wait=lambda w, p: now[0][w][1], cores=lambda w, p: now[0][w][2],
                 noise=noise, phi=phi, speed_walk=0.01, wait_noise=0.3, cpu_budget=2.0, seed=seed,
                 start_windows=1, settle_mix=True, warmup_windows=warmup, warmup_dip=dip)


def run(table: dict, noise: float, phi: float, windows: int, seed: int, warmup: int, dip: float,
        start: tuple[int, int] = (2, 2), then: tuple[dict, int] | None = None) -> dict:
    """One simulated run; returns what :func:`summarise` needs. ``then``: (the curve after, the
    window it takes over at); each window is scored against the best of the curve it ran on."""
    policy = Policy(PolicyConfig(max_workers=max(table), max_prefetch=4))
    now = [table]
    loop = curve(now, noise, phi, seed, warmup, dip)
    phases = [(table, windows)] if then is None else [(table, then[1]), (then[0], windows - then[1])]
    trained, workers, setting = [], [], start
    for t, n in phases:
        now[0] = t
        best = max(r for r, _, _ in t.values())
        steps = simulate.run(policy, loop, n, *setting)
        trained += [st.expected / best for st in steps]
        workers += [st.measurement.workers for st in steps]
        setting = (steps[-1].decision.workers, steps[-1].decision.prefetch)
    s = policy.stats()
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


#: The columns of the table: (row key, heading, format).
COLUMNS = (("after_lead", "after {lead}", "{:.3f}"), ("after_lead_min", "worst seed", "{:.3f}"),
           ("first", "before {lead}", "{:.3f}"), ("resets_per_run", "forgets / run", "{}"),
           ("changes_per_run", "changes / run", "{}"))


def table(docs: dict[str, dict], lead: str, rows: str = "rows") -> list[str]:
    """A markdown table of the ``rows`` of ``docs`` (label -> a policy_sim.json document), one
    line per curve and noise, each cell the labels' values in order, separated by ``/``; ``lead``
    names the windows the first column leaves out and the third holds."""
    labels = [lab for lab, doc in docs.items() if doc.get(rows)]
    if not labels:
        return []
    by = {lab: {(r["curve"], r["noise"]): r for r in docs[lab][rows]} for lab in labels}
    keys = list(by[labels[-1]])
    heads = [h.format(lead=lead) for _, h, _ in COLUMNS] + ["windows at 1/2/3 workers"]
    lines = ["| curve | noise | " + " | ".join(heads) + " |", "| --- | ---: |" + " ---: |" * len(COLUMNS) + " --- |"]
    for key in keys:
        rows = [by[lab].get(key) for lab in labels]
        cells = [" / ".join("-" if r is None else fmt.format(r[k]) for r in rows) for k, _, fmt in COLUMNS]
        cells.append(" ; ".join("-" if r is None else " / ".join(f"{r['workers_share'].get(str(w), 0):.2f}"
                                                                 for w in (1, 2, 3)) for r in rows))
        lines.append(f"| {key[0]} | {key[1]:.2f} | " + " | ".join(cells) + " |")
    return lines


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
    ap.add_argument("--label", default="this run", help="this run's name in a comparison (a commit)")
    ap.add_argument("--compare", action="append", default=[], metavar="LABEL=JSON",
                    help="a policy_sim.json of another run to put beside this one (repeatable)")
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
    change_rows = []
    for name, (before, after, at) in CHANGES.items() if not a.curve else ():
        for nz in noises:
            runs = [run(CURVES[before], nz, a.phi, a.windows, seed, a.warmup, a.dip, then=(after, at))
                    for seed in range(a.seeds)]
            change_rows.append({"curve": name, "noise": nz, "at": at, **summarise(runs, at)})
            r = change_rows[-1]
            print(f"{name} noise {nz:.2f}: after the change {r['after_lead']:.3f} of the new best "
                  f"(worst seed {r['after_lead_min']:.3f}), workers {r['workers_share']}", flush=True)
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "compare")}
    settings["noise"], settings["curve"] = noises, a.curve or list(CURVES)
    doc = {"format": "feedgpu.bench.policy-sim/1", "settings": settings, "curves": CURVES, "rows": rows,
           "changes": {k: {"before": b, "after": c, "at": t} for k, (b, c, t) in CHANGES.items()},
           "change_rows": change_rows}
    docs = {}
    for spec in a.compare:
        label, _, path = spec.partition("=")
        docs[label] = json.loads(Path(path).read_text())
    docs[a.label] = doc
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "policy_sim.json").write_text(json.dumps(doc, indent=1))
        lines = [f"# Balancer policy on simulated loops\n\n{a.note}\n",
                 f"{a.seeds} seeds x {a.windows} windows, AR(1) phi {a.phi}, warm-up {a.warmup} windows "
                 f"{a.dip:.0%} slower; share of the best curve rate trained. Each cell: "
                 + " / ".join(docs) + ".\n", *table(docs, f"{a.lead} windows")]
        if change_rows:
            lines += ["", "Curves that change shape (``CHANGES``): the first columns are the share of the new curve's "
                      "best trained after the change, the windows at each count are those after it.\n",
                      *table(docs, "the change", "change_rows")]
        (a.out / "policy_sim.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
