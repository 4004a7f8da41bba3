"""The prepared GPU check (../shared/docs/gpu-checks.md): every GPU test and benchmark feedgpu
needs from a GPU machine, in one command, with a short table printed last.

Steps (each in its own process, with a time limit; a failed step is reported and the next runs):

1. ``doctor``: torch, CUDA device, DALI, PIL build.
2. ``gpu tests``: the tests marked ``gpu`` (DALI GPU parity with DALI CPU, the cases set and
   the CPU fallback on the GPU engine).
3. ``data only``: ``feedgpu bench`` on the built-in ImageNet-like sample (``--images``, default
   5,000 as in anchors.md), the Python pool, DALI CPU, DALI GPU and torch DataLoader + Pillow side
   by side in alternating rounds, batches delivered to the GPU.
4. ``resnet50`` / ``resnet18``: ``feedgpu bench --model M --compare-engines`` (model alone,
   loader alone, both; GPU idle share; placement), once with the Python engine and once with the
   DALI GPU engine, as the end-to-end table of anchors.md.
5. ``torchvision``: the ImageNet reference train recipe as a user writes it (``ImageFolder`` +
   ``Compose``), compiled by ``feedgpu.DataLoader`` with ``engine="dali", device="cuda"`` and on the
   Python engine (``bench/torchvision_gpu.py``; skipped, saying so, where torchvision does not import).

Outputs (logs, JSON, plots) go to ``--out``; a step's JSON and plot are removed before it runs,
and the table shows figures only from the steps of this run that succeeded (never a file left
by an earlier run). The tests step counts as failed on a GPU run when no test passed (all
skipped: no CUDA device or no DALI). ``--cpu`` runs every step on the CPU with small
settings (tests skip, DALI GPU left out, a synthetic consumer instead of the models): use it to
try this script on a machine without a GPU before spending GPU time.

On the GPU machine DALI and feedgpu's dependencies are not installed: ``bench/gpu_deps.sh``
prepares feedgpu's runtime dependencies as wheels beside the DALI parts from
``../shared/tools/dali-device-wheels.sh``; install both into one folder on ``PYTHONPATH`` and run
``python3 bench/gpu_check.py --out $OUT/gpu_check`` from the repository root.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _feedgpu(*args: str) -> list[str]:
    """The feedgpu CLI run from this checkout (it need not be installed)."""
    return [sys.executable, "-c", "import sys; from feedgpu.cli.main import main; sys.argv[0] = 'feedgpu'; main()",
            *args]


def steps(a) -> list[tuple[str, list[str], int, list[Path]]]:
    """``(name, command, time limit in s, files it writes)`` of each step."""
    out = Path(a.out)
    device = "cpu" if a.cpu else "cuda"
    engines = ["python", "dali-cpu", "torch"] + ([] if a.cpu else ["dali-gpu"])
    data = ["--images", str(a.images), "--workers", str(a.workers), "--rounds", str(a.rounds),
            "--seconds", str(a.seconds), "--batch-size", str(a.batch_size)]
    todo = [("doctor", _feedgpu("doctor"), 120, []),
            (TESTS, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                     "tests/engines/test_dali.py", "tests/gpu/test_gpu.py", "tests/integration/test_iterable.py",
                     "tests/integration/test_torch_parity.py"], 600, []),
            ("data only", _feedgpu("bench", *data, *sum((["--engine", e] for e in engines), []),
                                   "--device", device, "--json", str(out / "data_only.json")), 900,
             [out / "data_only.json"])]
    todo.append(("torchvision", [sys.executable, "-m", "bench.torchvision_gpu", "--device", device, "--images",
                                 str(a.images), "--batch-size", str(a.batch_size), "--workers", str(a.workers),
                                 "--batches", "3" if a.cpu else "10", "--json", str(out / "torchvision.json")], 600,
                 [out / "torchvision.json"]))
    consumer = ["--consumer-rate", "3000"] if a.cpu else None
    plots = importlib.util.find_spec("matplotlib") is not None   # not on the GPU machine
    for model in (["synthetic"] if a.cpu else ["resnet50", "resnet18"]):
        for engine, sets in (("python", []), ("dali-gpu", ["--set", "engine.name=dali", "--set", "engine.device=gpu"])):
            if a.cpu and engine == "dali-gpu":
                sets = ["--set", "engine.name=dali", "--set", "engine.device=cpu"]
                engine = "dali-cpu"
            name = f"{model} {engine}"
            js, png = out / f"e2e_{model}_{engine}.json", out / f"e2e_{model}_{engine}.png"
            todo.append((name, _feedgpu("bench", *(consumer or ["--model", model]), "--compare-engines",
                                        "--images", str(a.images), "--batch-size", str(a.batch_size),
                                        "--duration", str(a.duration), "--device", device, *sets,
                                        "--json", str(js), *(["--plot", str(png)] if plots else [])), 900,
                         [js, png]))
    return todo


TESTS = "gpu tests"


def tests_passed(last: str) -> bool:
    """True when pytest's summary line (``"3 passed, 2 skipped in 4.1s"``) counts a passed test."""
    return any(part.strip().split(" ")[-1] == "passed" for part in last.split(" in ")[0].split(","))


def run_step(name: str, cmd: list[str], limit: int, out: Path) -> dict:
    log = out / (name.replace(" ", "_") + ".log")
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:   # its output so far (bytes, even with text=True)
        parts = [x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x]
        rc, text = "timeout", "".join(parts)
    log.write_text(text)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return {"step": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "last": lines[-1] if lines else ""}


def summary(out: Path, results: list[dict]) -> list[str]:
    """The table printed last: each step's status, then the figures the JSON files of this run's
    successful steps hold."""
    rows = ["| step | status | s | last line |", "| --- | --- | ---: | --- |"]
    for r in results:
        status = "ok" if r["rc"] == 0 else f"FAILED ({r['rc']})"
        if r.get("all_skipped") and r["rc"] == 0:
            status = "skipped (no test ran)"
        rows.append(f"| {r['step']} | {status} | {r['seconds']} | {r['last'][:100]} |")
    fresh = {Path(f) for r in results if r["rc"] == 0 for f in r.get("outputs", [])}
    d = out / "data_only.json"
    if d in fresh and d.exists():
        doc = json.loads(d.read_text())
        rows += ["", "| data only: loader | samples/s | ms/batch | CPU % |", "| --- | ---: | ---: | ---: |"]
        for x in doc["summary"].values():
            rows.append(f"| {x['label']} | {x['samples_per_s']:.0f} | {x['ms_per_batch']:.1f} | {x['cpu_percent']:.0f} |")
    tv = out / "torchvision.json"
    if tv in fresh and tv.exists():
        x = json.loads(tv.read_text())
        rows += ["", "| torchvision train recipe | samples/s | batches on |", "| --- | ---: | --- |"]
        rows += [f"| {e} | {x[e]['samples_per_s']:.0f} | {x[e]['batch_device']} |" for e in ("dali", "python") if e in x]
        if "skipped" in x:
            rows.append(f"| skipped | - | {x['skipped'][:80]} |")
    e2e = sorted(f for f in out.glob("e2e_*.json") if f in fresh)
    if e2e:
        rows += ["", "| end to end | model alone /s | loader alone /s | both /s | GPU idle | placement |",
                 "| --- | ---: | ---: | ---: | ---: | --- |"]
        for f in e2e:
            x = json.loads(f.read_text())
            rows.append(f"| {f.stem[4:]} | {x['model_alone']['samples_per_s']:.0f} | "
                        f"{x['loader_alone']['samples_per_s']:.0f} | {x['together']['samples_per_s']:.0f} | "
                        f"{100 * x['gpu_idle_fraction']:.1f} % | {x['placement'].get('choice')} |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "gpu_check"), help="folder for logs and JSON")
    ap.add_argument("--cpu", action="store_true", help="try the script without a GPU (small, CPU only)")
    ap.add_argument("--images", type=int, default=None, help="images in the sample (default 5000; --cpu: 300)")
    ap.add_argument("--workers", type=int, default=None, help="workers / DALI threads (default: cores - 1)")
    ap.add_argument("--rounds", type=int, default=None, help="data-only rounds (default 2; --cpu: 1)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 256; --cpu: 32")
    ap.add_argument("--seconds", type=float, default=0.0,
                    help="data only: time each run at least this long (feedgpu bench --seconds; default 0: the rest "
                         "of one epoch, which keeps the check within its device time)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per end-to-end phase (default 15; --cpu: 2)")
    ap.add_argument("--only", action="append", default=[], help="run only steps whose name starts with this")
    a = ap.parse_args(argv)
    small = a.cpu
    a.images = a.images or (300 if small else 5000)
    a.workers = a.workers or max(1, (os.cpu_count() or 2) - 1)
    a.rounds = a.rounds or (1 if small else 2)
    a.batch_size = a.batch_size or (32 if small else 256)
    a.duration = a.duration or (2.0 if small else 15.0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, cmd, limit, outputs in steps(a):
        if a.only and not any(name.startswith(o) for o in a.only):
            continue
        print(f"== {name}: {' '.join(cmd[3:] if cmd[1] == '-c' else cmd)}", flush=True)
        for f in outputs:   # what an earlier run left must not pass for this run's figures
            f.unlink(missing_ok=True)
        r = run_step(name, cmd, limit, out)
        r["outputs"] = [str(f) for f in outputs]
        if name == TESTS and not tests_passed(r["last"]):
            r["all_skipped"] = True
            if r["rc"] == 0 and not a.cpu:   # a GPU run whose GPU tests did not run checked nothing
                r["rc"] = "no test ran"

        print(f"   {r['rc']} in {r['seconds']} s: {r['last']}", flush=True)
        results.append(r)
    table = summary(out, results)
    (out / "summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
