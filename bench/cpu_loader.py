#!/usr/bin/env python
"""The recorded CPU benchmark: feedgpu's CPU engines against torch's DataLoader + Pillow, SPDL
and a hand-written DALI CPU pipeline, side by side in one run.

Loaders on the same data, same transforms (``--recipes train``: ``pipelines/imagenet_train.yaml``,
decode, random resized crop 224, horizontal flip, normalize to float32 NCHW; ``val``:
``pipelines/imagenet_val.yaml``, decode, resize 256 + center crop 224, normalize), same batch size
and equal cores (``--workers`` worker processes, or as many threads for the thread-based loaders);
``--loaders`` picks among them (default all):

* ``torch_pillow``: ``torch.utils.data.DataLoader`` + torchvision-equivalent transforms
  (``feedgpu.bench.torch_baseline``) with stock Pillow, what users have: Pillow from PyPI
  installed once into ``bench/.pillow-stock`` and put first on ``PYTHONPATH``;
* ``torch_pillow_simd``: the same torch loader with this environment's Pillow-SIMD;
* ``spdl``: SPDL's thread-pool pipeline with FFmpeg decode and filter graph (``bench/spdl_loader.py``;
  installed once into ``bench/.spdl``);
* ``dali_hand``: a hand-written DALI CPU pipeline (``bench/dali_cpu.py``'s ``HandDali``): train
  ``fn.decoders.image_random_crop`` + ``fn.resize`` (the usual DALI training pipeline, which decodes
  only the crop window), val ``fn.decoders.image`` + ``fn.resize(resize_shorter)`` + centre crop;
* ``feedgpu_full``, ``feedgpu``, ``feedgpu_reduce``: ``feedgpu.DataLoader`` on the pipeline,
  Python engine (Pillow-SIMD), with ``decode: {reduce: off}`` (every image decoded whole),
  ``rows`` (the default: JPEG rows below the window not decoded, the full decode's pixels) and
  ``auto`` (also at the DCT scale the window allows);
* ``feedgpu_dali_cpu``, ``feedgpu_dali_cpu_whole``: ``feedgpu.DataLoader`` with
  ``engine={"name": "dali", "device": "cpu"}``, decoding only the window (the default) or whole
  images (``window_decode: false``).

Each loader lives in its own process (a fresh interpreter, so none inherits another's memory or
PIL build); the parent asks them in turn for one measured run each, round after round (the order
rotated by one each round), so drift in the machine's speed hits all loaders alike. One
unrecorded round comes first (each process's first run pays one-time costs, such as first touch
of fresh memory, that training pays once). The measurement is ``feedgpu.bench.measure.measure``
(what ``feedgpu bench`` reports); the ratios are taken within each round, then their median,
minimum and maximum are reported.

Data (``--datasets``): ``imagenet-like``, ``--images`` JPEGs built from the photographs, and
``photos``, the full-size photographs themselves, repeated to ``--photo-images`` files in an
ImageFolder layout of links (``bench/out/photos-<N>``). Every dataset x recipe is one part of the
results: ``bench/results/cpu_loader.json`` and ``.md`` hold every part measured so far (a run of
some parts replaces those parts and keeps the others).

    .venv/bin/python -m bench.cpu_loader                 # all loaders, both datasets and recipes
    .venv/bin/python -m bench.cpu_loader --datasets photos --recipes val --rounds 3
    .venv/bin/python -m bench.cpu_loader --loaders torch_pillow,feedgpu,feedgpu_reduce
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.harness import REPO, Child, check_pil, ensure_stock_pillow, spread, wait_quiet, write_results
from bench.harness import serve as harness_serve

PIPELINES = {"train": REPO / "pipelines" / "imagenet_train.yaml", "val": REPO / "pipelines" / "imagenet_val.yaml"}
PIPELINE = PIPELINES["train"]
DATASETS = ("imagenet-like", "photos")

# name -> (kind, stock Pillow?, decode's reduce setting); kinds: feedgpu.bench.subjects.MAKERS keys,
# "spdl", "dali_hand", or a DALI engine variant of DALI_ENGINES
LOADERS = {
    "torch_pillow": ("torch", True, "off"),
    "torch_pillow_simd": ("torch", False, "off"),
    "spdl": ("spdl", False, "off"),
    "dali_hand": ("dali_hand", False, "off"),
    "feedgpu_full": ("feedgpu", False, "off"),
    "feedgpu": ("feedgpu", False, "rows"),
    "feedgpu_reduce": ("feedgpu", False, "auto"),
    "feedgpu_dali_cpu": ("feedgpu_dali_cpu", False, "off"),
    "feedgpu_dali_cpu_whole": ("feedgpu_dali_cpu_whole", False, "off"),
}
DALI_ENGINES = {"feedgpu_dali_cpu": {"name": "dali", "device": "cpu"},
                "feedgpu_dali_cpu_whole": {"name": "dali", "device": "cpu", "window_decode": False}}
#: the references feedgpu's loaders are compared with, and the goals: (part, reference) -> ratio
REFERENCES = ("torch_pillow", "torch_pillow_simd", "spdl", "dali_hand")
GOALS = {("imagenet-like/train", "torch_pillow"): 2.5, ("imagenet-like/train", "dali_hand"): 1.6,
         ("imagenet-like/val", "dali_hand"): 1.6,
         ("photos/train", "torch_pillow"): 4.0, ("photos/val", "torch_pillow"): 4.0}


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
    import shutil

    files = sorted(p for p in Path(photos).iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    if not files:
        raise FileNotFoundError(f"no JPEG photographs in {photos}")
    if out.is_dir() and len(list(out.rglob("*.jpg"))) == n:
        return out
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    for i in range(n):
        f = files[i % len(files)]
        d = tmp / f.stem
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.jpg").symlink_to(f.resolve())
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def one_run(base: dict, p, on_batch) -> dict:
    """One measured run of the child's loader on pipeline ``p``."""
    from feedgpu.bench.measure import measure, run_one
    from feedgpu.bench.subjects import feedgpu_subject

    kind, workers, bs = base["kind"], base["workers"], base["batch_size"]
    if kind == "spdl":
        from bench.spdl_loader import spdl_subject

        return measure(spdl_subject(p, workers, bs, base["recipe"]), base["batches"], base["warmup"], on_batch)
    if kind == "dali_hand":
        from bench.dali_cpu import hand_subject

        subject = hand_subject(p, base["data"], workers, bs, base["recipe"] == "train", base["recipe"])
        return measure(subject, base["batches"], base["warmup"], on_batch)
    if kind in DALI_ENGINES:
        subject = feedgpu_subject(p, workers, bs, "cpu", engine=DALI_ENGINES[kind], name=kind)
        return measure(subject, base["batches"], base["warmup"], on_batch)
    return run_one(kind, p, workers, bs, base["batches"], base["warmup"], "cpu", on_batch=on_batch)


def serve(base: dict) -> None:
    """Child process: index the data once, then answer one JSON command per stdin line with one
    result line on stdout: ``{"mode": "run", "desc": ...}`` measures one run of this child's
    loader, ``{"mode": "single", "images": n}`` the per-core reference, ``{"mode": "exit"}``."""
    check_pil(base["stock"])
    from feedgpu.bench.measure import progress_bar
    from feedgpu.imaging import pil_label

    p = _pipeline(base["data"], base["recipe"], base["reduce"])
    len(p.source)

    def answer(cmd: dict) -> dict:
        if cmd["mode"] == "single":
            return {"pil": pil_label(), **per_core(p, cmd["images"])}
        with progress_bar(base["warmup"] + base["batches"], cmd["desc"]) as bar:
            res = one_run(base, p, lambda: bar.update(1))
        return {**res, "pil": pil_label()}

    harness_serve({"ready": True, "pil": pil_label()}, answer)


def per_core(p, n: int) -> dict:
    """One process, no loader: images/s of decode + the geometric transforms (the anchors'
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
def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated, of imagenet-like, photos "
                    "(default both): imagenet-like: JPEGs of 400-640 px made from --photos; photos: the "
                    "photographs themselves at full size, repeated")
    ap.add_argument("--recipes", default="train,val", help="comma-separated, of train (random resized crop 224 "
                    "+ flip) and val (resize 256 + center crop 224) (default both)")
    ap.add_argument("--images", type=int, default=2000, help="ImageNet-like images (default 2000)")
    ap.add_argument("--photo-images", type=int, default=1536,
                    help="files of the photos dataset, links to the photographs in turn (default 1536)")
    ap.add_argument("--photos", default=str((REPO / ".." / "shared" / "data" / "photos").resolve()),
                    help="photographs the datasets are made from (default ../shared/data/photos)")
    ap.add_argument("--loaders", default=",".join(LOADERS), help=f"comma-separated, of {', '.join(LOADERS)} "
                    "(default all)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes, or threads of the thread-based "
                    "loaders (default 2)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batches", type=int, help="timed batches per run (default: the rest of one epoch, "
                    "rounded down to a multiple of --workers)")
    ap.add_argument("--single-images", type=int, default=200,
                    help="images of the per-core reference without a loader (0: skip it; default 200)")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each run, wait up to this many seconds for other processes to go idle")
    ap.add_argument("--max-others", type=float, default=25.0,
                    help="rerun a run during which other processes used more than this %% of a core")
    ap.add_argument("--retries", type=int, default=3, help="reruns of a disturbed run (default 3)")
    ap.add_argument("--note", default="", help="a line saying how the run was made (a busy machine, say); "
                    "shown at the top of the report")
    ap.add_argument("--fresh", action="store_true", help="drop the parts of an existing cpu_loader.json "
                    "not measured in this run")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="where cpu_loader.json/.md go")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for opt, choices in (("loaders", LOADERS), ("datasets", DATASETS), ("recipes", PIPELINES)):
        names = [n.strip() for n in getattr(a, opt).split(",") if n.strip()]
        unknown = sorted(set(names) - set(choices))
        if unknown or not names:
            ap.error(f"--{opt}: unknown {unknown}; choose among {', '.join(choices)}")
        setattr(a, opt, names)
    return a


def measure_part(a, dataset: str, recipe: str) -> dict:
    """Every loader of ``a.loaders`` on one dataset and recipe: the part's figures."""
    from feedgpu.bench.machine import data_info
    from feedgpu.bench.measure import default_batches, epoch_batches
    from feedgpu.sample_data import build_imagenet_like

    t0 = time.perf_counter()
    key = f"{dataset}/{recipe}"
    if dataset == "photos":
        data = build_photo_set(REPO / "bench" / "out" / f"photos-{a.photo_images}", a.photos, a.photo_images)
    else:
        data = REPO / "bench" / "out" / f"imagenet-like-{a.images}"
        build_imagenet_like(data, a.images, photos_dir=a.photos, progress=True)
    p = _pipeline(str(data), recipe)
    nb = epoch_batches(p, a.batch_size)
    batches = a.batches or default_batches(nb, a.warmup, a.workers)
    print(f"{key}: measuring the data set", file=sys.stderr)
    data_meta = data_info(p, str(data), sample=None)
    settings = {"pipeline": str(PIPELINES[recipe].relative_to(REPO)), "recipe": recipe, "dataset": dataset,
                "loaders": a.loaders, "workers": a.workers, "batch_size": a.batch_size, "batches_per_epoch": nb,
                "timed_batches": batches, "warmup": a.warmup, "rounds": a.rounds,
                "prefetch_factor": p.prefetch_factor, "device": "cpu", "shuffle": p.shuffle,
                "drop_last": p.drop_last, "photos": a.photos, "quiet_wait_s": a.quiet_wait,
                "max_others_percent": a.max_others, "retries": a.retries}
    base = {"data": str(data), "workers": a.workers, "batch_size": a.batch_size, "batches": batches,
            "warmup": a.warmup, "recipe": recipe}
    children: dict[str, Child] = {}
    disturbed: list[dict] = []
    try:
        for name in a.loaders:
            kind, stock, reduce = LOADERS[name]
            path = [REPO / "bench" / ".spdl"] if kind == "spdl" else []
            children[name] = Child(name, {**base, "kind": kind, "stock": stock, "reduce": reduce},
                                   "bench.cpu_loader", path)
        single = {}
        if a.single_images > 0:
            print(f"{key}: per-core reference (one process, no loader)", file=sys.stderr)
            for pil, name in (("pillow_simd", "torch_pillow_simd"), ("pillow", "torch_pillow")):
                if name in children:
                    wait_quiet(a.quiet_wait)
                    single[pil] = children[name].ask({"mode": "single", "images": min(a.single_images, len(p.source))})

        def run(name: str, r: int, on_batch) -> dict:
            desc = f"{key} {name} warm-up round" if r < 0 else f"{key} {name} round {r + 1}/{a.rounds}"
            for attempt in range(1, a.retries + 2):
                waited = wait_quiet(a.quiet_wait) if a.quiet_wait > 0 else 0.0
                res = children[name].ask({"mode": "run", "desc": desc})
                res.update(loader=name, waited_for_quiet_s=waited, attempt=attempt)
                print(f"{desc}: {res['samples_per_s']:.0f} samples/s, CPU {res['cpu_percent']:.0f} %, others "
                      f"{res['others_cpu_percent'] or 0:.0f} % ({time.perf_counter() - t0:.0f} s into the part)",
                      file=sys.stderr)
                if (res["others_cpu_percent"] or 0) <= a.max_others or attempt > a.retries:
                    return res
                print(f"{name}: other processes used {res['others_cpu_percent']:.0f} % CPU during the run; "
                      "running it again", file=sys.stderr)
                res["round"] = r + 1
                disturbed.append(res)
            return res  # pragma: no cover - the loop always returns

        # one unrecorded round first: each process's first run pays one-time costs (first touch
        # of fresh memory, imports, file cache) that a training run pays once, not per epoch
        warm = [run(name, -1, None) for name in a.loaders]
        runs = []   # round r runs the loaders in their order rotated by r
        for r in range(a.rounds):
            k = r % len(a.loaders)
            for name in a.loaders[k:] + a.loaders[:k]:
                runs.append({**run(name, r, None), "round": r + 1})
    finally:
        for c in children.values():
            c.close()
    return {"key": key, "settings": settings, "data": data_meta, **figures(runs, a.rounds),
            "per_core_no_loader": single, "runs": runs, "warmup_runs_not_counted": warm,
            "disturbed_runs_repeated": disturbed, "seconds": round(time.perf_counter() - t0, 1)}


def figures(runs: list[dict], rounds: int) -> dict:
    """Medians per loader (``summary``) and each feedgpu loader's ratio to each reference taken
    within each round (``ratios``: median, min, max and the values)."""
    from feedgpu.bench.measure import summarize

    summary = summarize(runs)
    for name, s in summary.items():
        rs = [r for r in runs if r["loader"] == name]
        s["pil"] = rs[0]["pil"]
        s["samples_per_s_min"] = min(r["samples_per_s"] for r in rs)
        s["samples_per_s_max"] = max(r["samples_per_s"] for r in rs)
        s["steal_percent_median"] = statistics.median(r["steal_percent"] or 0 for r in rs)
        # CPU seconds (main process + workers, or the process's threads) per 1,000 samples delivered
        s["cpu_s_per_1000"] = round(statistics.median(r["cpu_percent"] / 100 * 1000 / r["samples_per_s"]
                                                      for r in rs), 2)
        stages = rs[0].get("stage_ms_per_sample")
        if stages:
            s["stage_ms_per_sample"] = {k: round(statistics.median(r["stage_ms_per_sample"][k] for r in rs), 3)
                                        for k in stages}
    ratios = {}
    refs = [y for y in REFERENCES if y in summary]
    for x in summary:
        for y in refs:
            if x == y or (x in REFERENCES and REFERENCES.index(x) <= REFERENCES.index(y)):
                continue
            vals, cpu = [], []
            for r in range(1, rounds + 1):
                rx = [q for q in runs if q["round"] == r and q["loader"] == x]
                ry = [q for q in runs if q["round"] == r and q["loader"] == y]
                if rx and ry and ry[0]["samples_per_s"]:
                    vals.append(rx[0]["samples_per_s"] / ry[0]["samples_per_s"])
                    cpu.append(_cpu_per_sample(ry[0]) / _cpu_per_sample(rx[0]))
            if vals:
                ratios[f"{x}_over_{y}"] = {**spread(vals, 3), "values": [round(v, 3) for v in vals], "x": x, "y": y,
                                           "cpu": {**spread(cpu, 3), "values": [round(v, 3) for v in cpu]}}
    return {"summary": summary, "ratios": ratios}


def _cpu_per_sample(run: dict) -> float:
    """CPU seconds the loader spent per sample in a run's timed window."""
    return run["cpu_percent"] / 100 / run["samples_per_s"]


def previous_parts(out: Path) -> dict:
    """The parts of ``out/cpu_loader.json`` (this format's; none otherwise): a run replaces the
    parts it measures and keeps the others."""
    old = out / "cpu_loader.json"
    if not old.exists():
        return {}
    prev = json.loads(old.read_text())
    return dict(prev.get("parts", {})) if prev.get("format") == FORMAT else {}


def main(argv=None) -> int:
    a = _args(argv)
    if a.serve:
        serve(json.loads(a.serve))
        return 0
    from feedgpu.bench.machine import machine_info

    t0 = time.perf_counter()
    stock_version = ensure_stock_pillow() if any(LOADERS[n][1] for n in a.loaders) else None
    spdl_version = None
    if "spdl" in a.loaders:
        from bench.spdl_loader import ensure_spdl

        spdl_version = ensure_spdl()
    machine = machine_info()
    machine["pil_stock"] = f"Pillow {stock_version}" if stock_version else None
    machine["spdl"] = spdl_version
    if any(LOADERS[n][0] in ("dali_hand", *DALI_ENGINES) for n in a.loaders):
        import nvidia.dali

        machine["dali"] = nvidia.dali.__version__
    out = Path(a.out)
    parts = {} if a.fresh else previous_parts(out)
    for dataset in a.datasets:
        for recipe in a.recipes:
            part = measure_part(a, dataset, recipe)
            part.update(machine=machine, note=a.note, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        command="python -m bench.cpu_loader " + shlex.join(sys.argv[1:] if argv is None else argv))
            parts[part["key"]] = part
    order = [f"{d}/{r}" for d in DATASETS for r in PIPELINES]
    doc = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m bench.cpu_loader " + shlex.join(sys.argv[1:] if argv is None else argv),
           "note": a.note, "machine": machine,
           "goals": [{"part": k, "over": y, "ratio": v} for (k, y), v in GOALS.items()],
           "parts": {k: parts[k] for k in sorted(parts, key=lambda k: order.index(k) if k in order else 99)},
           "total_seconds": round(time.perf_counter() - t0, 1)}
    from bench.cpu_loader_report import markdown

    write_results(out, "cpu_loader", doc, markdown)
    return 0


FORMAT = "feedgpu.bench.cpu_loader/2"

if __name__ == "__main__":
    sys.exit(main())
