"""First batch, index time and memory at ImageNet-1k's size: 1,281,167 files in 1,000 class folders.

    .venv/bin/python -m bench.folder_index                 # builds the tree once (~1 min), runs ~4 min
    .venv/bin/python -m bench.folder_index --files 128000 --classes 100

Data: ``--unique`` JPEGs (ImageNet-like recipe, :mod:`feedgpu.sample_data`, from
``shared/data/photos``), hard-linked ``--files`` times into ``--classes`` class folders (an even
share each, the first ones one more) under ``--root``, outside the repository. Hard links cost
inodes, not blocks; the tree is built once (a marker beside it records its settings).

Each run is a fresh process (``--child``) that times, from its own start: the import, the index
(feedgpu: ``pipeline.source``, the :class:`FolderSource` walk or saved index; torch: ``sorted(glob(
root/*/*))`` and a label per path, as a user writes it), and the first batch of
``pipelines/imagenet_train.yaml`` (batch 256, random resized crop 224, flip, normalize) with 2
worker processes (feedgpu's ``DataLoader``; torch's over the same transforms, :mod:`feedgpu.bench.torch_baseline`),
then the main process's RSS and the workers' USS (psutil), and for feedgpu the time of
``source.identity()`` (what a cache or a loader state costs on top; on a saved index it
``stat``-s every file). Order: feedgpu cold (empty index dir), torch, feedgpu warm (the index the
cold run saved), torch again, then the same two for ``stat_files=True`` (the default, ``"auto"``,
lists only at this size: a ``stat`` of every file is what ``stat_files=True`` adds). "Cold" means no saved
index, not a cold page cache: dropping the page cache needs root on the host, which this
machine's sandbox does not allow, so every run after the tree was built finds its folders and
inodes in memory. Results: ``bench/results/folder_index.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench.harness imports feedgpu (and torch): a measured child must not have them before it times them
REPO = Path(__file__).resolve().parents[1]

MiB = 1 << 20
YAML = REPO / "feedgpu" / "pipelines" / "imagenet_train.yaml"


def build_tree(root: Path, files: int, classes: int, unique: int, photos: Path) -> tuple[Path, float]:
    from feedgpu.sample_data import build_imagenet_like

    settings = {"files": files, "classes": classes, "unique": unique, "photos": str(photos), "recipe": 1}
    marker = root.with_name(root.name + ".json")
    if root.is_dir() and marker.exists() and json.loads(marker.read_text()) == settings:
        return root, 0.0
    t = time.perf_counter()
    src = build_imagenet_like(root.with_name(f"src-{unique}"), n_images=unique, photos_dir=photos)
    jpgs = sorted(src.rglob("*.jpg"))
    tmp = root.with_name(root.name + ".building")
    if tmp.exists():
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
    tmp.mkdir(parents=True)
    base, extra = divmod(files, classes)
    k = 0
    for c in range(classes):
        name = f"n{1440764 + 1000 * c:08d}"
        d = tmp / name
        d.mkdir()
        for j in range(base + (c < extra)):
            os.link(jpgs[k % len(jpgs)], d / f"{name}_{j}.JPEG")
            k += 1
    if root.exists():
        subprocess.run(["rm", "-rf", str(root)], check=True)
    os.replace(tmp, root)
    marker.write_text(json.dumps(settings))
    time.sleep(3)   # a saved index is not written for folders changed within 2 s
    return root, time.perf_counter() - t


# -- one measured run, in a fresh process -------------------------------------------------------
def _since_start() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()


def _memory(loader_pids=None) -> dict:
    import psutil

    me = psutil.Process()
    kids = me.children(recursive=True)
    uss = []
    for k in kids:
        try:
            uss.append(k.memory_full_info().uss / MiB)
        except psutil.Error:
            pass
    return {"main_rss_mib": me.memory_info().rss / MiB, "worker_uss_mib": sorted(uss)}


def child(kind: str, root: str, workers: int) -> dict:
    t0 = _since_start()
    import psutil

    out: dict = {"kind": kind, "process_start_s": t0}
    t = time.perf_counter()
    import torch  # noqa: F401  what every training script imports first

    out["torch_import_s"] = time.perf_counter() - t
    torch_done = _since_start()
    if kind.startswith("feedgpu"):
        t = time.perf_counter()
        import feedgpu
        from feedgpu import DataLoader, Pipeline

        out["import_s"] = time.perf_counter() - t
        rss0 = psutil.Process().memory_info().rss
        # "feedgpu": the source's default (stat_files "auto": at this size, list only)
        p = Pipeline.from_yaml(YAML, source={"path": root, **({"stat_files": True} if kind == "feedgpu-stat" else {})})
        t = time.perf_counter()
        src = p.source
        out["index_s"] = time.perf_counter() - t
        out["from_saved_index"] = src.from_saved_index
        out["index_rss_mib"] = (psutil.Process().memory_info().rss - rss0) / MiB
        out["rss_after_index_mib"] = psutil.Process().memory_info().rss / MiB
        out["index_buffers_mib"] = sum(a.nbytes for a in (src.paths.blob, src.paths.offsets, src.labels)) / MiB
        out["samples"] = len(src)
        loader = DataLoader(p, num_workers=workers)
        t = time.perf_counter()
        batch = next(iter(loader))
        out["first_batch_after_index_s"] = time.perf_counter() - t
        out["first_batch_s"] = _since_start()
        out["after_torch_s"] = out["first_batch_s"] - torch_done
        out["batch_shape"] = list(batch.images.shape)
        out.update(_memory())
        t = time.perf_counter()
        src.identity()
        out["identity_s"] = time.perf_counter() - t
        out["feedgpu_version"] = feedgpu.__version__
        loader.shutdown()
    else:
        import glob

        import torch.utils.data as tud

        t = time.perf_counter()
        from feedgpu import Pipeline
        from feedgpu.bench.torch_baseline import build_transforms

        out["import_s"] = time.perf_counter() - t   # feedgpu's, for the transforms: not counted after torch
        rss0 = psutil.Process().memory_info().rss
        t = time.perf_counter()
        files = sorted(glob.glob(os.path.join(root, "*", "*")))
        classes = sorted(os.path.basename(d) for d in glob.glob(os.path.join(root, "*")) if os.path.isdir(d))
        index = {c: i for i, c in enumerate(classes)}
        samples = [(f, index[os.path.basename(os.path.dirname(f))]) for f in files]
        out["index_s"] = time.perf_counter() - t
        out["from_saved_index"] = False
        out["index_rss_mib"] = (psutil.Process().memory_info().rss - rss0) / MiB
        out["rss_after_index_mib"] = psutil.Process().memory_info().rss / MiB
        out["samples"] = len(samples)
        tf = build_transforms(Pipeline.from_yaml(YAML, source={"path": root}))   # the source is not opened

        class Files(tud.Dataset):
            def __len__(self):
                return len(samples)

            def __getitem__(self, i):
                path, label = samples[i]
                with open(path, "rb") as f:
                    return tf(f.read()), label

        g = torch.Generator()
        g.manual_seed(0)
        loader = tud.DataLoader(Files(), batch_size=256, shuffle=True, drop_last=True, num_workers=workers,
                                prefetch_factor=2, persistent_workers=True, generator=g)
        t = time.perf_counter()
        it = iter(loader)
        images, _ = next(it)
        out["first_batch_after_index_s"] = time.perf_counter() - t
        out["first_batch_s"] = _since_start()
        out["after_torch_s"] = out["first_batch_s"] - torch_done - out["import_s"]
        out["batch_shape"] = list(images.shape)
        out.update(_memory())
        del it
    return out


def run_child(kind: str, root: Path, workers: int, cache_dir: Path) -> dict:
    env = dict(os.environ, FEEDGPU_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO))
    load = os.getloadavg()[0]
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "bench.folder_index", "--child", kind, "--root", str(root), "--workers", str(workers)],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{res.stderr[-4000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t
    out["load_avg_1min_before"] = load
    print(f"{kind:14s} saved_index={out['from_saved_index']!s:5s} index {out['index_s']:6.2f} s  first batch "
          f"{out['first_batch_s']:6.2f} s  main RSS {out['main_rss_mib']:6.0f} MiB  (load {load:.1f})",
          file=sys.stderr, flush=True)
    return out


def markdown(doc: dict) -> str:
    m, s = doc["machine"], doc["settings"]
    lines = ["# ImageFolder at ImageNet-1k's size: first batch, index, memory", "",
             f"Machine: {m['platform']}, {m.get('cpu_count', m.get('nproc', m.get('cpus')))} CPUs, Python {m['python']}, torch {m['torch']}, feedgpu "
             f"{m['feedgpu_commit']}. 1-minute load average {doc['load_avg'][0]:.1f} at the start, "
             f"{doc['load_avg'][1]:.1f} at the end (each row gives it at its start).",
             "",
             f"Data: {s['files']:,} files in {s['classes']:,} class folders (`n<8 digits>/<class>_<j>.JPEG`), hard "
             f"links of {s['unique']} ImageNet-like JPEGs (400-640 px, from shared/data/photos) under {s['root']}. "
             f"Pipeline: {s['pipeline']} (batch 256, random resized crop 224, flip, normalize, float32), "
             f"{s['workers']} worker processes; torch: `torch.utils.data.DataLoader` over `sorted(glob(root/*/*))` "
             "with the same transforms (feedgpu.bench.torch_baseline, torchvision's code path written with Pillow).", "",
             "Times are from the process's start (interpreter start included). Cold: no saved index (a new, empty "
             "cache dir); warm: the index the cold run saved. The page cache could not be dropped (no root on the "
             "host), so every run finds the folders and inodes in memory; torch has no saved index, its two runs "
             "differ only by noise. `identity` is what a cache or loader state adds on top (it stats every file "
             "when the index was read from a saved file).", "",
             "`import torch s`: the `import torch` every training script starts with; `import s`: feedgpu's on top "
             "(for the torch run, what building the same transforms from the YAML file imports; not counted "
             "in its time after torch). `after import torch s`: from `import torch` done to the first batch, "
             "what the loader adds to a training script's start. feedgpu's modules are byte-compiled before the "
             "runs, as an installed package's are (this machine's environment sets PYTHONDONTWRITEBYTECODE).", "",
             "| round | run | saved index | import torch s | import s | index s | first batch s (from start) "
             "| after import torch s | index RSS MiB "
             "| main RSS after index MiB | main RSS after 1st batch MiB | worker USS MiB | identity s | load |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in doc["runs"]:
        lines.append(f"| {r.get('round', 1)} | {r['label']} | {'yes' if r['from_saved_index'] else 'no'} | "
                     f"{r['torch_import_s']:.2f} | {r['import_s']:.2f} | "
                     f"{r['index_s']:.2f} | {r['first_batch_s']:.2f} | {r['after_torch_s']:.2f} | "
                     f"{r['index_rss_mib']:.0f} | "
                     f"{r['rss_after_index_mib']:.0f} | {r['main_rss_mib']:.0f} | {', '.join(f'{u:.0f}' for u in r['worker_uss_mib'])} | "
                     + (f"{r['identity_s']:.2f}" if "identity_s" in r else "-") + f" | {r['load_avg_1min_before']:.1f} |")
    lines += ["", "Index RSS: the main process's RSS growth over the index step alone (feedgpu: the numpy "
              f"buffers, {doc['runs'][0].get('index_buffers_mib', 0):.0f} MiB of paths, offsets and labels, "
              "plus sizes and mtimes, plus what the allocator keeps; torch: the list of path strings and tuples).",
              "Goals (issue): first batch <= 5 s cold, <= 2 s warm, index <= 150 MB.", "",
             "Medians over the rounds (first batch from start / after import torch / index, s):", ""]
    import statistics

    for label in dict.fromkeys(r["label"].replace(" (1st)", "").replace(" (2nd)", "") for r in doc["runs"]):
        rs = [r for r in doc["runs"] if r["label"].replace(" (1st)", "").replace(" (2nd)", "") == label]
        lines.append(f"- {label}: {statistics.median(r['first_batch_s'] for r in rs):.2f} / "
                     f"{statistics.median(r['after_torch_s'] for r in rs):.2f} / "
                     f"{statistics.median(r['index_s'] for r in rs):.2f} ({len(rs)} runs)")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/work/bench-data/imagenet-folder")
    ap.add_argument("--files", type=int, default=1_281_167)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--unique", type=int, default=300)
    ap.add_argument("--photos", default=str(REPO.parent / "shared" / "data" / "photos"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="times the six runs are repeated (the machine is shared)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.root, args.workers)))
        return

    from bench.harness import git_commit, machine, write_results

    start = time.perf_counter()
    load0 = os.getloadavg()[0]
    root, built = build_tree(Path(args.root), args.files, args.classes, args.unique, Path(args.photos))
    # as an installed package is: pip byte-compiles it, an environment with PYTHONDONTWRITEBYTECODE
    # would otherwise compile every module in every run
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "feedgpu")], check=True)
    runs = []
    for rnd in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory(prefix="feedgpu-index-bench-") as tmp:
            for kind, cache, label in [("feedgpu", "a", "feedgpu cold"), ("torch", "t", "torch (1st)"),
                                       ("feedgpu", "a", "feedgpu warm"), ("torch", "t", "torch (2nd)"),
                                       ("feedgpu-stat", "b", "feedgpu stat_files=True cold"),
                                       ("feedgpu-stat", "b", "feedgpu stat_files=True warm")]:
                r = run_child(kind, root, args.workers, Path(tmp) / cache)
                r["label"], r["round"] = label, rnd
                runs.append(r)
    doc = {"machine": machine(feedgpu_commit=git_commit()), "load_avg": [load0, os.getloadavg()[0]], "tree_build_s": built,
           "settings": {"root": str(root), "files": args.files, "classes": args.classes, "unique": args.unique,
                        "workers": args.workers, "pipeline": "feedgpu/pipelines/imagenet_train.yaml"},
           "runs": runs, "total_seconds": time.perf_counter() - start}
    write_results(args.out, "folder_index", doc, markdown)


if __name__ == "__main__":
    main()
