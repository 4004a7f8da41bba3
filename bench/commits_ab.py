"""The same measurement at two commits, side by side: did a change move the CPU figures?

Runs ``feedgpu bench`` (the packaged ImageNet-like sample and ``imagenet_train.yaml``: decode,
random resized crop, flip, normalize; its loaders ``python``, ``dali-cpu`` and torch's DataLoader)
from two checkouts of this repository in alternating order, one round each per pass, in fresh
processes, each with its own checkout first on the path. Torch's loader is the same code on both
sides, so it shows how much the machine itself drifted between the runs.

Reports, per loader, the median samples/s at each commit and the per-pass ratio head/base
(median, min, max): a refactor that keeps behaviour should land within the spread of torch's own
ratio.

    python -m bench.commits_ab --base ../base-checkout --passes 5

writes ``bench/results/commits_ab.{md,json}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import REPO, RESULTS, machine, md_table, spread, wait_quiet, write_results

LOADERS = ("python", "dali-cpu", "torch")


def _git(path: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, check=True).stdout.strip()


def run_once(checkout: Path, args) -> dict:
    """One ``feedgpu bench`` run (one round per loader) from ``checkout``: ``{loader: samples/s}``
    plus CPU per sample."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "feedgpu.cli.main", "bench", "--rounds", "1", "--seconds", str(args.seconds),
               "--workers", str(args.workers), "--images", str(args.images), "--json", str(out)]
        for name in LOADERS:
            cmd += ["--engine", name]
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"feedgpu bench failed in {checkout}:\n{done.stderr[-2000:]}")
        doc = json.loads(out.read_text())
    return {name: {"samples_per_s": s["samples_per_s"], "cpu_percent": s.get("cpu_percent")}
            for name, s in doc["summary"].items()}


def markdown(doc: dict) -> str:
    s = doc["settings"]
    lines = [f"# {doc['title']}", "",
             f"Machine: {doc['machine'].get('cpu_model')} ({doc['machine'].get('cpus_usable')} CPUs usable), "
             f"PIL {doc['machine'].get('pil_label')}; load average at start {doc['machine'].get('load_average')}.",
             f"Data and settings: `feedgpu bench` on its ImageNet-like sample ({s['images']} images), "
             f"imagenet_train.yaml, {s['workers']} workers, {s['seconds']} s timed per run, {s['passes']} passes "
             "(base and head alternating, the first side of each pass alternating too).",
             f"Base: `{doc['base']['commit']}` ({doc['base']['subject']}). "
             f"Head: `{doc['head']['commit']}` ({doc['head']['subject']}).", ""]
    rows = []
    for name, r in doc["loaders"].items():
        rows.append([r["label"], f"{r['base']['median']:,.0f}", f"{r['head']['median']:,.0f}",
                     f"{r['ratio']['median']:.3f}", f"{r['ratio']['min']:.3f} - {r['ratio']['max']:.3f}"])
    lines += md_table(["loader", "base samples/s (median)", "head samples/s (median)", "head / base (median of passes)",
                       "range"], rows)
    lines += ["", "Per pass (samples/s, base / head):", ""]
    for name, r in doc["loaders"].items():
        pairs = ", ".join(f"{b:,.0f} / {h:,.0f}" for b, h in zip(r["base"]["runs"], r["head"]["runs"]))
        lines.append(f"- {r['label']}: {pairs}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="a checkout of the base commit")
    ap.add_argument("--head", default=REPO, type=Path, help="a checkout of the head commit (default: this one)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    sides = {"base": args.base.resolve(), "head": args.head.resolve()}
    runs = {"base": [], "head": []}
    mach = machine(waited_s=wait_quiet(60))
    for p in range(args.passes):
        order = ("base", "head") if p % 2 == 0 else ("head", "base")
        for side in order:
            runs[side].append(run_once(sides[side], args))
            print(f"pass {p + 1}/{args.passes} {side}: "
                  + ", ".join(f"{k} {v['samples_per_s']:,.0f}/s" for k, v in runs[side][-1].items()), file=sys.stderr)
    labels = {"feedgpu": "feedgpu, Python engine", "feedgpu_dali_cpu": "feedgpu, DALI CPU engine",
              "torch": "torch DataLoader (same code both sides)"}
    loaders = {}
    for name in runs["base"][0]:
        b = [r[name]["samples_per_s"] for r in runs["base"]]
        h = [r[name]["samples_per_s"] for r in runs["head"]]
        loaders[name] = {"label": labels.get(name, name),
                         "base": {**spread(b, 1), "runs": [round(x, 1) for x in b]},
                         "head": {**spread(h, 1), "runs": [round(x, 1) for x in h]},
                         "ratio": spread([y / x for x, y in zip(b, h)], 4)}
    doc = {"title": "The same CPU benchmark at two commits", "machine": mach,
           "settings": {"passes": args.passes, "seconds": args.seconds, "workers": args.workers, "images": args.images},
           **{k: {"commit": _git(v, "rev-parse", "--short", "HEAD"), "subject": _git(v, "log", "-1", "--format=%s")[:80]}
              for k, v in sides.items()},
           "loaders": loaders, "total_seconds": round(time.perf_counter() - t0, 1)}
    write_results(args.out, "commits_ab", doc, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
