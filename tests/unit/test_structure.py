"""The floor plan of ``feedgpu/`` (STYLE.md): no import cycles, no module over 500 lines, sorted
``__all__`` lists naming what exists (``bench/``'s too), one version source, no measured figures or
tracker references in comments.

The import graph is read from the source (``ast``), not by importing: every ``import`` and
``from ... import`` counts, at module level and inside functions (a function-level import that
closes a cycle still couples the two modules both ways); imports under ``if TYPE_CHECKING:`` do
not (they never run). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module
(a package ``__init__`` importing its submodules), else to ``pkg``'s ``__init__``. Importing
``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` first; those implicit edges are left out,
as every submodule would otherwise be in a cycle with a package that imports it.
"""
from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
import tomllib
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "feedgpu"
MAX_LINES = 500


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` for every ``.py`` file under ``root``."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    edges: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module or ""
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in files else pkg for a in node.names]
            else:
                continue
            for t in targets:
                while t not in files and "." in t:   # import a.b.c where a.b.c is a name in a.b
                    t = t.rsplit(".", 1)[0]
                if t in files and t != mod:
                    edges[mod].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_one_cycle(edges, set(c)) for c in comps]


def _one_cycle(edges: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    start = min(comp)
    paths = {w: [start, w] for w in sorted(edges[start] & comp)}
    queue = list(paths)
    while queue:
        v = queue.pop(0)
        if v == start:
            return paths[v]
        for w in sorted(edges[v] & comp):
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def test_the_graph_finds_a_cycle_closed_inside_a_function_and_a_package_importing_its_module(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .sub import b\ndef f():\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..a import f\n    from .. import a\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n"
                                      "import pkg.sub.b\n")
    (pkg / "d.py").write_text("from . import sub\nfrom pkg import a\n")
    g = import_graph(pkg)
    assert g == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.a"},
                 "pkg.sub.c": {"pkg.sub.b"}, "pkg.d": {"pkg.sub", "pkg.a"}}
    assert cycles(g) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_feedgpu_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in feedgpu/:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_module_is_over_500_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {f: n for f, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by responsibility): {over}"


def modules_with_all() -> list[str]:
    """Modules of ``feedgpu/`` and ``bench/`` that assign ``__all__`` at top level."""
    out = []
    for root in (PACKAGE, REPO / "bench"):
        for p in sorted(root.rglob("*.py")):
            if any(part.startswith(".") or part == "out" for part in p.relative_to(root).parts):
                continue   # bench/.pillow-stock, bench/out: installed or generated, not ours
            tree = ast.parse(p.read_text())
            if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
                   for n in tree.body):
                out.append(module_name(p, root))
    return out


def test_all_lists_are_found():
    found = modules_with_all()
    assert {"feedgpu", "feedgpu.tabular", "feedgpu.bench.measure", "bench.harness"} <= set(found)


@pytest.mark.parametrize("name", modules_with_all())
def test_all_is_sorted_without_duplicates_and_every_name_exists(name):
    mod = importlib.import_module(name)
    names = list(mod.__all__)
    assert names == sorted(names), f"{name}.__all__ is not sorted: {names} (sorted: {sorted(names)})"
    assert len(set(names)) == len(names), f"{name}.__all__ repeats a name"
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ names what {name} lacks: {missing}"


def test_one_version_source():
    import feedgpu
    from feedgpu._version import __version__

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"], "pyproject.toml writes a version"
    dynamic = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "feedgpu._version.__version__"}
    assert feedgpu.__version__ is __version__
    written = [p for p in PACKAGE.rglob("*.py") if p.name != "_version.py"
               and any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in n.targets)
                       for n in ast.walk(ast.parse(p.read_text())))]
    assert not written, f"__version__ assigned outside feedgpu/_version.py: {written}"


#: Measured figures (STYLE.md): a duration in ms/us/ns, an approximate "~N s", a rate "N unit/s",
#: or a speed ratio "Nx faster/slower". Sizes, defaults and bounds ("64 MiB", "every 30 s") are not.
FIGURE = re.compile(r"(?<![\w.])(?:~?\d[\d,]*(?:\.\d+)?\s?(?:ms|us|µs|ns)\b"
                    r"|~\d[\d,]*(?:\.\d+)?\s?s\b"
                    r"|\d[\d,]*(?:\.\d+)?\s?(?:img|samples|rows|batches|MB|GB|MiB|GiB)/s\b"
                    r"|\d+(?:\.\d+)?\s?[x×] (?:faster|slower))")
#: References to an issue tracker users do not see.
TRACKER = re.compile(r"\bissue\s*#?\d+|\bthe issue(?:'s)?\b|\bissues?/\d+", re.IGNORECASE)


def comment_texts(src: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and docstring (attribute docstrings too) of a module."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out += [(stmt.lineno, stmt.value.value) for stmt in node.body
                    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)]
    return out


SAMPLE = '''"""Reads a header (~11 us instead of ~45 us), 581 samples/s, 5x faster."""
X = 1  # pages of ~8 MiB, default 64 MiB, every 30 s, 2 % target; see (the issue above)


def f():
    """Takes 0.348 ms per sample; ~0.3 s to start; a 2-core machine; resnet50 at 224 px."""
    return "12 ms in a string is not a comment"
'''


def test_the_figure_and_tracker_patterns_catch_what_they_are_for():
    texts = comment_texts(SAMPLE)
    assert [m.group(0) for _, t in texts for m in FIGURE.finditer(t)] == [
        "~11 us", "~45 us", "581 samples/s", "5x faster", "0.348 ms", "~0.3 s"]
    assert [m.group(0) for _, t in texts for m in TRACKER.finditer(t)] == ["the issue"]


def test_no_measured_figures_or_tracker_references_in_comments():
    found = []
    for p in sorted(PACKAGE.rglob("*.py")):
        for line, text in comment_texts(p.read_text()):
            for pat in (FIGURE, TRACKER):
                for m in pat.finditer(text):
                    found.append(f"{p.relative_to(REPO)}:{line}: ...{text[max(0, m.start() - 40):m.end() + 20]}...")
    assert not found, ("measured figures or tracker references in comments and docstrings (cite the "
                       "bench/results/ file instead, STYLE.md):\n" + "\n".join(found))


def test_the_library_core_does_not_import_the_bench():
    """``feedgpu.bench`` is the benchmark's package: only the command line imports it."""
    g = import_graph()
    users = sorted(m for m, deps in g.items() if any(d == "feedgpu.bench" or d.startswith("feedgpu.bench.")
                                                    for d in deps)
                   and not (m == "feedgpu.bench" or m.startswith(("feedgpu.bench.", "feedgpu.cli."))))
    assert not users, f"modules outside feedgpu/bench and feedgpu/cli import the bench: {users}"
    assert "feedgpu.bench.runner" in g["feedgpu.cli.bench"], "the bench command runs feedgpu.bench"


def test_no_two_test_files_share_a_name():
    """Test modules are imported by their file name (rootdir, no packages): two tiers holding
    the same name stop the whole suite at collection."""
    seen: dict[str, Path] = {}
    for f in sorted((REPO / "tests").glob("*/test_*.py")):
        assert f.name not in seen, f"{f.relative_to(REPO)} and {seen[f.name].relative_to(REPO)} share a name"
        seen[f.name] = f
    assert len(seen) > 20
