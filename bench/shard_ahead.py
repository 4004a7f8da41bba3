"""Read-ahead of shards over a simulated link: how long the reader waits for the network.

    .venv/bin/python bench/shard_ahead.py                  # ~1.5 min on the 2-core dev machine
    .venv/bin/python bench/shard_ahead.py --rounds 5 --latency 0.05 --transfer 0.03

No network: a fake shard cache (:class:`Link`) answers each fetch after ``--latency`` seconds (the
store's time to first byte, overlapping between fetches) plus ``--transfer`` seconds on one shared
link (transfers queue: in-flight fetches hide latency, not bandwidth). A reader takes
``--shards`` x ``--size`` samples in the epoch order, in batches of ``--batch``, sleeping
``--per-sample`` seconds a sample (a training step), acquiring each sample's shard through
:class:`feedgpu.shard_ahead.ShardAhead` and releasing it after the batch. Settings, run in turn
in each round:

* ``on demand``: a shard is fetched when the reader first needs it (``max_in_flight=1``,
  ``max_held=1``: only the shard waited for is ever requested), shard-aware order;
* ``ahead 1`` / ``ahead 4``: read-ahead with 1 / 4 fetches in flight, shard-aware order;
* ``plain shuffle``: read-ahead with 4 in flight, the plain shuffle (every shard needed at once).

Reported per setting: the reader's wall time, its time waiting for the network
(``network_wait_s``), and the wait before the first batch, medians and per-round ranges.
Results: ``bench/results/shard_ahead.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from feedgpu.order.sharded import ShardedOrder
from feedgpu.shard_ahead import ShardAhead

RESULTS = Path(__file__).resolve().parent / "results"


class Link:
    """Fetches after ``latency`` s (in parallel) plus ``transfer`` s on one shared link."""

    def __init__(self, latency: float, transfer: float):
        self.latency, self.transfer = latency, transfer
        self.wire = threading.Lock()

    def fetch_async(self, shard) -> Future:
        fut: Future = Future()

        def run():
            time.sleep(self.latency)
            with self.wire:
                time.sleep(self.transfer)
            fut.set_result(f"/cache/{shard}")

        threading.Thread(target=run, daemon=True).start()
        return fut


def one_run(order: np.ndarray, shard_of: np.ndarray, a, in_flight: int, held: int | None) -> dict:
    link = Link(a.latency, a.transfer)
    t0 = time.perf_counter()
    first = None
    with ShardAhead(order, shard_of, link, max_in_flight=in_flight, max_held=held) as ahead:
        for lo in range(0, len(order), a.batch):
            hi = min(lo + a.batch, len(order))
            for pos in range(lo, hi):
                ahead.acquire(pos)
            if first is None:
                first = time.perf_counter() - t0
            time.sleep(a.per_sample * (hi - lo))
            for pos in range(lo, hi):
                ahead.release(pos)
        st = ahead.stats()
    return {"wall_s": round(time.perf_counter() - t0, 3), "network_wait_s": round(st["network_wait_s"], 3),
            "first_batch_s": round(first, 3), "max_held": st["max_held"], "max_in_flight": st["max_in_flight"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--per-sample", type=float, default=0.0005)
    ap.add_argument("--latency", type=float, default=0.05)
    ap.add_argument("--transfer", type=float, default=0.03)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "shard_ahead"))
    a = ap.parse_args()
    n = a.shards * a.size
    shard_of = np.repeat(np.arange(a.shards), a.size)
    aware = ShardedOrder(n, a.batch, seed=0, shard_window=a.window, shard_of=shard_of)
    plain = ShardedOrder(n, a.batch, seed=0)
    settings = {"on demand": (aware, 1, 1), "ahead 1": (aware, 1, None), "ahead 4": (aware, 4, None),
                "plain shuffle": (plain, 4, None)}
    runs: dict[str, list] = {k: [] for k in settings}
    for r in range(a.rounds):
        for name, (order, in_flight, held) in settings.items():
            runs[name].append(one_run(order.epoch_order(r), shard_of, a, in_flight, held))
            print(r, name, runs[name][-1], flush=True)
    summary = {}
    for name, rs in runs.items():
        summary[name] = {k: {"median": statistics.median(x[k] for x in rs), "min": min(x[k] for x in rs),
                             "max": max(x[k] for x in rs)} for k in ("wall_s", "network_wait_s", "first_batch_s")}
        summary[name]["max_held"] = max(x["max_held"] for x in rs)
    compute = n * a.per_sample
    out = {"settings": vars(a), "compute_s": compute, "runs": runs, "summary": summary,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "note": "2-core VM shared with other agents; the link and the reader are sleeps"},
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# Read-ahead of shards over a simulated link ({a.rounds} rounds, `bench/shard_ahead.py`)", "",
             f"{a.shards} shards of {a.size} samples, shard-aware window {a.window}, batches of {a.batch}, "
             f"{1e3 * a.per_sample:.1f} ms of training per sample ({compute:.1f} s an epoch); each fetch "
             f"{1e3 * a.latency:.0f} ms to first byte (overlapping) + {1e3 * a.transfer:.0f} ms on one shared link. "
             f"{os.cpu_count()} cores, shared with other agents (the link and the reader sleep, so the load "
             "matters little).", "",
             "| setting | wall (s) | waiting for the network (s) | first batch after (s) | most shards held |",
             "| --- | --- | --- | --- | --- |"]
    for name, s in summary.items():
        cell = {k: f"{s[k]['median']:.2f} ({s[k]['min']:.2f}-{s[k]['max']:.2f})"
                for k in ("wall_s", "network_wait_s", "first_batch_s")}
        lines.append(f"| {name} | {cell['wall_s']} | {cell['network_wait_s']} | {cell['first_batch_s']} | "
                     f"{s['max_held']} |")
    lines += ["", "Medians, per-round range in brackets."]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
