"""Rendering ``feedgpu bench``'s results as text: the comparison table with its header lines and
speed-ups, the warnings a skewed run deserves, and the "why is my GPU idle" report. Functions
return lines; the command line prints them.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["balancer_lines", "comparison_lines", "comparison_warnings", "format_table", "idle_lines", "memory_notes",
           "write_json"]

MB = 1 << 20

#: others' CPU (percent of one core) above which a comparison is flagged as skewed.
BUSY_PERCENT = 15


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(summary: dict, names: list[str] | None = None) -> str:
    """One row per loader: workers, samples/s and ms/batch (from the same timed window: their
    product is the batch size), timed batches per run (median), first batch, CPU %, and the
    memory each worker holds alone (USS, median)."""
    header = ("loader", "workers", "samples/s", "ms/batch", "timed batches", "1st batch s", "CPU %",
              "USS/worker MB")
    rows = [header]
    for name in names or list(summary):
        s = summary[name]
        workers = f"{s['threads']} threads" if s.get("threads") else str(s["workers"])
        timed = "-" if s.get("timed_batches") is None else f"{s['timed_batches']:.0f} in {s['timed_seconds']:.1f} s"
        rows.append((s["label"], workers, _fmt(s["samples_per_s"], ".0f"), _fmt(s["ms_per_batch"], ".1f"), timed,
                     _fmt(s["first_batch_s"], ".2f"), _fmt(s["cpu_percent"], ".0f"), _fmt(s["uss_mb_per_worker"], ".0f")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def comparison_lines(doc: dict) -> list[str]:
    """The stdout of ``feedgpu bench`` for a ``feedgpu.bench/1`` document: pipeline, data, machine
    and settings lines, the table of :func:`format_table`, what its columns are, the speed-ups and
    the skipped engines."""
    s, d, m = doc["settings"], doc["data"], doc["machine"]
    if s.get("min_seconds"):
        timed = (f"timed: at least {s['timed_batches']} batches and {s['min_seconds']:g} s per run after "
                 f"{s['warmup']} warm-up batches")
    else:
        timed = f"{s['timed_batches']} timed batches after {s['warmup']} warm-up per run"
    out = [f"pipeline: {s['pipeline_name']} ({s['pipeline']})",
           f"data:     {d['path']}: {d['images']} images, mean {d['mean_width']}x"
           f"{d['mean_height']} px ({d['mean_megapixels']} MP), "
           f"{_fmt(d['mean_bytes'] and d['mean_bytes'] / 1024, '.0f')} KB",
           f"machine:  {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB, "
           f"PIL: {m['pil_label']} (both loaders), torch {m['torch']}",
           f"settings: {s['workers']} workers, batch {s['batch_size']}, {timed}, {s['rounds']} rounds (medians), "
           f"prefetch {s['prefetch_factor']}, device {s['device']}",
           ""]
    summary = doc["summary"]
    out.append(format_table(summary))
    out.append("samples/s and ms/batch: one timed window (worker start-up excluded), per run; medians over the "
               "rounds")
    memory = ("USS/worker: memory each worker holds alone (pages no other process maps); RSS, in the JSON, counts "
              "the libraries and shared batch buffers every worker maps once per worker")
    budgets = {v["worker_memory_mb"] for v in summary.values() if v.get("worker_memory_mb")}
    if budgets:
        memory += f"; feedgpu's budget {', '.join(f'{b:,.0f}' for b in sorted(budgets))} MB per worker (worker_memory)"
    out.append(memory)
    out += [f"note: {line}" for line in memory_notes(summary)]
    lines = [f"{summary[a]['label']} / {summary[b]['label']}: {v:.2f}x"
             for key, v in doc["speedups"].items() if v is not None for a, b in [key.split("_over_")]]
    if lines:
        out.append("\nspeed-up " + "\nspeed-up ".join(lines))
    out += [f"({note})" for note in s["skipped_engines"]]
    return out


def memory_notes(summary: dict, growth_mb: float | None = None) -> list[str]:
    """Lines on memory per worker: a loader whose workers copied more than ``growth_mb`` of the
    memory they share with the main process (default: the copy-on-read warning's threshold)
    between the run's first batch and its end (Python objects copied into each worker as it
    reads them), and a feedgpu loader whose workers hold more than their memory budget."""
    from ..exec.memory_watch import THRESHOLD_BYTES

    limit = THRESHOLD_BYTES / MB if growth_mb is None else growth_mb
    out = []
    for s in summary.values():
        grew, uss, budget = s.get("cow_growth_mb_per_worker"), s.get("uss_mb_per_worker"), s.get("worker_memory_mb")
        if grew is not None and grew > limit:
            out.append(f"{s['label']}: a worker copied {grew:,.0f} MB of the memory it shared with the main process "
                       f"during the run (more than {limit:,.0f} MB): copy-on-read, likely: the dataset holds Python "
                       "objects that each worker copies as it reads them; keep them in numpy arrays, a pyarrow table "
                       "or a feedgpu source")
        if budget is not None and uss is not None and uss > budget:
            out.append(f"{s['label']}: USS per worker {uss:,.0f} MB is over its memory budget of {budget:,.0f} MB "
                       "(worker_memory)")
    return out


def comparison_warnings(doc: dict) -> list[str]:
    """Warnings for a ``feedgpu.bench/1`` document: other processes busy during the timed runs,
    loaders whose batches differ in shape or dtype."""
    summary = doc["summary"]
    out = []
    busy = max(s["others_cpu_percent"] for s in summary.values())
    if busy > BUSY_PERCENT:
        out.append(f"warning: other processes used {busy:.0f} % CPU (of one core) during the timed runs; "
                   "the numbers are skewed, rerun on a quiet machine")
    outputs = {k: s["output"] for k, s in summary.items()}
    if len({json.dumps(o, sort_keys=True) for o in outputs.values()}) > 1:
        out.append("warning: the loaders' batches differ: " + ", ".join(f"{k} {o}" for k, o in outputs.items()))
    return out


def idle_lines(r: dict) -> list[str]:
    """The stdout of ``feedgpu bench --model / --consumer-rate`` for a ``feedgpu.idle/1`` report."""
    m, a, b = r["model_alone"], r["loader_alone"], r["together"]
    balanced = r.get("num_workers") == "auto"
    out = [f"consumer:      {r['consumer']}",
           f"model alone:   {1e3 * m['seconds_per_step']:.1f} ms/step = {m['samples_per_s']:,.0f} samples/s "
           f"(batch already on the device)",
           f"loader alone:  {a['samples_per_s']:,.0f} samples/s "
           + (f"(its balancer ended at {a['workers']} workers)" if balanced else f"({a['workers']} workers)"),
           f"both:          {b['samples_per_s']:,.0f} samples/s, waited {b['median_wait_ms']:.1f} ms "
           f"per batch (median)",
           f"GPU idle:      {100 * r['gpu_idle_fraction']:.1f} % (reads {100 * r['wait_split']['read']:.1f} %, "
           f"preprocessing {100 * r['wait_split']['preprocess']:.1f} %)"]
    if r.get("network_wait_fraction"):
        out.append(f"network:       the loader waited for shard downloads {100 * r['network_wait_fraction']:.1f} % "
                   "of the time (waiting for the network)")
    costs = r["stage_costs"]["ms_per_sample"]
    if costs:
        out.append("stage costs:   " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()) + " ms/sample (workers)")
    out += balancer_lines(r["balancer"])
    pl = r.get("placement")
    if pl:
        out.append("placement:     " + ", ".join(f"{k} {v['samples_per_s']:,.0f}/s on {v['cpu_cores']:.1f} cores"
                                                 for k, v in pl["measured"].items()) + f" -> {pl['choice']}")
    out += ["", r["recommendation"]]
    return out


def balancer_lines(bal: dict) -> list[str]:
    """The balancer's log of phase 3 (loader + consumer) for :func:`idle_lines`: where it ended,
    every step it took or undid from the loader's start, and the step still on trial when the run
    ended (if any). Nothing without a timeline (a fixed worker count)."""
    tl = bal.get("timeline") or []
    if not tl:
        return []
    t0 = bal.get("t_begin", tl[0]["t"])
    out = [f"balancer:      phase 3 (loader + consumer): {len(tl)} windows, ended at {bal['final_workers']} workers, "
           f"prefetch {bal['final_prefetch']}"]
    if bal.get("t_timed") is not None:
        out.append(f"  (t: seconds since the loader started; settling until t=+{bal['t_timed'] - t0:.0f}s, "
                   "timed after)")
    for d in bal["decisions"]:
        out.append(f"  t=+{d['t'] - t0:.0f}s {d['kind']} -> {d['workers']} workers / prefetch {d['prefetch']}: "
                   f"{d['reason']}")
    if bal.get("trying"):
        out.append(f"  t=+{tl[-1]['t'] - t0:.0f}s the run ended while trying {bal['trying']}: no verdict on it yet")
    elif bal.get("summary"):
        out.append(f"  t=+{tl[-1]['t'] - t0:.0f}s at the end: {bal['summary']}")
    return out


def write_json(doc: dict, path: str) -> None:
    """Write ``doc`` to ``path`` (parent folders created), indented, with a final newline."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
