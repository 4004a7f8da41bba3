"""``scripts/setup.sh`` run again only checks: feedgpu is installed again only when the venv lacks
an editable install of this checkout made from the same ``pyproject.toml``.

The script runs on a copy of the checkout with a fresh venv that sees the test environment's
packages (every one but feedgpu) through a ``.pth`` file, so torch, Pillow-SIMD and the extras
count as installed and only feedgpu itself is (re)installed: real pip, real editable installs,
nothing downloaded but the build backend.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(420)

SKIPPED = "not reinstalled"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("setup")
    checkout = tmp / "checkout"
    checkout.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, checkout / name)
    for name in ("feedgpu", "scripts"):
        shutil.copytree(REPO / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    site = Path(sysconfig.get_paths()["purelib"])
    shim = tmp / "shim"
    shim.mkdir()
    for entry in site.iterdir():   # everything installed here but feedgpu (and .pth hooks)
        if "feedgpu" not in entry.name and entry.suffix != ".pth":
            (shim / entry.name).symlink_to(entry)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()) / "shim.pth").write_text(f"{shim}\n")
    return checkout, venv


def _setup(checkout: Path, venv: Path) -> subprocess.CompletedProcess:
    res = subprocess.run(["bash", "scripts/setup.sh"], cwd=checkout, capture_output=True, text=True, timeout=400,
                         env=dict(os.environ, FEEDGPU_VENV=str(venv), PYTHONPATH=""))
    assert res.returncode == 0, res.stderr
    return res


def _installed_from(venv: Path) -> str:
    res = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", "import feedgpu; print(feedgpu.__file__)"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_a_second_run_only_checks_and_a_changed_pyproject_installs_again(env):
    checkout, venv = env
    first = _setup(checkout, venv)
    assert SKIPPED not in first.stderr
    assert _installed_from(venv) == str(checkout / "feedgpu" / "__init__.py")
    again = _setup(checkout, venv)
    assert SKIPPED in again.stderr
    # a dependency added to pyproject.toml (here: a changed file) is installed by the next run
    (checkout / "pyproject.toml").write_text((checkout / "pyproject.toml").read_text() + "\n# changed\n")
    changed = _setup(checkout, venv)
    assert SKIPPED not in changed.stderr
    assert SKIPPED in _setup(checkout, venv).stderr


def test_a_venv_without_feedgpu_or_with_another_checkout_installs_again(env):
    checkout, venv = env
    _setup(checkout, venv)
    other = checkout.parent / "other"
    shutil.copytree(checkout, other, ignore=shutil.ignore_patterns("*.egg-info"))
    moved = _setup(other, venv)   # same pyproject.toml, another checkout: installed from there
    assert SKIPPED not in moved.stderr
    assert _installed_from(venv) == str(other / "feedgpu" / "__init__.py")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "feedgpu"], check=True,
                   timeout=120)
    assert SKIPPED not in _setup(other, venv).stderr
    assert _installed_from(venv) == str(other / "feedgpu" / "__init__.py")
