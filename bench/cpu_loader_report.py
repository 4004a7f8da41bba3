"""The markdown report of ``bench/cpu_loader.py``: the goals, then each dataset x recipe's figures."""
from __future__ import annotations

import statistics

__all__ = ["NAMES", "markdown"]

NAMES = {"torch_pillow": "torch DataLoader + stock Pillow", "torch_pillow_simd": "torch DataLoader + Pillow-SIMD",
         "spdl": "SPDL (FFmpeg decode, thread pool)", "dali_hand": "hand-written DALI CPU",
         "feedgpu_full": "feedgpu, Python engine, reduce: off",
         "feedgpu": "feedgpu, Python engine, reduce: rows (default)",
         "feedgpu_reduce": "feedgpu, Python engine, reduce: auto",
         "feedgpu_dali_cpu": "feedgpu, DALI CPU engine (window decode, default)",
         "feedgpu_dali_cpu_whole": "feedgpu, DALI CPU engine, window_decode: false"}
SHORT = {"torch_pillow": "torch + stock Pillow", "torch_pillow_simd": "torch + Pillow-SIMD", "spdl": "SPDL",
         "dali_hand": "hand-written DALI", "feedgpu_full": "Python, off", "feedgpu": "Python, rows",
         "feedgpu_reduce": "Python, auto", "feedgpu_dali_cpu": "DALI, window", "feedgpu_dali_cpu_whole": "DALI, whole"}
RECIPES = {"train": "decode → RandomResizedCrop(224, scale 0.08–1, bilinear) → horizontal flip → normalize to "
                    "float32 NCHW",
           "val": "decode → Resize(256) + CenterCrop(224) (bilinear) → normalize to float32 NCHW"}
DATASET_NAMES = {"imagenet-like": "(a) ImageNet-like", "photos": "(b) full-size photos"}


def _f(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _r(r: dict | None) -> str:
    return "–" if not r else f"{r['median']:.2f}× ({r['min']:.2f}–{r['max']:.2f})"


def _title(key: str) -> str:
    dataset, recipe = key.split("/")
    return f"{DATASET_NAMES.get(dataset, dataset)}, {recipe}"


def _goals(doc: dict) -> list[str]:
    feed = [n for n in NAMES if n.startswith("feedgpu")]
    L = ["## Goals", "",
         "Each feedgpu loader's samples/s over the reference's, taken within each round (the loaders ran in "
         "turn): median over the rounds (min–max); ✓ where the median meets the goal.", "",
         "| part | goal | " + " | ".join(SHORT[n] for n in feed) + " |",
         "| --- | --- | " + " | ".join("---:" for _ in feed) + " |"]
    for g in doc["goals"]:
        part = doc["parts"].get(g["part"])
        if part is None:
            continue
        cells = []
        for n in feed:
            r = part["ratios"].get(f"{n}_over_{g['over']}")
            cells.append("–" if r is None else _r(r) + (" ✓" if r["median"] >= g["ratio"] else " ✗"))
        L.append(f"| {_title(g['part'])} | ≥ {g['ratio']:g}× {SHORT[g['over']]} | " + " | ".join(cells) + " |")
    return L


def _setup(doc: dict) -> list[str]:
    m = doc["machine"]
    L = ["## Setup", "",
         f"- Machine: {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB RAM, {m['platform']}; "
         f"Python {m['python']}, torch {m['torch']}" + (f", NVIDIA DALI {m['dali']} (CPU operators, "
                                                        "`device_id=None`)" if m.get("dali") else "") +
         (f", SPDL {m['spdl']} (`bench/.spdl`)" if m.get("spdl") else "") + ".",
         f"- PIL builds: {m['pil_label']} (feedgpu, torch + Pillow-SIMD)" +
         (f"; {m['pil_stock']} from PyPI in `bench/.pillow-stock` (torch + stock Pillow)." if m.get("pil_stock")
          else "."),
         "- Loaders, each in its own process, at equal cores (2 worker processes, or 2 threads for SPDL and "
         "the DALI loaders):",
         "  - torch: `torch.utils.data.DataLoader` + the torchvision-equivalent transforms of "
         "`feedgpu.bench.torch_baseline` (`Image.open().convert(\"RGB\")`, the same geometric transforms, "
         "`ToTensor`, `Normalize`, `default_collate`, `pin_memory=False`);",
         "  - SPDL: `spdl.pipeline` with a thread pool: read, `spdl.io.demux_image`, `decode_packets` through an "
         "FFmpeg filter graph (train: `crop` of the window drawn from the stored size + `scale` bilinear + "
         "`hflip`; val: `scale` of the short side + centre `crop`), `aggregate`, then stack + normalize with "
         "torch (`bench/spdl_loader.py`);",
         "  - hand-written DALI CPU (`bench/dali_cpu.py`'s `HandDali`): train `fn.readers.file(random_shuffle)` → "
         "`fn.decoders.image_random_crop` → `fn.resize` (linear, antialias) → `fn.crop_mirror_normalize(mirror=coin "
         "flip)` (the usual DALI training pipeline, decoding only the crop window); val `fn.decoders.image` → "
         "`fn.resize(resize_shorter=256)` → `fn.crop_mirror_normalize(crop=224)`; `DALIGenericIterator`;",
         "  - feedgpu: `feedgpu.DataLoader` on the YAML pipeline, Python engine with `decode: {reduce: off | rows | "
         "auto}`, or `engine: {name: dali, device: cpu}` with window decode (`fn.decoders.image_slice`) or "
         "`window_decode: false` (whole images).",
         ]
    return L


def _part(part: dict) -> list[str]:
    d, s, su = part["data"], part["settings"], part["summary"]
    L = ["", f"## {_title(part['key'])}", "",
         f"Recorded {part['created']} with `{part['command'].strip()}` ({part['seconds']:.0f} s for this part)." +
         (f" **{part['note']}**" if part.get("note") else ""), "",
         (f"- Data: {d['images']} ImageNet-like JPEGs built by `feedgpu.sample_data.build_imagenet_like` from "
          f"`{s['photos']}`" if s["dataset"] == "imagenet-like" else
          f"- Data: the full-size photographs of `{s['photos']}`, repeated to {d['images']} files") +
         f" (ImageFolder layout; mean {d['mean_bytes'] / 1024:.1f} KB, {d['mean_width']}×{d['mean_height']} px, "
         f"{d['mean_megapixels']:.3f} megapixels).",
         f"- Pipeline: `{s['pipeline']}` — {RECIPES[s['recipe']]}, output on the CPU.",
         f"- Settings: {s['workers']} workers / threads, batch {s['batch_size']}, prefetch {s['prefetch_factor']}, "
         f"shuffle {s['shuffle']}, drop_last {s['drop_last']} ({s['batches_per_epoch']} batches per epoch); per run "
         f"{s['warmup']} warm-up batches, then {s['timed_batches']} timed batches; one unrecorded warm-up round, "
         f"then {s['rounds']} rounds with the loaders in turn (order rotated each round).", "",
         "| loader | samples/s (min–max) | CPU % | CPU s / 1,000 samples | first batch s | RSS peak / worker MB "
         "| main RSS peak MB |",
         "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, x in su.items():
        L.append(f"| {NAMES.get(name, name)} | **{x['samples_per_s']:.0f}** ({x['samples_per_s_min']:.0f}–"
                 f"{x['samples_per_s_max']:.0f}) | {x['cpu_percent']:.0f} | **{_f(x.get('cpu_s_per_1000'), '.2f')}** | "
                 f"{x['first_batch_s']:.2f} | {_f(x['rss_peak_mb_per_worker'], '.0f')} | {x['rss_peak_mb_main']:.0f} |")
    refs = [y for y in NAMES if not y.startswith("feedgpu") and y in su]
    rows = [x for x in su if any(f"{x}_over_{y}" in part["ratios"] for y in refs)]
    if rows:
        L += ["", "Samples/s over each reference, within each round: median (min–max).", "",
              "| loader | " + " | ".join(f"/ {SHORT[y]}" for y in refs) + " |",
              "| --- | " + " | ".join("---:" for _ in refs) + " |"]
        for x in rows:
            L.append(f"| {NAMES.get(x, x)} | " + " | ".join(_r(part["ratios"].get(f"{x}_over_{y}")) for y in refs)
                     + " |")
        L += ["", "CPU seconds per sample of each reference over the loader's, within each round: median (min–max) "
              "(the same comparison by CPU time spent, less sensitive to other processes taking cores than samples/s).",
              "", "| loader | " + " | ".join(f"{SHORT[y]} / it" for y in refs) + " |",
              "| --- | " + " | ".join("---:" for _ in refs) + " |"]
        for x in rows:
            L.append(f"| {NAMES.get(x, x)} | " + " | ".join(_r((part["ratios"].get(f"{x}_over_{y}") or {}).get("cpu"))
                                                          for y in refs) + " |")
    single = part.get("per_core_no_loader") or {}
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
            L += ["", f"{NAMES.get(name, name)}: time per sample by stage (median over runs, ms): " +
                  ", ".join(f"{k} {v:.2f}" for k, v in st.items()) + "."]
    runs = part["runs"]
    L += ["", f"Other processes used a median {statistics.median(r['others_cpu_percent'] or 0 for r in runs):.0f} % "
          f"of a core during the timed windows (max {max(r['others_cpu_percent'] or 0 for r in runs):.0f} %); "
          f"runs repeated because others used more than {s['max_others_percent']:.0f} %: "
          f"{len(part['disturbed_runs_repeated'])}.", "",
          "<details><summary>Every run</summary>", "",
          "| round | loader | samples/s | CPU % | CPU s / 1,000 | others' CPU % | steal % |",
          "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        L.append(f"| {r['round']} | {r['loader']} | {r['samples_per_s']:.0f} | {r['cpu_percent']:.0f} | "
                 f"{r['cpu_percent'] / 100 * 1000 / r['samples_per_s']:.2f} | {_f(r['others_cpu_percent'], '.0f')} | "
                 f"{_f(r['steal_percent'], '.1f')} |")
    L += ["", "</details>"]
    return L


def markdown(doc: dict) -> str:
    L = ["# CPU loader benchmark: feedgpu's CPU engines vs torch + Pillow, SPDL and hand-written DALI", "",
         f"Written {doc['created']} by `{doc['command'].strip()}` ({doc['total_seconds']:.0f} s); each part below "
         "says when and how it was measured. Raw numbers, every run: `cpu_loader.json`."]
    if doc.get("note"):
        L += ["", f"> **{doc['note']}**"]
    L += [""] + _goals(doc) + [""] + _setup(doc)
    for part in doc["parts"].values():
        L += _part(part)
    L += [
        "", "## How it is measured", "",
        "- samples/s: samples in the timed batches ÷ time from the last warm-up batch to the last timed batch "
        "(worker start-up and the pipeline fill are excluded; `feedgpu.bench.measure.measure`). The timed batches "
        "are a multiple of the worker count because each worker fills whole batches.",
        "- CPU %: CPU seconds of the loader's process and all its children (the workers) over the timed window ÷ "
        "its wall time; 200 % = both cores busy. CPU s / 1,000 samples: those CPU seconds per 1,000 samples "
        "delivered (median over runs).",
        "- Before each run the script waits (up to `--quiet-wait` s) until the rest of the machine is idle (< 15 % "
        "of a core), and reruns a run during which other processes used more than `--max-others` % of a core "
        "(up to `--retries` times; the disturbed runs are in the JSON).",
    ]
    return "\n".join(L) + "\n"
