#!/usr/bin/env python
"""The recorded balancer benchmark: ``num_workers="auto"`` against every fixed worker count,
with real training loops side by side in one run.

The loader is ``feedgpu.DataLoader`` on ``pipelines/imagenet_train.yaml`` (decode, random
resized crop, flip, normalize float32) with a ``--crop`` px crop and batch ``--batch-size``,
persistent workers, over the default ImageNet-like sample. Consumers, each in the main
process, as a training loop would be:

* ``cnn-1t``: a small conv net trained on the CPU (forward, cross-entropy, backward, SGD) with
  ``torch.set_num_threads(1)``;
* ``cnn-all``: the same with one thread per core (the model competes with the workers);
* ``busy-core``: spins one core for ``batch / --busy-rate`` seconds per batch, as the Python
  side of a GPU training loop keeps a core busy;
* ``sleep-R``: sleeps ``batch / R`` seconds per batch (no CPU), for each ``--sleep-rate``.

For each consumer and round, every fixed count (1 .. cores + 1), ``auto`` and a control (the
count ``auto`` starts at, run a second time) run in a fresh loader, in an order rotated each
round, ``--seconds`` each, timed from the first batch. Besides medians over rounds, ``auto`` is
compared with the best fixed count of the same round (per round, median, and the geometric
mean with its standard error over rounds: the resolution more rounds buy), and the control with
its twin: how far two runs of one setting spread within a round. ``--counts`` runs some fixed
counts only (the best ones known from a full run), leaving time for more rounds. The control
runs right after ``auto``, so where its count is the best fixed count, ``auto`` over it is the
pair closest in time.
Reported per run: trained samples/s (samples the loop consumed per second) and the waiting
share (time in ``next()`` over wall time), and the rate from ``--tail-from`` seconds (30) to
the end, once ``auto`` has had the time the goal gives it (its medians, and ``auto`` over the
best fixed count within each round); for ``auto`` also its final setting, the time until the
mean of three consecutive balancer windows came within ``TIE`` of the best fixed count's
median rate, and its experiments in words.

Writes ``bench/results/balancer.json`` and ``bench/results/balancer.md`` (figures only; any
conclusions are written by hand there, under "Conclusions", which a rerun keeps).

    .venv/bin/python -m bench.balancer                                  # the recorded run
    .venv/bin/python -m bench.balancer --seconds 12 --rounds 1 --consumer cnn-1t --consumer sleep-300
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import yaml

from bench.harness import REPO, machine, write_results  # noqa: E402

import torch  # noqa: E402

from feedgpu import DataLoader, Pipeline  # noqa: E402
from feedgpu.host import cpu_cores  # noqa: E402
from feedgpu.balancer import start_workers  # noqa: E402
from feedgpu.sample_data import default_sample  # noqa: E402

PIPELINE = REPO / "pipelines" / "imagenet_train.yaml"
TIE = 0.03


# -- consumers ----------------------------------------------------------------------------------

def _images(batch):
    return batch.images if hasattr(batch, "images") else batch[0]


def _labels(batch):
    return batch.labels if hasattr(batch, "labels") else batch[1]


class ConvNet:
    """A small conv net trained on the CPU: one SGD step per batch."""

    def __init__(self, threads: int):
        self.threads = threads
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def start(self):
        torch.set_num_threads(self.threads)

    def step(self, batch) -> None:
        x = _images(batch)
        y = _labels(batch).long() % 10
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()


class BusyCore:
    """Keeps one core busy for ``rows / rate`` seconds per batch."""

    def __init__(self, rate: float):
        self.rate = rate

    def start(self):
        pass

    def step(self, batch) -> None:
        t = time.thread_time() + len(_images(batch)) / self.rate
        while time.thread_time() < t:
            pass


class Sleeper:
    """Sleeps ``rows / rate`` seconds per batch (no CPU used)."""

    def __init__(self, rate: float):
        self.rate = rate

    def start(self):
        pass

    def step(self, batch) -> None:
        time.sleep(len(_images(batch)) / self.rate)


def consumer(name: str, a) -> object:
    if name == "cnn-1t":
        return ConvNet(1)
    if name == "cnn-all":
        return ConvNet(cpu_cores())
    if name == "busy-core":
        return BusyCore(a.busy_rate)
    if name.startswith("sleep-"):
        return Sleeper(float(name.split("-", 1)[1]))
    raise SystemExit(f"unknown consumer {name!r}")


# -- one run --------------------------------------------------------------------------------------

def train(p: Pipeline, nw, cons, seconds: float, batch_size: int, tail_from: float = 30.0) -> dict:
    loader = DataLoader(p, num_workers=nw, batch_size=batch_size, device="cpu", persistent_workers=True)
    cons.start()
    epoch = 0
    it = iter(loader)
    cons.step(next(it))           # the workers are up before the clock starts
    rows = waited = 0.0
    steps = 0
    t0 = time.perf_counter()
    tail_t = tail_rows = None          # the clock and rows when tail_from seconds had passed
    while time.perf_counter() - t0 < seconds:
        if tail_t is None and time.perf_counter() - t0 >= tail_from:
            tail_t, tail_rows = time.perf_counter(), rows
        tw = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            epoch += 1
            loader.set_epoch(epoch)
            it = iter(loader)
            b = next(it)
        waited += time.perf_counter() - tw
        cons.step(b)
        rows += len(_images(b))
        steps += 1
    wall = time.perf_counter() - t0
    end = t0 + wall
    tail = (rows - tail_rows) / (end - tail_t) if tail_t is not None and end > tail_t else None
    r = {"workers": nw, "samples_per_s": rows / wall, "waiting_share": waited / wall, "steps": steps,
         "wall_s": round(wall, 2), "tail_from_s": tail_from, "tail_samples_per_s": tail}
    if nw == "auto":
        b = loader.balancer
        st = loader.stats()["balancer"]
        r["final"] = f"{b.workers}w/p{b.prefetch}"
        r["final_workers"] = b.workers
        r["timeline"] = [{"t": round(x["t"] - t0, 2), "rate": round(x["delivered_rate"], 1),
                          "wait": round(x["wait_fraction"], 4), "workers": x["workers"], "prefetch": x["prefetch"],
                          "cores": round(x["cpu_cores_used"], 2),
                          "decision": x["decision"], "reason": x.get("reason"), "resets": x.get("resets")}
                         for x in b.timeline]
        r["experiments"] = [e["text"] for e in st["experiments"]]
        r["summary"] = st["summary"]
        r["resets"] = st["resets"]
    loader.shutdown()
    del it
    return r


def paired_mean(ratios: list[float]) -> dict:
    """The geometric mean of within-round ratios and its relative standard error (the spread of
    the log ratios over rounds / sqrt(rounds); None with fewer than two rounds)."""
    logs = [math.log(x) for x in ratios if x > 0]
    if not logs:
        return {"auto_vs_best_paired_mean": None, "auto_vs_best_paired_se": None}
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else None
    return {"auto_vs_best_paired_mean": math.exp(statistics.fmean(logs)), "auto_vs_best_paired_se": se}


def reached(auto: dict, best_rate: float) -> float | None:
    """Seconds from the clock's start until three consecutive windows average within TIE of
    ``best_rate`` (None: never)."""
    tl = auto.get("timeline") or []
    for i in range(2, len(tl)):
        if statistics.mean(x["rate"] for x in tl[i - 2:i + 1]) >= (1 - TIE) * best_rate:
            return max(0.0, tl[i]["t"])
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--consumer", action="append",
                    help="cnn-1t, cnn-all, busy-core, sleep-R (repeatable; default all, sleep at each --sleep-rate)")
    ap.add_argument("--sleep-rate", type=float, action="append", help="samples/s (default 300, 800, 3000)")
    ap.add_argument("--busy-rate", type=float, default=1000.0, help="samples/s the busy-core consumer takes")
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--crop", type=int, default=112)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tail-from", type=float, default=30.0,
                    help="each run's rate is also measured from this many seconds on (default 30: the "
                         "goal is that auto reaches the best fixed count within 30 s)")
    ap.add_argument("--only", choices=["auto"], default=None,
                    help="run auto alone (a look at its decisions; no comparison, results not meant for bench/results)")
    ap.add_argument("--max-fixed", type=int, default=None, help="largest fixed count (default cores + 1)")
    ap.add_argument("--counts", default=None,
                    help="fixed counts to run, comma-separated (default 1 .. --max-fixed): fewer runs a round leave "
                         "time for more rounds where the best count is known, and more rounds narrow the comparison")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="leave out the control run (by default each round also runs the count auto starts at a "
                         "second time, so the results say how far one setting's runs spread within a round)")
    ap.add_argument("--note", default="", help="a note recorded with the results (e.g. the machine was shared)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = ap.parse_args(argv)
    rates = a.sleep_rate or [300.0, 800.0, 3000.0]
    names = a.consumer or ["cnn-1t", "cnn-all", "busy-core", *[f"sleep-{r:g}" for r in rates]]
    t_start = time.perf_counter()
    warnings.filterwarnings("ignore", message="num_workers=.* exceeds the")  # cores + 1 is measured on purpose
    data = str(default_sample(a.images, progress=True))
    doc = yaml.safe_load(PIPELINE.read_text())
    doc = copy.deepcopy(doc)
    doc["source"]["path"] = data
    doc["output"]["device"] = "cpu"
    for s in doc["stages"]:
        if s["op"] == "random_resized_crop":
            s["size"] = a.crop
    p = Pipeline.from_config(doc, where=str(PIPELINE))
    cores = cpu_cores()
    counts = ([int(x) for x in a.counts.split(",")] if a.counts
              else list(range(1, (a.max_fixed or cores + 1) + 1)))
    start = start_workers(cores)
    kinds = ["auto"] if a.only == "auto" else [*counts, "auto"] + (["control"] if a.control else [])
    results = []
    for name in names:
        runs: dict[str, list] = {str(k): [] for k in kinds}
        for rnd in range(a.rounds):
            order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]
            for pos, nw in enumerate(order):
                r = train(p, start if nw == "control" else nw, consumer(name, a), a.seconds, a.batch_size,
                          a.tail_from)
                r["round"], r["position"] = rnd, pos
                runs[str(nw)].append(r)
                print(f"{name} round {rnd} workers {nw}: {r['samples_per_s']:,.0f} samples/s, waiting "
                      f"{100 * r['waiting_share']:.1f} %" + (f", ended at {r['final']}" if nw == "auto" else ""),
                      file=sys.stderr, flush=True)
        if a.only == "auto":
            results.append({"consumer": name, "runs": runs})
            continue
        med = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in runs.items()}
        fixed = {k: med[str(k)] for k in counts}
        top = max(fixed.values())
        best = min(k for k, v in fixed.items() if v >= (1 - TIE) * top)
        reach = [reached(x, fixed[best]) for x in runs["auto"]]
        tails = {k: [x["tail_samples_per_s"] for x in v if x.get("tail_samples_per_s") is not None]
                 for k, v in runs.items()}
        tail_med = {k: statistics.median(v) if v else None for k, v in tails.items()}
        tail_fixed = {k: tail_med[str(k)] for k in counts if tail_med[str(k)] is not None}
        tail_top = max(tail_fixed.values()) if tail_fixed else None
        paired = [x["samples_per_s"] / y["samples_per_s"] for x, y in zip(runs["auto"], runs[str(best)])]
        paired_tail = [x["tail_samples_per_s"] / y["tail_samples_per_s"] for x, y in zip(runs["auto"], runs[str(best)])
                       if x.get("tail_samples_per_s") and y.get("tail_samples_per_s")]
        tail_mean = paired_mean(paired_tail)
        control = ([x["samples_per_s"] / y["samples_per_s"] for x, y in zip(runs["control"], runs[str(start)])]
                   if "control" in runs else [])
        # auto against the control when the two ran one after the other (minutes closer than the
        # fixed run of the same count) and the control's count is the best fixed count
        next_to = ([x["samples_per_s"] / y["samples_per_s"] for x, y in zip(runs["auto"], runs["control"])
                    if abs(x["position"] - y["position"]) == 1] if control and start == best else [])
        results.append({
            "consumer": name, "runs": runs, "median_samples_per_s": med,
            "auto_vs_adjacent_control": next_to,
            "auto_vs_adjacent_control_median": statistics.median(next_to) if next_to else None,
            "auto_vs_best_paired": paired, "auto_vs_best_paired_median": statistics.median(paired),
            **paired_mean(paired),
            "auto_tail_vs_best_paired": paired_tail,
            "auto_tail_vs_best_paired_median": statistics.median(paired_tail) if paired_tail else None,
            "auto_tail_vs_best_paired_mean": tail_mean["auto_vs_best_paired_mean"],
            "auto_tail_vs_best_paired_se": tail_mean["auto_vs_best_paired_se"],
            "control_workers": start if control else None, "control_vs_same": control,
            "median_waiting_share": {k: statistics.median(x["waiting_share"] for x in v) for k, v in runs.items()},
            "best_fixed": best, "best_fixed_rate": fixed[best], "top_fixed_rate": top,
            "auto_vs_top": med["auto"] / top, "auto_final": [x["final"] for x in runs["auto"]],
            "auto_reached_s": reach, "median_tail_samples_per_s": tail_med,
            "auto_tail_vs_best_fixed_tail": (tail_med["auto"] / tail_med[str(best)]
                                             if tail_med["auto"] and tail_med[str(best)] else None),
            "auto_tail_vs_top_fixed_tail": (tail_med["auto"] / tail_top if tail_med["auto"] and tail_top else None)})
    out = {"format": "feedgpu.bench.balancer/2", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": machine(), "note": a.note,
           "settings": {"pipeline": str(PIPELINE.relative_to(REPO)), "data": data, "images": a.images,
                        "crop": a.crop, "batch_size": a.batch_size, "seconds": a.seconds, "rounds": a.rounds,
                        "busy_rate": a.busy_rate, "fixed_counts": counts, "tie": TIE, "tail_from": a.tail_from},
           "consumers": results, "total_seconds": round(time.perf_counter() - t_start, 1)}
    if a.only == "auto":
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "balancer_auto.json").write_text(json.dumps(out, indent=1))
        return 0
    write_results(a.out, "balancer", out, markdown)
    return 0


def _f(v, spec=",.0f"):
    return "-" if v is None else format(v, spec)


def markdown(doc: dict) -> str:
    m, s = doc["machine"], doc["settings"]
    counts = s["fixed_counts"]
    lines = ["# Balancer: num_workers=\"auto\" against fixed worker counts, real training loops", "",
             f"Machine: {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB, PIL {m['pil_label']}, "
             f"torch {m['torch']}. Data: {s['images']} ImageNet-like images, `{s['pipeline']}` with a "
             f"{s['crop']} px crop, batch {s['batch_size']}, persistent workers. Each run {s['seconds']:.0f} s in a "
             f"fresh loader, {s['rounds']} round(s), order rotated each round; medians over rounds. Best fixed: the "
             f"fewest workers within {100 * s['tie']:.0f} % of the highest fixed rate.", ""]
    if doc.get("note"):
        lines += [f"Note: {doc['note']}", ""]
    lines += ["Trained samples/s (waiting share of step time):", "",
              "| consumer | " + " | ".join(f"{k} workers" for k in counts)
              + " | auto | best fixed | auto / highest fixed | auto ended at | auto within 3 % after |",
              "|---" * (len(counts) + 6) + "|"]
    for c in doc["consumers"]:
        med, wt = c["median_samples_per_s"], c["median_waiting_share"]
        cells = [f"{_f(med[str(k)])} ({100 * wt[str(k)]:.0f} %)" for k in counts]
        reach = ", ".join("never" if x is None else f"{x:.0f} s" for x in c["auto_reached_s"])
        lines.append(f"| {c['consumer']} | " + " | ".join(cells)
                     + f" | {_f(med['auto'])} ({100 * wt['auto']:.0f} %) | {c['best_fixed']} | "
                       f"{c['auto_vs_top']:.3f} | {', '.join(c['auto_final'])} | {reach} |")
    tail_from = s.get("tail_from")
    if tail_from is not None:
        lines += ["", f"From {tail_from:.0f} s to the end of each run (medians over rounds, samples/s): what `auto` "
                  "trains once it has had the time the goal gives it:", "",
                  "| consumer | " + " | ".join(f"{k} workers" for k in counts)
                  + " | auto | auto / best fixed | auto / highest fixed |", "|---" * (len(counts) + 4) + "|"]
        for c in doc["consumers"]:
            tm = c.get("median_tail_samples_per_s") or {}
            lines.append(f"| {c['consumer']} | " + " | ".join(_f(tm.get(str(k))) for k in counts)
                         + f" | {_f(tm.get('auto'))} | {_f(c.get('auto_tail_vs_best_fixed_tail'), '.3f')} | "
                           f"{_f(c.get('auto_tail_vs_top_fixed_tail'), '.3f')} |")
    if any(c.get("auto_vs_best_paired") for c in doc["consumers"]):
        lines += ["", "Within each round (runs minutes apart, so a drift of the machine's speed between rounds cancels): "
                  "auto over the best fixed count of the same round, and the control, the count auto starts at "
                  "run a second time in the same round, over its first run (how far one setting spreads):", "",
                  "| consumer | auto / best fixed, per round | median | geometric mean ± standard error | "
                  "control / same count, per round | "
                  "median distance from 1 | auto / control run next to it, per round | median |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in doc["consumers"]:
            pr, ctl = c.get("auto_vs_best_paired") or [], c.get("control_vs_same") or []
            nxt = c.get("auto_vs_adjacent_control") or []
            spread = statistics.median(abs(x - 1) for x in ctl) if ctl else None
            lines.append(f"| {c['consumer']} | {', '.join(f'{x:.3f}' for x in pr)} | "
                         f"{_f(c.get('auto_vs_best_paired_median'), '.3f')} | "
                         f"{_f(c.get('auto_vs_best_paired_mean'), '.3f')} ± {_f(c.get('auto_vs_best_paired_se'), '.3f')} | "
                         f"{', '.join(f'{x:.3f}' for x in ctl) or '-'} | {_f(spread, '.3f')} | "
                         f"{', '.join(f'{x:.3f}' for x in nxt) or '-'} | "
                         f"{_f(c.get('auto_vs_adjacent_control_median'), '.3f')} |")
        if any(c.get("auto_tail_vs_best_paired") for c in doc["consumers"]):
            lines += ["", f"The same within each round, from {s.get('tail_from', 30):.0f} s to the end of each run "
                      "(once `auto` has had the time the goal gives it):", "",
                      "| consumer | auto / best fixed from then on, per round | median | "
                      "geometric mean ± standard error |", "|---|---|---|---|"]
            for c in doc["consumers"]:
                pt = c.get("auto_tail_vs_best_paired") or []
                lines.append(f"| {c['consumer']} | {', '.join(f'{x:.3f}' for x in pt) or '-'} | "
                             f"{_f(c.get('auto_tail_vs_best_paired_median'), '.3f')} | "
                             f"{_f(c.get('auto_tail_vs_best_paired_mean'), '.3f')} ± "
                             f"{_f(c.get('auto_tail_vs_best_paired_se'), '.3f')} |")
        lines += ["", "The control runs right after auto unless a round's rotation splits the two; where its count is "
                  "the best fixed count, auto over the control next to it is the comparison the machine's drift "
                  "moves least (the last two columns)."]
    lines += ["", "Each round's runs (samples/s):", ""]
    for c in doc["consumers"]:
        per = "; ".join(f"{k}: " + ", ".join(_f(x["samples_per_s"]) for x in v) for k, v in c["runs"].items())
        lines.append(f"- {c['consumer']}: {per}")
    lines += ["", "The balancer's experiments (first auto run of each consumer):", ""]
    for c in doc["consumers"]:
        a = c["runs"]["auto"][0]
        lines.append(f"- {c['consumer']}: " + ("; ".join(a["experiments"]) or "none") + f". Summary: {a['summary']}")
    lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
