"""Converters and every image ending the folder source reads; a killed convert's partial output;
read-back mismatches named."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import REPO
from feedgpu import FolderSource, ParquetSource, SourceError, TarShardSource
from feedgpu.convert import folder_to_tar, remove_stale_partials
from feedgpu.sources import extensions
from feedgpu.sources.tar import local as tar_local, members as tar_members
from test_source_endings import encoded

FORMATS = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP", ".bmp": "BMP", ".ppm": "PPM",
           ".pgm": "PPM-gray", ".tif": "TIFF", ".tiff": "TIFF", ".gif": "GIF"}


def cli(*args):
    from feedgpu.cli.main import main

    return CliRunner().invoke(main, [str(a) for a in args])


def every_ending(root: Path) -> Path:
    """One file of each image ending the folder source reads, the ending's case alternating, in
    two classes."""
    assert set(FORMATS) == set(extensions.IMAGE_EXTENSIONS)
    for i, e in enumerate(extensions.IMAGE_EXTENSIONS):
        d = root / ("a" if i < 5 else "b")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}{e.upper() if i % 2 else e}").write_bytes(encoded(i, FORMATS[e]))
    return root


def records(src) -> list[tuple[int, bytes]]:
    return [(r.label, bytes(r.payload)) for r in (src.read(i) for i in range(len(src)))]


def test_every_image_ending_goes_through_every_converter(tmp_path):
    """Before: ``--to tar`` refused a folder holding a ``.pgm`` (read back as N-1 samples)."""
    folder = every_ending(tmp_path / "in")
    want = records(FolderSource(folder, index_dir=False))
    assert len(want) == len(extensions.IMAGE_EXTENSIONS)
    res = cli("convert", folder, tmp_path / "tar", "--to", "tar")
    assert res.exit_code == 0, res.output
    assert records(TarShardSource(tmp_path / "tar", index_dir=False)) == want
    res = cli("convert", folder, tmp_path / "pq", "--to", "parquet")
    assert res.exit_code == 0, res.output
    assert records(ParquetSource(tmp_path / "pq")) == want
    res = cli("convert", tmp_path / "tar", tmp_path / "pq2", "--to", "parquet")
    assert res.exit_code == 0, res.output
    assert records(ParquetSource(tmp_path / "pq2")) == want


def test_a_read_back_mismatch_names_the_files(tmp_path, monkeypatch):
    """With a tar source that does not take ``.pgm`` (as before), the refusal names the file."""
    folder = every_ending(tmp_path / "in")
    fewer = tuple(s for s in tar_members.IMAGE_SUFFIXES if s != "pgm")
    monkeypatch.setattr(tar_members, "IMAGE_SUFFIXES", fewer)
    monkeypatch.setattr(tar_local, "IMAGE_SUFFIXES", fewer)
    pgm = next(p for p in folder.rglob("*") if p.suffix.lower() == ".pgm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SourceError, match="read back as 9 samples, the source has 10") as e:
            folder_to_tar(folder, tmp_path / "tar")
    assert str(pgm) in str(e.value) and "not read back (1)" in str(e.value)
    assert not (tmp_path / "tar").exists() and not list(tmp_path.glob(".tar.partial-*"))


def _killed_convert(folder: Path, out: Path) -> Path:
    """Run a convert into ``out`` in a child that is SIGKILLed once its partial folder exists."""
    code = ("import os, signal, sys\n"
            "import feedgpu.convert as c\n"
            "real = c.write_class_names\n"
            "def die(*a, **k):\n"
            "    real(*a, **k)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "c.write_class_names = die\n"
            "c.folder_to_tar(sys.argv[1], sys.argv[2])\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-c", code, str(folder), str(out)], env=env)
    assert p.wait(timeout=120) == -9
    left = out.parent / f".{out.name}.partial-{p.pid}"
    assert left.is_dir() and (left / "_classes.txt").exists()
    return left


def test_a_killed_converts_partial_output_is_removed_by_the_next(tmp_path):
    """Before: the hidden ``.OUT.partial-PID`` folder of a SIGKILLed convert stayed for good."""
    folder = every_ending(tmp_path / "in")
    out = tmp_path / "tar"
    left = _killed_convert(folder, out)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = out.parent / f".{out.name}.partial-{sleeper.pid}"   # a live convert's: kept
        busy.mkdir()
        other = out.parent / f".other.partial-{left.name.rsplit('-', 1)[1]}"   # another output's: kept
        other.mkdir()
        with pytest.warns(UserWarning, match="removed the partial output") as w:
            res = folder_to_tar(folder, out)
        assert str(left) in str(w[0].message)
        assert res.samples == len(extensions.IMAGE_EXTENSIONS)
        assert not left.exists() and busy.is_dir() and other.is_dir()
        assert remove_stale_partials(out) == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_killed_convert_to_a_urls_build_folder_is_removed_by_the_next(tmp_path, monkeypatch):
    import tempfile

    from feedgpu.convert import URL_BUILD_PREFIX, remove_stale_url_builds

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{URL_BUILD_PREFIX}{dead.pid}-abc"
    (left / "out").mkdir(parents=True)
    mine = tmp_path / f"{URL_BUILD_PREFIX}{os.getpid()}-xyz"
    mine.mkdir()
    with pytest.warns(UserWarning, match="to a URL"):
        assert remove_stale_url_builds() == [left]
    assert not left.exists() and mine.is_dir()
