"""The shard-aware shuffle's cost and randomness beside the plain shuffle, in one run.

    .venv/bin/python bench/shard_order.py                      # ~1 min on the 2-core dev machine
    .venv/bin/python bench/shard_order.py --samples 10000000 --shard-size 1000 --window 8 --rounds 5

Each round times, one after the other in this process, the plain shuffle's epoch order
(``ShardedOrder.epoch_order``: ``default_rng([seed, epoch]).permutation(n)``) and
:func:`feedgpu.order.shard_shuffle.shard_order` for the same ``n`` samples in shards of ``--shard-size``
(epoch = round, so each round draws a new order). Reported: seconds per epoch order (median and
per-round range) and their ratio per round; for the last round's orders, the most shards open at
once and the share of consecutive samples from the same shard. Results:
``bench/results/shard_order.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from feedgpu.order.sharded import ShardedOrder
from feedgpu.order.shard_shuffle import max_open, same_shard_neighbours, shard_order

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "shard_order"))
    a = ap.parse_args()
    n = a.samples
    shard_of = (np.arange(n, dtype=np.int64) // a.shard_size).astype(np.int32)
    plain = ShardedOrder(n, 256, seed=0)
    rounds = []
    for r in range(a.rounds):
        t = time.perf_counter()
        p = plain.epoch_order(r)
        t_plain = time.perf_counter() - t
        t = time.perf_counter()
        s = shard_order(shard_of, seed=0, epoch=r, window=a.window)
        t_shard = time.perf_counter() - t
        rounds.append({"plain_s": round(t_plain, 3), "shards_s": round(t_shard, 3),
                       "ratio": round(t_shard / t_plain, 2), "load": round(os.getloadavg()[0], 2)})
        print(rounds[-1], flush=True)
    quality = {"shards": {"max_open": max_open(s, shard_of), "same_shard_neighbours": round(same_shard_neighbours(s, shard_of), 4)},
               "plain": {"max_open": max_open(p, shard_of), "same_shard_neighbours": round(same_shard_neighbours(p, shard_of), 5)}}
    med = {k: statistics.median(x[k] for x in rounds) for k in ("plain_s", "shards_s", "ratio")}
    rng = {k: (min(x[k] for x in rounds), max(x[k] for x in rounds)) for k in ("plain_s", "shards_s", "ratio")}
    out = {"settings": vars(a), "shards": -(-n // a.shard_size), "rounds": rounds, "median": med, "range": rng,
           "quality": quality,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "numpy": np.__version__,
                       "note": "2-core VM shared with other agents; load average per round in 'rounds'"},
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# Shard-aware shuffle vs plain shuffle: epoch order of {n:,} samples",
             "",
             f"{out['shards']:,} shards of {a.shard_size} samples, window {a.window}, {a.rounds} rounds "
             f"(`bench/shard_order.py`), numpy {np.__version__}, {os.cpu_count()} cores, {platform.platform()}; "
             "the VM was shared with other agents (load average per round below).",
             "",
             "| round | plain shuffle (s) | shard-aware (s) | ratio | load |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {i} | {x['plain_s']} | {x['shards_s']} | {x['ratio']} | {x['load']} |" for i, x in enumerate(rounds)]
    lines += ["",
              f"Median: plain {med['plain_s']:.2f} s ({rng['plain_s'][0]}-{rng['plain_s'][1]}), shard-aware "
              f"{med['shards_s']:.2f} s ({rng['shards_s'][0]}-{rng['shards_s'][1]}); ratio per round median "
              f"{med['ratio']:.2f}x ({rng['ratio'][0]}-{rng['ratio'][1]}x).",
              "",
              f"Last round's orders: most shards open at once {quality['shards']['max_open']} (plain: "
              f"{quality['plain']['max_open']}); consecutive samples from the same shard "
              f"{quality['shards']['same_shard_neighbours']:.4f} (1/window = {1 / a.window:.4f}; plain: "
              f"{quality['plain']['same_shard_neighbours']:.5f})."]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
