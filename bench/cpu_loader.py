#!/usr/bin/env python
"""The recorded CPU benchmark: feedgpu's CPU path against torch's DataLoader + Pillow.

Loaders on the same data, same transforms (``--recipe train``: ``pipelines/imagenet_train.yaml``,
decode, random resized crop 224, horizontal flip, normalize to float32 NCHW; ``--recipe val``:
``pipelines/imagenet_val.yaml``, decode, resize 256 + center crop 224, normalize), same worker
count and batch size (``--loaders`` picks among them; default all five):

* ``feedgpu``: ``feedgpu.DataLoader`` on the pipeline (Python engine, ``decode: {reduce: rows}``,
  the default: JPEG rows below the window are not decoded, the full decode's pixels), with the
  PIL build of this environment (Pillow-SIMD);
* ``feedgpu_full``: the same with ``reduce: off`` (every image decoded whole);
* ``feedgpu_reduce``: the same with ``reduce: auto`` (also at the DCT scale the window allows);
* ``torch_pillow_simd``: ``torch.utils.data.DataLoader`` + torchvision-equivalent transforms
  (``feedgpu.bench.torch_baseline``), same PIL build;
* ``torch_pillow``: the same torch loader with stock Pillow, what users have: Pillow from PyPI
  installed once into ``bench/.pillow-stock`` and put first on ``PYTHONPATH``.

Each loader lives in its own process (a fresh interpreter, so none inherits another's memory or
PIL build); the parent asks them in turn for one measured run each, round after round, so drift
in the machine's speed hits all loaders alike. One unrecorded round comes first (each process's
first run pays one-time costs, such as first touch of fresh memory, that training pays once).
The measurement itself is ``feedgpu.bench.measure.measure`` (what ``feedgpu bench`` reports). Before
the rounds, each PIL build's per-core rate without any loader is measured for reference.

Data (``--dataset``): ``imagenet-like``, ``--images`` JPEGs built from the photographs, or
``photos``, the full-size photographs themselves, repeated to ``--images`` files in an
ImageFolder layout of links (``bench/out/photos-<N>``).

Writes ``bench/results/cpu_loader.json`` and ``bench/results/cpu_loader.md`` (ImageNet-like, train),
else ``cpu_loader_<dataset>_<recipe>.{json,md}``.

    .venv/bin/python -m bench.cpu_loader                 # 2,000 images, 2 workers, 7 rounds
    .venv/bin/python -m bench.cpu_loader --images 5000 --rounds 3
    .venv/bin/python -m bench.cpu_loader --dataset photos --recipe val --images 1000 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.harness import REPO, Child, check_pil, ensure_stock_pillow, spread, wait_quiet, write_results
from bench.harness import serve as harness_serve

PIPELINES = {"train": REPO / "pipelines" / "imagenet_train.yaml", "val": REPO / "pipelines" / "imagenet_val.yaml"}
PIPELINE = PIPELINES["train"]

# name -> (feedgpu.bench.subjects loader kind, stock Pillow?, decode's reduce setting)
LOADERS = {
    "feedgpu": ("feedgpu", False, "rows"),
    "feedgpu_full": ("feedgpu", False, "off"),
    "feedgpu_reduce": ("feedgpu", False, "auto"),
    "torch_pillow_simd": ("torch", False, "off"),
    "torch_pillow": ("torch", True, "off"),
}


# -- the child: one measured run (or the per-core reference) in a fresh interpreter ---------------
def _pipeline(data: str, recipe: str = "train", reduce: str = "off"):
    from feedgpu import Pipeline
    from feedgpu import config as cfg

    conf = cfg.merge(cfg.load_yaml(PIPELINES[recipe]), {"source.path": data, "output.device": "cpu"})
    conf["stages"][0]["reduce"] = reduce    # the first stage is decode in both recipes
    return Pipeline.from_config(conf, where=str(PIPELINES[recipe]))


def build_photo_set(out: Path, photos: str, n: int) -> Path:
    """``n`` links to the photographs in ``photos`` (in turn), as ``out/<photo's stem>/<i>.jpg``
    (ImageFolder layout, one class per photograph); reused when complete."""
    files = sorted(p for p in Path(photos).iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    if not files:
        raise FileNotFoundError(f"no JPEG photographs in {photos}")
    if out.is_dir() and len(list(out.rglob("*.jpg"))) == n:
        return out
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    for i in range(n):
        f = files[i % len(files)]
        d = tmp / f.stem
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.jpg").symlink_to(f.resolve())
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def serve(base: dict) -> None:
    """Child process: index the data once, then answer one JSON command per stdin line with one
    result line on stdout: ``{"mode": "run", "desc": ...}`` measures one run of this child's
    loader, ``{"mode": "single", "images": n}`` the per-core reference, ``{"mode": "exit"}``."""
    check_pil(base["stock"])
    from feedgpu.bench.measure import progress_bar, run_one
    from feedgpu.imaging import pil_label

    p = _pipeline(base["data"], base["recipe"], base["reduce"])
    len(p.source)

    def answer(cmd: dict) -> dict:
        if cmd["mode"] == "single":
            return {"pil": pil_label(), **per_core(p, cmd["images"])}
        with progress_bar(base["warmup"] + base["batches"], cmd["desc"]) as bar:
            res = run_one(base["kind"], p, base["workers"], base["batch_size"], base["batches"],
                          base["warmup"], "cpu", on_batch=lambda: bar.update(1))
        return {**res, "pil": pil_label()}

    harness_serve({"ready": True, "pil": pil_label()}, answer)


def per_core(p, n: int) -> dict:
    """One process, no loader: images/s of decode + random resized crop + flip (the anchors'
    measure) and of the whole torchvision-style transform (+ ToTensor + Normalize)."""
    import torch

    from feedgpu.bench.torch_baseline import build_transforms

    torch.set_num_threads(1)
    torch.manual_seed(0)
    full = build_transforms(p)
    geometric = type(full)([t for t in full.transforms if type(t).__name__ in
                            ("LoadImage", "RandomResizedCrop", "RandomHorizontalFlip", "Resize", "CenterCrop")])
    payloads = [p.source.read(i).payload for i in range(min(n, len(p.source)))]
    out = {}
    for name, tf in (("decode_crop_flip", geometric), ("full_transform", full)):
        for x in payloads[:20]:  # warm caches
            tf(x)
        t0 = time.perf_counter()
        for x in payloads:
            tf(x)
        dt = time.perf_counter() - t0
        out[name] = {"images_per_s": round(len(payloads) / dt, 1), "ms_per_image": round(dt / len(payloads) * 1e3, 3)}
    out["images"] = len(payloads)
    return out


# -- the parent ------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000, help="images in the dataset (default 2000)")
    ap.add_argument("--photos", default=str((REPO / ".." / "shared" / "data" / "photos").resolve()),
                    help="photographs the dataset is made from (default ../shared/data/photos)")
    ap.add_argument("--data", help="dataset folder (default bench/out/<dataset>-<images>, built if missing)")
    ap.add_argument("--dataset", choices=("imagenet-like", "photos"), default="imagenet-like",
                    help="imagenet-like: JPEGs of 400-640 px made from --photos; photos: the photographs "
                    "themselves at full size, repeated (default imagenet-like)")
    ap.add_argument("--recipe", choices=sorted(PIPELINES), default="train",
                    help="train: random resized crop 224 + flip; val: resize 256 + center crop 224 (default train)")
    ap.add_argument("--loaders", default=",".join(LOADERS),
                    help=f"comma-separated, of {', '.join(LOADERS)} (default all)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batches", type=int, help="timed batches per run (default: the rest of one epoch, "
                    "rounded down to a multiple of --workers)")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each run, wait up to this many seconds for other processes to go idle")
    ap.add_argument("--max-others", type=float, default=25.0,
                    help="rerun a run during which other processes used more than this %% of a core")
    ap.add_argument("--retries", type=int, default=3, help="reruns of a disturbed run (default 3)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="where cpu_loader.json/.md go")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        serve(json.loads(a.serve))
        return 0
    names = [n.strip() for n in a.loaders.split(",") if n.strip()]
    unknown = sorted(set(names) - set(LOADERS))
    if unknown or not names:
        ap.error(f"--loaders: unknown {unknown}; choose among {', '.join(LOADERS)}")
    loaders = {n: LOADERS[n] for n in names}

    from feedgpu.bench.machine import data_info, machine_info
    from feedgpu.bench.measure import default_batches, epoch_batches, ratio, run_rounds, summarize
    from feedgpu.sample_data import build_imagenet_like

    t0 = time.perf_counter()
    stock_version = ensure_stock_pillow() if any(v[1] for v in loaders.values()) else None
    data = Path(a.data) if a.data else REPO / "bench" / "out" / f"{a.dataset}-{a.images}"
    if not a.data and a.dataset == "photos":
        build_photo_set(data, a.photos, a.images)
    elif not a.data:
        build_imagenet_like(data, a.images, photos_dir=a.photos, progress=True)
    p = _pipeline(str(data), a.recipe)
    nb = epoch_batches(p, a.batch_size)
    batches = a.batches or default_batches(nb, a.warmup, a.workers)
    print("measuring the data set", file=sys.stderr)
    data_meta = data_info(p, str(data), sample=None)
    machine = machine_info()
    machine["pil_stock"] = f"Pillow {stock_version}" if stock_version else None
    settings = {"pipeline": str(PIPELINES[a.recipe].relative_to(REPO)), "recipe": a.recipe, "dataset": a.dataset,
                "loaders": names, "workers": a.workers, "batch_size": a.batch_size,
                "batches_per_epoch": nb, "timed_batches": batches, "warmup": a.warmup, "rounds": a.rounds,
                "prefetch_factor": p.prefetch_factor, "device": "cpu", "shuffle": p.shuffle,
                "drop_last": p.drop_last, "photos": a.photos, "quiet_wait_s": a.quiet_wait,
                "max_others_percent": a.max_others, "retries": a.retries}
    base = {"data": str(data), "workers": a.workers, "batch_size": a.batch_size, "batches": batches,
            "warmup": a.warmup, "recipe": a.recipe}

    children = {}
    disturbed: list[dict] = []
    try:
        for name, (kind, stock, reduce) in loaders.items():
            children[name] = Child(name, {**base, "kind": kind, "stock": stock, "reduce": reduce}, "bench.cpu_loader")
        print("per-core reference (one process, no loader)", file=sys.stderr)
        n_single = min(500, len(p.source))
        single = {}
        for key, name in (("pillow_simd", "torch_pillow_simd"), ("pillow", "torch_pillow")):
            if name not in children:
                continue
            wait_quiet(a.quiet_wait)
            single[key] = children[name].ask({"mode": "single", "images": n_single})

        def run(name: str, r: int, on_batch) -> dict:
            desc = f"{name} warm-up round" if r < 0 else f"{name} round {r + 1}/{a.rounds}"
            for attempt in range(1, a.retries + 2):
                waited = wait_quiet(a.quiet_wait) if a.quiet_wait > 0 else 0.0
                res = children[name].ask({"mode": "run", "desc": desc})
                res.update(loader=name, waited_for_quiet_s=waited, attempt=attempt)
                if (res["others_cpu_percent"] or 0) <= a.max_others or attempt > a.retries:
                    return res
                print(f"{name}: other processes used {res['others_cpu_percent']:.0f} % CPU during the run; "
                      "running it again", file=sys.stderr)
                res["round"] = r + 1
                disturbed.append(res)
            return res  # pragma: no cover - the loop always returns

        # one unrecorded round first: each process's first run pays one-time costs (first touch
        # of fresh memory, imports, file cache) that a training run pays once, not per epoch
        warm = [run(name, -1, None) for name in loaders]
        runs = run_rounds(list(loaders), a.rounds, run)
    finally:
        for c in children.values():
            c.close()
    summary = summarize(runs)
    for name, s in summary.items():
        rs = [r for r in runs if r["loader"] == name]
        s["pil"] = rs[0]["pil"]
        s["samples_per_s_min"] = min(r["samples_per_s"] for r in rs)
        s["samples_per_s_max"] = max(r["samples_per_s"] for r in rs)
        s["steal_percent_median"] = statistics.median(r["steal_percent"] or 0 for r in rs)
        # CPU seconds (main process + workers) spent per 1,000 samples delivered
        s["cpu_s_per_1000"] = round(statistics.median(r["cpu_percent"] / 100 * 1000 / r["samples_per_s"]
                                                      for r in rs), 2)
        if name.startswith("feedgpu"):
            stages = rs[0]["stage_ms_per_sample"].keys()
            s["stage_ms_per_sample"] = {k: round(statistics.median(r["stage_ms_per_sample"][k] for r in rs), 3)
                                        for k in stages}
    pairs = {f"{x}_over_{y}": (x, y) for x in summary for y in ("torch_pillow", "torch_pillow_simd", "feedgpu")
             if x != y and y in summary and (x.startswith("feedgpu") or x == "torch_pillow_simd")
             and not (x == "torch_pillow_simd" and y == "feedgpu")}
    ratios = {key: ratio(summary, x, y) for key, (x, y) in pairs.items()}
    # the same ratio taken within each round (the loaders ran back to back), then the median
    per_round = {}
    for key, (x, y) in pairs.items():
        vals = []
        for r in range(1, a.rounds + 1):
            rx = [q["samples_per_s"] for q in runs if q["round"] == r and q["loader"] == x]
            ry = [q["samples_per_s"] for q in runs if q["round"] == r and q["loader"] == y]
            vals.append(rx[0] / ry[0])
        per_round[key] = spread(vals)
    total = time.perf_counter() - t0
    doc = {"format": "feedgpu.bench.cpu_loader/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m bench.cpu_loader " + " ".join(sys.argv[1:] if argv is None else argv),
           "target": "feedgpu >= 2.0x torch DataLoader + stock Pillow, 2 workers, >= 2,000 images",
           "machine": machine, "data": data_meta, "settings": settings, "summary": summary, "ratios": ratios,
           "ratios_per_round": per_round, "per_core_no_loader": single, "runs": runs,
           "warmup_runs_not_counted": warm, "disturbed_runs_repeated": disturbed,
           "total_seconds": round(total, 1)}
    name = "cpu_loader" if (a.dataset, a.recipe) == ("imagenet-like", "train") else \
        f"cpu_loader_{a.dataset.replace('-', '_')}_{a.recipe}"
    doc["results_name"] = name
    write_results(a.out, name, doc, markdown)
    return 0


# -- the report --------------------------------------------------------------------------------------
NAMES = {"feedgpu": "feedgpu.DataLoader", "feedgpu_full": "feedgpu.DataLoader, decode reduce: off",
         "feedgpu_reduce": "feedgpu.DataLoader, decode reduce: auto",
         "torch_pillow_simd": "torch DataLoader + Pillow-SIMD", "torch_pillow": "torch DataLoader + stock Pillow"}
RECIPES = {"train": "decode → RandomResizedCrop(224, bilinear) → horizontal flip → normalize to float32 NCHW",
           "val": "decode → Resize(256) + CenterCrop(224) (bilinear) → normalize to float32 NCHW"}


def _f(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _pair_label(key: str, doc: dict) -> str:
    """``"x_over_y"`` -> ``"x / y"`` with the loaders' names."""
    names = list(doc["summary"])
    for x in names:
        for y in names:
            if key == f"{x}_over_{y}":
                return f"{NAMES.get(x, x)} / {NAMES.get(y, y)}"
    return key


def markdown(doc: dict) -> str:
    m, d, s, su, ra = doc["machine"], doc["data"], doc["settings"], doc["summary"], doc["ratios"]
    L = [
        "# CPU loader benchmark: feedgpu vs torch DataLoader + Pillow",
        "",
        f"Recorded {doc['created']} with `{doc['command'].strip()}` ({doc['total_seconds']:.0f} s). "
        f"Raw numbers, every run: `{doc.get('results_name', 'cpu_loader')}.json`.",
        "",
        ("; ".join(f"**{_pair_label(k, doc)}: {v:.2f}×**" for k, v in ra.items()
                   if v is not None and k.endswith("_over_torch_pillow")) + " (the target: feedgpu ≥ 2.0×)."
         if "torch_pillow" in su else "No torch + stock Pillow loader in this run."),
        "",
        "## Setup",
        "",
        f"- Machine: {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB RAM, {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}.",
        f"- PIL builds: {m['pil_label']} (feedgpu and torch + Pillow-SIMD)" +
        (f"; {m['pil_stock']} from PyPI in `bench/.pillow-stock` (torch + stock Pillow)." if m.get("pil_stock") else "."),
        (f"- Data: {d['images']} ImageNet-like JPEGs built by `feedgpu.sample_data.build_imagenet_like` from "
         f"`{s['photos']}` photographs" if s.get("dataset", "imagenet-like") == "imagenet-like" else
         f"- Data: the full-size photographs of `{s['photos']}`, repeated to {d['images']} files") +
        f" (ImageFolder layout; mean {d['mean_bytes'] / 1024:.1f} KB, {d['mean_width']}×{d['mean_height']} px, "
        f"{d['mean_megapixels']:.3f} megapixels).",
        f"- Pipeline: `{s['pipeline']}` — {RECIPES[s.get('recipe', 'train')]}, output on the CPU; "
        "feedgpu runs `decode: {reduce: rows}` (the default), `feedgpu_full` `reduce: off`, `feedgpu_reduce` "
        "`reduce: auto`. The torch loaders run the torchvision-equivalent "
        "transforms of `feedgpu.bench.torch_baseline` (`Image.open().convert(\"RGB\")`, the same geometric "
        "transforms, `ToTensor`, `Normalize`, `default_collate`, `pin_memory=False`).",
        f"- Settings: {s['workers']} workers each, batch {s['batch_size']}, prefetch {s['prefetch_factor']}, "
        f"shuffle, drop_last ({s['batches_per_epoch']} batches per epoch); per run {s['warmup']} warm-up "
        f"batches, then {s['timed_batches']} timed batches; one unrecorded warm-up round, then "
        f"{s['rounds']} rounds with the loaders in turn, each loader in its own process; medians over rounds.",
        "",
        "## Results (medians over rounds)",
        "",
        "| loader | PIL | samples/s (min–max) | ms/batch | first batch s | CPU % | CPU s / 1,000 samples "
        "| RSS peak / worker MB | PSS / worker MB | USS / worker MB | main RSS peak MB |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, x in su.items():
        L.append(f"| {NAMES.get(name, name)} | {x['pil']} | **{x['samples_per_s']:.0f}** "
                 f"({x['samples_per_s_min']:.0f}–{x['samples_per_s_max']:.0f}) | {x['ms_per_batch']:.0f} | "
                 f"{x['first_batch_s']:.2f} | {x['cpu_percent']:.0f} | {_f(x.get('cpu_s_per_1000'), '.2f')} | "
                 f"{_f(x['rss_peak_mb_per_worker'], '.0f')} | "
                 f"{_f(x['pss_mb_per_worker'], '.0f')} | {_f(x['uss_mb_per_worker'], '.0f')} | "
                 f"{x['rss_peak_mb_main']:.0f} |")
    pr = doc["ratios_per_round"]
    L += [
        "",
        "| ratio | of medians | per round: median (min–max) |",
        "| --- | ---: | ---: |",
    ]
    for key, v in ra.items():
        r = pr.get(key)
        L.append(f"| {_pair_label(key, doc)} | **{_f(v, '.2f')}×** | " +
                 (f"{r['median']:.2f}× ({r['min']:.2f}–{r['max']:.2f}) |" if r else "|"))
    single = doc["per_core_no_loader"]
    if single:
        L += ["", f"Per-core reference, one process without a loader (first {next(iter(single.values()))['images']} "
              "images):", "", "| PIL | decode + geometric transforms, img/s | + ToTensor + Normalize, img/s |",
              "| --- | ---: | ---: |"]
    for x in single.values():
        L.append(f"| {x['pil']} | {x['decode_crop_flip']['images_per_s']:.0f} "
                 f"({x['decode_crop_flip']['ms_per_image']:.2f} ms) | {x['full_transform']['images_per_s']:.0f} "
                 f"({x['full_transform']['ms_per_image']:.2f} ms) |")
    for name in su:
        st = su[name].get("stage_ms_per_sample")
        if st:
            L += ["", f"{name}'s time per sample in its workers (median over runs, ms): " +
                  ", ".join(f"{k} {v:.2f}" for k, v in st.items()) + f" (sum {sum(st.values()):.2f})."]
    L += [
        "",
        "## How it is measured",
        "",
        "- samples/s: samples in the timed batches ÷ time from the last warm-up batch to the last timed batch "
        "(worker start-up and the pipeline fill are excluded). The timed batches are a multiple of the worker "
        "count because each worker fills whole batches: an epoch's odd last batch would leave a worker idle, a "
        "tail that weighs on a 7-batch epoch far more than on a real dataset.",
        "- ms/batch: the same timed window ÷ the timed batches (samples/s × ms/batch = the batch size); the "
        "consumer reads a slice of each batch and does nothing else, so this is the loader's own pace.",
        "- first batch: from `iter(loader)` to the first batch (includes starting the workers).",
        "- CPU %: CPU seconds of the main process and all its children (the workers) over the timed window ÷ "
        "its wall time; 200 % = both cores busy. CPU s / 1,000 samples: those CPU seconds per 1,000 samples "
        "delivered (median over runs).",
        "- Memory per worker: RSS peak (VmHWM) counts pages shared with the main process and the shared batch "
        "buffers; PSS splits shared pages among their users; USS is what the worker alone holds. Sampled "
        "half-way through the timed window (PSS, USS) and at every batch (RSS peak).",
        "- Before each run the script waits (up to "
        f"{s['quiet_wait_s']:.0f} s) until the rest of the machine is idle (< 15 % of a core), and a run "
        f"during which other processes used more than {s['max_others_percent']:.0f} % of a core is run again "
        f"(up to {s['retries']} times; repeated here: {len(doc['disturbed_runs_repeated'])}, the disturbed "
        "runs are in the JSON).",
        f"- Quiet machine check: other processes used a median "
        f"{statistics.median(r['others_cpu_percent'] or 0 for r in doc['runs']):.0f} % CPU (of one core) during "
        f"the timed windows (max {max(r['others_cpu_percent'] or 0 for r in doc['runs']):.0f} %); the VM's CPU "
        f"steal: median {statistics.median(x['steal_percent_median'] for x in su.values()):.1f} %.",
        "",
        "## Every run",
        "",
        "| round | loader | samples/s | ms/batch | first batch s | CPU % | others' CPU % | steal % |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["runs"]:
        L.append(f"| {r['round']} | {r['loader']} | {r['samples_per_s']:.0f} | {r['ms_per_batch']:.0f} | "
                 f"{r['first_batch_s']:.2f} | {r['cpu_percent']:.0f} | {_f(r['others_cpu_percent'], '.0f')} | "
                 f"{_f(r['steal_percent'], '.1f')} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
