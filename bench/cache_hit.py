#!/usr/bin/env python
"""The pixel cache's hit path, checkout against checkout: epochs read wholly from a full cache.

For each pipeline below, one cache entry is filled once (an epoch with ``num_workers=0``); then,
round after round, each checkout (``--checkout PATH``, repeatable; ``--base REV`` adds the
``feedgpu/`` of a git revision, extracted under ``bench/out``) runs ``--epochs`` epochs from that
entry in a fresh interpreter with ``num_workers=0`` (every sample a hit, in one process, on one
core; the run checks that nothing was decoded). Per epoch: samples/s from the first batch to
the last (wall clock) and the process's CPU time per sample; per stage, milliseconds per sample
(``loader.stats()["stage_s"]``). The checkouts alternate, their order rotating per round;
medians over rounds and epochs, with the range of the per-round medians.

Pipelines (batches of float32 NCHW unless ``uint8``), cut after the last deterministic stage:

* ``train``: decode, resize 256 | random resized crop 224, horizontal flip, normalize;
* ``val``: decode, resize 256 + center crop 224 | normalize (nothing after the cut needs PIL);
* ``val_uint8``: decode, resize 256 + center crop 224 | (uint8 NHWC batches);
* ``val_flip``: decode, resize 256 + center crop 224 | horizontal flip, normalize.

Writes ``bench/results/cache_hit.json`` and ``bench/results/cache_hit.md``.

    .venv/bin/python -m bench.cache_hit --base main --checkout .      # before / after
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PIPELINES = ("train", "val", "val_uint8", "val_flip")
MARK = "@@cache_hit "


def stages(name: str) -> list:
    from feedgpu.stages import Decode, HorizontalFlip, Normalize, RandomResizedCrop, Resize, ResizeCenterCrop

    if name == "train":
        return [Decode(), Resize(256), RandomResizedCrop(224), HorizontalFlip(), Normalize()]
    val = [Decode(), ResizeCenterCrop(256, 224)]
    return {"val": val + [Normalize()], "val_uint8": val, "val_flip": val + [HorizontalFlip(), Normalize()]}[name]


def loader(name: str, data: str, root: str, batch_size: int):
    from feedgpu import DataLoader, FolderSource, Pipeline

    p = Pipeline(FolderSource(data), stages(name), batch_size=batch_size, num_workers=0, seed=0, device="cpu",
                 drop_last=False, shuffle=True, persistent_workers=False, cache={"dir": root})
    return DataLoader(p)


def child(cmd: dict) -> dict:
    """In a fresh interpreter, with the checkout's ``feedgpu`` first on the path: for each of
    ``pipelines``, fill its entry (``fill``) or time ``epochs`` epochs of hits."""
    import feedgpu

    out = {"feedgpu": str(Path(feedgpu.__file__).resolve().parent), "pipelines": {}}
    for name in cmd["pipelines"]:
        ld = loader(name, cmd["data"], cmd["root"], cmd["batch_size"])
        eps = []
        for e in range(1 if cmd.get("fill") else cmd["epochs"]):
            before = ld.stats()["stage_s"] if e else {}
            n = 0
            it = iter(ld)
            first = next(it)   # not timed: the first batch (opening the entry, first touches)
            t0, c0 = time.perf_counter(), time.process_time()
            for b in it:
                n += len(b.labels)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if n == 0:
                raise SystemExit("one batch per epoch: nothing timed (a smaller --batch-size or more images)")
            spent = {k: v - before.get(k, 0.0) for k, v in ld.stats()["stage_s"].items()}
            total = n + len(first.labels)
            if not cmd.get("fill") and spent.get("decode", 0.0) != 0.0:
                raise SystemExit(f"{name}: decoded images; the epoch did not read from the cache")
            eps.append({"samples": n, "samples_per_s": n / wall, "cpu_us_per_sample": cpu / n * 1e6,
                        "stage_ms_per_sample": {k: round(v / total * 1e3, 4) for k, v in spent.items()}})
        out["pipelines"][name] = {"epochs": eps, "cache": ld.stats()["cache"]}
        ld.shutdown()
    return out


def run_child(checkout: Path, cmd: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cmd)], env=env,
                          cwd=checkout, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit(f"{checkout}: the benchmark process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def extract(repo: Path, rev: str, into: Path) -> Path:
    """``feedgpu/`` of git revision ``rev`` under ``into/checkout-<commit>``."""
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=repo, capture_output=True, text=True,
                            check=True).stdout.strip()
    out = into / f"checkout-{commit}"
    if not (out / "feedgpu" / "__init__.py").exists():
        out.mkdir(parents=True, exist_ok=True)
        tar = subprocess.run(["git", "archive", commit, "feedgpu"], cwd=repo, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    return out


def markdown(doc: dict) -> str:
    from bench.harness import md_table

    s = doc["settings"]
    lines = ["# Cache hit path: checkout against checkout", "",
             f"Machine: {doc['machine'].get('cpu_model', '?')}, {doc['machine'].get('cpus_usable', '?')} usable CPUs, "
             f"load average at the start {doc['machine'].get('load_average')} (shared with other jobs). "
             f"Data: {s['images']} ImageNet-like JPEGs ({s['data']}). `num_workers=0` (one process), batch size "
             f"{s['batch_size']}, {s['epochs']} epochs per run, {s['rounds']} rounds, the checkouts alternating "
             "(order rotated per round); every sample a cache hit (compression none). Medians over all epochs; "
             "the range is that of the per-round medians. The first batch of each epoch is not timed.", ""]
    names = list(doc["checkouts"])
    rows = []
    for p in s["pipelines"]:
        for c in names:
            r = doc["summary"][p][c]
            rows.append([p, c, f"{r['samples_per_s']['median']:.0f}",
                         f"{r['samples_per_s']['min']:.0f}-{r['samples_per_s']['max']:.0f}",
                         f"{r['cpu_us_per_sample']['median']:.0f}",
                         f"{r['cpu_us_per_sample']['min']:.0f}-{r['cpu_us_per_sample']['max']:.0f}",
                         " ".join(f"{k} {v:.3f}" for k, v in r["stage_ms_per_sample"].items() if v)])
        if len(names) == 2:
            a, b = (doc["summary"][p][c] for c in names)
            rows.append([p, f"{names[1]} / {names[0]}",
                         f"{b['samples_per_s']['median'] / a['samples_per_s']['median']:.2f}x", "",
                         f"{b['cpu_us_per_sample']['median'] / a['cpu_us_per_sample']['median']:.2f}x", "", ""])
    lines += md_table(["pipeline", "checkout", "samples/s", "range", "CPU us/sample", "range",
                       "ms per sample by stage"], rows, "llrrrrl")
    lines += ["", "Checkouts: " + ", ".join(f"`{k}` = {v}" for k, v in doc["checkouts"].items()), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--checkout", action="append", default=[], help="a folder holding feedgpu/ (repeatable)")
    ap.add_argument("--base", action="append", default=[], help="a git revision whose feedgpu/ is measured too")
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--photos", default=None, help="photos the sample is made from (default: the packaged ones)")
    ap.add_argument("--data", help="dataset folder (default bench/out/imagenet-like-<images>, built if missing)")
    ap.add_argument("--pipeline", action="append", choices=PIPELINES, help=f"repeatable (default: {', '.join(PIPELINES)})")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quiet-wait", type=float, default=20.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.child:
        print(MARK + json.dumps(child(json.loads(a.child))), flush=True)
        return 0

    from bench.harness import REPO, RESULTS, alternating, machine, spread, wait_quiet, write_results
    from feedgpu.sample_data import build_imagenet_like

    t_all = time.perf_counter()
    out_dir = REPO / "bench" / "out"
    checkouts = {f"base {rev}": extract(REPO, rev, out_dir) for rev in a.base}
    checkouts.update({f"checkout {Path(c).resolve().name}": Path(c).resolve() for c in a.checkout or ["."]})
    data = Path(a.data).expanduser() if a.data else out_dir / f"imagenet-like-{a.images}"
    if not a.data:
        build_imagenet_like(data, a.images, photos_dir=a.photos, progress=True)
    images = sum(1 for _ in data.rglob("*.jpg"))
    pipelines = a.pipeline or list(PIPELINES)
    root = Path(tempfile.mkdtemp(prefix="cache-hit-", dir=out_dir))
    base = {"data": str(data), "root": str(root), "batch_size": a.batch_size, "epochs": a.epochs}
    doc = {"machine": machine(), "settings": {"images": images, "data": str(data), "batch_size": a.batch_size,
                                              "epochs": a.epochs, "rounds": a.rounds, "pipelines": pipelines,
                                              "num_workers": 0, "compression": "none", "device": "cpu"},
           "checkouts": {k: str(v) for k, v in checkouts.items()}, "runs": []}
    # one entry per pipeline, filled once: the format is the same in every checkout
    print("filling the cache entries", file=sys.stderr)
    run_child(next(iter(checkouts.values())), {**base, "pipelines": pipelines, "fill": True})
    for rnd, name in alternating(list(checkouts), a.rounds, rotate=True):
        waited = wait_quiet(a.quiet_wait) if a.quiet_wait > 0 else 0.0
        r = run_child(checkouts[name], {**base, "pipelines": pipelines})
        for p, res in r["pipelines"].items():
            assert res["cache"]["complete"], res["cache"]
            doc["runs"].append({"round": rnd, "checkout": name, "pipeline": p, "waited_for_quiet_s": waited,
                                "feedgpu": r["feedgpu"], "epochs": res["epochs"]})
            print(f"round {rnd} {name} {p}: " + ", ".join(f"{e['samples_per_s']:.0f}/s" for e in res["epochs"]),
                  file=sys.stderr)
    summary: dict = {}
    for p in pipelines:
        summary[p] = {}
        for c in checkouts:
            runs = [r for r in doc["runs"] if r["pipeline"] == p and r["checkout"] == c]
            eps = [e for r in runs for e in r["epochs"]]
            per_round = {k: [statistics.median(e[k] for e in r["epochs"]) for r in runs]
                         for k in ("samples_per_s", "cpu_us_per_sample")}
            med = {k: statistics.median(e[k] for e in eps) for k in per_round}
            stages_ = eps[0]["stage_ms_per_sample"].keys()
            summary[p][c] = {k: {**spread(per_round[k]), "median": med[k]} for k in per_round}
            summary[p][c]["stage_ms_per_sample"] = {s: round(statistics.median(e["stage_ms_per_sample"].get(s, 0.0)
                                                                               for e in eps), 4) for s in stages_}
    doc["summary"] = summary
    doc["total_seconds"] = round(time.perf_counter() - t_all, 1)
    shutil.rmtree(root, ignore_errors=True)
    write_results(a.out or RESULTS, "cache_hit", doc, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
