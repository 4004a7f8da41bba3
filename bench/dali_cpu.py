#!/usr/bin/env python
"""The recorded DALI CPU benchmark: feedgpu's DALI engine on DALI's CPU operators, side by side
with torch's DataLoader + Pillow, feedgpu's Python engine and hand-written DALI pipelines.

Same data (ImageNet-like JPEGs), same transforms (``pipelines/imagenet_train.yaml``: decode,
random resized crop 224, horizontal flip, normalize to float32 NCHW), same batch size and equal
cores (2 workers = 2 DALI threads), output on the CPU:

* ``torch_pillow``: ``torch.utils.data.DataLoader`` + torchvision-equivalent transforms
  (``feedgpu.bench.torch_baseline``) with stock Pillow from PyPI (``bench/.pillow-stock``), what users have;
* ``torch_pillow_simd``: the same with this environment's Pillow-SIMD;
* ``feedgpu_python``: ``feedgpu.DataLoader``, Python engine (worker processes, Pillow-SIMD);
* ``feedgpu_dali_cpu``: ``feedgpu.DataLoader`` with ``engine={"name": "dali", "device": "cpu"}``
  (``device_id=None``, 2 threads): the same YAML, one key changed;
* ``feedgpu_dali_cpu_whole``: the same with ``window_decode: false`` (whole images decoded;
  the crop-on-decode ablation); ``feedgpu_dali_cpu_epoch2``: the default engine timed in its
  second epoch, where each file's header check is kept from the first;
* ``dali_hand``: a hand-written DALI CPU pipeline decoding whole images, as DALI's
  documentation writes it: ``fn.readers.file(random_shuffle=True)`` -> ``fn.decoders.image`` ->
  ``fn.random_resized_crop`` (a resize of a random ROI, the same area / aspect-ratio ranges) ->
  ``fn.crop_mirror_normalize(mirror=fn.random.coin_flip())`` to float32 CHW, ``DALIGenericIterator``;
  DALI's default asynchronous, pipelined executor (prefetch queue depth 2);
* ``dali_hand_roi_decode``: the same with ``fn.decoders.image_random_crop`` + ``fn.resize``
  (decodes only the crop window: the usual DALI training pipeline, and the same operators as
  feedgpu's engine: the reference of the "within 5 %" target).

Each loader lives in its own process (a fresh interpreter); the parent asks them in turn for one
measured run each, round after round; one unrecorded warm-up round comes first. The measurement
is ``feedgpu.bench.measure.measure`` (what ``feedgpu bench`` and ``bench/cpu_loader.py`` report).

Other people run benchmarks on the 2-core development machine: before the first run the script
waits until the 1-minute load average is below ``--max-load`` (0.5); before each run, until the
rest of the machine is idle; and a run during which others used more than ``--max-others`` % of a
core is run again (the disturbed runs stay in the JSON).

Writes ``bench/results/dali_cpu.json`` and ``bench/results/dali_cpu.md``.

    .venv/bin/python -m bench.dali_cpu                   # 2,000 images, 2 workers / threads, 7 rounds
    .venv/bin/python -m bench.dali_cpu --rounds 3 --batches 8
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness import REPO, Child, check_pil, ensure_stock_pillow, spread, wait_quiet, write_results
from bench.harness import serve as harness_serve

PIPELINE = REPO / "pipelines" / "imagenet_train.yaml"

# name -> (kind, stock Pillow?); kinds are feedgpu.bench.subjects.MAKERS keys or hand-written DALI
LOADERS = {
    "torch_pillow": ("torch", True),
    "torch_pillow_simd": ("torch", False),
    "feedgpu_python": ("feedgpu", False),
    "feedgpu_dali_cpu": ("feedgpu_dali_cpu", False),
    "feedgpu_dali_cpu_whole": ("feedgpu_dali_cpu_whole", False),
    "feedgpu_dali_cpu_epoch2": ("feedgpu_dali_cpu_epoch2", False),
    "dali_hand": ("dali_hand", False),
    "dali_hand_roi_decode": ("dali_hand_roi_decode", False),
}
NAMES = {"torch_pillow": "torch DataLoader + stock Pillow", "torch_pillow_simd": "torch DataLoader + Pillow-SIMD",
         "feedgpu_python": "feedgpu, Python engine (Pillow-SIMD)", "feedgpu_dali_cpu": "feedgpu, DALI CPU engine",
         "feedgpu_dali_cpu_whole": "feedgpu, DALI CPU engine, window_decode off (whole images decoded)",
         "feedgpu_dali_cpu_epoch2": "feedgpu, DALI CPU engine, timed in its 2nd epoch (headers known)",
         "dali_hand": "hand-written DALI CPU (decoders.image + random_resized_crop)",
         "dali_hand_roi_decode": "hand-written DALI CPU (decoders.image_random_crop + resize)"}


# -- the hand-written DALI pipelines ------------------------------------------------------------------
class HandDali:
    """A DALI CPU pipeline written by hand from the pipeline's settings, iterated as torch tensors
    with ``DALIGenericIterator`` (what DALI's PyTorch examples do). Built on the first ``iter()``,
    so that the first batch's time includes the build, as for the other loaders."""

    def __init__(self, pipeline, data: str, batch_size: int, threads: int, roi_decode: bool, seed: int = 0,
                 recipe: str = "train"):
        from feedgpu.stages import HorizontalFlip, Normalize, RandomResizedCrop, ResizeCenterCrop

        st = {type(s): s for s in pipeline.stages}
        self.recipe = recipe
        self.rrc, self.flip, self.norm = st.get(RandomResizedCrop), st.get(HorizontalFlip), st[Normalize]
        self.rcc = st.get(ResizeCenterCrop)
        if (self.rrc if recipe == "train" else self.rcc) is None:
            raise ValueError(f"the pipeline has no stage of the {recipe} recipe")
        self.data, self.batch_size, self.threads = data, batch_size, threads
        self.roi_decode, self.seed = roi_decode, seed
        self.n = len(pipeline.source)
        self.pipe = self.it = None

    def __len__(self) -> int:
        return self.n // self.batch_size

    def _build(self) -> None:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        rrc, norm = self.rrc, self.norm
        if self.recipe == "val":
            return self._build_val(fn, pipeline_def, types, DALIGenericIterator, LastBatchPolicy)
        h, w = rrc.size
        area, ratio = list(rrc.scale), list(rrc.ratio)

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=None, seed=self.seed)
        def graph():
            jpegs, labels = fn.readers.file(file_root=self.data, random_shuffle=True, name="Reader")
            if self.roi_decode:
                images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                       random_area=area, random_aspect_ratio=ratio, num_attempts=10)
                images = fn.resize(images, resize_x=w, resize_y=h, interp_type=types.INTERP_LINEAR, antialias=True)
            else:
                images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
                images = fn.random_resized_crop(images, size=[h, w], random_area=area, random_aspect_ratio=ratio,
                                                num_attempts=10, interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.crop_mirror_normalize(
                images, dtype=types.FLOAT, output_layout="CHW", mean=[m * 255 for m in norm.mean],
                std=[s * 255 for s in norm.std], mirror=fn.random.coin_flip(probability=self.flip.p))
            return images, labels

        self.pipe = graph()
        self.pipe.build()
        self.it = DALIGenericIterator([self.pipe], ["images", "labels"], reader_name="Reader",
                                      last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)

    def _build_val(self, fn, pipeline_def, types, DALIGenericIterator, LastBatchPolicy) -> None:
        """The val recipe as DALI's examples write it: whole-image decode, resize of the short side
        (``fn.resize(resize_shorter=...)``, linear, antialias), centre crop and normalize in
        ``crop_mirror_normalize``; the files in order."""
        rcc, norm = self.rcc, self.norm

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=None, seed=self.seed)
        def graph():
            jpegs, labels = fn.readers.file(file_root=self.data, random_shuffle=False, name="Reader")
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            images = fn.resize(images, resize_shorter=rcc.resize, interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.crop_mirror_normalize(
                images, dtype=types.FLOAT, output_layout="CHW", crop=list(rcc.crop),
                mean=[m * 255 for m in norm.mean], std=[s * 255 for s in norm.std])
            return images, labels

        self.pipe = graph()
        self.pipe.build()
        self.it = DALIGenericIterator([self.pipe], ["images", "labels"], reader_name="Reader",
                                      last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)

    def __iter__(self):
        if self.it is None:
            self._build()
        for out in self.it:
            yield out[0]["images"], out[0]["labels"].view(-1).long()

    def close(self) -> None:
        self.it = self.pipe = None
        gc.collect()


def hand_subject(pipeline, data: str, workers: int, batch_size: int, roi_decode: bool, recipe: str = "train"):
    from feedgpu.bench.subjects import Subject

    loader = HandDali(pipeline, data, batch_size, workers, roi_decode, recipe=recipe)
    name = "dali_hand_roi_decode" if roi_decode else "dali_hand"
    extra = lambda: {"threads": workers}  # noqa: E731
    return Subject(name, NAMES[name], loader, lambda: [], "cpu", loader.close, extra)


# -- the child: one loader, one measured run per request ------------------------------------------------
def _pipeline(data: str):
    from feedgpu import Pipeline

    return Pipeline.from_yaml(PIPELINE, **{"source.path": data, "output.device": "cpu"})


#: feedgpu's DALI engine, variants measured as loaders of their own
DALI_VARIANTS = {"feedgpu_dali_cpu_whole": {"name": "dali", "device": "cpu", "window_decode": False},
                 "feedgpu_dali_cpu_epoch2": {"name": "dali", "device": "cpu"}}


def _warmup(base: dict) -> int:
    """Warm-up batches of a run: ``feedgpu_dali_cpu_epoch2`` is timed in its second epoch (a
    whole first epoch, then the usual warm-up), where each file's header check is known."""
    return base["warmup"] + (base["batches_per_epoch"] if base["kind"] == "feedgpu_dali_cpu_epoch2" else 0)


def one_run(base: dict, p, on_batch) -> dict:
    from feedgpu.bench.measure import measure, run_one
    from feedgpu.bench.subjects import feedgpu_subject

    kind = base["kind"]
    if kind.startswith("dali_hand"):
        subject = hand_subject(p, base["data"], base["workers"], base["batch_size"], kind == "dali_hand_roi_decode")
        return measure(subject, base["batches"], base["warmup"], on_batch)
    if kind in DALI_VARIANTS:
        subject = feedgpu_subject(p, base["workers"], base["batch_size"], "cpu", engine=DALI_VARIANTS[kind],
                                     name=kind)
        return measure(subject, base["batches"], _warmup(base), on_batch)
    return run_one(kind, p, base["workers"], base["batch_size"], base["batches"], base["warmup"], "cpu",
                      on_batch=on_batch)


def serve(base: dict) -> None:
    """Child process: answer one JSON command per stdin line with one result line on stdout:
    ``{"mode": "run", "desc": ...}`` or ``{"mode": "exit"}``."""
    check_pil(base["stock"])
    from feedgpu.bench.measure import progress_bar
    from feedgpu.imaging import pil_label

    p = _pipeline(base["data"])
    len(p.source)

    def answer(cmd: dict) -> dict:
        warm, snaps, done = _warmup(base), [], [0]

        def on_batch():
            bar.update(1)
            done[0] += 1
            if done[0] in (warm, warm + base["batches"]):   # the timed window's ends (as measure's)
                snaps.append(thread_cpu())

        with progress_bar(warm + base["batches"], cmd["desc"]) as bar:
            res = one_run(base, p, on_batch)
        res["pil"] = pil_label()
        if len(snaps) == 2 and res.get("samples"):
            res["thread_cpu_ms_per_sample"] = {k: 1e3 * (snaps[1].get(k, 0.0) - snaps[0].get(k, 0.0)) / res["samples"]
                                               for k in snaps[1]}
        return res

    harness_serve({"ready": True, "pil": pil_label()}, answer)


def thread_cpu() -> dict:
    """CPU seconds of this process's threads so far: DALI's (named ``[DALI]...``) and the rest
    (the main thread and feedgpu's helper threads), from ``/proc/self/task`` (Linux)."""
    out = {"dali": 0.0, "python": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue   # the thread ended meanwhile
        out["dali" if name.startswith("[DALI]") else "python"] += (int(fields[11]) + int(fields[12])) / tick
    return out


# -- the parent ------------------------------------------------------------------------------------------
def wait_load(max_load: float, limit_s: float) -> dict:
    """Wait (up to ``limit_s``) until the 1-minute load average is below ``max_load``."""
    t0 = time.perf_counter()
    start = os.getloadavg()[0]
    while os.getloadavg()[0] >= max_load and time.perf_counter() - t0 < limit_s:
        time.sleep(5)
    return {"load_at_start": round(start, 2), "load_when_started": round(os.getloadavg()[0], 2),
            "waited_s": round(time.perf_counter() - t0, 1), "max_load": max_load}


def per_round(runs: list[dict], rounds: int, x: str, y: str) -> dict | None:
    vals = []
    for r in range(1, rounds + 1):
        rx = [q["samples_per_s"] for q in runs if q["round"] == r and q["loader"] == x]
        ry = [q["samples_per_s"] for q in runs if q["round"] == r and q["loader"] == y]
        if rx and ry:
            vals.append(rx[0] / ry[0])
    if not vals:
        return None
    return {**spread(vals), "values": [round(v, 3) for v in vals]}


RATIOS = {  # key -> (numerator, denominator, target or None)
    "feedgpu_dali_cpu_over_torch_pillow": ("feedgpu_dali_cpu", "torch_pillow", 2.0),
    "feedgpu_dali_cpu_over_dali_hand_roi_decode": ("feedgpu_dali_cpu", "dali_hand_roi_decode", 0.95),
    "feedgpu_dali_cpu_over_dali_hand": ("feedgpu_dali_cpu", "dali_hand", None),
    "feedgpu_dali_cpu_epoch2_over_torch_pillow": ("feedgpu_dali_cpu_epoch2", "torch_pillow", None),
    "feedgpu_dali_cpu_epoch2_over_dali_hand_roi_decode": ("feedgpu_dali_cpu_epoch2", "dali_hand_roi_decode", None),
    "feedgpu_dali_cpu_over_feedgpu_dali_cpu_whole": ("feedgpu_dali_cpu", "feedgpu_dali_cpu_whole", None),
    "dali_hand_over_torch_pillow": ("dali_hand", "torch_pillow", None),
    "dali_hand_roi_decode_over_torch_pillow": ("dali_hand_roi_decode", "torch_pillow", None),
    "feedgpu_dali_cpu_over_feedgpu_python": ("feedgpu_dali_cpu", "feedgpu_python", None),
    "feedgpu_python_over_torch_pillow": ("feedgpu_python", "torch_pillow", None),
    "feedgpu_dali_cpu_over_torch_pillow_simd": ("feedgpu_dali_cpu", "torch_pillow_simd", None),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000, help="images in the dataset (default 2000)")
    ap.add_argument("--photos", default=str((REPO / ".." / "shared" / "data" / "photos").resolve()),
                    help="photographs the dataset is made from (default ../shared/data/photos)")
    ap.add_argument("--data", help="dataset folder (default bench/out/imagenet-like-<images>, built if missing)")
    ap.add_argument("--workers", type=int, default=2, help="workers per torch/Python loader = DALI threads")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batches", type=int, help="timed batches per run (default: the rest of one epoch, "
                    "rounded down to a multiple of --workers)")
    ap.add_argument("--loaders", default=",".join(LOADERS), help="comma-separated subset of: " + ", ".join(LOADERS))
    ap.add_argument("--max-load", type=float, default=0.5,
                    help="before the first run, wait until the 1-minute load average is below this")
    ap.add_argument("--load-wait", type=float, default=900.0, help="... for at most this many seconds")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each run, wait up to this many seconds for other processes to go idle")
    ap.add_argument("--max-others", type=float, default=25.0,
                    help="rerun a run during which other processes used more than this %% of a core")
    ap.add_argument("--retries", type=int, default=3, help="reruns of a disturbed run (default 3)")
    ap.add_argument("--report-only", metavar="JSON", help="rewrite the markdown report from a results JSON")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="where dali_cpu.json/.md go")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        serve(json.loads(a.serve))
        return 0
    if a.report_only:
        doc = json.loads(Path(a.report_only).read_text())
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dali_cpu.md").write_text(markdown(doc))
        print(f"wrote {out / 'dali_cpu.md'}", file=sys.stderr)
        return 0

    import nvidia.dali

    from feedgpu.bench.machine import data_info, machine_info
    from feedgpu.bench.measure import default_batches, epoch_batches, ratio, run_rounds, summarize
    from feedgpu.sample_data import build_imagenet_like

    t0 = time.perf_counter()
    names = [n.strip() for n in a.loaders.split(",") if n.strip()]
    unknown = set(names) - set(LOADERS)
    if unknown:
        ap.error(f"unknown loaders {sorted(unknown)}; choose from {', '.join(LOADERS)}")
    stock_version = ensure_stock_pillow() if any(LOADERS[n][1] for n in names) else None
    data = Path(a.data) if a.data else REPO / "bench" / "out" / f"imagenet-like-{a.images}"
    if not a.data:
        build_imagenet_like(data, a.images, photos_dir=a.photos, progress=True)
    p = _pipeline(str(data))
    nb = epoch_batches(p, a.batch_size)
    batches = a.batches or default_batches(nb, a.warmup, a.workers)
    print("measuring the data set", file=sys.stderr)
    data_meta = data_info(p, str(data), sample=None)
    machine = machine_info()
    machine["pil_stock"] = f"Pillow {stock_version}" if stock_version else None
    machine["dali"] = nvidia.dali.__version__
    settings = {"pipeline": str(PIPELINE.relative_to(REPO)), "workers": a.workers, "dali_threads": a.workers,
                "batch_size": a.batch_size, "batches_per_epoch": nb, "timed_batches": batches, "warmup": a.warmup,
                "rounds": a.rounds, "prefetch_factor": p.prefetch_factor, "device": "cpu", "shuffle": p.shuffle,
                "drop_last": p.drop_last, "photos": a.photos, "loaders": names, "max_load": a.max_load,
                "quiet_wait_s": a.quiet_wait, "max_others_percent": a.max_others, "retries": a.retries}
    base = {"data": str(data), "workers": a.workers, "batch_size": a.batch_size, "batches": batches,
            "warmup": a.warmup, "batches_per_epoch": nb}

    print(f"waiting for the 1-minute load average to drop below {a.max_load}", file=sys.stderr)
    load = wait_load(a.max_load, a.load_wait)
    print(f"load {load}", file=sys.stderr)
    children: dict[str, Child] = {}
    disturbed: list[dict] = []
    try:
        for name in names:
            kind, stock = LOADERS[name]
            children[name] = Child(name, {**base, "kind": kind, "stock": stock}, "bench.dali_cpu")

        def run(name: str, r: int, on_batch) -> dict:
            desc = f"{name} warm-up round" if r < 0 else f"{name} round {r + 1}/{a.rounds}"
            for attempt in range(1, a.retries + 2):
                waited = wait_quiet(a.quiet_wait) if a.quiet_wait > 0 else 0.0
                res = children[name].ask({"mode": "run", "desc": desc})
                res.update(loader=name, label=NAMES[name], waited_for_quiet_s=waited, attempt=attempt,
                           load1=round(os.getloadavg()[0], 2))
                if (res["others_cpu_percent"] or 0) <= a.max_others or attempt > a.retries:
                    return res
                print(f"{name}: other processes used {res['others_cpu_percent']:.0f} % CPU during the run; "
                      "running it again", file=sys.stderr)
                res["round"] = r + 1
                disturbed.append(res)
            return res  # pragma: no cover - the loop always returns

        warm = [run(name, -1, None) for name in names]
        runs = run_rounds(names, a.rounds, run)
    finally:
        for c in children.values():
            c.close()
    summary = summarize(runs)
    for name, s in summary.items():
        rs = [r for r in runs if r["loader"] == name]
        s["label"] = NAMES[name]
        s["pil"] = rs[0]["pil"]
        s["samples_per_s_min"] = min(r["samples_per_s"] for r in rs)
        s["samples_per_s_max"] = max(r["samples_per_s"] for r in rs)
        s["steal_percent_median"] = statistics.median(r["steal_percent"] or 0 for r in rs)
        if "stage_ms_per_sample" in rs[0]:
            stages = rs[0]["stage_ms_per_sample"].keys()
            s["stage_ms_per_sample"] = {k: round(statistics.median(r["stage_ms_per_sample"].get(k, 0.0) for r in rs), 4)
                                        for k in stages}
        if name.startswith(("feedgpu_dali", "dali_hand")) and all("thread_cpu_ms_per_sample" in r for r in rs):
            s["thread_cpu_ms_per_sample"] = {
                k: round(statistics.median(r["thread_cpu_ms_per_sample"][k] for r in rs), 4) for k in ("dali", "python")}
    ratios = {k: ratio(summary, x, y) for k, (x, y, _) in RATIOS.items() if x in summary and y in summary}
    ratios_per_round = {k: per_round(runs, a.rounds, x, y) for k, (x, y, _) in RATIOS.items()
                        if x in summary and y in summary}
    targets = {k: {"target": t, "met": ratios[k] is not None and ratios[k] >= t}
               for k, (_, _, t) in RATIOS.items() if t is not None and k in ratios}
    total = time.perf_counter() - t0
    doc = {"format": "feedgpu.bench.dali_cpu/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m bench.dali_cpu " + " ".join(sys.argv[1:] if argv is None else argv),
           "targets": targets, "machine": machine, "data": data_meta, "settings": settings, "load": load,
           "summary": summary, "ratios": ratios, "ratios_per_round": ratios_per_round,
           "runs": runs, "warmup_runs_not_counted": warm,
           "disturbed_runs_repeated": disturbed, "total_seconds": round(total, 1)}
    write_results(a.out, "dali_cpu", doc, markdown)
    return 0


# -- the report ------------------------------------------------------------------------------------------
def _f(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _ratio_row(doc: dict, key: str, label: str) -> str:
    r, pr = doc["ratios"].get(key), doc["ratios_per_round"].get(key)
    t = doc["targets"].get(key)
    target = "" if t is None else f"≥ {t['target']:.2f}×"
    per = "–" if pr is None else f"{pr['median']:.2f}× ({pr['min']:.2f}–{pr['max']:.2f})"
    return f"| {label} | **{_f(r, '.2f')}×** | {per} | {target} |"


def markdown(doc: dict) -> str:
    m, d, s, su = doc["machine"], doc["data"], doc["settings"], doc["summary"]
    L = [
        "# DALI CPU benchmark: feedgpu's DALI engine vs torch DataLoader + Pillow and hand-written DALI",
        "",
        f"Recorded {doc['created']} with `{doc['command'].strip()}` ({doc['total_seconds']:.0f} s). "
        "Raw numbers, every run: `dali_cpu.json`.",
        "",
        "| ratio (samples/s) | of medians | per round: median (min–max) | target |",
        "| --- | ---: | ---: | --- |",
    ]
    labels = {"feedgpu_dali_cpu_over_torch_pillow": "feedgpu DALI CPU / torch DataLoader + stock Pillow",
              "feedgpu_dali_cpu_over_dali_hand_roi_decode":
                  "feedgpu DALI CPU / hand-written DALI CPU, same operators (crop-on-decode)",
              "feedgpu_dali_cpu_over_dali_hand": "feedgpu DALI CPU / hand-written DALI CPU (whole-image decode)",
              "feedgpu_dali_cpu_epoch2_over_torch_pillow": "feedgpu DALI CPU, 2nd epoch / torch + stock Pillow",
              "feedgpu_dali_cpu_epoch2_over_dali_hand_roi_decode":
                  "feedgpu DALI CPU, 2nd epoch / hand-written DALI CPU (crop-on-decode)",
              "feedgpu_dali_cpu_over_feedgpu_dali_cpu_whole": "feedgpu DALI CPU / the same with window_decode off",
              "feedgpu_dali_cpu_over_feedgpu_python": "feedgpu DALI CPU / feedgpu Python engine",
              "feedgpu_dali_cpu_over_torch_pillow_simd": "feedgpu DALI CPU / torch DataLoader + Pillow-SIMD",
              "feedgpu_python_over_torch_pillow": "feedgpu Python engine / torch DataLoader + stock Pillow",
              "dali_hand_over_torch_pillow": "hand-written DALI (whole-image decode) / torch + stock Pillow",
              "dali_hand_roi_decode_over_torch_pillow": "hand-written DALI (crop-on-decode) / torch + stock Pillow"}
    for key, label in labels.items():
        if key in doc["ratios"]:
            L.append(_ratio_row(doc, key, label))
    ld = doc["load"]
    L += [
        "",
        "## Setup",
        "",
        f"- Machine: {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB RAM, {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}, NVIDIA DALI {m['dali']} (CPU operators, `device_id=None`); "
        f"CUDA available: {m['cuda_available']}.",
        f"- PIL builds: {m['pil_label']} (feedgpu's Python engine, the Pillow-SIMD torch loader, and feedgpu's "
        f"header probe / fallback decode on the DALI engine); {m['pil_stock'] or '–'} from PyPI in "
        "`bench/.pillow-stock` (the stock torch loader).",
        f"- Data: {d['images']} ImageNet-like JPEGs built by `feedgpu.sample_data.build_imagenet_like` from "
        f"`{s['photos']}` (ImageFolder layout; mean {d['mean_bytes'] / 1024:.1f} KB, "
        f"{d['mean_width']}×{d['mean_height']} px, {d['mean_megapixels']:.3f} megapixels).",
        f"- Pipeline: `{s['pipeline']}` — decode → RandomResizedCrop(224, scale 0.08–1, ratio 3/4–4/3, bilinear) → "
        "horizontal flip (p 0.5) → normalize to float32 NCHW, on the CPU. feedgpu's DALI engine runs the same "
        "file with `engine: {name: dali, device: cpu}`: `fn.external_source` (samples in feedgpu's sampler "
        "order; each file's header checked in Python in the first epoch, then only stat()ed; crop windows and "
        "flips computed per batch in Python from feedgpu's per-sample draws, as on the Python engine) → "
        "`fn.io.file.read` (the files' paths; in the first epoch the bytes Python read for the header check are "
        "fed instead) → `fn.decoders.image_slice` (crop-on-decode: the crop window plus the resampling filter's "
        "reach) → `fn.resize` (the window, to 224) → `fn.crop_mirror_normalize(mirror=...)`, DALI's asynchronous "
        "dynamic executor with up to `prefetch_factor` (2) batches scheduled ahead; the batch is DALI's output "
        "buffer itself (DLPack, no copy) where there is no CUDA. The `window_decode off` variant decodes whole images (`fn.decoders.image`) and resizes the window "
        "(ROI) instead; the `2nd epoch` variant is the default engine timed after one whole epoch.",
        "- Hand-written DALI: `fn.readers.file(random_shuffle=True)` → `fn.decoders.image` → "
        "`fn.random_resized_crop` (DALI draws the window; same ranges, linear, antialias) → "
        "`fn.crop_mirror_normalize(mirror=fn.random.coin_flip(0.5))` → float32 CHW through `DALIGenericIterator` "
        "(`LastBatchPolicy.DROP`), DALI's default asynchronous pipelined executor (prefetch queue depth 2). The "
        "ROI-decode variant replaces the first two operators with `fn.decoders.image_random_crop` + `fn.resize` "
        "(libjpeg-turbo decodes only the rows of the crop window), the usual DALI training pipeline and the one "
        "with the same operators as feedgpu's engine (the target's reference).",
        f"- Settings: equal cores — {s['workers']} worker processes for torch and feedgpu's Python engine, "
        f"{s['dali_threads']} DALI threads for every DALI loader; batch {s['batch_size']}, prefetch "
        f"{s['prefetch_factor']} (worker loaders), shuffle, drop_last ({s['batches_per_epoch']} batches per "
        f"epoch); per run {s['warmup']} warm-up batches, then {s['timed_batches']} timed batches; one unrecorded "
        f"warm-up round, then {s['rounds']} rounds with the loaders in turn, each loader in its own process; "
        "medians over rounds.",
        f"- Quiet machine: the first run started once the 1-minute load average was below {ld['max_load']} "
        f"(it was {ld['load_at_start']}, waited {ld['waited_s']:.0f} s); before each run the script waited until "
        "the rest of the machine was idle (< 15 % of a core), and reran a run during which other processes used "
        f"more than {s['max_others_percent']:.0f} % of a core (repeated: {len(doc['disturbed_runs_repeated'])}; "
        f"others' CPU during the recorded runs: median "
        f"{statistics.median(r['others_cpu_percent'] or 0 for r in doc['runs']):.0f} %, max "
        f"{max(r['others_cpu_percent'] or 0 for r in doc['runs']):.0f} % of a core).",
        "",
        "## Results (medians over rounds)",
        "",
        "| loader | samples/s (min–max) | ms/batch | first batch s | CPU % | RSS peak / worker MB | main RSS peak MB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, x in su.items():
        L.append(f"| {x['label']} | **{x['samples_per_s']:.0f}** ({x['samples_per_s_min']:.0f}–"
                 f"{x['samples_per_s_max']:.0f}) | {x['ms_per_batch']:.0f} | {x['first_batch_s']:.2f} | "
                 f"{x['cpu_percent']:.0f} | {_f(x['rss_peak_mb_per_worker'], '.0f')} | {x['rss_peak_mb_main']:.0f} |")
    dst = su.get("feedgpu_dali_cpu", {}).get("stage_ms_per_sample")
    pst = su.get("feedgpu_python", {}).get("stage_ms_per_sample")
    L += ["", "## Where feedgpu's DALI engine spends its time", ""]
    if dst:
        py_side = sum(v for k, v in dst.items() if k != "dali")
        L += [
            "From `loader.stats()[\"stage_s\"]` (median over the runs, ms per sample, wall time of the thread "
            "doing it): " + ", ".join(f"{k} {v:.3f}" for k, v in dst.items()) + ". The Python side (read + header "
            f"check + crop windows and flips{' + python_decode' if 'python_decode' in dst else ''}: {py_side:.3f} ms "
            "per sample) runs on one helper thread for batches ahead of the one DALI works on; `dali` is the runner "
            "thread's time from scheduling a batch to handing it out, which overlaps the next batches' "
            "DALI work (wall times of threads that share the cores with DALI's; their CPU time is below).",
        ]
    tc = {k: x["thread_cpu_ms_per_sample"] for k, x in su.items() if x.get("thread_cpu_ms_per_sample")}
    if tc:
        L += ["", "CPU time per sample in the timed window (ms, median over the runs), in DALI's threads and in "
              "the process's other threads (the main thread; for feedgpu also its helper threads preparing and "
              "collecting batches):", "", "| loader | DALI threads | other threads | total |", "| --- | ---: | ---: | ---: |"]
        for k, v in tc.items():
            L.append(f"| {su[k]['label']} | {v['dali']:.3f} | {v['python']:.3f} | {v['dali'] + v['python']:.3f} |")
    e2 = su.get("feedgpu_dali_cpu_epoch2", {}).get("stage_ms_per_sample")
    if e2:
        L += ["", "In the second epoch (each file's header check kept from the first): " +
              ", ".join(f"{k} {v:.3f}" for k, v in e2.items()) + "."]
    if pst:
        L += ["", "For comparison, the Python engine's seconds per sample summed over its workers (ms): " +
              ", ".join(f"{k} {v:.3f}" for k, v in pst.items()) + "."]
    L += [
        "",
        "## How it is measured",
        "",
        "- samples/s: samples in the timed batches ÷ time from the last warm-up batch to the last timed batch; "
        "the consumer reads a slice of each batch and nothing else (`feedgpu.bench.measure.measure`).",
        "- CPU %: CPU seconds of the loader's process and its children over the timed window ÷ wall time "
        "(200 % = both cores). DALI loaders have no worker processes: their threads are in the main process.",
        "- ms/batch: the timed window ÷ its batches (samples/s × ms/batch = the batch size).",
        "",
        "## Every run",
        "",
        "| round | loader | samples/s | ms/batch | CPU % | others' CPU % | steal % | load avg (incl. this benchmark) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["runs"]:
        L.append(f"| {r['round']} | {r['loader']} | {r['samples_per_s']:.0f} | {r['ms_per_batch']:.0f} | "
                 f"{r['cpu_percent']:.0f} | {_f(r['others_cpu_percent'], '.0f')} | {_f(r['steal_percent'], '.1f')} | "
                 f"{_f(r.get('load1'), '.2f')} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
