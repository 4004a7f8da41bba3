#!/usr/bin/env python
"""The recorded balancer benchmark: ``num_workers="auto"`` against every fixed worker count.

For each demand level, a synthetic consumer (``feedgpu.idle.RateConsumer``: it sleeps
``batch / rate`` seconds per batch, as a GPU step would, without using a core) is fed by
``feedgpu.DataLoader`` on ``pipelines/imagenet_train.yaml`` (decode, random resized crop 224,
flip, normalize float32) over the default 2,000-image sample, once with each fixed worker count
(1 .. cores) and once with ``"auto"``, each in a fresh loader, one after the other on a quiet
machine. Reported per level:

* the best fixed count: the fewest workers whose delivered rate is within 3 % of the highest;
* auto's delivered rate over time (the balancer's 1 s windows), the time from the first batch
  until the mean of three consecutive windows reaches 95 % of the best fixed rate, the worker
  counts it used after that, and its rate over the last half of the run;
* the balancer's diagnosis (``feedgpu.idle``'s, what ``feedgpu bench --consumer-rate`` prints):
  verdict, rate per core and the cores that demand would need.

Writes ``bench/results/balancer.json`` and ``bench/results/balancer.md``.

    .venv/bin/python bench/balancer.py                      # demands 400, 800, 3000 samples/s
    .venv/bin/python bench/balancer.py --demand 500 --auto-seconds 60
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from cpu_loader import wait_quiet, write_results  # noqa: E402

from feedgpu import DataLoader, Pipeline  # noqa: E402
from feedgpu.cli.bench import machine_info  # noqa: E402
from feedgpu.exec.autoscale import cpu_cores  # noqa: E402
from feedgpu.idle import RateConsumer, _diagnosis, run_loader  # noqa: E402
from feedgpu.metrics import cpu_seconds  # noqa: E402
from feedgpu.sample_data import default_sample  # noqa: E402

PIPELINE = REPO / "pipelines" / "imagenet_train.yaml"
TIE = 0.03
REACH = 0.95


def one(p, nw, demand: float, seconds: float, batch_size: int) -> dict:
    loader = DataLoader(p, num_workers=nw, batch_size=batch_size, device="cpu")
    consumer = RateConsumer(demand)
    it = iter(loader)  # start the workers (and take one batch) before the clock starts
    next(it)
    del it
    pids = loader.worker_pids()
    c0, t0 = cpu_seconds(pids), time.perf_counter()
    r = run_loader(loader, consumer, seconds)
    wall = time.perf_counter() - t0
    r["cores_used"] = (cpu_seconds(loader.worker_pids()) - c0) / wall if nw != "auto" else None
    r["workers"] = nw
    if nw == "auto":
        b = loader.balancer
        r["timeline"] = list(b.timeline)
        r["diagnosis"] = _diagnosis(list(b.measurements))
        r["decisions"] = [d.as_dict() for d in b.policy.history if d.changes]
    loader.shutdown()
    return r


def analyse_auto(auto: dict, best_rate: float, best_n: int) -> dict:
    tl = auto["timeline"]
    if not tl:
        return {"reached_s": None}
    t0 = tl[0]["t"] - 1.0  # windows end at t; the first one began about a window earlier
    reached = None
    for i in range(2, len(tl)):
        mean = statistics.mean(p["delivered_rate"] for p in tl[i - 2:i + 1])
        if mean >= REACH * best_rate:
            reached = tl[i]["t"] - t0
            break
    after = [p["workers"] for p in tl if reached is not None and p["t"] - t0 >= reached]
    half = [p["delivered_rate"] for p in tl[len(tl) // 2:]]
    return {"reached_s": reached, "workers_after": sorted(set(after)), "max_workers_after": max(after) if after else None,
            "extra_workers": (max(after) - best_n) if after else None,
            "late_rate": statistics.median(half) if half else None,
            "late_ratio": (statistics.median(half) / best_rate) if half and best_rate else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demand", type=float, action="append", help="samples/s (repeatable; default 400, 800, 3000)")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--fixed-seconds", type=float, default=20.0)
    ap.add_argument("--auto-seconds", type=float, default=45.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--quiet-s", type=float, default=30.0, help="wait up to this long for a quiet machine before each run")
    a = ap.parse_args(argv)
    demands = a.demand or [400.0, 800.0, 3000.0]
    t_start = time.perf_counter()
    data = str(default_sample(a.images, progress=True))
    p = Pipeline.from_yaml(PIPELINE, **{"source.path": data, "output.device": "cpu"})
    cores = cpu_cores()
    levels = []
    for demand in demands:
        runs = {}
        for nw in [*range(1, cores + 1), "auto"]:
            waited = wait_quiet(a.quiet_s)
            secs = a.auto_seconds if nw == "auto" else a.fixed_seconds
            r = one(p, nw, demand, secs, a.batch_size)
            r["waited_for_quiet_s"] = round(waited, 1)
            runs[str(nw)] = r
            print(f"demand {demand:,.0f}/s, workers {nw}: {r['samples_per_s']:,.0f} samples/s", file=sys.stderr)
        fixed = {int(k): v["samples_per_s"] for k, v in runs.items() if k != "auto"}
        top = max(fixed.values())
        best_n = min(n for n, v in fixed.items() if v >= (1 - TIE) * top)
        level = {"demand": demand, "runs": runs, "best_fixed_workers": best_n, "best_fixed_rate": fixed[best_n],
                 "auto": analyse_auto(runs["auto"], fixed[best_n], best_n)}
        d = runs["auto"]["diagnosis"]
        if d:
            bf = runs[str(best_n)]
            per_core = bf["samples_per_s"] / bf["cores_used"] if bf["cores_used"] else None
            level["check"] = {"fixed_rate_per_core": per_core,
                              "cores_needed_from_fixed": demand / per_core if per_core else None}
        levels.append(level)
    doc = {"format": "feedgpu.bench.balancer/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": machine_info(), "settings": {"pipeline": str(PIPELINE.relative_to(REPO)), "data": data,
                                                   "images": a.images, "batch_size": a.batch_size,
                                                   "fixed_seconds": a.fixed_seconds, "auto_seconds": a.auto_seconds,
                                                   "tie": TIE, "reach": REACH},
           "levels": levels, "total_seconds": round(time.perf_counter() - t_start, 1)}
    write_results(a.out, "balancer", doc, markdown)
    return 0


def _f(v, spec=",.0f"):
    return "-" if v is None else format(v, spec)


def markdown(doc: dict) -> str:
    m, s = doc["machine"], doc["settings"]
    lines = ["# Balancer: num_workers=\"auto\" against fixed worker counts", "",
             f"Machine: {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB, PIL {m['pil_label']}, "
             f"torch {m['torch']}. Data: {s['images']} ImageNet-like images (`{s['pipeline']}`, batch "
             f"{s['batch_size']}, float32 NCHW 224). Consumer: synthetic (sleeps batch/rate per step). Fixed counts "
             f"run {s['fixed_seconds']:.0f} s, auto {s['auto_seconds']:.0f} s, each in a fresh loader, one after "
             f"the other; best fixed = fewest workers within {100 * s['tie']:.0f} % of the highest rate.", "",
             "| demand (samples/s) | " + " | ".join(f"{k} workers" for k in doc["levels"][0]["runs"] if k != "auto")
             + " | best fixed | auto: reached 95 % after | auto workers after | auto late rate (vs best) | verdict |",
             "|---" * (len(doc["levels"][0]["runs"]) + 5) + "|"]
    for lv in doc["levels"]:
        runs, au = lv["runs"], lv["auto"]
        fixed = " | ".join(_f(v["samples_per_s"]) for k, v in runs.items() if k != "auto")
        d = runs["auto"].get("diagnosis") or {}
        lines.append(f"| {lv['demand']:,.0f} | {fixed} | {lv['best_fixed_workers']} ({_f(lv['best_fixed_rate'])}) | "
                     f"{_f(au.get('reached_s'), '.1f')} s | {au.get('workers_after')} | {_f(au.get('late_rate'))} "
                     f"({_f(au.get('late_ratio'), '.2f')}x) | {d.get('verdict', '-')} |")
    lines += ["", "Diagnosis of the auto runs (last setting, windows after the first) against a check from the "
              "best fixed run (its samples/s per core used by the workers):", "",
              "| demand | verdict | delivered | rate per core | cores needed | check: rate per core (fixed) | "
              "check: cores needed |", "|---|---|---|---|---|---|---|"]
    for lv in doc["levels"]:
        d = lv["runs"]["auto"].get("diagnosis") or {}
        c = lv.get("check") or {}
        lines.append(f"| {lv['demand']:,.0f} | {d.get('verdict', '-')} | {_f(d.get('delivered_rate'))} | "
                     f"{_f(d.get('rate_per_core'))} | {_f(d.get('cores_needed'), '.1f')} | "
                     f"{_f(c.get('fixed_rate_per_core'))} | {_f(c.get('cores_needed_from_fixed'), '.1f')} |")
    lines += ["", "Balancer decisions (changes only) per level:", ""]
    for lv in doc["levels"]:
        tl = lv["runs"]["auto"]["timeline"]
        t0 = tl[0]["t"] - 1.0 if tl else 0.0
        steps = "; ".join(f"t={d['t'] - t0:.0f}s {d['kind']} to {d['workers']}w/p{d['prefetch']}"
                          for d in lv["runs"]["auto"]["decisions"])
        lines.append(f"- demand {lv['demand']:,.0f}: {steps or 'none'}")
    lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
