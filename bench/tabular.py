#!/usr/bin/env python
"""Feature engineering on the flights table: feedgpu's CPU engine, DALI's CPU engine, pandas.

One definition, ``pipelines/flights_features.yaml`` (2 lookup joins, 17 feature steps = 34
per-column stages; 38 dense features, 7 categorical indices, a label), three implementations of
it, run side by side:

* ``feedgpu_cpu``: ``feedgpu.DataLoader`` over the ``TablePipeline``, CPU engine (numpy/pyarrow);
* ``feedgpu_dali_cpu``: the same loader, DALI engine on DALI's CPU operators (1 thread);
* ``pandas``: ``bench/tabular_pandas.py``, the same joins and stages with pandas, reusing the
  same fit statistics; batches turned into the same dict of torch tensors.

Equal cores: every subject is single-threaded (``num_workers=0``, DALI ``num_threads=1``,
pyarrow and OpenMP limited to one thread) in its own fresh process. Before the rounds, the
outputs of the three are compared on one batch (integers equal, dense within 1e-5). Each round
runs every subject once, in turn; a run is one unrecorded warm-up epoch and one timed epoch
(shuffled, ``--batch-size`` rows per batch, the same seeded order for all); the fit is done once
beforehand and loaded by all (not timed). Reported: medians over rounds of rows per second of
wall time and of the process's CPU time (CPU time is less sensitive to other processes on a
shared machine), and the ratios to pandas.

Writes ``bench/results/tabular.json`` and ``bench/results/tabular.md``.

    .venv/bin/python -m bench.tabular                  # 5 rounds, batch 4096
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import REPO, machine as machine_info, write_markdown, write_results  # noqa: E402
PIPELINE = REPO / "pipelines" / "flights_features.yaml"
SUBJECTS = ("feedgpu_cpu", "feedgpu_dali_cpu", "pandas")
MARK = "@@result "
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _pipeline(fit: str, engine: str = "python"):
    from feedgpu.tabular import TablePipeline

    return TablePipeline.from_yaml(PIPELINE, **{"fit.path": fit, "fit.mode": "load", "engine.name": engine,
                                                "engine.threads": 1})


def _batches(subject: str, fit: str, batch_size: int, seed: int):
    """An iterator factory yielding the epoch's dicts of tensors for ``subject``."""
    import torch

    if subject == "pandas":
        from feedgpu.order.sharded import ShardedOrder
        from bench.tabular_pandas import PandasPipeline

        pp = PandasPipeline(_pipeline(fit))
        order = ShardedOrder(len(pp.df), batch_size, shuffle=True, seed=seed)

        def epoch(e):
            for b in range(len(order)):
                yield {k: torch.from_numpy(v) for k, v in pp.transform(order.batch(e, b)).items()}
        return epoch
    p = _pipeline(fit, "dali" if subject == "feedgpu_dali_cpu" else "python")
    dl = p.loader(batch_size=batch_size, num_workers=0, seed=seed, shuffle=True)

    def epoch(e):
        dl.set_epoch(e)
        return iter(dl)
    return epoch


def child(subject: str, fit: str, batch_size: int, seed: int) -> dict:
    import pyarrow as pa

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    epoch = _batches(subject, fit, batch_size, seed)
    rows = sum(len(b["label"]) for b in epoch(0))  # warm-up (one-time costs, first touch)
    w0, c0 = time.perf_counter(), time.process_time()
    n = sum(len(b["label"]) for b in epoch(1))
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    assert n == rows
    return {"subject": subject, "rows": n, "wall_s": wall, "cpu_s": cpu, "rows_per_s": n / wall,
            "rows_per_cpu_s": n / cpu}


def compare(fit: str, batch_size: int) -> dict:
    """Max differences of the DALI engine and pandas from feedgpu's CPU engine on one batch."""
    import numpy as np
    from feedgpu.tabular.dali import DaliTableEngine
    from bench.tabular_pandas import PandasPipeline

    p = _pipeline(fit)
    idx = np.random.default_rng(7).permutation(len(p))[:batch_size]
    ref = p.transform(idx)
    out = {}
    for name, o in (("feedgpu_dali_cpu", DaliTableEngine(p).transform(idx)), ("pandas", PandasPipeline(p).transform(idx))):
        ints = all(np.array_equal(ref[k], o[k]) for k in ref if ref[k].dtype.kind == "i")
        dmax = float(np.abs(ref["dense"] - o["dense"]).max())
        lab = bool(np.array_equal(ref["label"], o["label"]))
        ok = ints and lab and np.allclose(ref["dense"], o["dense"], atol=1e-5, rtol=1e-5)
        out[name] = {"integers_equal": ints, "label_equal": lab, "dense_max_abs_diff": dmax, "ok": bool(ok)}
    return out


def machine() -> dict:
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    try:
        import nvidia.dali as dali
        dv = dali.__version__
    except ImportError:
        dv = None
    return machine_info(numpy=np.__version__, pyarrow=pa.__version__, pandas=pd.__version__, dali=dv)


def run_child(subject: str, a) -> dict:
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "bench.tabular", "--child", subject, "--fit", a.fit, "--batch-size", str(a.batch_size),
                        "--seed", str(a.seed)], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    for line in r.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    sys.exit(f"{subject} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")


def markdown(doc: dict) -> str:
    m, s, med = doc["machine"], doc["settings"], doc["median"]
    L = ["# Feature engineering on the flights table: feedgpu CPU engine, DALI CPU engine, pandas", "",
         f"- Machine: {m.get('cpu_count', m.get('nproc', m.get('cpus')))} CPUs ({m['cpu_model']}), {m['ram_gb']} GB RAM, {m['platform']}; Python "
         f"{m['python']}, numpy {m['numpy']}, pyarrow {m['pyarrow']}, pandas {m['pandas']}, torch {m['torch']}, "
         f"DALI {m['dali']}",
         f"- Load (1/5/15-min averages, shared machine): before {doc['load_before']}, after {doc['load_after']}",
         f"- Data: {s['data']} ({s['rows']:,} rows) joined with weather and planes; pipeline "
         f"`{s['pipeline']}` ({s['dense']} dense float32 features, {s['categorical']} int64 categorical, label)",
         f"- Settings: batch {s['batch_size']}, shuffled, one timed epoch after one warm-up epoch per run, "
         f"{s['rounds']} rounds (subjects in turn), medians; every subject single-threaded in its own process "
         "(num_workers=0, DALI 1 thread, pyarrow/OpenMP 1 thread); fit statistics loaded, not timed",
         "- Outputs compared on one batch against feedgpu's CPU engine: "
         + "; ".join(f"{k}: integers equal {v['integers_equal']}, label equal {v['label_equal']}, dense max abs diff "
                     f"{v['dense_max_abs_diff']:.2g}" for k, v in doc["parity"].items()),
         "", "| subject | rows/s (wall) | rows/s (CPU time) | epoch wall s | vs pandas (wall) | vs pandas (CPU) |",
         "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for k in SUBJECTS:
        v = med[k]
        L.append(f"| {k} | {v['rows_per_s']:,.0f} | {v['rows_per_cpu_s']:,.0f} | {v['wall_s']:.3f} | "
                 f"{v['rows_per_s'] / med['pandas']['rows_per_s']:.2f}x | "
                 f"{v['rows_per_cpu_s'] / med['pandas']['rows_per_cpu_s']:.2f}x |")
    spread = {k: [r["rows_per_s"] for r in doc["runs"] if r["subject"] == k] for k in SUBJECTS}
    L += ["", "Wall-time rates, largest / smallest round: " + ", ".join(
          f"{k} {max(v) / min(v):.1f}x" for k, v in spread.items()) + " (the load is above)."]
    L += ["", "Target feedgpu >= 1.5x pandas; measured "
          f"{med['feedgpu_cpu']['rows_per_s'] / med['pandas']['rows_per_s']:.2f}x (wall).",
          "", "Per-round wall rows/s: " + "; ".join(
              f"{k}: " + ", ".join(f"{r['rows_per_s']:,.0f}" for r in doc["runs"] if r["subject"] == k) for k in SUBJECTS),
          ""]
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fit", default=str(REPO / "bench" / "out" / "flights_features.fit.json"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--child", choices=SUBJECTS, help=argparse.SUPPRESS)
    ap.add_argument("--render", action="store_true", help="rewrite tabular.md from tabular.json and stop")
    a = ap.parse_args(argv)
    if a.render:
        doc = json.loads((Path(a.out) / "tabular.json").read_text())
        write_markdown(Path(a.out) / "tabular.md", markdown(doc))
        return 0
    if a.child:
        print(MARK + json.dumps(child(a.child, a.fit, a.batch_size, a.seed)), flush=True)
        return 0
    t0 = time.time()
    from feedgpu.tabular import TablePipeline

    p = TablePipeline.from_yaml(PIPELINE, **{"fit.path": a.fit, "fit.mode": "refit"})  # fit once, saved
    parity = compare(a.fit, a.batch_size)
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs = []
    for r in range(a.rounds):
        for s in SUBJECTS:
            res = run_child(s, a)
            res["round"] = r
            runs.append(res)
            print(f"round {r} {s}: {res['rows_per_s']:,.0f} rows/s wall, {res['rows_per_cpu_s']:,.0f} rows/CPU-s",
                  file=sys.stderr)
    med = {s: {k: statistics.median(x[k] for x in runs if x["subject"] == s)
               for k in ("rows_per_s", "rows_per_cpu_s", "wall_s", "cpu_s")} for s in SUBJECTS}
    doc = {"machine": machine(), "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()],
           "settings": {"pipeline": str(PIPELINE.relative_to(REPO)), "data": "shared/data/tables/flights.parquet",
                        "rows": len(p), "dense": len(p.dense_names()), "categorical": len(p.cardinalities()),
                        "batch_size": a.batch_size, "rounds": a.rounds, "seed": a.seed},
           "parity": parity, "runs": runs, "median": med,
           "total_seconds": time.time() - t0}
    write_results(a.out, "tabular", doc, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
