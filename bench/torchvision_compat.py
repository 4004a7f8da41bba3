#!/usr/bin/env python
"""A user's torchvision script with torch's DataLoader and with ``feedgpu.DataLoader``: the one-line change.

The same ``ImageFolder`` and transforms (torchvision's ImageNet reference train and val recipes,
and the train recipe with ``ColorJitter``, which feedgpu runs as Python), the same arguments
(``batch_size``, ``shuffle``, ``num_workers``, ``persistent_workers=True``, ``pin_memory`` off,
``prefetch_factor`` torch's default 2), three loaders:

* ``feedgpu``: ``feedgpu.DataLoader``, the transforms compiled (Pillow-SIMD of this environment);
* ``torch_pillow_simd``: ``torch.utils.data.DataLoader``, same PIL build;
* ``torch_pillow``: the same torch loader with stock Pillow (what ``pip install torchvision``
  gives users), installed once into ``bench/.pillow-stock`` and put first on ``PYTHONPATH``.

Each loader lives in its own process (a fresh interpreter with its own PIL build) and keeps one
loader per recipe for the whole benchmark, as a training script keeps its loader across epochs:
each run is one ``iter(loader)`` (a new epoch; the persistent workers stay). The parent asks the
processes in turn for one run per recipe, round after round, the order rotating each round, so
drift in the machine's speed hits all alike; one unrecorded round comes first (worker start,
batch buffers, first touch of memory: what training pays once). A run skips ``--warmup``
batches, then times ``--batches`` batches: samples/s, the CPU time of the main process and of
the workers (``/proc/<pid>/stat``) per sample, and the CPU the rest of the machine used meanwhile.
Before each run the parent waits (up to ``--quiet-wait`` seconds) for the rest of the machine to
idle, and runs again (up to ``--retries`` times) a run during which it used more than
``--max-others`` % of a core; the runs done again are kept in the JSON.
Needs torchvision: run it in ``.venv-tv``.

    .venv-tv/bin/python -m bench.torchvision_compat                     # 5,000 images, 5 rounds
    .venv-tv/bin/python -m bench.torchvision_compat --rounds 1 --batches 2 --images 1000 --out /tmp/x   # smoke

Writes ``bench/results/torchvision_compat.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.harness import (REPO, Child, alternating, busy_seconds, check_pil, ensure_stock_pillow, machine,
                           md_table, spread, wait_quiet, write_results)
from bench.harness import serve as harness_serve

LOADERS = {"feedgpu": False, "torch_pillow_simd": False, "torch_pillow": True}   # name -> stock Pillow?
RECIPES = ("train", "val", "jitter")
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def recipe(name: str):
    """torchvision's ImageNet reference transforms (v1): ``train``, ``val``, or ``jitter`` (train
    with ``ColorJitter(0.4, 0.4, 0.4)`` after the flip)."""
    import torchvision.transforms as T

    if name == "val":
        return T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    head = [T.RandomResizedCrop(224), T.RandomHorizontalFlip()]
    jitter = [T.ColorJitter(0.4, 0.4, 0.4)] if name == "jitter" else []
    return T.Compose(head + jitter + [T.ToTensor(), T.Normalize(MEAN, STD)])


#: the issue's targets: (recipe, baseline, least feedgpu / baseline samples/s)
GOALS = (("train", "torch_pillow", 1.9), ("val", "torch_pillow", 1.9), ("train", "torch_pillow_simd", 1.4),
         ("val", "torch_pillow_simd", 1.4), ("jitter", "torch_pillow", 1.3))
#: ... and feedgpu's CPU time per sample at most this share of torch + stock Pillow's
CPU_GOALS = (("train", 0.5), ("val", 0.5))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(base: dict) -> None:
    """Child: answer ``{"recipe": name}`` with one measured run of this child's loader (one loader
    per recipe, made at its first run and kept)."""
    check_pil(base["stock"])
    import torch.utils.data as tud
    from torchvision.datasets import ImageFolder

    import feedgpu
    from feedgpu.imaging import pil_label

    make = feedgpu.DataLoader if base["loader"] == "feedgpu" else tud.DataLoader
    loaders = {}

    def answer(cmd: dict) -> dict:
        rec = cmd["recipe"]
        if rec not in loaders:
            ds = ImageFolder(base["data"], transform=recipe(rec))
            loaders[rec] = make(ds, batch_size=base["batch_size"], shuffle=rec != "val",
                                num_workers=base["workers"], persistent_workers=True)
        loader = loaders[rec]
        it = iter(loader)
        for _ in range(base["warmup"]):
            next(it)
        pids = loader.worker_pids() if isinstance(loader, feedgpu.DataLoader) else [w.pid for w in it._workers]
        w0, m0, b0, n, t0 = sum(map(_cpu_s, pids)), time.process_time(), busy_seconds(), 0, time.perf_counter()
        for _ in range(base["batches"]):
            _, labels = next(it)
            n += len(labels)
        wall = time.perf_counter() - t0
        main_s, workers_s = time.process_time() - m0, sum(map(_cpu_s, pids)) - w0
        others = max(0.0, busy_seconds() - b0 - main_s - workers_s)
        res = {"samples_per_s": n / wall, "samples": n, "wall_s": wall,
               "main_cpu_ms_per_sample": 1e3 * main_s / n, "workers_cpu_ms_per_sample": 1e3 * workers_s / n,
               "cpu_ms_per_sample": 1e3 * (main_s + workers_s) / n, "others_cpu_pct": 100 * others / wall,
               "pil": pil_label()}
        if isinstance(loader, feedgpu.DataLoader):
            res["explain"] = loader.explain()
        del it
        return res

    harness_serve({"ready": True, "pil": pil_label()}, answer)


def summarise(runs: dict) -> dict:
    """Per recipe: medians over rounds, the per-round ratios feedgpu / each torch loader (samples/s)
    and CPU share (feedgpu's CPU time per sample / the torch loader's), with their spread."""
    summary = {}
    for rec, by in runs.items():
        med = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in by.items()}
        cpu = {k: statistics.median(x["cpu_ms_per_sample"] for x in v) for k, v in by.items()}
        base = [b for b in ("torch_pillow", "torch_pillow_simd") if b in by and "feedgpu" in by]
        per_round = {b: [f["samples_per_s"] / t["samples_per_s"] for f, t in zip(by["feedgpu"], by[b])] for b in base}
        cpu_round = {b: [f["cpu_ms_per_sample"] / t["cpu_ms_per_sample"] for f, t in zip(by["feedgpu"], by[b])]
                     for b in base}
        summary[rec] = {"median_samples_per_s": med, "median_cpu_ms_per_sample": cpu,
                        "feedgpu_over": {b: med["feedgpu"] / med[b] for b in base},
                        "feedgpu_over_per_round": {b: spread(v, 3) for b, v in per_round.items()},
                        "feedgpu_cpu_share_of": {b: cpu["feedgpu"] / cpu[b] for b in base},
                        "feedgpu_cpu_share_per_round": {b: spread(v, 3) for b, v in cpu_round.items()},
                        "ratio_per_round": per_round, "cpu_share_per_round": cpu_round, "runs": by}
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--data", help="an ImageFolder (default bench/out/imagenet-like-<images>); built there if missing")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2, help="batches skipped at the start of each run")
    ap.add_argument("--batches", type=int, default=16, help="timed batches per run (after the warm-up)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="seconds to wait at most before each run for the rest of the machine to idle (< 15 %% of a core)")
    ap.add_argument("--max-others", type=float, default=25.0,
                    help="a run during which the rest of the machine used more (%% of a core) is run again")
    ap.add_argument("--retries", type=int, default=2, help="times a disturbed run is run again at most")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--note", default="", help="said with the machine (e.g. who else used it)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        serve(json.loads(a.serve))
        return 0
    from feedgpu.sample_data import build_imagenet_like

    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    stock = ensure_stock_pillow()
    data = Path(a.data) if a.data else REPO / "bench" / "out" / f"imagenet-like-{a.images}"
    if not a.data or not data.exists():
        build_imagenet_like(data, a.images, photos_dir=(REPO / ".." / "shared" / "data" / "photos").resolve(),
                            progress=True)
    n_files = sum(1 for p in data.rglob("*") if p.is_file() and not p.name.startswith("."))
    if (a.warmup + a.batches) * a.batch_size > n_files:
        sys.exit(f"{a.warmup} + {a.batches} batches of {a.batch_size} need {(a.warmup + a.batches) * a.batch_size} "
                 f"images in one epoch; {data} holds {n_files}")
    recipes = a.recipes.split(",")
    base = {"data": str(data), "workers": a.workers, "batch_size": a.batch_size, "batches": a.batches,
            "warmup": a.warmup}
    children = {}
    runs = {r: {name: [] for name in LOADERS} for r in recipes}
    explain, disturbed = {}, []   # disturbed: runs done again (others' CPU over --max-others)
    try:
        for name, is_stock in LOADERS.items():
            children[name] = Child(name, {**base, "loader": name, "stock": is_stock}, "bench.torchvision_compat")
        for rec in recipes:   # the unrecorded round: each loader made, its workers started
            for name in LOADERS:
                explain.setdefault(rec, children[name].ask({"recipe": rec}).get("explain"))
        order = alternating(list(LOADERS), a.rounds, rotate=True)
        for rnd in range(1, a.rounds + 1):
            names = [name for rr, name in order if rr == rnd]
            for rec in recipes:
                for name in names:
                    for attempt in range(a.retries + 1):
                        waited = wait_quiet(a.quiet_wait) if a.quiet_wait > 0 else 0.0
                        res = {"round": rnd, "waited_s": waited, **children[name].ask({"recipe": rec})}
                        res.pop("explain", None)
                        if res["others_cpu_pct"] <= a.max_others or attempt == a.retries:
                            break
                        disturbed.append({"recipe": rec, "loader": name, **res})
                    runs[rec][name].append(res)
                print(f"round {rnd}/{a.rounds} {rec}: " + ", ".join(
                    f"{k} {v[-1]['samples_per_s']:,.0f}/s" for k, v in runs[rec].items()), file=sys.stderr, flush=True)
    finally:
        for c in children.values():
            c.close()
    doc = {"format": "feedgpu.bench.torchvision_compat/2", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": shlex.join(["python", "-m", "bench.torchvision_compat", *(sys.argv[1:] if argv is None else argv)]),
           "machine": machine(load_average_start=load_start, note=a.note, pil_stock=f"Pillow {stock}"),
           "data": {"path": str(data), "files": n_files},
           "settings": {k: v for k, v in vars(a).items() if k not in ("out", "note", "serve", "data")},
           "goals": {"speed": [list(g) for g in GOALS], "cpu_share": [list(g) for g in CPU_GOALS]},
           "results": summarise(runs), "disturbed_runs": disturbed, "explain": explain, "total_seconds": round(time.perf_counter() - t0, 1)}
    write_results(a.out, "torchvision_compat", doc, markdown)
    return 0


def _range(s: dict, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def markdown(doc: dict) -> str:
    m, res = doc["machine"], doc["results"]
    names = {"torch_pillow": "torch + stock Pillow", "torch_pillow_simd": "torch + Pillow-SIMD", "feedgpu": "feedgpu"}
    lines = ["# A torchvision script: torch's DataLoader against feedgpu.DataLoader", "",
             f"Recorded {doc['created']} with `{doc['command'].strip()}` ({doc['total_seconds']:.0f} s). Raw numbers, "
             "every run: `torchvision_compat.json`.", "",
             *([f"**{m['note']}**", ""] if m.get("note") else []),
             "## Setup", "",
             f"- Machine: {m.get('cpus_usable', m.get('cpus'))} CPUs ({m.get('cpu_model', '?')}), {m['platform']}, "
             f"Python {m['python']}, torch {m['torch']}; PIL builds: {m.get('pil_label', '?')} (feedgpu, torch + "
             f"Pillow-SIMD), stock {m.get('pil_stock')} (torch + stock Pillow). Load average {m.get('load_average_start')} "
             f"at the start, {m.get('load_average')} at the end.",
             f"- Data: {doc['data']['files']} ImageNet-like JPEGs (`feedgpu.sample_data.build_imagenet_like` from the "
             "shared photographs, ImageFolder layout).",
             "- Script: `ImageFolder(root, transform=recipe)` and `DataLoader(ds, batch_size, shuffle=(recipe != 'val'), "
             "num_workers, persistent_workers=True)`, torch's or feedgpu's, nothing else changed (pin_memory off, "
             "prefetch_factor 2, default_collate). Recipes: torchvision's ImageNet reference train "
             "(RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize) and val (Resize(256), CenterCrop(224), "
             "ToTensor, Normalize), and jitter (train with ColorJitter(0.4, 0.4, 0.4) after the flip).",
             f"- Settings: {doc['settings']}. One loader per recipe per process, kept across runs; one unrecorded "
             "round first; each run is a new epoch: warm-up batches, then the timed ones. CPU: the main process's "
             "and the workers' CPU seconds in the timed window per sample (ms per sample = CPU seconds per 1,000 "
             "samples); others' CPU: what the rest of the machine used meanwhile (% of one core). Before each run the script waits (up to --quiet-wait s) for the rest of the machine to idle, and runs again (up to --retries times) a run during which it used more than --max-others % of a core.", "",
             "## Results (medians over rounds)", ""]
    rows = []
    for rec, s in res.items():
        med, cpu = s["median_samples_per_s"], s["median_cpu_ms_per_sample"]
        for k in ("torch_pillow", "torch_pillow_simd", "feedgpu"):
            if k in med:
                rows.append((rec, names[k], f"{med[k]:,.0f}", f"{cpu[k]:.2f}"))
    lines += md_table(("recipe", "loader", "samples/s", "CPU s per 1,000 samples"), rows, "llrr")
    lines += ["", "Ratios, feedgpu over each torch loader: of the medians, and per round median (min-max):", ""]
    rows = []
    for rec, s in res.items():
        for b, r in s["feedgpu_over"].items():
            rows.append((rec, names[b], f"**{r:.2f}x**", _range(s["feedgpu_over_per_round"][b]),
                         f"{s['feedgpu_cpu_share_of'][b]:.2f}", _range(s["feedgpu_cpu_share_per_round"][b])))
    lines += md_table(("recipe", "over", "samples/s ratio", "per round", "CPU per sample, share", "per round"),
                      rows, "llrrrr")
    lines += ["", "Against the targets (medians of the per-round ratios):", ""]
    rows = []
    for rec, b, want in doc["goals"]["speed"]:
        if rec in res and b in res[rec]["feedgpu_over_per_round"]:
            got = res[rec]["feedgpu_over_per_round"][b]
            rows.append((f"{rec}: feedgpu / {names[b]}", f">= {want}x", _range(got),
                         "met" if got["median"] >= want else "not met"))
    for rec, share in doc["goals"]["cpu_share"]:
        if rec in res and "torch_pillow" in res[rec]["feedgpu_cpu_share_per_round"]:
            got = res[rec]["feedgpu_cpu_share_per_round"]["torch_pillow"]
            rows.append((f"{rec}: CPU per sample, feedgpu / torch + stock Pillow", f"<= {share}", _range(got),
                         "met" if got["median"] <= share else "not met"))
    lines += md_table(("target", "wanted", "measured", ""), rows, "lrrl")
    lines += ["", "## Every run", "",
              f"Runs done again because the rest of the machine used more than {doc['settings'].get('max_others', '-')} % "
              f"of a core meanwhile (in the JSON): {len(doc.get('disturbed_runs', []))}; the last attempt is kept.", ""]
    rows = []
    for rec, s in res.items():
        for k, v in s["runs"].items():
            for r in v:
                rows.append((r["round"], rec, k, f"{r['samples_per_s']:,.0f}", f"{r['cpu_ms_per_sample']:.2f}",
                             f"{r['main_cpu_ms_per_sample']:.2f}", f"{r['workers_cpu_ms_per_sample']:.2f}",
                             f"{r['others_cpu_pct']:.0f}"))
    rows.sort(key=lambda row: (row[0], row[1]))
    lines += md_table(("round", "recipe", "loader", "samples/s", "CPU ms/sample", "main", "workers", "others' CPU %"),
                      rows, "rllrrrrr")
    for rec, text in doc.get("explain", {}).items():
        if text:
            lines += ["", f"`loader.explain()`, {rec}:", "", "```", text, "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
