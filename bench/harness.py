"""What the recorded benchmarks share: the machine a run is on, waiting for a quiet machine,
alternating rounds, medians and ratios, markdown tables, results files, and the protocol of the
long-lived child processes that measure one loader each (with stock Pillow on the path when asked).

Run the benchmarks from the repository root as modules (``python -m bench.cpu_loader``), so this
checkout's ``feedgpu`` and ``bench`` are the ones imported. The measurement of one loader run is
:mod:`feedgpu.bench.measure` (what ``feedgpu bench`` reports).

Results files hold figures (machine, data, settings, tables, every run); conclusions are written
by hand, next to them (``bench/results/*.md``, under "Conclusions", kept when a script rewrites
the file: :func:`write_results`).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from feedgpu.bench.machine import cpu_model, machine_info

__all__ = ["CONCLUSIONS", "Child", "REPO", "RESULTS", "RESULT_MARK", "STOCK_DIR", "STOCK_REQ", "alternating",
           "busy_seconds", "check_pil", "cpu_model", "ensure_stock_pillow", "git_commit", "machine",
           "md_table", "others_busy", "pil_env", "ratio", "reply", "serve", "spread", "wait_quiet", "write_markdown",
           "write_results"]

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
STOCK_DIR = REPO / "bench" / ".pillow-stock"
STOCK_REQ = "pillow==12.*"
RESULT_MARK = "@@result "
#: The heading under which a results markdown file holds its hand-written conclusions.
CONCLUSIONS = "## Conclusions"


# -- the machine ---------------------------------------------------------------------------------
def machine(**extra) -> dict:
    """:func:`feedgpu.bench.machine.machine_info` (CPUs, memory, OS, Python, torch, PIL build),
    the load average at the time, and ``extra``."""
    info = machine_info()
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not Unix
        pass
    return {**info, **extra}


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (user, nice, system, irq, softirq, steal)."""
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def others_busy(seconds: float = 0.5) -> float:
    """CPU used by every process on the machine over ``seconds``, in percent of one core."""
    a = busy_seconds()
    time.sleep(seconds)
    return (busy_seconds() - a) / seconds * 100


def wait_quiet(limit_s: float, max_busy: float = 15.0) -> float:
    """Wait (up to ``limit_s``) until the machine uses < ``max_busy`` % of a core over half a
    second (the loader processes are idle between runs); returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        busy = others_busy(0.5)
        waited = time.perf_counter() - t0
        if busy < max_busy or waited >= limit_s:
            return round(waited, 1)


# -- rounds and their figures --------------------------------------------------------------------
def alternating(names: Sequence[str], rounds: int, rotate: bool = False) -> list[tuple[int, str]]:
    """``(round, name)`` pairs, every name once per round, rounds numbered from 1: the same order
    each round, or with ``rotate`` the order shifted by one each round (so no name always runs
    first, after the same neighbour)."""
    out = []
    for r in range(rounds):
        shift = r % len(names) if rotate and names else 0
        out += [(r + 1, n) for n in list(names[shift:]) + list(names[:shift])]
    return out


def spread(values: Iterable[float], digits: int | None = None) -> dict:
    """``{"median", "min", "max"}`` of ``values`` (rounded to ``digits`` when given)."""
    vals = list(values)
    out = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return {k: round(v, digits) for k, v in out.items()} if digits is not None else out


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def md_table(header: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> list[str]:
    """A markdown table: ``align`` per column, ``l`` or ``r`` (default: the first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    out = ["| " + " | ".join(map(str, header)) + " |",
           "|" + "|".join(" --- " if a == "l" else " ---: " for a in align) + "|"]
    out += ["| " + " | ".join("-" if v is None else str(v) for v in row) + " |" for row in rows]
    return out


# -- results files -------------------------------------------------------------------------------
def write_results(out_dir: str | Path, name: str, doc: dict, markdown: Callable[[dict], str]) -> Path:
    """Write ``out_dir/name.json`` (``doc``) and ``out_dir/name.md`` (``markdown(doc)``: figures),
    keeping the hand-written section from :data:`CONCLUSIONS` to the end of an existing
    ``name.md``; print the markdown. Returns ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = out / f"{name}.md"
    text = write_markdown(md, markdown(doc))
    print(text)
    print(f"wrote {out / (name + '.json')} and {md} ({doc.get('total_seconds', 0):.0f} s)", file=sys.stderr)
    return out


def write_markdown(path: Path, figures: str) -> str:
    """Write ``figures`` (a script's markdown) to ``path``, followed by the hand-written section of
    the file already there (from :data:`CONCLUSIONS` to its end), if any; returns what was written."""
    old = path.read_text() if path.exists() else ""
    text = figures.rstrip("\n") + "\n"
    if CONCLUSIONS in old:
        text += "\n" + old[old.index(CONCLUSIONS):].rstrip("\n") + "\n"
    path.write_text(text)
    return text


# -- child processes: one loader each, in a fresh interpreter ------------------------------------
def pil_env(stock: bool) -> dict:
    """This process's environment with ``bench/.pillow-stock`` first on ``PYTHONPATH`` (``stock``)
    or off it."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != STOCK_DIR.resolve()]
    if stock:
        parts.insert(0, str(STOCK_DIR))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def check_pil(stock: bool) -> None:
    """Exit unless the PIL imported here is stock Pillow from ``bench/.pillow-stock`` (``stock``)
    or Pillow-SIMD."""
    import PIL

    from feedgpu.imaging import pil_build

    where = Path(PIL.__file__).resolve()
    if stock:
        if ".post" in PIL.__version__ or STOCK_DIR.resolve() not in where.parents:
            sys.exit(f"expected stock Pillow from {STOCK_DIR}, got PIL {PIL.__version__} from {where}")
    elif not pil_build()["simd"]:
        sys.exit(f"expected Pillow-SIMD in this environment, got PIL {PIL.__version__} from {where}; "
                 "reinstall pillow-simd (scripts/setup.sh)")


def ensure_stock_pillow() -> str:
    """Install stock Pillow into ``bench/.pillow-stock`` once (the venv keeps Pillow-SIMD); return
    its version."""
    if not (STOCK_DIR / "PIL" / "__init__.py").exists():
        print(f"installing stock {STOCK_REQ} into {STOCK_DIR} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                        str(STOCK_DIR), STOCK_REQ], check=True)
    out = subprocess.run([sys.executable, "-c", "import PIL; print(PIL.__version__)"], env=pil_env(True),
                         capture_output=True, text=True, check=True, cwd=REPO)
    version = out.stdout.strip()
    if ".post" in version:
        sys.exit(f"{STOCK_DIR} holds PIL {version}, not stock Pillow; delete the folder and rerun")
    return version


def reply(result: dict) -> None:
    """In a child: send one result line to the parent."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def serve(ready: dict, answer: Callable[[dict], dict]) -> None:
    """In a child: :func:`reply` ``ready``, then answer each JSON command read from stdin with one
    reply of ``answer(command)``, until ``{"mode": "exit"}`` or the end of stdin."""
    reply(ready)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("mode") == "exit":
            return
        reply(answer(cmd))


class Child:
    """A long-lived benchmark process for one loader: ``python -m MODULE --serve BASE`` (stock
    Pillow first on its path when ``base["stock"]``, then the folders of ``path``), which answers one JSON command per stdin
    line with one :func:`reply` line; its first reply says it is ready (:attr:`info`)."""

    def __init__(self, name: str, base: dict, module: str, path: Sequence[str | Path] = ()):
        self.name = name
        env = pil_env(base["stock"])
        if path:   # folders put first on the child's PYTHONPATH (a benchmark-only install)
            env["PYTHONPATH"] = os.pathsep.join([*map(str, path), *filter(None, [env["PYTHONPATH"]])])
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--serve", json.dumps(base)],
                                     env=env, cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT_MARK):
                return json.loads(line[len(RESULT_MARK):])
        code = self.proc.wait()
        sys.exit(f"benchmark process for {self.name} ended (exit code {code}); see the messages above")

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"mode": "exit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def git_commit() -> str:
    """This checkout's short commit hash, or "?"."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=REPO).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"
