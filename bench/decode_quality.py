#!/usr/bin/env python
"""What reduced (DCT-scaled) JPEG decode changes in the pixels a batch gets.

For each image, the train recipe (``random_resized_crop`` 224, the windows of ``--windows``
samples' draws) and the val recipe (``resize_center_crop`` 256/224) are run twice through
:meth:`feedgpu.stages.decode.Decode.apply_window` and the stage's ``resize_window``: with
``reduce="off"`` (full decode + the resize: torchvision's pixels) and with ``reduce="auto"`` (the
JPEG decoded at the DCT scale the window allows, then the same resize). The two outputs
(uint8 RGB, 224x224) are compared: PSNR, largest absolute difference, mean absolute difference,
grouped by the scale ``auto`` chose. Samples decoded at full size by both are counted, not
compared (identical by construction; the tests check it).

Data: the full-size photographs (``--photos``) and the ImageNet-like sample built from them
(``feedgpu.sample_data.build_imagenet_like``, as ``bench.cpu_loader`` builds it). One process;
the decode + resize seconds of each setting are also recorded (one core, indicative: the loader
comparison is ``bench.cpu_loader``).

Writes ``bench/results/decode_quality.json`` and ``bench/results/decode_quality.md``.

    .venv/bin/python -m bench.decode_quality                  # photos + 500 ImageNet-like images
    .venv/bin/python -m bench.decode_quality --images 2000 --windows 8
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench.harness import REPO, machine, md_table, write_results

__all__ = ["compare", "decode_ms", "main", "markdown", "psnr"]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 arrays in dB (``inf`` when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def _recipes(windows: int):
    from feedgpu.stages.draws import Draws
    from feedgpu.stages.geometry import RandomResizedCrop, ResizeCenterCrop

    rrc, val = RandomResizedCrop(224), ResizeCenterCrop(256, 224)
    return {"train": (rrc, [lambda i, k=k: Draws(0, k, i, 1) for k in range(windows)]),
            "val": (val, [lambda i: None])}


def compare(files: list[Path], windows: int) -> dict:
    """``{recipe: {"rows": [per compared sample: scale, psnr, max, mean], "full": n, "secs": {...}}}``."""
    from feedgpu.stages.decode import Decode

    off, auto = Decode(reduce="off"), Decode(reduce="auto")
    out = {}
    for recipe, (stage, draws) in _recipes(windows).items():
        rows, full, secs = [], 0, {"off": 0.0, "auto": 0.0}
        for i, f in enumerate(files):
            data = f.read_bytes()
            for make in draws:
                rng = make(i)

                def target(w, h):
                    return stage.window(w, h, rng)

                res = {}
                for name, dec in (("off", off), ("auto", auto)):
                    t0 = time.perf_counter()
                    img, box, size = dec.apply_window(data, target)
                    px = np.asarray(stage.resize_window(img, box, size))
                    secs[name] += time.perf_counter() - t0
                    res[name] = (px, img.size)
                scale = round(res["off"][1][0] / res["auto"][1][0])
                if scale == 1:
                    full += 1
                    continue
                a, b = res["off"][0], res["auto"][0]
                d = np.abs(a.astype(np.int16) - b.astype(np.int16))
                rows.append({"file": f.name, "scale": scale, "psnr": round(psnr(a, b), 2), "max": int(d.max()),
                             "mean": round(float(d.mean()), 3)})
        out[recipe] = {"rows": rows, "full": full, "samples": len(files) * len(draws),
                       "secs": {k: round(v, 2) for k, v in secs.items()}}
    return out


def decode_ms(files: list[Path], reps: int = 3) -> dict[int, float]:
    """Median milliseconds per image of Pillow's JPEG decode at each DCT scale (1, 2, 4, 8): the
    scales interleaved image by image, ``reps`` times, so drift hits them alike."""
    import io

    from PIL import Image

    from feedgpu.stages.dct_scale import DCT_SCALES

    times: dict[int, list[float]] = {s: [] for s in DCT_SCALES}
    datas = [f.read_bytes() for f in files]
    for _ in range(reps):
        for data in datas:
            for s in DCT_SCALES:
                t0 = time.perf_counter()
                im = Image.open(io.BytesIO(data))
                if s > 1:
                    im.draft(None, (im.width // s, im.height // s))
                im.load()
                times[s].append(time.perf_counter() - t0)
    return {s: round(statistics.median(v) * 1e3, 3) for s, v in sorted(times.items())}


def _summary(rows: list[dict]) -> list[dict]:
    by = defaultdict(list)
    for r in rows:
        by[r["scale"]].append(r)
    out = []
    for scale in sorted(by):
        rs = by[scale]
        ps = sorted(r["psnr"] for r in rs)
        mx = sorted(r["max"] for r in rs)
        out.append({"scale": scale, "n": len(rs), "psnr_median": round(statistics.median(ps), 2),
                    "psnr_min": ps[0], "psnr_p01": ps[int(0.01 * (len(ps) - 1))],
                    "max_median": statistics.median(mx), "max_p99": mx[int(0.99 * (len(mx) - 1))], "max_max": mx[-1],
                    "mean_abs_median": round(statistics.median(r["mean"] for r in rs), 3)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--photos", default=str((REPO / ".." / "shared" / "data" / "photos").resolve()),
                    help="full-size photographs (default ../shared/data/photos)")
    ap.add_argument("--images", type=int, default=500, help="ImageNet-like images (default 500; 0: none)")
    ap.add_argument("--windows", type=int, default=8, help="random resized crop windows per image (default 8)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = ap.parse_args(argv)

    from feedgpu.sample_data import build_imagenet_like

    t0 = time.perf_counter()
    sets = {"photos": sorted(p for p in Path(a.photos).iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))}
    if a.images:
        data = REPO / "bench" / "out" / f"imagenet-like-{a.images}"
        build_imagenet_like(data, a.images, photos_dir=a.photos, progress=True)
        sets["imagenet_like"] = sorted(data.rglob("*.jpg"))
    results = {}
    for name, files in sets.items():
        print(f"{name}: {len(files)} images", file=sys.stderr)
        res = compare(files, a.windows)
        for recipe, r in res.items():
            r["by_scale"] = _summary(r["rows"])
        sizes = [_size(f) for f in files[:200]]
        results[name] = {"images": len(files), "mean_width": round(statistics.mean(w for w, _ in sizes)),
                         "mean_height": round(statistics.mean(h for _, h in sizes)), "recipes": res,
                         "decode_ms": decode_ms(files[:200], reps=5)}
    doc = {"format": "feedgpu.bench.decode_quality/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m bench.decode_quality " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(), "settings": {"windows": a.windows, "photos": a.photos, "images": a.images,
                                              "interpolation": "bilinear"},
           "results": results, "total_seconds": round(time.perf_counter() - t0, 1)}
    write_results(a.out, "decode_quality", doc, markdown)
    return 0


def _size(f: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(f) as im:
        return im.size


def markdown(doc: dict) -> str:
    s = doc["settings"]
    L = ["# Reduced (DCT-scaled) JPEG decode: pixels against full decode + the same resize", "",
         f"Recorded {doc['created']} with `{doc['command'].strip()}` ({doc['total_seconds']:.0f} s). "
         "Every compared sample: `decode_quality.json`.", "",
         f"- Machine: {doc['machine']['cpus_usable']} CPUs, {doc['machine']['pil_label']}.",
         f"- Recipes: train = `random_resized_crop` 224 (scale 0.08-1, ratio 3/4-4/3, {s['windows']} windows per "
         "image from the loader's draws); val = `resize_center_crop` 256 / 224; interpolation "
         f"{s['interpolation']}.",
         "- off: `Decode(reduce=\"off\")`, full decode then the window's resize (torchvision's pixels). "
         "auto: `Decode(reduce=\"auto\")`, the JPEG decoded at 1/scale (the largest of 8, 4, 2 whose "
         "reduced window is still at least 224 px both ways; and only down to the rows the window needs, "
         "which changes no pixel), then the same window resized.",
         "- PSNR and differences over the 224x224x3 uint8 output, per sample; p01: the 1st percentile "
         "(worst 1 %), p99 the 99th. Samples where auto also decodes at full size are identical and "
         "only counted.", ""]
    for name, r in doc["results"].items():
        L += [f"## {name}: {r['images']} images, mean {r['mean_width']}x{r['mean_height']} px", ""]
        rows = []
        for recipe, x in r["recipes"].items():
            for b in x["by_scale"]:
                rows.append([recipe, f"1/{b['scale']}", b["n"], f"{b['psnr_median']:.1f}", f"{b['psnr_p01']:.1f}",
                             f"{b['psnr_min']:.1f}", b["max_median"], b["max_p99"], b["max_max"],
                             f"{b['mean_abs_median']:.2f}"])
            rows.append([recipe, "1 (full)", x["full"], "identical", "", "", 0, 0, 0, "0"])
        L += md_table(["recipe", "scale", "samples", "PSNR dB median", "PSNR p01", "PSNR min", "max err median",
                       "max err p99", "max err max", "mean abs err median"], rows, "llrrrrrrrr")
        dm = r["decode_ms"]
        L += ["", "JPEG decode alone, one process, median ms per image (first 200 images, 5 times, scales interleaved): " +
              ", ".join(f"1/{k} {v:.2f}" if int(k) > 1 else f"full {v:.2f}" for k, v in dm.items()) + "."]
        L += ["", "One process, decode + resize seconds over all samples: " + "; ".join(
            f"{recipe}: off {x['secs']['off']:.1f} s, auto {x['secs']['auto']:.1f} s"
            for recipe, x in r["recipes"].items()) + ".", ""]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
