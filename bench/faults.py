"""Inject faults into real training loops and count the samples lost and repeated.

    .venv/bin/python -m bench.faults                  # ~1 min on the 2-core dev machine
    .venv/bin/python -m bench.faults --samples 2000

Each fault runs in fresh processes (``--child NAME``). A sample's label is its index, so the
delivered labels are compared, as multisets, with the epoch's expected order
(``ShardedOrder(...).shard(epoch)``): ``lost`` = expected samples never delivered, ``repeated``
= deliveries beyond the expected count. Where the loader raises, the run is then resumed the
way a user can today (``load_state_dict(state_dict())`` in a new loader) and the counts cover
the whole epoch, both parts together. Results: ``bench/results/faults.{json,md}``.

Measures whatever the current behaviour is: it is meant to be re-run after changes to the worker
pool (e.g. worker replacement after SIGKILL).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.harness import REPO, RESULTS, git_commit, machine, write_results  # noqa: E402

import torch.utils.data as tud  # noqa: E402


MARK = "FAULTS-RESULT "
BS, SEED, SIZE = 32, 11, 32


# -- data ---------------------------------------------------------------------------------------
def _jpegs(k: int = 8, size: tuple[int, int] = (SIZE, SIZE)) -> list[bytes]:
    from PIL import Image, ImageOps

    photos = sorted((REPO.parent / "shared" / "data" / "photos").glob("*.jpg"))[:k]
    out = []
    for p in photos:
        buf = io.BytesIO()
        ImageOps.fit(Image.open(p).convert("RGB"), size).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


class Tiny(tud.Dataset):
    """``n`` tiny JPEGs, label = index; ``bad`` indices hold an HTML page; ``odd`` indices a
    33 x 32 image (the stuck stage stalls on it)."""

    def __init__(self, n: int, bad=(), odd=()):
        self.n, self.bad, self.odd = n, set(bad), set(odd)
        self.good = _jpegs()
        self.wide = _jpegs(1, (SIZE + 1, SIZE))[0]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            return b"<html>502 Bad Gateway</html>", i
        return (self.wide if i in self.odd else self.good[i % len(self.good)]), i


STALL = {"on": True}


def stall(img):
    """A user stage that hangs on one sample (a stuck network read, a deadlock ...)."""
    if STALL["on"] and img.size == (SIZE + 1, SIZE):
        time.sleep(3600)
    return img


def pipeline(ds, workers: int, extra=(), **kw):
    from feedgpu import Pipeline
    from feedgpu.stages import Decode, ResizeCenterCrop

    return Pipeline(ds, [Decode(), *extra, ResizeCenterCrop(SIZE, SIZE)], batch_size=BS, shuffle=True, seed=SEED,
                    num_workers=workers, device="cpu", **kw)


def expected(n: int, epoch: int = 0) -> list[int]:
    from feedgpu.order.sharded import ShardedOrder

    return ShardedOrder(n, BS, shuffle=True, seed=SEED).shard(epoch).tolist()


def tally(exp: list[int], got: list[int], bad=()) -> dict:
    e, g = Counter(exp), Counter(got)
    missing = e - g
    bad_missing = sum(c for i, c in missing.items() if i in set(bad))
    return {"delivered": len(got), "expected": len(exp), "lost": sum(missing.values()) - bad_missing,
            "bad_skipped": bad_missing, "repeated": sum((g - e).values())}


def _quiet():
    import warnings

    from feedgpu import SkippedSampleWarning

    warnings.simplefilter("ignore", SkippedSampleWarning)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _resume_rest(make_loader, state: dict) -> list[int]:
    loader = make_loader()
    loader.load_state_dict(state)
    got = [int(v) for b in loader for v in b.labels]
    loader.shutdown()
    return got


# -- faults (children) --------------------------------------------------------------------------
def f_sigkill_worker(a) -> dict:
    from feedgpu import DataLoader

    ds = Tiny(a.samples)
    make = lambda: DataLoader(pipeline(ds, 2), timeout=60)  # noqa: E731
    loader = make()
    got, outcome, t0, t_err = [], "completed the epoch", time.perf_counter(), None
    killed = None
    try:
        for b, batch in enumerate(loader):
            got += [int(v) for v in batch.labels]
            if b == 3:
                killed = loader.worker_pids()[0]
                os.kill(killed, signal.SIGKILL)
    except Exception as e:  # noqa: BLE001
        outcome, t_err = f"raised {_err(e)}", time.perf_counter() - t0
    first = tally(expected(a.samples)[:len(got)], got)
    res = {"injected": f"SIGKILL to worker pid {killed} after batch 3 of {len(loader)}",
           "outcome": outcome, "seconds_to_error": t_err, "delivered_before": len(got),
           "prefix_lost": first["lost"], "prefix_repeated": first["repeated"]}
    if t_err is not None:
        rest = _resume_rest(make, loader.state_dict())
        res.update(tally(expected(a.samples), got + rest), recovery="user resumes from loader.state_dict() "
                   "in a new loader")
    else:
        res.update(tally(expected(a.samples), got), recovery="none needed")
    loader.shutdown()
    return res


def f_stuck_stage(a) -> dict:
    from feedgpu import DataLoader
    from feedgpu.stages import PythonStage

    ds = Tiny(a.samples, odd={a.samples // 2})
    make = lambda: DataLoader(pipeline(ds, 2, extra=[PythonStage(stall, name="stall")]), timeout=5)  # noqa: E731
    loader = make()
    got, outcome, t0, t_err = [], "completed the epoch", time.perf_counter(), None
    try:
        for batch in loader:
            got += [int(v) for v in batch.labels]
    except Exception as e:  # noqa: BLE001
        outcome, t_err = f"raised {_err(e)}", time.perf_counter() - t0
    res = {"injected": f"a python stage sleeps forever on sample {a.samples // 2}; timeout=5",
           "outcome": outcome, "seconds_to_error": t_err, "delivered_before": len(got),
           "error_names_stage": "stall" in outcome}
    STALL["on"] = False  # the user fixes the stage, then resumes
    rest = _resume_rest(make, loader.state_dict()) if t_err is not None else []
    res.update(tally(expected(a.samples), got + rest),
               recovery="stage fixed, resumed from loader.state_dict()" if t_err is not None else "none needed")
    loader.shutdown()
    return res


def _corrupt(a, k: int) -> dict:
    from feedgpu import DataLoader

    _quiet()
    step = a.samples // k
    bad = {i * step + 7 for i in range(k)}
    loader = DataLoader(pipeline(Tiny(a.samples, bad=bad), 2), timeout=60)
    got, outcome = [], "completed the epoch"
    try:
        for batch in loader:
            got += [int(v) for v in batch.labels]
    except Exception as e:  # noqa: BLE001
        outcome = f"raised {_err(e)}"
    s = loader.stats()
    loader.shutdown()
    exp = expected(a.samples)
    t = tally(exp if outcome.startswith("completed") else exp[:len(got)], got, bad)
    return {"injected": f"{k} of {a.samples} samples are HTML pages ({100 * k / a.samples:.1f} %, "
                        f"budget max_skipped=0.01)", "outcome": outcome, "skipped": s["skipped"], **t,
            "note": "repeated = spare samples refilling the skipped rows (batches keep their size, by design)"
            if outcome.startswith("completed") else "counts over the batches delivered before the error"}


def f_corrupt_under_budget(a) -> dict:
    return _corrupt(a, max(1, a.samples // 200))   # 0.5 %


def f_corrupt_over_budget(a) -> dict:
    return _corrupt(a, max(2, a.samples // 50))    # 2 %


def f_sigterm_a(a) -> dict:
    """Train until SIGTERM; on it, save the loader state and the labels seen, then exit."""
    from feedgpu import DataLoader

    flag = {"term": False}
    signal.signal(signal.SIGTERM, lambda *_: flag.update(term=True))
    loader = DataLoader(pipeline(Tiny(a.samples), 2), timeout=60)
    got = []
    for b, batch in enumerate(loader):
        got += [int(v) for v in batch.labels]
        Path(a.work, "progress").write_text(str(b + 1))
        time.sleep(0.05)  # the training step
        if flag["term"]:
            break
    state = loader.state_dict()
    loader.shutdown()
    Path(a.work, "state.json").write_text(json.dumps({"state": state, "got": got}))
    return {"batches": len(got) // BS, "terminated": flag["term"]}


def f_sigterm_b(a) -> dict:
    from feedgpu import DataLoader

    saved = json.loads(Path(a.work, "state.json").read_text())
    make = lambda: DataLoader(pipeline(Tiny(a.samples), 2), timeout=60)  # noqa: E731
    rest = _resume_rest(make, saved["state"])
    ref = make()
    reference = [int(v) for b in ref for v in b.labels]
    ref.shutdown()
    both = saved["got"] + rest
    return {**tally(expected(a.samples), both), "exact_order": both == reference,
            "before": len(saved["got"]), "after": len(rest)}


def _image_folder(root: Path, n: int) -> Path:
    """``n`` JPEGs, one class folder each (label = index)."""
    if (root / "done").exists():
        return root
    jpegs = _jpegs(8, (64, 64))
    for i in range(n):
        d = root / f"c{i:05d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "img.jpg").write_bytes(jpegs[i % 8])
    (root / "done").write_text("ok")
    return root


def _cache_pipe(a, cache):
    from feedgpu import FolderSource, Pipeline
    from feedgpu.stages import Decode, RandomResizedCrop, Resize

    src = FolderSource(_image_folder(Path(a.work).parent / "folder", a.cache_samples))
    return Pipeline(src, [Decode(), Resize(48), RandomResizedCrop(SIZE)], batch_size=BS, shuffle=True, seed=SEED,
                    num_workers=2, device="cpu", cache=cache, persistent_workers=False)


def CACHE(a) -> dict:
    """Small parts (~100 kB, ~20 rows): parts are closed and listed all through the epoch, so the
    kill lands between and inside part writes."""
    return {"dir": str(Path(a.work) / "cache"), "part_bytes": 100_000}


def f_cache_build(a) -> dict:
    """Fill the cache while training, slowly; the parent kills this process mid-epoch."""
    from feedgpu import DataLoader

    loader = DataLoader(_cache_pipe(a, CACHE(a)), timeout=60)
    for b, _ in enumerate(loader):
        Path(a.work, "progress").write_text(str(b + 1))
        time.sleep(0.1)
    return {"finished": True}


def f_cache_check(a) -> dict:
    import torch

    from feedgpu import DataLoader
    from feedgpu.cache import verify

    root = Path(a.work) / "cache"
    entries = [p for p in root.iterdir() if p.is_dir()]
    from feedgpu.cache import manifest as mf

    listed = [e for e in entries if mf.read(e) is not None]
    checks = [verify(e, repair=False) for e in listed]
    before = {"entries": len(entries), "with_manifest": len(listed), "rows_listed": sum(c["rows"] for c in checks),
              "bad_parts": sum(len(c["bad_parts"]) for c in checks),
              "part_files": sum(p.suffix == ".arrow" for e in entries for p in e.iterdir()),
              "temp_files": sorted(p.name for e in entries for p in e.iterdir() if "tmp" in p.name)}
    ref = [(b.images.clone(), b.labels.clone()) for b in DataLoader(_cache_pipe(a, None), timeout=60)]
    loader = DataLoader(_cache_pipe(a, CACHE(a)), timeout=60)
    got = [(b.images.clone(), b.labels.clone()) for b in loader]
    cache = loader.stats()["cache"]
    mismatched = sum(not (torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])) for x, y in zip(ref, got))
    labels = [int(v) for _, y in got for v in y]
    from feedgpu.order.sharded import ShardedOrder

    exp = ShardedOrder(a.cache_samples, BS, shuffle=True, seed=SEED).shard(0).tolist()
    return {**tally(exp, labels), "after_kill": before, "mismatched_batches": mismatched + abs(len(ref) - len(got)),
            "cache_after_rerun": {k: cache[k] for k in ("cached", "samples", "complete")}}


CHILDREN = {f.__name__[2:]: f for f in (f_sigkill_worker, f_stuck_stage, f_corrupt_under_budget, f_corrupt_over_budget,
                                         f_sigterm_a, f_sigterm_b, f_cache_build, f_cache_check)}


# -- parent -------------------------------------------------------------------------------------
def _cmd(name: str, a, work: Path) -> list[str]:
    return [sys.executable, "-m", "bench.faults", "--child", name, "--samples", str(a.samples), "--cache-samples",
            str(a.cache_samples), "--work", str(work)]


def _parse(out: str) -> dict:
    for line in out.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {"outcome": "child gave no result", "tail": out[-400:]}


def run_child(name: str, a, work: Path, timeout: float = 180) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(_cmd(name, a, work), capture_output=True, text=True, timeout=timeout, cwd=REPO)
        res = _parse(p.stdout)
        if p.returncode != 0:
            res.setdefault("stderr_tail", p.stderr[-600:])
    except subprocess.TimeoutExpired:
        res = {"outcome": f"HUNG: no result within {timeout} s"}
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    return res


def _wait_progress(work: Path, proc, batches: int, limit: float = 120) -> int:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            k = int((work / "progress").read_text() or 0)
        except (FileNotFoundError, ValueError):
            k = 0
        if k >= batches:
            return k
        time.sleep(0.02)
    return -1


def run_sigterm(a, work: Path) -> dict:
    proc = subprocess.Popen(_cmd("sigterm_a", a, work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    at = _wait_progress(work, proc, 8)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(120)
    first = _parse(out)
    res = run_child("sigterm_b", a, work)
    return {"injected": f"SIGTERM to the training process after batch {at} (of {-(-a.samples // BS)}); it saves "
                        "loader.state_dict() and exits; a new process loads it and finishes the epoch",
            "outcome": f"saved after {first.get('batches')} batches, exit code {proc.returncode}; resumed, "
                       f"same order as an uninterrupted run: {res.get('exact_order')}", **res}


def run_cache_kill(a, work: Path) -> dict:
    proc = subprocess.Popen(_cmd("cache_build", a, work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    at = _wait_progress(work, proc, 5)
    proc.kill()  # SIGKILL to the training process; its workers see their parent gone and stop
    proc.wait(30)
    time.sleep(1.0)
    res = run_child("cache_check", a, work)
    k = res.get("after_kill", {})
    return {"injected": f"SIGKILL to the training process after batch {at} while it fills the cache "
                        f"({a.cache_samples} JPEGs, 2 workers)",
            "outcome": f"after the kill: {k.get('part_files')} part files, {k.get('rows_listed')} rows listed, "
                       f"{k.get('bad_parts')} bad parts, {len(k.get('temp_files', []))} unfinished temp files; "
                       f"rerun with the cache: {res.get('mismatched_batches')} batches differ from an uncached run",
            **res}


def markdown(doc: dict) -> str:
    m, s = doc["machine"], doc["settings"]
    lines = ["# Faults injected: what happened, samples lost and repeated", "",
             f"Machine: {m['platform']}, {m.get('cpu_count', m.get('nproc', m.get('cpus')))} CPUs, Python {m['python']}, torch {m['torch']}, "
             f"feedgpu {m['feedgpu_commit']}.", "",
             f"Data: {s['samples']} tiny JPEGs ({SIZE} px, from shared/data/photos; label = index) for the loader "
             f"faults, {s['cache_samples']} 64 px JPEGs in a folder for the cache fault. Loader: batch {BS}, "
             f"shuffle, seed {SEED}, 2 worker processes, CPU. Lost/repeated compare the delivered labels with "
             "the epoch's expected order over the whole epoch (after the user's resume where the loader raised). "
             "Targets: 0 lost, 0 repeated.", "",
             "| fault | injected | what happened | delivered / expected | lost | repeated | notes |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in doc["faults"].items():
        note = r.get("recovery") or r.get("note") or ""
        if "bad_skipped" in r and r.get("bad_skipped"):
            note = f"{r['bad_skipped']} bad samples skipped; " + note
        if "error_names_stage" in r:
            note += f"; error names the stage: {r['error_names_stage']}"
        if "exact_order" in r:
            note += f"exact order as uninterrupted: {r['exact_order']}"
        lines.append(f"| {name} | {r.get('injected', '')} | {r.get('outcome', '')} | {r.get('delivered', '?')} / "
                     f"{r.get('expected', '?')} | {r.get('lost', '?')} | {r.get('repeated', '?')} | {note} |")
    lines += ["", "Re-run after changes to the worker pool: `.venv/bin/python -m bench.faults`.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--cache-samples", type=int, default=400)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--child", choices=sorted(CHILDREN))
    ap.add_argument("--work")
    ap.add_argument("--only", nargs="*", help="run only these faults")
    a = ap.parse_args(argv)
    if a.child:
        res = CHILDREN[a.child](a)
        print(MARK + json.dumps(res), flush=True)
        os._exit(0)  # a killed worker's pool must not hold up the exit
    t0 = time.perf_counter()
    faults = {}
    with tempfile.TemporaryDirectory(prefix="feedgpu-faults-") as tmp:
        plan = {"sigkill_worker": lambda w: run_child("sigkill_worker", a, w),
                "stuck_stage": lambda w: run_child("stuck_stage", a, w),
                "corrupt_under_budget": lambda w: run_child("corrupt_under_budget", a, w),
                "corrupt_over_budget": lambda w: run_child("corrupt_over_budget", a, w),
                "sigterm_resume": lambda w: run_sigterm(a, w),
                "cache_build_killed": lambda w: run_cache_kill(a, w)}
        for name, fn in plan.items():
            if a.only and name not in a.only:
                continue
            work = Path(tmp) / name
            work.mkdir()
            print(f"fault {name} ...", file=sys.stderr, flush=True)
            faults[name] = fn(work)
    doc = {"machine": machine(feedgpu_commit=git_commit()), "settings": {"samples": a.samples, "cache_samples": a.cache_samples,
                                              "batch_size": BS, "seed": SEED, "workers": 2},
           "faults": faults, "total_seconds": time.perf_counter() - t0}
    write_results(a.out, "faults", doc, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
