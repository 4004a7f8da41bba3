#!/usr/bin/env python
"""The recorded cache benchmark: epoch 1 from the JPEG files against epoch 2 from the local cache.

Pipeline ``pipelines/imagenet_train_cached.yaml`` (decode -> resize short side 256 -> [cache] ->
random resized crop 224 -> flip -> normalize to float32 NCHW) on the CPU, same workers and batch
size throughout, full epochs with ``drop_last=False`` (so the fill caches every sample). In one
process, alternating round after round (the compression order rotates per round), it measures:

* ``no_cache``: an epoch with ``cache=False`` -- "epoch 1 from the JPEG files";
* ``fill:<c>``: an epoch that fills a fresh, empty cache directory with compression ``c`` --
  epoch 1 while writing the cache (the workers write their last part when they exit, which the
  "incl. start-up and shutdown" column counts);
* ``read:<c>``: the next epoch, a new loader on that full cache -- "epoch 2" (every sample is read
  from the cache; the run checks that nothing was decoded).

Each run is :func:`feedgpu.bench.measure.measure` (what ``feedgpu bench`` reports): samples/s from the
first batch to the last (``--warmup 1``: worker start-up and the first batch excluded), and here
also samples/s over the whole epoch from ``iter(loader)`` until its workers have exited (start-up
and the final cache flush included). Medians over rounds; ratios also per round.

Writes ``bench/results/cache_epochs.json`` and ``bench/results/cache_epochs.md``.

    .venv/bin/python -m bench.cache_epochs                     # 2,000 images, 5 rounds, ~3.5 min
    .venv/bin/python -m bench.cache_epochs --rounds 3 --compression zstd:1
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import REPO, wait_quiet, write_results

PIPELINE = REPO / "pipelines" / "imagenet_train_cached.yaml"
TARGET_READ = 4.0       # epoch 2 (cache) / epoch 1 (JPEG) samples/s
TARGET_WRITE = 0.15     # extra time of the filling epoch over the uncached one


def pipeline(data: str, dtype: str = "float32"):
    """The cached ImageNet pipeline; with ``dtype="uint8"`` without its normalize stage (uint8 NHWC
    batches, normalized on the GPU in training), else normalizing to ``dtype``."""
    import yaml

    from feedgpu import Pipeline

    d = yaml.safe_load(PIPELINE.read_text())
    d.setdefault("source", {})["path"] = data
    d.setdefault("output", {}).update(device="cpu", dtype=dtype)
    d.setdefault("loader", {})["drop_last"] = False
    if dtype == "uint8":
        d["stages"] = [st for st in d["stages"] if st["op"] != "normalize"]
        d["output"]["layout"] = "NHWC"
    return Pipeline.from_config(d, where=str(PIPELINE))


def subject(p, workers: int, batch_size: int, cache, name: str, persistent: bool = False, since=None):
    """A :class:`feedgpu.bench.subjects.Subject` for ``DataLoader(p, cache=cache)``. Non-persistent
    workers exit, and write their last cache part, at the end of the epoch. ``since``: a dict
    that holds ``stage_s`` at the start of the measured epoch (seconds per stage are reported
    for that epoch only)."""
    from feedgpu import DataLoader
    from feedgpu.bench.subjects import Subject
    from feedgpu.imaging import pil_label

    loader = DataLoader(p, batch_size=batch_size, num_workers=workers, persistent_workers=persistent,
                        drop_last=False, cache=cache)

    def extra() -> dict:
        st = loader.stats()
        base = (since or {}).get("stage_s", {})
        n = max(1, st["samples"] - (since or {}).get("samples", 0))
        return {"stage_ms_per_sample": {k: round((v - base.get(k, 0.0)) / n * 1e3, 4) for k, v in st["stage_s"].items()},
                "skipped": st["skipped_total"], "cache_state": st["cache"], "epoch_samples": n}

    return Subject(name, f"feedgpu ({pil_label()}) {name}", loader, loader.worker_pids, "cpu", loader.shutdown, extra)


def one_run(p, a, nb: int, name: str, cache, prepare=None, steady: bool = False) -> dict:
    """One measured epoch; repeated (``--retries``) when other processes used more than
    ``--max-others`` % of a core meanwhile (``prepare()`` runs before every attempt). ``steady``:
    one loader with persistent workers runs an unmeasured epoch first, then the measured one
    (its workers have touched the batch buffers and opened the cache already)."""
    from feedgpu.bench.measure import measure, progress_bar

    for attempt in range(1, a.retries + 2):
        if prepare is not None:
            prepare()
        waited = wait_quiet(a.quiet_wait) if a.quiet_wait > 0 else 0.0
        since: dict = {}
        s = subject(p, a.workers, a.batch_size, cache, name, persistent=steady, since=since)
        skip = nb if steady else 0  # batches of the unmeasured first epoch
        seen = [0]

        def on_batch(bar) -> None:
            seen[0] += 1
            bar.update(1)
            if seen[0] == skip:
                st = s.loader.stats()
                since.update(stage_s=dict(st["stage_s"]), samples=st["samples"])

        t0 = time.perf_counter()
        with progress_bar(skip + nb, name) as bar:
            res = measure(s, nb - a.warmup, skip + a.warmup, on_batch=lambda: on_batch(bar))
        wall = time.perf_counter() - t0  # iter() ... last batch ... workers exited (cache flushed)
        n = res.pop("epoch_samples")
        res.update(loader=name, epoch_samples=n, epoch_wall_s=None if steady else round(wall, 3),
                   samples_per_s_with_startup=None if steady else n / wall, waited_for_quiet_s=waited,
                   attempt=attempt, steady=steady)
        if (res["others_cpu_percent"] or 0) <= a.max_others or attempt > a.retries:
            return res
        print(f"{name}: other processes used {res['others_cpu_percent']:.0f} % of a core during the run; "
              "running it again", file=sys.stderr)
        DISTURBED.append(res)
    return res  # pragma: no cover - the loop always returns


DISTURBED: list[dict] = []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--photos", default=str((REPO / ".." / "shared" / "data" / "photos").resolve()))
    ap.add_argument("--data", help="dataset folder (default bench/out/imagenet-like-<images>, built if missing)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="batches before the timed window (default 1)")
    ap.add_argument("--compression", action="append", help="repeatable (default: zstd:1, zstd:3, none)")
    ap.add_argument("--cache-root", help="where the caches are written (default: a temporary folder on the "
                    "disk of bench/out)")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each run, wait up to this many seconds for other processes to go idle")
    ap.add_argument("--max-others", type=float, default=25.0,
                    help="rerun a run during which other processes used more than this %% of a core")
    ap.add_argument("--retries", type=int, default=3, help="reruns of a disturbed run (default 3)")
    ap.add_argument("--no-steady", action="store_true", help="skip the steady-state (persistent workers) runs")
    ap.add_argument("--no-persistent-check", action="store_true",
                    help="skip the extra two-epoch run with persistent workers")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "uint8"],
                    help="output dtype (uint8: normalize left to the GPU); results go to cache_epochs[_<dtype>]")
    a = ap.parse_args(argv)
    comps = a.compression or ["zstd:1", "zstd:3", "none"]

    from feedgpu.cache import entries
    from feedgpu.cache.settings import parse_compression
    from feedgpu.bench.machine import data_info, machine_info
    from feedgpu.bench.measure import epoch_batches
    from feedgpu.sample_data import build_imagenet_like

    for c in comps:
        parse_compression(c)
    t_all = time.perf_counter()
    data = Path(a.data) if a.data else REPO / "bench" / "out" / f"imagenet-like-{a.images}"
    if not a.data:
        build_imagenet_like(data, a.images, photos_dir=a.photos, progress=True)
    p = pipeline(str(data), a.dtype)
    n = len(p.source)
    nb = epoch_batches(p, a.batch_size)
    jpeg_bytes = int(p.source.sizes.sum()) if hasattr(p.source, "sizes") else None
    print("measuring the data set", file=sys.stderr)
    data_meta = data_info(p, str(data), sample=None)
    data_meta["jpeg_bytes_total"] = jpeg_bytes
    machine = machine_info()
    base_root = Path(a.cache_root) if a.cache_root else REPO / "bench" / "out"
    base_root.mkdir(parents=True, exist_ok=True)
    base_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="cache-epochs-", dir=base_root))
    settings = {"pipeline": str(PIPELINE.relative_to(REPO)), "stages": [s.name for s in p.stages], "dtype": a.dtype,
                "cached_prefix": [s.name for s in p.stages[:p.plan("cpu").cache_prefix]],
                "workers": a.workers, "batch_size": a.batch_size, "batches_per_epoch": nb, "drop_last": False,
                "warmup_batches": a.warmup, "timed_batches": nb - a.warmup, "rounds": a.rounds,
                "prefetch_factor": p.prefetch_factor, "persistent_workers": "no (steady runs: yes)", "device": "cpu",
                "compressions": comps, "cache_root": str(tmp), "quiet_wait_s": a.quiet_wait,
                "part_bytes": 64 << 20, "max_others_percent": a.max_others, "retries": a.retries,
                "steady_runs": not a.no_steady}
    steady = not a.no_steady
    runs: list[dict] = []
    sizes: dict[str, list[dict]] = {c: [] for c in comps}
    persistent = profile = None
    try:
        # one unrecorded run of each kind first: first-touch costs (imports, page cache of the JPEGs)
        print("warm-up runs (not recorded)", file=sys.stderr)
        one_run(p, a, nb, "no_cache", False)
        one_run(p, a, nb, f"fill:{comps[0]}", {"dir": str(tmp / "warm"), "compression": comps[0]})
        shutil.rmtree(tmp / "warm")
        for r in range(a.rounds):
            order = comps[r % len(comps):] + comps[:r % len(comps)]

            def record(res: dict) -> dict:
                res["round"] = r + 1
                runs.append(res)
                return res

            record(one_run(p, a, nb, "no_cache", False))
            if steady:
                record(one_run(p, a, nb, "no_cache_steady", False, steady=True))
            for c in order:
                root = tmp / f"round{r + 1}-{c.replace(':', '')}"
                cache = {"dir": str(root), "compression": c}
                record(one_run(p, a, nb, f"fill:{c}", cache, prepare=lambda root=root: shutil.rmtree(root, ignore_errors=True)))
                es = entries(root)
                assert len(es) == 1 and es[0]["rows"] == n, f"the fill did not cache every sample: {es}"
                sizes[c].append({"bytes": es[0]["bytes"], "parts": es[0]["parts"], "rows": es[0]["rows"]})
                for kind in ("read", "read_steady") if steady else ("read",):
                    res = record(one_run(p, a, nb, f"{kind}:{c}", cache, steady=kind == "read_steady"))
                    decoded = res["stage_ms_per_sample"].get("decode", 0.0)
                    assert decoded == 0.0, f"{kind} decoded images ({decoded} ms/sample): not read from the cache"
                shutil.rmtree(root)
        if not a.no_persistent_check:
            persistent = persistent_check(p, a, tmp / "persistent", comps[0], n)
        print("fill cost profile (one process)", file=sys.stderr)
        wait_quiet(a.quiet_wait)
        profile = fill_profile(p, comps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    kinds = ("fill", "read", "read_steady") if steady else ("fill", "read")
    names = ["no_cache"] + (["no_cache_steady"] if steady else []) + [f"{k}:{c}" for c in comps for k in kinds]
    summary = {}
    med = statistics.median

    def med_or_none(xs):
        xs = [x for x in xs if x is not None]
        return med(xs) if xs else None

    for name in names:
        rs = [r for r in runs if r["loader"] == name]
        stages = rs[0]["stage_ms_per_sample"].keys()
        summary[name] = {
            "samples_per_s": med(r["samples_per_s"] for r in rs),
            "samples_per_s_min": min(r["samples_per_s"] for r in rs),
            "samples_per_s_max": max(r["samples_per_s"] for r in rs),
            "samples_per_s_with_startup": med_or_none(r["samples_per_s_with_startup"] for r in rs),
            "epoch_wall_s": med_or_none(r["epoch_wall_s"] for r in rs),
            "first_batch_s": med(r["first_batch_s"] for r in rs),
            "cpu_percent": med(r["cpu_percent"] for r in rs),
            "uss_mb_per_worker": med(u for r in rs for u in (r["uss_mb_per_worker"] or [0])),
            "rss_peak_mb_per_worker": max(u for r in rs for u in r["rss_peak_mb_per_worker"]),
            "others_cpu_percent": med(r["others_cpu_percent"] or 0 for r in rs),
            "stage_ms_per_sample": {k: round(med(r["stage_ms_per_sample"].get(k, 0.0) for r in rs), 4) for k in stages},
        }
    per_comp = {}
    for c in comps:
        read_x, write_cost, read_x_su, write_cost_su = [], [], [], []
        for r in range(1, a.rounds + 1):
            get = {q["loader"]: q for q in runs if q["round"] == r}
            base, fill, read = get["no_cache"], get[f"fill:{c}"], get[f"read:{c}"]
            read_x.append(read["samples_per_s"] / base["samples_per_s"])
            write_cost.append(base["samples_per_s"] / fill["samples_per_s"] - 1)
            read_x_su.append(read["samples_per_s_with_startup"] / base["samples_per_s_with_startup"])
            write_cost_su.append(base["samples_per_s_with_startup"] / fill["samples_per_s_with_startup"] - 1)
        steady_x, train_x = [], []
        if steady:
            for r in range(1, a.rounds + 1):
                get = {q["loader"]: q for q in runs if q["round"] == r}
                steady_x.append(get[f"read_steady:{c}"]["samples_per_s"] / get["no_cache_steady"]["samples_per_s"])
                train_x.append(get[f"read_steady:{c}"]["samples_per_s"] / get["no_cache"]["samples_per_s"])
        b = med(s["bytes"] for s in sizes[c])
        s_no, s_fill, s_read = summary["no_cache"], summary[f"fill:{c}"], summary[f"read:{c}"]
        per_comp[c] = {
            "read_speedup": s_read["samples_per_s"] / s_no["samples_per_s"],
            "read_speedup_per_round": _mmm(read_x),
            "write_cost": s_no["samples_per_s"] / s_fill["samples_per_s"] - 1,
            "write_cost_per_round": _mmm(write_cost),
            "read_speedup_with_startup": s_read["samples_per_s_with_startup"] / s_no["samples_per_s_with_startup"],
            "read_speedup_with_startup_per_round": _mmm(read_x_su),
            "write_cost_with_startup": s_no["samples_per_s_with_startup"] / s_fill["samples_per_s_with_startup"] - 1,
            "write_cost_with_startup_per_round": _mmm(write_cost_su),
            "read_speedup_steady": (summary[f"read_steady:{c}"]["samples_per_s"] / summary["no_cache_steady"]["samples_per_s"]
                                    if steady else None),
            "read_speedup_steady_per_round": _mmm(steady_x) if steady else None,
            # a training run: its epoch 2 (persistent workers, from the cache) over its epoch 1 (from JPEG)
            "epoch2_steady_over_epoch1": (summary[f"read_steady:{c}"]["samples_per_s"] / summary["no_cache"]["samples_per_s"]
                                          if steady else None),
            "epoch2_steady_over_epoch1_per_round": _mmm(train_x) if steady else None,
            "cache_bytes": b, "cache_bytes_per_image": b / n, "cache_parts": sizes[c][0]["parts"],
            "cache_over_jpeg": b / jpeg_bytes if jpeg_bytes else None,
        }
        pc = per_comp[c]
        pc["meets_read_target"] = pc["read_speedup"] >= TARGET_READ
        pc["meets_write_target"] = pc["write_cost"] <= TARGET_WRITE
    total = time.perf_counter() - t_all
    doc = {"format": "feedgpu.bench.cache_epochs/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python -m bench.cache_epochs " + " ".join(sys.argv[1:] if argv is None else argv),
           "targets": {"read_speedup_min": TARGET_READ, "write_cost_max": TARGET_WRITE},
           "machine": machine, "data": data_meta, "settings": settings, "summary": summary,
           "per_compression": per_comp, "persistent_workers_check": persistent,
           "fill_profile": profile, "runs": runs,
           "disturbed_runs_repeated": DISTURBED,
           "total_seconds": round(total, 1)}
    write_results(a.out, "cache_epochs" if a.dtype == "float32" else f"cache_epochs_{a.dtype}", doc, markdown)
    return 0


def fill_profile(p, comps: list[str], n_rows: int = 450, fast_levels=(-20, -5), pause_s: float = 6.0) -> dict:
    """What filling costs per sample, without a loader (one process): the prefix output (PIL
    images) of the first ``n_rows`` images (about one 64 MiB part at zstd:1) packed to RGB bytes
    (``rgb_array``; timed one image at a time, each result dropped before the next as in the
    loader, so the allocator reuses its memory), encoded row by row (zstd, or the xxh3-64 of the
    raw row), then copied into the reused batch buffer (allocated and touched once, as a worker's)
    and streamed into a part file as the cache writes it (``PartWriter``: ~8 MiB record batches to
    a temporary file in pieces of at most 256 KiB, checksums from the rows, rename; no fsync). The
    part is written three times, each time after deleting the one before: as the cache does, after
    ``pause_s`` seconds (for the balloon driver to report the freed memory to the host); with one
    ``write()`` per record batch buffer (~8 MiB, as before format 3), after the same pause; and
    that again at once (into pages the kernel has just freed). ``fast_levels``: zstd's negative
    levels, encode and decode only (not offered as settings), for the choice of what to store."""
    import zstandard

    from feedgpu.cache.parts import PartWriter, RowBuffer, RowEncoder
    from feedgpu.cache.settings import parse_compression
    from feedgpu.cache.store import BATCH_BYTES
    from feedgpu.exec.pixels import rgb_array

    plan = p.plan("cpu")
    prefix = plan.sample_stages[:plan.cache_prefix]
    images = []
    for i in range(min(n_rows, len(p.source))):
        x = p.source.read(i).payload
        for st in prefix:
            x = st.apply(x, None)
        images.append(x)
    t_pack = 0.0
    for x in images:
        t0 = time.perf_counter()
        rgb_array(x)
        t_pack += time.perf_counter() - t0
    arrays = [rgb_array(x) for x in images]
    del images
    raw = sum(a.nbytes for a in arrays)
    k = len(arrays) / 1e3
    out = {"rows": len(arrays), "raw_mib": raw / 2**20, "pack_ms": t_pack / k, "pause_s": pause_s}
    (REPO / "bench" / "out").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="fill-profile-", dir=REPO / "bench" / "out"))
    rows = RowBuffer(BATCH_BYTES + (1 << 20))
    for a in arrays:  # touch the buffer's memory once
        rows.add(0, "", 0, a.shape[0], a.shape[1], 0, a)
        if rows.nbytes >= BATCH_BYTES:
            break
    rows.clear()

    def write_part(enc, encoded, **kw) -> tuple[float, dict]:
        t = time.perf_counter()
        w = PartWriter(tmp, "part.arrow", enc, **kw)
        for i, shape, data, check in encoded:
            rows.add(i, str(i), 0, shape[0], shape[1], check, data)
            if rows.nbytes >= BATCH_BYTES:
                w.write(rows)
                rows.clear()
        if len(rows):
            w.write(rows)
            rows.clear()
        entry = w.close()
        dt = time.perf_counter() - t
        (tmp / "part.arrow").unlink()
        return dt / k, entry

    try:
        for c in comps:
            enc = RowEncoder(*parse_compression(c))
            t0 = time.perf_counter()
            encoded = [(i, arr.shape, *enc.encode(arr)) for i, arr in enumerate(arrays)]
            t_enc = time.perf_counter() - t0
            time.sleep(pause_s)
            t_write, entry = write_part(enc, encoded)
            time.sleep(pause_s)
            t_big, _ = write_part(enc, encoded, write_chunk=BATCH_BYTES + (1 << 20))
            t_big_again, _ = write_part(enc, encoded, write_chunk=BATCH_BYTES + (1 << 20))
            out[c] = {"encode_ms": t_enc / k, "part_write_ms": t_write, "part_write_one_per_batch_ms": t_big,
                      "part_write_one_per_batch_again_ms": t_big_again, "part_mib": entry["bytes"] / 2**20}
            out[c]["total_ms"] = out["pack_ms"] + out[c]["encode_ms"] + out[c]["part_write_ms"]
        fast = {}
        for lvl in fast_levels:
            cz = zstandard.ZstdCompressor(level=lvl, write_checksum=True)
            dz = zstandard.ZstdDecompressor()
            t0 = time.perf_counter()
            frames = [cz.compress(a) for a in arrays]
            t1 = time.perf_counter()
            for f in frames:
                dz.decompress(f)
            t2 = time.perf_counter()
            fast[str(lvl)] = {"encode_ms": (t1 - t0) / k, "decode_ms": (t2 - t1) / k,
                              "ratio": sum(len(f) for f in frames) / raw}
        out["zstd_fast_levels"] = fast
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def persistent_check(p, a, root: Path, compression: str, n: int) -> dict:
    """Two epochs of one loader with persistent workers (the pipeline's default), as a training
    loop runs them: does epoch 2 read the cache filled by epoch 1?"""
    from feedgpu import DataLoader

    wait_quiet(a.quiet_wait)
    loader = DataLoader(p, batch_size=a.batch_size, num_workers=a.workers, persistent_workers=True,
                        drop_last=False, cache={"dir": str(root), "compression": compression})
    out = {"compression": compression, "epochs": []}
    prev = {}
    for e in range(2):
        t0 = time.perf_counter()
        k = sum(len(b.labels) for b in loader)
        dt = time.perf_counter() - t0
        st = loader.stats()
        stage = {key: round((v - prev.get(key, 0.0)) / k * 1e3, 4) for key, v in st["stage_s"].items()}
        prev = dict(st["stage_s"])
        out["epochs"].append({"epoch": e + 1, "samples": k, "seconds": round(dt, 3), "samples_per_s": k / dt,
                              "cached_after": st["cache"]["cached"], "stage_ms_per_sample": stage})
    loader.shutdown()
    from feedgpu.cache import entries

    es = entries(root)
    out["rows_stored_after_shutdown"] = es[0]["rows"] if es else 0
    out["samples"] = n
    return out


def _mmm(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# -- the report --------------------------------------------------------------------------------------
def _f(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _label(name: str) -> str:
    if name == "no_cache":
        return "epoch 1 from JPEG (`cache=False`)"
    if name == "no_cache_steady":
        return "steady: epoch 2 from JPEG, persistent workers"
    kind, _, c = name.partition(":")
    return {"fill": f"epoch 1 filling `{c}`", "read": f"epoch 2 from `{c}`",
            "read_steady": f"steady: epoch 2 from `{c}`, persistent workers"}[kind]


def markdown(doc: dict) -> str:
    m, d, s, su, pc = doc["machine"], doc["data"], doc["settings"], doc["summary"], doc["per_compression"]
    t = doc["targets"]
    comps = s["compressions"]
    mib = 2**20
    lines = ["# Cache benchmark: epoch 1 from JPEG files vs epoch 2 from the local cache", "",
             f"Recorded {doc['created']} with `{doc['command'].strip()}` ({doc['total_seconds']:.0f} s). "
             "Raw numbers, every run: `cache_epochs.json`.", ""]
    ok = [c for c in comps if pc[c]["meets_read_target"] and pc[c]["meets_write_target"]]
    for c in comps:
        x = pc[c]
        steady = (f"; with persistent workers, a training run's epoch 2 from the cache / its epoch 1 from JPEG "
                  f"{x['epoch2_steady_over_epoch1']:.2f}×, steady epoch / steady epoch {x['read_speedup_steady']:.2f}×"
                  if x.get("read_speedup_steady") else "")
        lines.append(f"- `{c}`: epoch 2 / epoch 1 **{x['read_speedup']:.2f}×** (target ≥ {t['read_speedup_min']:.0f}×: "
                     f"{'met' if x['meets_read_target'] else 'not met'}{steady}), write cost **{x['write_cost'] * 100:+.0f} %** "
                     f"(target ≤ {t['write_cost_max'] * 100:.0f} %: {'met' if x['meets_write_target'] else 'not met'}), "
                     f"{x['cache_bytes'] / mib:.0f} MiB on disk ({x['cache_over_jpeg']:.2f}× the JPEGs)")
    lines += ["", "Meets both targets: " + (", ".join(f"`{c}`" for c in ok) if ok else "**none**") + ".", ""]
    lines += ["## Setup", "",
              f"- Machine: {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB RAM, {m['platform']}; "
              f"Python {m['python']}, torch {m['torch']}, PIL: {m['pil_label']}.",
              f"- Data: {d['images']} ImageNet-like JPEGs (`feedgpu.sample_data.build_imagenet_like` from "
              f"`../shared/data/photos`; `{d['path']}`): {_f(d['jpeg_bytes_total'] and d['jpeg_bytes_total'] / mib, '.1f')} MiB, "
              f"mean {_f(d['mean_bytes'] and d['mean_bytes'] / 1024, '.1f')} KB, {d['mean_width']}×{d['mean_height']} px "
              f"({d['mean_megapixels']} MP).",
              f"- Pipeline: `{s['pipeline']}`: {' → '.join(s['stages'])}; cached prefix: {' → '.join(s['cached_prefix'])} "
              "(uint8 HWC, short side 256); random resized crop 224 + flip"
              + (" run every epoch; batches are uint8 NHWC (normalize runs on the GPU in training)."
                 if s.get("dtype") == "uint8" else " + normalize to float32 NCHW run every epoch."),
              f"- Loader: {s['workers']} workers, batch {s['batch_size']}, prefetch {s['prefetch_factor']}, shuffle, "
              f"drop_last=False ({s['batches_per_epoch']} batches per epoch, the last one partial), output on the CPU. "
              "Cache parts of 64 MiB: rows copied into a reused ~8 MiB buffer, streamed to a temporary file as record "
              "batches in writes of at most 256 KiB, xxh3-64 per row (of its stored bytes) and over the small columns, "
              "the part's checksum from those and the keys (nothing read back), renamed (no fsync: row and meta "
              "checksums catch a torn part), then listed in the manifest.",
              f"- Rounds: one unrecorded warm-up run each of `no_cache` and a fill, then {s['rounds']} rounds. Each round: "
              "`no_cache`, then per compression (order rotated per round) `fill` → `read`. Every fill starts from an empty "
              "cache directory; every read is a new loader on the cache the fill just wrote (in the page cache). These "
              "runs use a new loader with non-persistent workers each: each run is that loader's first epoch. Medians "
              "over rounds.",
              "- *steady* runs: one loader with persistent workers runs an unmeasured epoch, then the measured one (its "
              "workers have already touched the shared batch buffers, ~0.3 ms of page faults per float32 sample in a "
              "new worker, and opened the cache). It is what epochs 2, 3, ... of a training run cost — for the cache once "
              "epoch 1 of the same loader fills it, which it does not do today with persistent workers (see below), so "
              "the steady cache runs read a cache filled by an earlier loader.",
              f"- samples/s: from the first batch to the last ({s['timed_batches']} batches; worker start-up and the "
              "first batch excluded); the fill's last parts are written when its workers exit, inside the last batch's "
              "wait. *incl. start-up*: the whole epoch from `iter(loader)` until the workers have exited.",
              f"- Runs during which other processes used more than {s['max_others_percent']:.0f} % of a core were "
              f"repeated (up to {s['retries']} times; {len(doc['disturbed_runs_repeated'])} repeated, kept in the JSON).", ""]
    lines += ["## Results (medians over rounds)", "",
              "| run | samples/s (min–max) | samples/s incl. start-up | epoch wall s | 1st batch s | CPU % "
              "| USS / worker MB | RSS peak / worker MB |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, x in su.items():
        lines.append(f"| {_label(name)} | **{x['samples_per_s']:.0f}** "
                     f"({x['samples_per_s_min']:.0f}–{x['samples_per_s_max']:.0f}) | "
                     f"{_f(x['samples_per_s_with_startup'], '.0f')} | {_f(x['epoch_wall_s'], '.2f')} | "
                     f"{x['first_batch_s']:.2f} | {x['cpu_percent']:.0f} | {x['uss_mb_per_worker']:.0f} | "
                     f"{x['rss_peak_mb_per_worker']:.0f} |")
    lines += ["", "| compression | epoch 2 / epoch 1 | per round median (min–max) | incl. start-up | steady epoch 2 / epoch 1 "
              "| steady / steady | write cost | per round median (min–max) | incl. start-up | on disk MiB | KB / image "
              "| × JPEG size | parts |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in comps:
        x = pc[c]
        rr, wr = x["read_speedup_per_round"], x["write_cost_per_round"]
        lines.append(f"| `{c}` | **{x['read_speedup']:.2f}×** | {rr['median']:.2f}× ({rr['min']:.2f}–{rr['max']:.2f}) | "
                     f"{x['read_speedup_with_startup']:.2f}× | {_f(x.get('epoch2_steady_over_epoch1'), '.2f')}× | "
                     f"{_f(x.get('read_speedup_steady'), '.2f')}× | "
                     f"**{x['write_cost'] * 100:+.0f} %** | "
                     f"{wr['median'] * 100:+.0f} % ({wr['min'] * 100:+.0f} – {wr['max'] * 100:+.0f}) | "
                     f"{x['write_cost_with_startup'] * 100:+.0f} % | {x['cache_bytes'] / mib:.1f} | "
                     f"{x['cache_bytes_per_image'] / 1024:.1f} | {_f(x['cache_over_jpeg'], '.2f')} | {x['cache_parts']} |")
    lines += ["", "*epoch 2 / epoch 1*: `read` ÷ `no_cache`, both a new loader's first epoch (the target's measure). "
              "*steady epoch 2 / epoch 1*: `read_steady` ÷ `no_cache`, i.e. a training run with persistent workers, "
              "its epoch 2 from the cache over its epoch 1 from JPEG. *steady / steady*: `read_steady` ÷ "
              "`no_cache_steady`, epochs 2+ with the cache over epochs 2+ without it.", "",
              "Write cost = (time of the filling epoch ÷ time of the uncached epoch) − 1, from samples/s. "
              "On disk: the whole entry (parts, manifest, lock, last_used) after the fill.", ""]
    stages = list(dict.fromkeys(k for x in su.values() for k in x["stage_ms_per_sample"]))
    lines += ["## Where the time goes", "",
              "ms per sample in the workers (`loader.stats()[\"stage_s\"]` ÷ samples; summed over the 2 workers, so "
              "2 workers deliver about 2000 ÷ sum samples/s), median over rounds:", "",
              "| run | " + " | ".join(stages) + " | sum |", "| --- |" + " ---: |" * (len(stages) + 1)]
    for name, x in su.items():
        sp = x["stage_ms_per_sample"]
        cells = " | ".join(f"{sp.get(k, 0.0):.3f}" for k in stages)
        lines.append(f"| {_label(name)} | {cells} | {sum(sp.values()):.3f} |")
    lines += ["", "`read`: the encoded file; `cache`: when reading, the cached row (zstd decompression, or the xxh3-64 "
              "check of the raw row) as a PIL image; when filling, the resized image packed to bytes, encoded (zstd, or "
              "xxh3-64 of the raw row), copied into the batch buffer, every ~8 MiB a record batch written to the part "
              "file (pieces of at most 256 KiB) and every 64 MiB the part closed (its checksum from the rows' checks and "
              "keys, rename, manifest update); `write`: the crop's "
              "output packed into the shared batch buffer"
              + (" (uint8 NHWC)." if s.get("dtype") == "uint8" else " and normalized to float32 NCHW.") + "", ""]
    pw = doc.get("persistent_workers_check")
    if pw:
        e1, e2 = pw["epochs"]
        lines += ["## One loader, two epochs, persistent workers (the pipeline default)", "",
                  f"`DataLoader(p, persistent_workers=True, cache={{'compression': '{pw['compression']}', ...}})` on an empty "
                  f"cache, two epochs in a row, as a training loop runs them: epoch 1 {e1['samples_per_s']:.0f} samples/s, "
                  f"cached after it: {e1['cached_after']} of {pw['samples']}; epoch 2 {e2['samples_per_s']:.0f} samples/s, "
                  f"decode {e2['stage_ms_per_sample'].get('decode', 0):.2f} ms/sample (every sample decoded would be "
                  f"{su['no_cache']['stage_ms_per_sample'].get('decode', 0):.2f}), cached after it: {e2['cached_after']}; "
                  f"rows stored after shutdown: {pw['rows_stored_after_shutdown']} for {pw['samples']} samples. "
                  + ("Each worker closes its part when its first task of the next epoch arrives, so epoch 2 reads what "
                     "epoch 1 cached and nothing is stored twice."
                     if e1["cached_after"] == pw["samples"] and pw["rows_stored_after_shutdown"] == pw["samples"]
                     else "Not everything epoch 1 computed was readable in epoch 2, or some rows were stored twice."), ""]
    fp = doc.get("fill_profile")
    if fp:
        lines += ["## What filling costs (one process, no loader)", "",
                  f"The prefix output of the first {fp['rows']} images ({fp['raw_mib']:.0f} MiB of pixels), packed to "
                  "RGB bytes, encoded, assembled into one part and written as the cache does it; ms per sample:", "",
                  "| compression | pack the image to RGB bytes | encode row (zstd, or xxh3 of the stored row) | copy + "
                  "write the part (≤ 256 KiB per write) + rename | total | the same part, one write() per ~8 MiB batch "
                  "| the same, again at once | part MiB |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for c in comps:
            x = fp[c]
            lines.append(f"| `{c}` | {fp['pack_ms']:.3f} | {x['encode_ms']:.3f} | {x['part_write_ms']:.3f} | "
                         f"**{x['total_ms']:.3f}** | {x['part_write_one_per_batch_ms']:.3f} | "
                         f"{x['part_write_one_per_batch_again_ms']:.3f} | {x['part_mib']:.1f} |")
        lines += ["", "The part is written three times, each after deleting the one before: as the cache does it and "
                  "with one write() per record batch buffer (how parts were written before format 3), each after a "
                  f"{fp.get('pause_s', 6):.0f} s pause, and the latter *again at once*, into pages the kernel has just freed. Writes of 2 MiB or "
                  "more get 2 MiB page-cache folios, taken from free blocks of 2 MiB and more: the ones this VM's "
                  "balloon driver reports to the host (free page reporting) once they have been free for a moment, "
                  "so each 4 KiB of them costs a host fault when first written. Writes of at most 256 KiB get folios "
                  "of at most 256 KiB, taken from smaller free blocks, which the guest never reports "
                  "(`feedgpu/cache/sink.py`)."]
        fast = fp.get("zstd_fast_levels") or {}
        if fast:
            lines += ["", "zstd's fast (negative) levels on the same rows, one process (not offered as settings): "
                      + "; ".join(f"level {lv}: {v['ratio']:.2f} of the raw bytes, encode {v['encode_ms']:.3f} ms, "
                                  f"decode {v['decode_ms']:.3f} ms per row" for lv, v in fast.items()) + "."]
        lines.append("")
    lines += analysis(doc)
    others = max(x["others_cpu_percent"] for x in su.values())
    lines += ["## Noise", "",
              f"Other processes used up to {others:.0f} % of a core (median over a kind's runs, worst kind) during "
              "the timed windows (`others_cpu_percent`, `steal_percent` per run in the JSON). A shared 2-core VM "
              "varies ±10–15 % run to run; read the min–max and per-round columns.", ""]
    return "\n".join(lines)


def analysis(doc: dict) -> list[str]:
    """Epoch 2 and the filling epoch, ms per sample, against the targets' budgets (figures; what
    they mean for the default compression is written by hand under "Conclusions")."""
    su, t, pc = doc["summary"], doc["targets"], doc["per_compression"]
    comps = doc["settings"]["compressions"]
    base = su["no_cache"]["stage_ms_per_sample"]
    base_sum = sum(base.values())
    budget_read = base_sum / t["read_speedup_min"]
    budget_write = base_sum * t["write_cost_max"]
    lines = ["## Against the targets", "",
             f"Epoch 1 from JPEG costs {base_sum:.2f} ms of worker time per sample (decode {base.get('decode', 0):.2f}, "
             f"resize {base.get('resize', 0):.2f}, crop {base.get('random_resized_crop', 0):.2f}, flip "
             f"{base.get('horizontal_flip', 0):.2f}, write {base.get('write', 0):.2f}). A 4× epoch 2 has "
             f"{budget_read:.2f} ms per sample; a ≤ {t['write_cost_max'] * 100:.0f} % write cost leaves "
             f"{budget_write:.2f} ms per sample for caching.", ""]
    rows = []
    for c in comps:
        for name in (f"read:{c}", f"read_steady:{c}"):
            if name in su:
                sp = su[name]["stage_ms_per_sample"]
                rows.append(f"- `{name}`: {sum(sp.values()):.2f} ms = cache read {sp.get('cache', 0):.2f} + crop "
                            f"{sp.get('random_resized_crop', 0):.2f} + flip {sp.get('horizontal_flip', 0):.2f} + write "
                            f"{sp.get('write', 0):.2f} (budget {budget_read:.2f}).")
    lines += ["Epoch 2, ms per sample:", ""] + rows + [""]
    rows = []
    for c in comps:
        sp = su[f"fill:{c}"]["stage_ms_per_sample"]
        rows.append(f"- `fill:{c}`: {sum(sp.values()) - base_sum:+.2f} ms over the uncached epoch, of which the `cache` "
                    f"stage {sp.get('cache', 0):.2f} (budget {budget_write:.2f}); measured write cost "
                    f"{pc[c]['write_cost'] * 100:+.0f} %.")
    lines += ["Filling, ms per sample:", ""] + rows + [""]

    return lines


if __name__ == "__main__":
    sys.exit(main())
