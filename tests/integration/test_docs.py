"""The documentation site builds with warnings as errors, its generated lists are there, and every
Python example of the guides runs.

Each page's ``python`` code blocks run in order, as one script in a fresh interpreter, in a folder
holding ``pipelines/`` (the repository's) and ``sample-data/train`` (a small ImageNet-like folder,
what the getting-started page builds), so an example that rots fails here. A block preceded by
``<!-- docs-test: skip REASON -->`` is not run; each such block is reported as a skipped test
with its reason.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from feedgpu.sample_data import build_imagenet_like

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
#: pages whose code is generated or for contributors, and text not yet folded in
NOT_GUIDES = ("reference/", "design/", "_incoming/", "hooks/")
_BLOCK = re.compile(r"(?:<!-- docs-test: skip (?P<reason>[^\n]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md")
                  if not p.relative_to(DOCS).as_posix().startswith(NOT_GUIDES) and "```python" in p.read_text())


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """``(code, skip reason or None)`` of each ``python`` fenced block of a markdown page."""
    return [(m.group("code"), m.group("reason")) for m in _BLOCK.finditer(text)]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NO_MKDOCS_2_WARNING="1")
    return env


def test_python_blocks_are_found_with_their_skip_marks():
    text = ("a\n```python\nx = 1\n```\n<!-- docs-test: skip needs a GPU -->\n```python\ny = 2\n```\n"
            "```bash\nls\n```\n")
    assert python_blocks(text) == [("x = 1\n", None), ("y = 2\n", "needs a GPU")]


def test_docs_build_strict(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    # the lists that code produces are in the built pages, generated from the code
    from click import Context, Group

    from feedgpu.cli.main import main
    from feedgpu.settings import SECTIONS
    from feedgpu.stages.registry import stage_classes

    stages = (site / "reference" / "stages" / "index.html").read_text()
    for name, cls in stage_classes().items():
        assert f"<code>{name}</code>" in stages, f"stage {name} missing from the generated stage list"
    schema = (site / "reference" / "schema" / "index.html").read_text()
    for section, cls in SECTIONS.items():
        for key in cls.__pydantic_fields__:
            assert f"<code>{key}</code>" in schema, f"{section}.{key} missing from the generated schema"
    cli = (site / "reference" / "cli" / "index.html").read_text()
    ctx = Context(main)
    for name in main.list_commands(ctx):   # click's API: also right for a group that loads lazily
        cmd = main.get_command(ctx, name)
        assert f"feedgpu {name}" in cli, f"command {name} missing from the generated CLI reference"
        if isinstance(cmd, Group):
            for sub in cmd.list_commands(Context(cmd, parent=ctx)):
                assert f"feedgpu {name} {sub}" in cli, f"command {name} {sub} missing from the CLI reference"
    assert "balancer_auto.png" in (site / "guides" / "workers" / "index.html").read_text()
    assert (site / "assets" / "balancer_auto.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def sample_train(tmp_path_factory) -> Path:
    return build_imagenet_like(tmp_path_factory.mktemp("docs-sample") / "train", n_images=64)


_RUN = [p for p in _pages() if any(reason is None for _, reason in python_blocks(p.read_text()))]


@pytest.mark.parametrize("page", _RUN, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_guide_examples_run(page, sample_train, tmp_path):
    blocks = [code for code, reason in python_blocks(page.read_text()) if reason is None]
    (tmp_path / "pipelines").symlink_to(REPO / "pipelines")
    (tmp_path / "sample-data").mkdir()
    (tmp_path / "sample-data" / "train").symlink_to(sample_train)
    script = tmp_path / "example.py"
    script.write_text("\n\n".join(blocks))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, (f"{page.relative_to(REPO)}: its Python examples failed\n--- script\n"
                               f"{script.read_text()}\n--- stderr\n{r.stderr[-6000:]}")


_SKIPPED = [(p, reason) for p in _pages() for code, reason in python_blocks(p.read_text()) if reason]


@pytest.mark.parametrize("page, reason", _SKIPPED, ids=[p.relative_to(DOCS).as_posix() for p, _ in _SKIPPED])
def test_guide_examples_not_run(page, reason):
    pytest.skip(f"{page.relative_to(DOCS)}: {reason}")
