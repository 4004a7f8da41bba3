#!/usr/bin/env python
"""The least CPU a JPEG decoder built on libjpeg(-turbo) spends per sample of the train and val
recipes on the full-size photographs, next to what feedgpu's Python engine spends.

A baseline JPEG has one entropy-coded stream: to reach a row, a decoder reads every block above
it (restart markers would let it jump, but these photographs have none: counted below). The
cheapest way libjpeg offers to go through those blocks is a decode at 1/8 scale (each 8x8 block
gives one pixel: the DC coefficient, no inverse DCT of the rest), so for each sample this script
times, in one process:

- ``floor``: the rows the sample's window reaches (down to its bottom edge, nothing below),
  decoded at 1/8 (:func:`feedgpu.stages.jpeg_header.with_rows` cuts the frame there);
- ``floor_whole``: the whole image decoded at 1/8;
- ``auto``: feedgpu's ``Decode(reduce="auto").apply_window`` (rows down to the window plus the
  resampling margin, at the DCT scale the window allows), and ``resize``: the window's resize to
  224 x 224 after it;
- ``off``: ``Decode(reduce="off")`` (the whole image at full size), for scale.

The recipes' windows are the loader's (``RandomResizedCrop(224)`` with feedgpu's seeded draws,
``--windows`` per photograph; val: ``Resize(256)`` + ``CenterCrop(224)``). The samples are taken
in rounds, each kind interleaved sample by sample so drift hits them alike; CPU time of this
process (``time.process_time``), medians over rounds of the mean per sample.

The 4x goal of the loader benchmark is then set against it: torch's DataLoader + stock Pillow's
CPU seconds per 1,000 samples on the same recipe and photographs (``bench/results/cpu_loader.json``,
the current run) / 4 is the most a loader at 4x may spend per sample, everything included.

Writes ``bench/results/decode_floor.json`` and ``bench/results/decode_floor.md``.

    .venv/bin/python -m bench.decode_floor
"""
from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import sys
import time
from pathlib import Path

from bench.harness import REPO, machine, md_table, write_results

__all__ = ["main", "markdown", "measure"]

KINDS = ("floor", "floor_whole", "auto", "resize", "off")


def _decode_at_eighth(data: bytes) -> None:
    from PIL import Image

    im = Image.open(io.BytesIO(data))
    im.draft(None, (max(1, im.width // 8), max(1, im.height // 8)))
    im.load()


def _restart_interval(data: bytes) -> int:
    """The DRI segment's restart interval before the first scan (0: none)."""
    i = data.find(b"\xff\xdd")
    first_scan = data.find(b"\xff\xda")
    if i < 0 or (0 <= first_scan < i):
        return 0
    return int.from_bytes(data[i + 4:i + 6], "big")


def _samples(files: list[Path], recipe: str, windows: int) -> list[tuple]:
    """``(data, frame offset, rows the window reaches, target)`` per sample."""
    from feedgpu.stages.draws import Draws
    from feedgpu.stages.geometry import RandomResizedCrop, ResizeCenterCrop
    from feedgpu.stages.jpeg_header import frame_rows, read_jpeg_header

    stage = RandomResizedCrop(224) if recipe == "train" else ResizeCenterCrop(256, 224)
    out = []
    for i, f in enumerate(files):
        data = f.read_bytes()
        head, frame = read_jpeg_header(data), frame_rows(data)
        if head is None or frame is None or head.orientation not in (None, 1):
            raise SystemExit(f"{f}: not a plain baseline JPEG without rotation; this script measures those")
        for k in range(windows if recipe == "train" else 1):
            rng = Draws(0, k, i, 1) if recipe == "train" else None

            def target(w, h, rng=rng):
                return stage.window(w, h, rng)

            box, _ = target(head.width, head.height)
            out.append((data, frame[0], min(head.height, math.ceil(box[3])), target, stage))
    return out


def measure(files: list[Path], recipe: str, windows: int, rounds: int) -> dict:
    """Per kind (:data:`KINDS`): the mean CPU milliseconds per sample of each round."""
    from feedgpu.stages.decode import Decode
    from feedgpu.stages.jpeg_header import with_rows

    auto, off = Decode(reduce="auto"), Decode(reduce="off")
    samples = _samples(files, recipe, windows)
    per_round = {k: [] for k in KINDS}
    clock = time.process_time
    for _ in range(rounds):
        acc = dict.fromkeys(KINDS, 0.0)
        for data, offset, rows, target, stage in samples:
            cut = with_rows(data, offset, rows)
            t0 = clock()
            _decode_at_eighth(cut)
            t1 = clock()
            _decode_at_eighth(data)
            t2 = clock()
            img, box, size = auto.apply_window(data, target)
            t3 = clock()
            stage.resize_window(img, box, size)
            t4 = clock()
            off.apply_window(data, target)
            t5 = clock()
            for k, dt in zip(KINDS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                acc[k] += dt
        for k in KINDS:
            per_round[k].append(acc[k] / len(samples) * 1e3)
    mean_rows = statistics.mean(r / _height(d) for d, _, r, _, _ in samples)
    return {"samples": len(samples), "rows_fraction": round(mean_rows, 3),
            "ms": {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
                   for k, v in per_round.items()}}


def _height(data: bytes) -> int:
    from feedgpu.stages.jpeg_header import read_jpeg_header

    return read_jpeg_header(data).height


def _torch_budget(part: str) -> dict | None:
    path = REPO / "bench" / "results" / "cpu_loader.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    p = doc["parts"].get(part)
    if p is None:
        return None
    s = p["summary"]
    return {"created": doc["created"], "torch_pillow_cpu_s_per_1000": s["torch_pillow"]["cpu_s_per_1000"],
            "feedgpu_auto_cpu_s_per_1000": s["feedgpu_reduce"]["cpu_s_per_1000"],
            "feedgpu_auto_stage_ms": s["feedgpu_reduce"].get("stage_ms_per_sample")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--photos", default=str((REPO / ".." / "shared" / "data" / "photos").resolve()),
                    help="full-size photographs (default ../shared/data/photos)")
    ap.add_argument("--windows", type=int, default=8, help="train windows per photograph (default 8)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--note", default="", help="a line saying how the run was made")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    files = sorted(p for p in Path(a.photos).iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    restarts = sum(1 for f in files if _restart_interval(f.read_bytes()))
    results = {}
    for recipe in ("train", "val"):
        print(f"{recipe}: {len(files)} photographs", file=sys.stderr)
        results[recipe] = measure(files, recipe, a.windows, a.rounds)
        results[recipe]["loader"] = _torch_budget(f"photos/{recipe}")
    doc = {"format": "feedgpu.bench.decode_floor/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m bench.decode_floor " + " ".join(sys.argv[1:] if argv is None else argv),
           "note": a.note, "machine": machine(),
           "settings": {"photos": a.photos, "images": len(files), "with_restart_markers": restarts,
                        "windows": a.windows, "rounds": a.rounds},
           "results": results, "total_seconds": round(time.perf_counter() - t0, 1)}
    write_results(a.out, "decode_floor", doc, markdown)
    return 0


def markdown(doc: dict) -> str:
    s = doc["settings"]
    L = ["# The decode floor: the least libjpeg spends per sample on the full-size photographs", "",
         f"Recorded {doc['created']} with `{doc['command'].strip()}` ({doc['total_seconds']:.0f} s)"
         + (f"; {doc['note']}" if doc["note"] else "") + ". Raw: `decode_floor.json`.", "",
         f"- Machine: {doc['machine']['cpus_usable']} CPUs ({doc['machine']['cpu_model']}), "
         f"{doc['machine']['pil_label']} (libjpeg-turbo from Debian).",
         f"- Data: the {s['images']} photographs of `../shared/data/photos` (1600x1000 and similar, baseline "
         f"JPEG); {s['with_restart_markers']} of them have restart markers.",
         f"- Samples: train = `RandomResizedCrop(224)` windows from the loader's seeded draws, {s['windows']} "
         "per photograph; val = `Resize(256)` + `CenterCrop(224)`, one per photograph. "
         f"{s['rounds']} rounds, kinds interleaved sample by sample; CPU time of one process; the median "
         "over rounds of the mean per sample (min-max).",
         "- floor: the rows down to the window's bottom edge decoded at 1/8 (every block of those rows "
         "entropy-decoded, the DC coefficient only transformed): the least a libjpeg-based decoder reads "
         "to give any pixel of the window. floor, whole: the whole image at 1/8. auto: feedgpu's "
         "`Decode(reduce=\"auto\")`, resize: its window resized to 224x224 after it. off: the whole image "
         "at full size.", ""]
    rows = []
    for recipe, r in doc["results"].items():
        ms = r["ms"]
        for k, label in (("floor", "floor (rows down to the window, 1/8)"), ("floor_whole", "floor, whole image"),
                         ("auto", "feedgpu decode, reduce: auto"), ("resize", "+ its resize to 224"),
                         ("off", "decode, reduce: off (whole, full size)")):
            m = ms[k]
            rows.append([recipe, label, f"{m['median']:.2f} ({m['min']:.2f}-{m['max']:.2f})"])
    L += md_table(["recipe", "per sample", "CPU ms"], rows, "llr") + [""]
    L += ["Against the loader benchmark's 4x goal (`cpu_loader.md`, torch's DataLoader + stock Pillow on the "
          "same recipes and photographs): a loader at 4x spends at most a quarter of torch's CPU time per sample, "
          "everything included (read, decode, resize, flip, normalize, the batch, the main process).", ""]
    rows = []
    for recipe, r in doc["results"].items():
        b = r["loader"]
        if b is None:
            continue
        budget = b["torch_pillow_cpu_s_per_1000"] / 4
        floor = r["ms"]["floor"]["median"]
        rows.append([recipe, f"{b['torch_pillow_cpu_s_per_1000']:.2f}", f"{budget:.2f}", f"{floor:.2f}",
                     f"{floor / budget:.0%}", f"{b['feedgpu_auto_cpu_s_per_1000']:.2f}",
                     f"{b['torch_pillow_cpu_s_per_1000'] / b['feedgpu_auto_cpu_s_per_1000']:.2f}x",
                     f"{b['torch_pillow_cpu_s_per_1000'] / floor:.2f}x"])
    L += md_table(["recipe", "torch + stock Pillow, CPU ms / sample", "4x budget, ms", "decode floor, ms",
                   "floor / budget", "feedgpu auto, CPU ms / sample", "torch / feedgpu", "torch / floor alone"],
                  rows, "lrrrrrrr")
    L += ["", "The loader figures are the run recorded in `cpu_loader.json` "
          f"({next(iter(doc['results'].values()))['loader']['created'] if next(iter(doc['results'].values()))['loader'] else '-'}).",
          ""]
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
