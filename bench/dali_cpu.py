#!/usr/bin/env python
"""The recorded DALI CPU benchmark: feedgpu's DALI engine on DALI's CPU operators, side by side
with torch's DataLoader + Pillow, feedgpu's Python engine and hand-written DALI pipelines.

Same data (ImageNet-like JPEGs), same transforms (``pipelines/imagenet_train.yaml``: decode,
random resized crop 224, horizontal flip, normalize to float32 NCHW), same batch size and equal
cores (2 workers = 2 DALI threads), output on the CPU:

* ``torch_pillow``: ``torch.utils.data.DataLoader`` + torchvision-equivalent transforms
  (``feedgpu.baseline``) with stock Pillow from PyPI (``bench/.pillow-stock``), what users have;
* ``torch_pillow_simd``: the same with this environment's Pillow-SIMD;
* ``feedgpu_python``: ``feedgpu.DataLoader``, Python engine (worker processes, Pillow-SIMD);
* ``feedgpu_dali_cpu``: ``feedgpu.DataLoader`` with ``engine={"name": "dali", "device": "cpu"}``
  (``device_id=None``, 2 threads): the same YAML, one key changed;
* ``dali_hand``: a hand-written DALI CPU pipeline with the same operators, as DALI's
  documentation writes it: ``fn.readers.file(random_shuffle=True)`` -> ``fn.decoders.image`` ->
  ``fn.random_resized_crop`` (a resize of a random ROI, the same area / aspect-ratio ranges) ->
  ``fn.crop_mirror_normalize(mirror=fn.random.coin_flip())`` to float32 CHW, ``DALIGenericIterator``;
  DALI's default asynchronous, pipelined executor (prefetch queue depth 2);
* ``dali_hand_roi_decode``: the same with ``fn.decoders.image_random_crop`` + ``fn.resize``
  (decodes only the crop window: the usual DALI training pipeline; for reference).

Each loader lives in its own process (a fresh interpreter); the parent asks them in turn for one
measured run each, round after round; one unrecorded warm-up round comes first. The measurement
is ``feedgpu.cli.bench.measure`` (what ``feedgpu bench`` and ``bench/cpu_loader.py`` report).

Other people run benchmarks on the 2-core development machine: before the first run the script
waits until the 1-minute load average is below ``--max-load`` (0.5); before each run, until the
rest of the machine is idle; and a run during which others used more than ``--max-others`` % of a
core is run again (the disturbed runs stay in the JSON).

Writes ``bench/results/dali_cpu.json`` and ``bench/results/dali_cpu.md``.

    .venv/bin/python bench/dali_cpu.py                   # 2,000 images, 2 workers / threads, 7 rounds
    .venv/bin/python bench/dali_cpu.py --rounds 3 --batches 8
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from cpu_loader import (RESULT_MARK, Child, _check_pil, ensure_stock_pillow, wait_quiet,  # noqa: E402
                        write_results)  # (same folder)

PIPELINE = REPO / "pipelines" / "imagenet_train.yaml"

# name -> (kind, stock Pillow?); kinds are feedgpu.cli.bench.MAKERS keys or hand-written DALI
LOADERS = {
    "torch_pillow": ("torch", True),
    "torch_pillow_simd": ("torch", False),
    "feedgpu_python": ("feedgpu", False),
    "feedgpu_dali_cpu": ("feedgpu_dali_cpu", False),
    "dali_hand": ("dali_hand", False),
    "dali_hand_roi_decode": ("dali_hand_roi_decode", False),
}
NAMES = {"torch_pillow": "torch DataLoader + stock Pillow", "torch_pillow_simd": "torch DataLoader + Pillow-SIMD",
         "feedgpu_python": "feedgpu, Python engine (Pillow-SIMD)", "feedgpu_dali_cpu": "feedgpu, DALI CPU engine",
         "dali_hand": "hand-written DALI CPU (decoders.image + random_resized_crop)",
         "dali_hand_roi_decode": "hand-written DALI CPU (decoders.image_random_crop + resize)"}


# -- the hand-written DALI pipelines ------------------------------------------------------------------
class HandDali:
    """A DALI CPU pipeline written by hand from the pipeline's settings, iterated as torch tensors
    with ``DALIGenericIterator`` (what DALI's PyTorch examples do). Built on the first ``iter()``,
    so that the first batch's time includes the build, as for the other loaders."""

    def __init__(self, pipeline, data: str, batch_size: int, threads: int, roi_decode: bool, seed: int = 0):
        from feedgpu.stages import HorizontalFlip, Normalize, RandomResizedCrop

        st = {type(s): s for s in pipeline.stages}
        self.rrc, self.flip, self.norm = st[RandomResizedCrop], st[HorizontalFlip], st[Normalize]
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

    def __iter__(self):
        if self.it is None:
            self._build()
        for out in self.it:
            yield out[0]["images"], out[0]["labels"].view(-1).long()

    def close(self) -> None:
        self.it = self.pipe = None
        gc.collect()


def hand_subject(pipeline, data: str, workers: int, batch_size: int, roi_decode: bool):
    from feedgpu.cli import bench as fb

    loader = HandDali(pipeline, data, batch_size, workers, roi_decode)
    name = "dali_hand_roi_decode" if roi_decode else "dali_hand"
    extra = lambda: {"threads": workers}  # noqa: E731
    return fb.Subject(name, NAMES[name], loader, lambda: [], "cpu", loader.close, extra)


# -- the child: one loader, one measured run per request ------------------------------------------------
def _pipeline(data: str):
    from feedgpu import Pipeline

    return Pipeline.from_yaml(PIPELINE, **{"source.path": data, "output.device": "cpu"})


def one_run(base: dict, p, on_batch) -> dict:
    from feedgpu.cli import bench as fb

    kind = base["kind"]
    if kind.startswith("dali_hand"):
        subject = hand_subject(p, base["data"], base["workers"], base["batch_size"], kind == "dali_hand_roi_decode")
        return fb.measure(subject, base["batches"], base["warmup"], on_batch)
    return fb.run_one(kind, p, base["workers"], base["batch_size"], base["batches"], base["warmup"], "cpu",
                      on_batch=on_batch)


def profile_dali_engine(p, base: dict, batches: int) -> dict:
    """One extra (untimed for the ratios) pass of the DALI engine with timers around DALI's calls:
    where one batch's time goes, in ms per sample. ``read``, ``probe`` and ``params`` are the
    Python side (on a helper thread, overlapping DALI's run of the previous batch, where the engine
    prepares ahead; before that, in the main thread while DALI's threads waited); ``feed_input`` copies the encoded bytes and
    the per-sample parameters into DALI; ``run`` is DALI's work (decode, resize, flip, normalize on
    its threads); ``copy_out`` copies the float32 batch into a fresh torch tensor (single thread,
    includes the first-touch page faults of the new tensor)."""
    import nvidia.dali.plugin.pytorch as dpt
    from nvidia.dali import Pipeline as DaliPipeline

    from feedgpu import DataLoader

    timers = {"feed_input": 0.0, "run": 0.0, "copy_out": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers[name] += time.perf_counter() - t0
        return wrapper

    saved = DaliPipeline.feed_input, DaliPipeline.run, dpt.feed_ndarray
    DaliPipeline.feed_input = timed("feed_input", saved[0])
    DaliPipeline.run = timed("run", saved[1])
    dpt.feed_ndarray = timed("copy_out", saved[2])
    try:
        loader = DataLoader(p, batch_size=base["batch_size"], num_workers=base["workers"],
                            engine={"name": "dali", "device": "cpu"})
        it = iter(loader)
        next(it)  # build + first batch: not counted
        for k in timers:
            timers[k] = 0.0
        before = loader.stats()["stage_s"]
        t0 = time.perf_counter()
        n = 0
        for _ in range(batches):
            try:
                b = next(it)
            except StopIteration:
                it = iter(loader)
                b = next(it)
            n += len(b.labels)
            del b
        wall = time.perf_counter() - t0
        after = loader.stats()["stage_s"]
        loader.shutdown()
    finally:
        DaliPipeline.feed_input, DaliPipeline.run, dpt.feed_ndarray = saved
    ms = lambda s: round(s / n * 1e3, 4)  # noqa: E731
    stages = {k: ms(after.get(k, 0.0) - before.get(k, 0.0)) for k in after}
    from feedgpu.exec.dali_engine import DaliWork

    out = {"samples": n, "wall_ms_per_sample": ms(wall), "samples_per_s": round(n / wall, 1),
           "prepares_ahead": hasattr(DaliWork, "prefetch"),
           "stage_ms_per_sample": stages, "dali_calls_ms_per_sample": {k: ms(v) for k, v in timers.items()}}
    python_side = sum(stages.get(k, 0.0) for k in ("read", "probe", "params", "python_decode"))
    out["python_side_ms_per_sample"] = round(python_side, 4)
    out["dali_stage_other_ms_per_sample"] = round(stages.get("dali", 0.0) - sum(out["dali_calls_ms_per_sample"].values()), 4)
    return out


# -- what would close the gap: variants of the DALI engine's loop, measured side by side ----------------
ABLATIONS = {
    "serial": "synchronous executor, the Python side in the main thread while DALI waits, a fresh output "
              "tensor per batch (the engine before it prepared ahead)",
    "serial_reused": "+ output written into pre-faulted buffers reused round-robin (no fresh 154 MB tensor)",
    "prep_thread": "synchronous executor, batch b+1 prepared on a helper thread while DALI runs batch b, fresh "
                   "output tensors (what the engine does now)",
    "prep_thread_reused": "+ reused pre-faulted output buffers",
    "pipelined": "synchronous -> pipelined: exec_async/exec_pipelined, batch b+1 read, probed and fed "
                 "before batch b's outputs are copied out (fresh output tensors)",
    "pipelined_reused": "pipelined + reused output buffers",
    "pipelined_reused_mirror_in_cmn": "+ the flip done by crop_mirror_normalize(mirror=...) instead of fn.flip",
    "pipelined_reused_roi_decode": "+ decoders.image_slice(start, end) decodes only feedgpu's crop window, "
                                   "then resize to 224 and crop_mirror_normalize(mirror=...)",
    "pipelined_reused_roi_decode_no_python": "the same with the Python side (read, probe, params) done "
                                             "beforehand: the upper bound of making it free",
}


class EngineVariants:
    """Re-creates :class:`feedgpu.exec.dali_engine.DaliWork`'s per-batch loop (its ``_prepare``,
    its stages' ``dali`` graphs, the same batches in the same order) with one change at a time."""

    def __init__(self, p, batch_size: int, threads: int, epochs: int = 2):
        from feedgpu.exec.dali_engine import DaliWork
        from feedgpu.sampling import ShardedOrder
        from feedgpu.stages import HorizontalFlip, RandomResizedCrop

        plan = p.plan("cpu")
        self.work = DaliWork(p.source, plan, p.seed, "skip", batch_size, device="cpu", threads=threads)
        self.order = ShardedOrder(len(p.source), batch_size, shuffle=True, seed=p.seed, drop_last=True)
        self.bs, self.threads = batch_size, threads
        self.seq = [(e, b) for e in range(epochs) for b in range(len(self.order))]
        names = [type(st) for st in self.work.ops]
        self.rrc_pos = names.index(RandomResizedCrop) + 1 if RandomResizedCrop in names else None
        self.flip_pos = names.index(HorizontalFlip) + 1 if HorizontalFlip in names else None
        shape = (batch_size, *self.work.out_shape)
        import torch

        self.shape = shape
        self.buffers = [torch.empty(shape).fill_(0) for _ in range(3)]  # pre-faulted
        self.cache: dict = {}

    def prep(self, e: int, b: int, cached: bool = False):
        from collections import Counter

        if cached and (e, b) in self.cache:
            return self.cache[(e, b)]
        items, params, secs = [], {}, Counter()
        for idx in self.order.batch(e, b).tolist():
            ok, item, ps, _ = self.work._prepare(idx, e, secs)
            if not ok:
                raise RuntimeError("this benchmark's data holds only plain JPEGs")
            items.append(item)
            for n, v in ps.items():
                params.setdefault(n, []).append(v)
        if cached:
            self.cache[(e, b)] = (items, params)
        return items, params

    def build(self, pipelined: bool, mirror_in_cmn: bool = False, roi_decode: bool = False):
        from nvidia.dali import fn, pipeline_def, types

        w = self.work
        norm = w.batch_stage

        @pipeline_def(batch_size=self.bs, num_threads=self.threads, device_id=None, exec_async=pipelined,
                      exec_pipelined=pipelined, prefetch_queue_depth=2 if pipelined else 1)
        def graph():
            x = fn.external_source(name="x", dtype=types.UINT8)
            args = {i: {n: fn.external_source(name=f"s{i}_{n}") for n in names}
                    for i, names in enumerate(w.param_names, start=1)}
            if roi_decode:
                a = args[self.rrc_pos]
                x = fn.decoders.image_slice(x, start=fn.cast(a["roi_start"], dtype=types.INT32),
                                            end=fn.cast(a["roi_end"], dtype=types.INT32), axis_names="HW",
                                            output_type=types.RGB, adjust_orientation=w.decode.exif_orientation)
                rrc = w.ops[self.rrc_pos - 1]
                x = fn.resize(x, resize_x=rrc.size[1], resize_y=rrc.size[0], interp_type=types.INTERP_LINEAR,
                              antialias=True)
            else:
                x = w.decode.dali(x, {}, "cpu")
            for i, st in enumerate(w.ops, start=1):
                if (roi_decode and i == self.rrc_pos) or ((mirror_in_cmn or roi_decode) and i == self.flip_pos):
                    continue
                x = st.dali(x, args[i], "cpu")
            if mirror_in_cmn or roi_decode:
                return fn.crop_mirror_normalize(
                    x, dtype=types.FLOAT if norm.dtype == "float32" else types.FLOAT16,
                    output_layout="CHW" if norm.layout == "NCHW" else "HWC", mean=[m * 255 for m in norm.mean],
                    std=[s_ * 255 for s_ in norm.std], mirror=args[self.flip_pos]["flip"])
            return norm.dali(x, {}, "cpu")

        pipe = graph()
        pipe.build()
        return pipe

    @staticmethod
    def feed(pipe, items, params) -> None:
        pipe.feed_input("x", items)
        for n, v in params.items():
            pipe.feed_input(n, v)

    def out(self, k: int, reuse: bool):
        import torch

        return self.buffers[k % len(self.buffers)] if reuse else torch.empty(self.shape)

    def _run_prep_thread(self, reuse: bool) -> float:
        from concurrent.futures import ThreadPoolExecutor

        from nvidia.dali.plugin.pytorch import feed_ndarray

        pipe = self.build(False)
        self.feed(pipe, *self.prep(*self.seq[-1]))
        pipe.run()
        n = 0
        with ThreadPoolExecutor(1) as ex:
            t0 = time.perf_counter()
            fut = ex.submit(self.prep, *self.seq[0])
            for k in range(len(self.seq)):
                items, params = fut.result()
                if k + 1 < len(self.seq):
                    fut = ex.submit(self.prep, *self.seq[k + 1])
                self.feed(pipe, items, params)
                feed_ndarray(pipe.run()[0].as_tensor(), self.out(k, reuse))
                n += self.bs
            return n / (time.perf_counter() - t0)

    def run(self, variant: str, first_only: bool = False):
        """Samples/s of one variant over ``self.seq`` (after one untimed batch); with
        ``first_only``, the first batch's output instead."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        pipelined = variant.startswith("pipelined")
        reuse = "reused" in variant
        if variant.startswith("prep_thread"):
            return self._run_prep_thread(reuse)
        cached = variant.endswith("no_python")
        if cached:
            for e, b in self.seq:
                self.prep(e, b, cached=True)
        pipe = self.build(pipelined, "mirror_in_cmn" in variant, "roi_decode" in variant)
        warm = self.prep(*self.seq[-1])
        if first_only:
            self.feed(pipe, *self.prep(*self.seq[0]))
            if pipelined:
                self.feed(pipe, *self.prep(*self.seq[0]))
            dst = self.out(0, False)
            feed_ndarray(pipe.run()[0].as_tensor(), dst)
            return dst
        n = 0
        if not pipelined:
            self.feed(pipe, *warm)
            pipe.run()
            t0 = time.perf_counter()
            for k, (e, b) in enumerate(self.seq):
                self.feed(pipe, *self.prep(e, b, cached))
                feed_ndarray(pipe.run()[0].as_tensor(), self.out(k, reuse))
                n += self.bs
            return n / (time.perf_counter() - t0)
        self.feed(pipe, *warm)
        self.feed(pipe, *warm)
        pipe.schedule_run()  # the first call runs prefetch_queue_depth (2) iterations
        pipe.outputs()
        pipe.outputs()
        t0 = time.perf_counter()
        self.feed(pipe, *self.prep(*self.seq[0], cached))
        pipe.schedule_run()
        for k in range(len(self.seq)):
            if k + 1 < len(self.seq):
                self.feed(pipe, *self.prep(*self.seq[k + 1], cached))
                pipe.schedule_run()
            feed_ndarray(pipe.outputs()[0].as_tensor(), self.out(k, reuse))
            n += self.bs
        return n / (time.perf_counter() - t0)


def ablation(p, base: dict, rounds: int) -> dict:
    """Each variant of :data:`ABLATIONS` once per round, in turn; medians. Also how far the
    ROI-decode variant's pixels are from the engine's (same crop windows and flips)."""
    v = EngineVariants(p, base["batch_size"], base["workers"])
    rates: dict[str, list[float]] = {k: [] for k in ABLATIONS}
    for _ in range(rounds):
        for k in ABLATIONS:
            rates[k].append(v.run(k))
            gc.collect()
    ref = v.run("pipelined_reused", first_only=True)
    roi = v.run("pipelined_reused_roi_decode", first_only=True)
    import torch

    norm = v.work.batch_stage
    shape = (1, 3, 1, 1) if norm.layout == "NCHW" else (1, 1, 1, 3)
    d = (ref - roi).abs().float() * (torch.tensor(norm.std).view(shape) * 255)  # back to 0-255 levels
    out = {k: {"samples_per_s": round(statistics.median(x), 1), "runs": [round(y, 1) for y in x],
               "what": ABLATIONS[k]} for k, x in rates.items()}
    return {"variants": out, "rounds": rounds, "samples_per_run": len(v.seq) * v.bs,
            "roi_decode_vs_engine_levels": {"mean": round(float(d.mean()), 3), "max": round(float(d.max()), 1),
                                            "share_over_2": round(float((d > 2).float().mean()), 5)}}


def serve(base: dict) -> None:
    """Child process: answer one JSON command per stdin line with one result line on stdout:
    ``{"mode": "run", "desc": ...}``, ``{"mode": "profile", "batches": n}``, ``{"mode": "ablation",
    "rounds": n}`` or ``{"mode": "exit"}``."""
    _check_pil(base["stock"])
    from feedgpu.cli import bench as fb
    from feedgpu.imaging import pil_label

    p = _pipeline(base["data"])
    len(p.source)
    print(RESULT_MARK + json.dumps({"ready": True, "pil": pil_label()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["mode"] == "exit":
            return
        if cmd["mode"] == "profile":
            res = profile_dali_engine(p, base, cmd["batches"])
        elif cmd["mode"] == "ablation":
            res = ablation(p, base, cmd["rounds"])
        else:
            with fb.progress_bar(base["warmup"] + base["batches"], cmd["desc"]) as bar:
                res = one_run(base, p, lambda: bar.update(1))
        res["pil"] = pil_label()
        print(RESULT_MARK + json.dumps(res), flush=True)


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
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": [round(v, 3) for v in vals]}


RATIOS = {  # key -> (numerator, denominator, target or None)
    "feedgpu_dali_cpu_over_torch_pillow": ("feedgpu_dali_cpu", "torch_pillow", 2.0),
    "feedgpu_dali_cpu_over_dali_hand": ("feedgpu_dali_cpu", "dali_hand", 0.95),
    "feedgpu_dali_cpu_over_dali_hand_roi_decode": ("feedgpu_dali_cpu", "dali_hand_roi_decode", None),
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
    ap.add_argument("--profile-batches", type=int, default=14,
                    help="batches of the DALI engine's timed breakdown after the rounds (0: none)")
    ap.add_argument("--ablation-rounds", type=int, default=3,
                    help="rounds of the DALI engine variants (what would close the gap) after the rounds (0: none)")
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

    from feedgpu.cli import bench as fb
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
    nb = fb.epoch_batches(p, a.batch_size)
    batches = a.batches or fb.default_batches(nb, a.warmup, a.workers)
    print("measuring the data set", file=sys.stderr)
    data_meta = fb.data_info(p, str(data), sample=None)
    machine = fb.machine_info()
    machine["pil_stock"] = f"Pillow {stock_version}" if stock_version else None
    machine["dali"] = nvidia.dali.__version__
    settings = {"pipeline": str(PIPELINE.relative_to(REPO)), "workers": a.workers, "dali_threads": a.workers,
                "batch_size": a.batch_size, "batches_per_epoch": nb, "timed_batches": batches, "warmup": a.warmup,
                "rounds": a.rounds, "prefetch_factor": p.prefetch_factor, "device": "cpu", "shuffle": p.shuffle,
                "drop_last": p.drop_last, "photos": a.photos, "loaders": names, "max_load": a.max_load,
                "quiet_wait_s": a.quiet_wait, "max_others_percent": a.max_others, "retries": a.retries}
    base = {"data": str(data), "workers": a.workers, "batch_size": a.batch_size, "batches": batches,
            "warmup": a.warmup}

    print(f"waiting for the 1-minute load average to drop below {a.max_load}", file=sys.stderr)
    load = wait_load(a.max_load, a.load_wait)
    print(f"load {load}", file=sys.stderr)
    children: dict[str, Child] = {}
    disturbed: list[dict] = []
    profile = ablations = None
    try:
        for name in names:
            kind, stock = LOADERS[name]
            children[name] = Child(name, {**base, "kind": kind, "stock": stock}, script=__file__)

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
        runs = fb.run_rounds(names, a.rounds, run)
        if a.profile_batches and "feedgpu_dali_cpu" in children:
            wait_quiet(a.quiet_wait)
            profile = children["feedgpu_dali_cpu"].ask({"mode": "profile", "batches": a.profile_batches})
        if a.ablation_rounds and "feedgpu_dali_cpu" in children:
            print("DALI engine variants", file=sys.stderr)
            wait_quiet(a.quiet_wait)
            t_ab = time.perf_counter()
            ablations = children["feedgpu_dali_cpu"].ask({"mode": "ablation", "rounds": a.ablation_rounds})
            ablations["seconds"] = round(time.perf_counter() - t_ab, 1)
            ablations["load1_after"] = round(os.getloadavg()[0], 2)
    finally:
        for c in children.values():
            c.close()
    summary = fb.summarize(runs)
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
    ratios = {k: fb.ratio(summary, x, y) for k, (x, y, _) in RATIOS.items() if x in summary and y in summary}
    ratios_per_round = {k: per_round(runs, a.rounds, x, y) for k, (x, y, _) in RATIOS.items()
                        if x in summary and y in summary}
    targets = {k: {"target": t, "met": ratios[k] is not None and ratios[k] >= t}
               for k, (_, _, t) in RATIOS.items() if t is not None and k in ratios}
    total = time.perf_counter() - t0
    doc = {"format": "feedgpu.bench.dali_cpu/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python bench/dali_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "targets": targets, "machine": machine, "data": data_meta, "settings": settings, "load": load,
           "summary": summary, "ratios": ratios, "ratios_per_round": ratios_per_round,
           "dali_engine_profile": profile, "dali_engine_variants": ablations, "runs": runs, "warmup_runs_not_counted": warm,
           "disturbed_runs_repeated": disturbed, "total_seconds": round(total, 1)}
    write_results(a.out, "dali_cpu", doc, markdown)
    return 0


# -- the report ------------------------------------------------------------------------------------------
def _f(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _ratio_row(doc: dict, key: str, label: str) -> str:
    r, pr = doc["ratios"].get(key), doc["ratios_per_round"].get(key)
    t = doc["targets"].get(key)
    target = "" if t is None else f"≥ {t['target']:.2f}× ({'met' if t['met'] else 'NOT met'})"
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
              "feedgpu_dali_cpu_over_dali_hand": "feedgpu DALI CPU / hand-written DALI CPU (same operators)",
              "feedgpu_dali_cpu_over_dali_hand_roi_decode": "feedgpu DALI CPU / hand-written DALI CPU (ROI decode)",
              "feedgpu_dali_cpu_over_feedgpu_python": "feedgpu DALI CPU / feedgpu Python engine",
              "feedgpu_dali_cpu_over_torch_pillow_simd": "feedgpu DALI CPU / torch DataLoader + Pillow-SIMD",
              "feedgpu_python_over_torch_pillow": "feedgpu Python engine / torch DataLoader + stock Pillow",
              "dali_hand_over_torch_pillow": "hand-written DALI (same operators) / torch + stock Pillow",
              "dali_hand_roi_decode_over_torch_pillow": "hand-written DALI (ROI decode) / torch + stock Pillow"}
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
        "order, crop windows and flips drawn in Python from the per-sample generator) → `fn.decoders.image` → "
        "`fn.resize` (ROI) → `fn.flip` → `fn.crop_mirror_normalize`, synchronous executor.",
        "- Hand-written DALI: `fn.readers.file(random_shuffle=True)` → `fn.decoders.image` → "
        "`fn.random_resized_crop` (DALI draws the window; same ranges, linear, antialias) → "
        "`fn.crop_mirror_normalize(mirror=fn.random.coin_flip(0.5))` → float32 CHW through `DALIGenericIterator` "
        "(`LastBatchPolicy.DROP`), DALI's default asynchronous pipelined executor (prefetch queue depth 2). The "
        "ROI-decode variant replaces the first two operators with `fn.decoders.image_random_crop` + `fn.resize` "
        "(libjpeg-turbo decodes only the rows of the crop window), the usual DALI training pipeline.",
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
    pr = doc.get("dali_engine_profile")
    ahead = bool(pr and pr.get("prepares_ahead"))
    L += ["", "## Where feedgpu's DALI engine spends its time", ""]
    if dst:
        py_side = sum(v for k, v in dst.items() if k != "dali")
        where = ("on the engine's helper thread, which prepares batch b+1 while DALI runs batch b (it competes "
                 "with DALI's 2 threads for the 2 cores); DALI itself still runs synchronously "
                 "(`exec_async=False, exec_pipelined=False`) and the copy out is not overlapped" if ahead else
                 "in the main thread while DALI's threads wait (synchronous executor: "
                 "`exec_async=False, exec_pipelined=False`)")
        L += [
            "From `loader.stats()[\"stage_s\"]` (median over the runs, ms per sample): " +
            ", ".join(f"{k} {v:.3f}" for k, v in dst.items()) + f". The Python side (read + probe + params"
            f"{' + python_decode' if 'python_decode' in dst else ''}) takes {py_side:.3f} ms per sample, "
            f"{py_side * s['batch_size']:.0f} ms per batch of {s['batch_size']}, {where}.",
        ]
    if pst:
        L += ["", "For comparison, the Python engine's seconds per sample summed over its workers (ms): " +
              ", ".join(f"{k} {v:.3f}" for k, v in pst.items()) + "."]
    if pr:
        c = pr["dali_calls_ms_per_sample"]
        wall = pr["wall_ms_per_sample"]
        L += [
            "",
            f"Timed breakdown of {pr['samples']} samples on the DALI engine after the rounds (one process, timers "
            f"around DALI's calls; {pr['samples_per_s']:.0f} samples/s with the timers), ms per sample:",
            "",
            "| thread | part | ms per sample | share of wall |",
            "| --- | --- | ---: | ---: |",
        ]
        main = [("DALI feed_input (bytes + per-sample parameters)", c["feed_input"]),
                ("DALI run (decode, resize, flip, normalize on DALI's threads)", c["run"]),
                ("copy out (feed_ndarray into a fresh torch tensor, one thread, first-touch page faults)",
                 c["copy_out"])]
        side = [(f"Python: {k}", v) for k, v in pr["stage_ms_per_sample"].items() if k != "dali"]
        if ahead:
            rest = wall - sum(v for _, v in main)
            rows = [("main", lbl, v) for lbl, v in main]
            rows.append(("main", "the rest (waiting for the prepared batch, allocation, loader)", rest))
            rows += [("helper (overlapped; wall time incl. waits for the GIL)", lbl, v) for lbl, v in side]
        else:
            rest = wall - sum(v for _, v in main) - sum(v for _, v in side)
            rows = [("main", lbl, v) for lbl, v in side + main]
            rows.append(("main", "the rest (loader, output allocation, stats)", rest))
        for th, lbl, v in rows:
            L.append(f"| {th} | {lbl} | {v:.3f} | {100 * v / wall:.0f} % |")
        L.append(f"| | **wall** | **{wall:.3f}** | |")
    ab = doc.get("dali_engine_variants")
    if ab:
        hand = su.get("dali_hand", {}).get("samples_per_s")
        torch_stock = su.get("torch_pillow", {}).get("samples_per_s")
        base_rate = (ab["variants"].get("prep_thread") or next(iter(ab["variants"].values())))["samples_per_s"]
        L += [
            "",
            "## What would close the gap (variants of the engine's loop, measured here)",
            "",
            f"`EngineVariants` re-creates the engine's per-batch loop (its `_prepare`, its stages' DALI graphs, the "
            f"same batches) and changes one thing at a time; {ab['rounds']} rounds of {ab['samples_per_run']} samples "
            "per variant, in one process after the loader rounds, medians. Ratios against this run's medians of the "
            "hand-written pipeline (same operators) and of torch + stock Pillow.",
            "",
            "| variant | samples/s | vs `prep_thread` (the engine now) | vs hand-written DALI | vs torch + stock Pillow |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for k, x in ab["variants"].items():
            r = x["samples_per_s"]
            vs = lambda y: "–" if not y else f"{r / y:.2f}×"  # noqa: E731
            L.append(f"| `{k}`: {x['what']} | {r:.0f} | {r / base_rate:.2f}× | {vs(hand)} | {vs(torch_stock)} |")
        dd = ab["roi_decode_vs_engine_levels"]
        L += ["", f"The ROI-decode variant's pixels against the engine's (same windows and flips, first batch): "
              f"mean {dd['mean']:.3f} levels, max {dd['max']:.0f}, {100 * dd['share_over_2']:.3f} % of values off by "
              "more than 2 (the resampling filter no longer sees pixels outside the window)."]
    L += [
        "",
        "## How it is measured",
        "",
        "- samples/s: samples in the timed batches ÷ time from the last warm-up batch to the last timed batch; "
        "the consumer reads a slice of each batch and nothing else (`feedgpu.cli.bench.measure`).",
        "- CPU %: CPU seconds of the loader's process and its children over the timed window ÷ wall time "
        "(200 % = both cores). DALI loaders have no worker processes: their threads are in the main process.",
        "- ms/batch: median time the consumer waits in `next()`.",
        "",
        "## Every run",
        "",
        "| round | loader | samples/s | ms/batch | CPU % | others' CPU % | steal % | load avg (incl. this benchmark) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["runs"]:
        L.append(f"| {r['round']} | {r['loader']} | {r['samples_per_s']:.0f} | {r['ms_per_batch_median']:.0f} | "
                 f"{r['cpu_percent']:.0f} | {_f(r['others_cpu_percent'], '.0f')} | {_f(r['steal_percent'], '.1f')} | "
                 f"{_f(r.get('load1'), '.2f')} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
