#!/usr/bin/env python
"""A user's torchvision script with torch's DataLoader and with ``feedgpu.DataLoader``: the one-line change.

The same ``ImageFolder`` and transforms (torchvision's ImageNet reference train and val recipes,
and the train recipe with ``ColorJitter``, which feedgpu runs as Python), the same arguments
(``batch_size``, ``shuffle``, ``num_workers``, ``persistent_workers``), three loaders:

* ``feedgpu``: ``feedgpu.DataLoader``, the transforms compiled (Pillow-SIMD of this environment);
* ``torch_pillow_simd``: ``torch.utils.data.DataLoader``, same PIL build;
* ``torch_pillow``: the same torch loader with stock Pillow (what ``pip install torchvision``
  gives users), installed once into ``bench/.pillow-stock`` and put first on ``PYTHONPATH``.

Each loader lives in its own process (a fresh interpreter with its own PIL build); the parent
asks them in turn for one measured run per recipe, round after round, the order rotating each
round, so drift in the machine's speed hits all alike. A run times ``--batches`` batches after
one warm-up batch and records samples/s and the CPU time per sample of the main process and of
the workers (``/proc/<pid>/stat``). Needs torchvision: run it in ``.venv-tv``.

    .venv-tv/bin/python -m bench.torchvision_compat                      # 2,000 images, 5 rounds
    .venv-tv/bin/python -m bench.torchvision_compat --rounds 1 --batches 2 --images 600 --out /tmp/x   # smoke

Writes ``bench/results/torchvision_compat.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness import (REPO, Child, alternating, check_pil, ensure_stock_pillow, machine, md_table,
                           write_results)
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


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(base: dict) -> None:
    """Child: answer ``{"recipe": name}`` with one measured run of this child's loader."""
    check_pil(base["stock"])
    import torch.utils.data as tud
    from torchvision.datasets import ImageFolder

    import feedgpu
    from feedgpu.imaging import pil_label

    make = feedgpu.DataLoader if base["loader"] == "feedgpu" else tud.DataLoader

    def answer(cmd: dict) -> dict:
        ds = ImageFolder(base["data"], transform=recipe(cmd["recipe"]))
        loader = make(ds, batch_size=base["batch_size"], shuffle=cmd["recipe"] != "val",
                      num_workers=base["workers"], persistent_workers=True)
        it = iter(loader)
        next(it)   # warm-up: workers started
        pids = loader.worker_pids() if isinstance(loader, feedgpu.DataLoader) else [w.pid for w in it._workers]
        w0, m0, n, t0 = sum(map(_cpu_s, pids)), time.process_time(), 0, time.perf_counter()
        for _ in range(base["batches"]):
            _, labels = next(it)
            n += len(labels)
        wall = time.perf_counter() - t0
        res = {"samples_per_s": n / wall, "samples": n, "main_cpu_ms_per_sample": 1e3 * (time.process_time() - m0) / n,
               "workers_cpu_ms_per_sample": 1e3 * (sum(map(_cpu_s, pids)) - w0) / n, "pil": pil_label()}
        if isinstance(loader, feedgpu.DataLoader):
            res["explain"] = loader.explain()
        del it, loader
        return res

    harness_serve({"ready": True, "pil": pil_label()}, answer)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--data", help="an ImageFolder (default bench/out/imagenet-like-<images>); built there if missing")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--batches", type=int, default=6, help="timed batches per run (after one warm-up batch)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--recipes", default=",".join(RECIPES))
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
    recipes = a.recipes.split(",")
    base = {"data": str(data), "workers": a.workers, "batch_size": a.batch_size, "batches": a.batches}
    children = {}
    runs = {r: {name: [] for name in LOADERS} for r in recipes}
    explain = {}
    try:
        for name, is_stock in LOADERS.items():
            children[name] = Child(name, {**base, "loader": name, "stock": is_stock}, "bench.torchvision_compat")
        order = alternating(list(LOADERS), a.rounds, rotate=True)
        for rnd in range(1, a.rounds + 1):
            names = [name for rr, name in order if rr == rnd]
            for rec in recipes:
                for name in names:
                    res = children[name].ask({"recipe": rec})
                    explain.setdefault(rec, res.pop("explain", None))
                    res.pop("explain", None)
                    runs[rec][name].append(res)
                print(f"round {rnd}/{a.rounds} {rec}: " + ", ".join(
                    f"{k} {v[-1]['samples_per_s']:,.0f}/s" for k, v in runs[rec].items()), file=sys.stderr, flush=True)
    finally:
        for c in children.values():
            c.close()
    summary = {}
    for rec, by in runs.items():
        med = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in by.items()}
        cpu = {k: statistics.median(x["main_cpu_ms_per_sample"] + x["workers_cpu_ms_per_sample"] for x in v)
               for k, v in by.items()}
        per_round = {b: [f["samples_per_s"] / t["samples_per_s"] for f, t in zip(by["feedgpu"], by[b])]
                     for b in ("torch_pillow", "torch_pillow_simd")}
        summary[rec] = {"median_samples_per_s": med, "median_cpu_ms_per_sample": cpu,
                        "feedgpu_over": {b: med["feedgpu"] / med[b] for b in per_round},
                        "feedgpu_cpu_share_of": {b: cpu["feedgpu"] / cpu[b] for b in per_round},
                        "ratio_per_round": per_round, "runs": by}
    doc = {"format": "feedgpu.bench.torchvision_compat/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m bench.torchvision_compat " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(load_average_start=load_start, note=a.note, pil_stock=f"Pillow {stock}"),
           "settings": {k: v for k, v in vars(a).items() if k not in ("out", "note", "serve")},
           "results": summary, "explain": explain, "total_seconds": round(time.perf_counter() - t0, 1)}
    write_results(a.out, "torchvision_compat", doc, markdown)
    return 0


def markdown(doc: dict) -> str:
    m = doc["machine"]
    rows = []
    for rec, s in doc["results"].items():
        med, cpu = s["median_samples_per_s"], s["median_cpu_ms_per_sample"]
        rows.append((rec, f"{med['torch_pillow']:,.0f}", f"{med['torch_pillow_simd']:,.0f}", f"{med['feedgpu']:,.0f}",
                     f"{s['feedgpu_over']['torch_pillow']:.2f}x", f"{s['feedgpu_over']['torch_pillow_simd']:.2f}x",
                     f"{cpu['torch_pillow']:.2f} / {cpu['feedgpu']:.2f}"))
    lines = ["# A torchvision script: torch's DataLoader against feedgpu.DataLoader", "",
             f"Recorded {doc['created']} with `{doc['command'].strip()}` ({doc['total_seconds']:.0f} s). Machine: "
             f"{m.get('cpus_usable', m.get('cpus'))} CPUs ({m.get('cpu_model', '?')}), {m['platform']}, Python "
             f"{m['python']}, torch {m['torch']}, stock {m.get('pil_stock')}, load average "
             f"{m.get('load_average_start')} at the start, {m.get('load_average')} at the end. {m.get('note', '')} "
             f"Settings: {doc['settings']}.", "",
             *md_table(("recipe", "torch + Pillow (samples/s)", "torch + Pillow-SIMD", "feedgpu", "feedgpu / torch+Pillow",
                        "feedgpu / torch+SIMD", "CPU ms per sample, torch+Pillow / feedgpu"), rows, "lrrrrrr")]
    for rec, text in doc.get("explain", {}).items():
        if text:
            lines += ["", f"`loader.explain()`, {rec}:", "", "```", text, "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
