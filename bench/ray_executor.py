#!/usr/bin/env python
"""The recorded Ray executor benchmark: local workers only against remote workers on a local
Ray cluster, and the balancer borrowing remote workers.

Everything runs on one machine: a Ray cluster started here (``num_cpus`` = the cores, no
dashboard, 500 MB object store), ``pipelines/imagenet_train.yaml`` (decode, random resized crop
224, flip, normalize float32 NCHW) over the default 2,000-image sample, batch 32 (19.3 MB per
batch through Ray's object store), delivered to the CPU, a loader-only consumer (it takes every
batch at once). On one node Ray cannot add CPUs: what this measures is what going through Ray
costs, and what the balancer decides.

1. Throughput, alternating the settings for ``--rounds`` rounds (medians reported):
   ``local 1``: one local worker; ``ray 1``: no local worker, one remote worker (the same work
   through Ray: the difference per batch is Ray's overhead: the batch put into the object store
   by the actor, fetched and copied into the loader's shared-memory slot); ``local 2``: two
   local workers; ``local 1 + ray 1``: one of each.
2. The balancer: ``num_workers="auto"`` with ``executor: {name: ray, max_local_workers: 1,
   max_remote_workers: 2}`` (local workers capped at 1 so that the second core is only reachable
   through Ray), an unlimited consumer for ``--auto-seconds``, then a consumer taking 40
   samples/s for as long: its timeline of windows (local and remote workers, delivered rate,
   wait, decision and reason).

Writes ``bench/results/ray_executor.json`` and ``.md`` (``--render JSON`` writes both again
from a recorded JSON, without measuring).

    flock /tmp/feedgpu-heavy.lock .venv/bin/python -m bench.ray_executor
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness import REPO, busy_seconds, git_commit, machine, wait_quiet, write_results  # noqa: E402

from feedgpu import DataLoader, Pipeline  # noqa: E402
from feedgpu.host import cpu_cores  # noqa: E402
from feedgpu.bench.idle import RateConsumer, run_loader  # noqa: E402
from feedgpu.sample_data import default_sample  # noqa: E402

PIPELINE = REPO / "pipelines" / "imagenet_train.yaml"
SETTINGS = {
    "local 1": dict(num_workers=1, executor="local"),
    "ray 1": dict(num_workers=0, executor={"name": "ray", "remote_workers": 1}),
    "local 2": dict(num_workers=2, executor="local"),
    "local 1 + ray 1": dict(num_workers=1, executor={"name": "ray", "remote_workers": 1}),
}


def throughput(p, setting: dict, seconds: float) -> dict:
    loader = DataLoader(p, **setting)
    # before the clock: the workers started and batches through each side (a remote worker's
    # process start-up and first batch take seconds; batches are delivered in order)
    it = iter(loader)
    remote = setting["executor"] != "local"
    for n in range(1, 200):
        try:
            next(it)
        except StopIteration:   # a small data set: the warm-up spans epochs
            it = iter(loader)
            continue
        if n >= 4 and (not remote or loader.stats()["executor"]["remote_batches"] >= 2):
            break
    del it
    b0, t0 = busy_seconds(), time.perf_counter()
    r = run_loader(loader, None, seconds)
    r["machine_cores"] = (busy_seconds() - b0) / (time.perf_counter() - t0)
    r["ms_per_batch"] = 1e3 * r["wall_s"] / r["batches"]
    r["executor"] = {k: v for k, v in loader.stats()["executor"].items() if k in
                     ("remote_batches", "local_batches", "retries")}
    loader.shutdown()
    return r


def balancer_run(p, seconds: float, slow_rate: float) -> dict:
    loader = DataLoader(p, num_workers="auto", executor={"name": "ray", "max_local_workers": 1,
                                                         "max_remote_workers": 2})
    phases = {}
    t0 = time.perf_counter()
    phases["unlimited"] = run_loader(loader, None, seconds)
    t1 = time.perf_counter()
    phases[f"{slow_rate:.0f}/s"] = run_loader(loader, RateConsumer(slow_rate), seconds)
    a = loader.balancer
    start = a.timeline[0]["t"] if a.timeline else 0.0
    timeline = [dict(p, t=round(p["t"] - start, 2)) for p in a.timeline]
    ex = loader.stats()["executor"]
    loader.shutdown()
    return {"phases": phases, "phase_starts_s": [0.0, round(t1 - t0, 1)], "timeline": timeline,
            "executor": {k: ex[k] for k in ("remote_batches", "local_batches", "retries")},
            "remote_stats": a.stats()["remote"]}


def markdown(doc: dict) -> str:
    m, s = doc["machine"], doc["settings"]
    med = doc["medians"]
    lines = [
        "# Ray executor: local workers against remote workers on a local Ray cluster",
        "",
        f"- Machine: {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB, PIL {m['pil_label']}, "
        f"Ray {doc['ray_version']}; one-node Ray cluster started by the benchmark (num_cpus={s['ray_cpus']}, "
        "no dashboard, 500 MB object store).",
        f"- Data: default sample ({s['images']} JPEGs), `pipelines/imagenet_train.yaml` (decode, random resized "
        f"crop 224, flip, normalize float32 NCHW), batch {s['batch_size']} "
        f"({s['batch_mb']:.1f} MB per batch), delivered on the CPU, loader-only consumer.",
        f"- {s['rounds']} rounds, settings alternated, {s['seconds']:.0f} s timed per run after a warm-up (at least "
        "4 batches, 2 of them from remote workers where there are some: their start-up is not timed); "
        "medians. `machine cores`: all processes on the machine (Ray's raylet, GCS and workers included).",
        f"- Command: `{s['command']}` ({doc['total_seconds']:.0f} s).",
        "",
        "## Throughput and overhead per batch",
        "",
        "| setting | samples/s | ms per batch | machine cores | batches remote / local (all rounds) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in med.items():
        where = f"{r['remote_batches']} / {r['local_batches']}" if "ray" in name else "all local"
        lines.append(f"| {name} | {r['samples_per_s']:.0f} | {r['ms_per_batch']:.1f} | {r['machine_cores']:.2f} | "
                     f"{where} |")
    o = doc["overhead"]
    lines += [
        "",
        f"- Ray's overhead per batch (`ray 1` - `local 1`, same work on one worker): **{o['ms_per_batch']:+.1f} ms** "
        f"per {s['batch_size']}-sample batch ({o['relative']:+.1%}; {o['per_sample_us']:+.0f} us per sample).",
        f"- On 2 cores, one local + one remote worker deliver {o['mixed_vs_local2']:.1%} of two local workers: "
        "the second core is reachable through Ray at that cost, but Ray adds no core here (its own processes share "
        "the same two).",
        "",
        "## The balancer borrowing remote workers",
        "",
        "`num_workers=\"auto\"`, `executor: {name: ray, max_local_workers: 1, max_remote_workers: 2}`: "
        f"an unlimited consumer for {s['auto_seconds']:.0f} s, then one taking {s['slow_rate']:.0f} samples/s.",
        "",
    ]
    b = doc["balancer"]
    for name, r in b["phases"].items():
        lines.append(f"- consumer {name}: {r['samples_per_s']:.0f} samples/s delivered, median wait "
                     f"{r['median_wait_ms']:.1f} ms")
    lines += ["", "Windows where the setting changed or a step was judged (all windows in the JSON):", "",
              "| t (s) | local | remote | delivered/s | wait | decision | reason |",
              "| ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for p in b["timeline"]:
        if p["decision"] in ("settle", "measure") or (p["decision"] == "hold" and not p["reason"].startswith(("kept",))):
            continue
        lines.append(f"| {p['t']:.1f} | {p['workers']} | {p['remote_workers']} | {p['delivered_rate']:.0f} | "
                     f"{p['wait_fraction']:.0%} | {p['decision']} | {p['reason']} |")
    lines += ["", f"Remote workers over time (one per window): "
                  f"{' '.join(str(p['remote_workers']) for p in b['timeline'])}", "",
              "On one node a remote worker's CPU is this machine's: with local workers capped at 1, the first remote "
              "worker reaches the second core; a further one finds no free core, and the balancer undoes a step that "
              "does not gain its threshold. On a cluster the same rule keeps adding while each worker pays.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--auto-seconds", type=float, default=45.0)
    ap.add_argument("--slow-rate", type=float, default=40.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--render", metavar="JSON", help="only write the markdown again from a recorded JSON")
    args = ap.parse_args()
    # the one-node cluster talks over the loopback address (Ray's single-node mode; read when ray
    # is imported) rather than the host's network address
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        doc["settings"]["command"] = doc["settings"]["command"].strip()
        write_results(args.out, "ray_executor", doc, markdown)
        return
    import ray

    t_start = time.perf_counter()
    data = default_sample(args.images, progress=False)
    p = Pipeline.from_yaml(PIPELINE, source={"path": str(data)}, **{"loader.batch_size": args.batch_size,
                                                                     "output.device": "cpu"})
    cores = cpu_cores()
    ray.init(num_cpus=cores, include_dashboard=False, object_store_memory=500 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        runs: dict[str, list] = {k: [] for k in SETTINGS}
        for rnd in range(args.rounds):
            for name, setting in SETTINGS.items():
                wait_quiet(10)
                r = throughput(p, setting, args.seconds)
                runs[name].append(r)
                print(f"round {rnd} {name}: {r['samples_per_s']:.0f}/s, {r['ms_per_batch']:.1f} ms/batch, "
                      f"machine {r['machine_cores']:.2f} cores", file=sys.stderr)
        wait_quiet(10)
        bal = balancer_run(p, args.auto_seconds, args.slow_rate)
    finally:
        ray.shutdown()
    medians = {}
    for name, rs in runs.items():
        medians[name] = {k: statistics.median(r[k] for r in rs) for k in
                         ("samples_per_s", "ms_per_batch", "machine_cores", "median_wait_ms")}
        medians[name]["remote_batches"] = sum(r["executor"].get("remote_batches", 0) for r in rs)
        medians[name]["local_batches"] = sum(r["executor"].get("local_batches", 0) for r in rs)
    lo, ry = medians["local 1"], medians["ray 1"]
    overhead = {"ms_per_batch": ry["ms_per_batch"] - lo["ms_per_batch"],
                "relative": ry["ms_per_batch"] / lo["ms_per_batch"] - 1,
                "per_sample_us": 1e3 * (ry["ms_per_batch"] - lo["ms_per_batch"]) / args.batch_size,
                "mixed_vs_local2": medians["local 1 + ray 1"]["samples_per_s"] / medians["local 2"]["samples_per_s"]}
    commit = git_commit()
    doc = {"machine": machine(), "ray_version": ray.__version__, "commit": commit,
           "settings": {"images": args.images, "batch_size": args.batch_size, "rounds": args.rounds,
                        "seconds": args.seconds, "auto_seconds": args.auto_seconds, "slow_rate": args.slow_rate,
                        "ray_cpus": cores, "batch_mb": args.batch_size * 3 * 224 * 224 * 4 / 1e6,
                        "command": " ".join(["flock /tmp/feedgpu-heavy.lock .venv/bin/python -m bench.ray_executor",
                                             *sys.argv[1:]])},
           "runs": runs, "medians": medians, "overhead": overhead, "balancer": bal,
           "total_seconds": time.perf_counter() - t_start}
    write_results(args.out, "ray_executor", doc, markdown)


if __name__ == "__main__":
    main()
