"""How long the ``feedgpu`` command line takes to answer: help, listings and checks, each run as a
user runs it (the console script installed beside this Python, a fresh process every time).

Every round runs every command once, in a rotated order, after ``python -c pass`` (the
interpreter's own start-up, for reference); the table gives each command's median and spread
(min-max) over the rounds, wall time from ``exec`` to exit. The commands run with this checkout
first on ``PYTHONPATH``, so an editable install or a plain checkout measure the same code; with
``--before DIR`` the same commands also run with another checkout first on the path (an older
commit, say), in the same rounds, so the two are measured side by side.

    python -m bench.cli_startup                 # 15 rounds -> bench/results/cli_startup.{json,md}
    python -m bench.cli_startup --before ../main --rounds 5 --out /tmp/x
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import REPO, RESULTS, alternating, git_commit, machine, md_table, spread, wait_quiet, write_results

__all__ = ["COMMANDS", "main", "time_once"]

TRAIN = "pipelines/imagenet_train.yaml"

#: (name, arguments): ``python`` runs the interpreter alone; the rest run the feedgpu console script
COMMANDS = [
    ("python -c pass", None),
    ("feedgpu --help", ["--help"]),
    ("feedgpu stages", ["stages"]),
    ("feedgpu bench --help", ["bench", "--help"]),
    ("feedgpu pipeline validate", ["pipeline", "validate", TRAIN]),
    ("feedgpu pipeline explain", ["pipeline", "explain", TRAIN]),
    ("feedgpu doctor", ["doctor"]),
]


def _argv(args: list[str] | None) -> list[str]:
    if args is None:
        return [sys.executable, "-c", "pass"]
    exe = shutil.which("feedgpu", path=str(Path(sys.executable).parent))
    if exe is None:
        raise SystemExit("the feedgpu console script is not installed beside this Python (scripts/setup.sh)")
    return [exe, *args]


def _env(checkout: Path) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def _commit(checkout: Path) -> str:
    res = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return res.stdout.strip() or "?"


def time_once(argv: list[str], env: dict) -> float:
    """Seconds from starting ``argv`` to its exit (output discarded); raises when it fails."""
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()[-500:]}")
    return dt


def markdown(doc: dict) -> str:
    m = doc["machine"]
    rows = []
    for name, r in doc["results"].items():
        row = [name, f"{r['median']:.3f}", f"{r['min']:.3f}-{r['max']:.3f}"]
        b = doc.get("before", {}).get(name)
        if doc.get("before"):
            row += [f"{b['median']:.3f}", f"{b['min']:.3f}-{b['max']:.3f}"] if b else ["-", "-"]
        rows.append(row)
    header = ["command", "median s", "spread s (min-max)"]
    if doc.get("before"):
        header += [f"before ({doc['before_commit']}) median s", "before spread s"]
    return "\n".join([
        "# feedgpu command line start-up",
        "",
        f"Machine: {m['cpus_usable']} CPUs ({m['cpu_model']}), {m['ram_gb']} GB, Python {m.get('python', '?')}, "
        f"torch {m.get('torch', '?')}, load average at start {doc['load_average_start']}, at the end "
        f"{m.get('load_average')} "
        f"(a machine shared with other work). Commit {doc['commit']}.",
        "",
        f"Settings: {doc['rounds']} rounds, every command once per round (rotated order), a fresh process each "
        "time, wall time from start to exit, output discarded; the console script beside the venv's Python "
        f"with this checkout on `PYTHONPATH`. Pipeline file: `{TRAIN}` (no data path: plans only). "
        "Run: `python -m bench.cli_startup`.",
        "",
        *md_table(header, rows),
        "",
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--before", help="Another checkout to time side by side (same commands, same rounds).")
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="Seconds to wait for a quiet machine first.")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    waited = wait_quiet(a.quiet_wait)
    checkouts = {"": REPO} | ({"before: ": Path(a.before).resolve()} if a.before else {})
    todo = {(tag, n): (_argv(args), _env(path)) for tag, path in checkouts.items() for n, args in COMMANDS
            if not (tag and args is None)}
    names = list(todo)
    for k in names:   # one untimed run each: the page cache holds what they read
        time_once(*todo[k])
    times: dict[tuple, list[float]] = {k: [] for k in names}
    for _, k in alternating(names, a.rounds, rotate=True):
        times[k].append(time_once(*todo[k]))
    doc = {"benchmark": "cli_startup", "commit": git_commit(), "machine": machine(waited_for_quiet_s=waited),
           "load_average_start": load_start, "rounds": a.rounds, "commands": {n: args for n, args in COMMANDS},
           "results": {n: spread(ts, 4) for (tag, n), ts in times.items() if not tag},
           "runs": {n: [round(t, 4) for t in ts] for (tag, n), ts in times.items() if not tag},
           "total_seconds": round(time.perf_counter() - t0, 1)}
    if a.before:
        doc.update(before_checkout=str(checkouts["before: "]), before_commit=_commit(checkouts["before: "]),
                   before={n: spread(ts, 4) for (tag, n), ts in times.items() if tag},
                   before_runs={n: [round(t, 4) for t in ts] for (tag, n), ts in times.items() if tag})
    write_results(a.out, "cli_startup", doc, markdown)


if __name__ == "__main__":
    main()
