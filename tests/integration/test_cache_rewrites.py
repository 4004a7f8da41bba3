"""A file rewritten after ``feedgpu cache build`` with new pixels, the same size and its mtime set
back (``touch -r``, ``rsync -t``, ``cp -p``, ``tar x`` do this), in place or by renaming a new file
over it: the cached loader gives the new pixels, never the cached old ones, in every source format
the cache takes and in both fingerprint modes. In ``fingerprint: content`` mode a change of
metadata alone keeps the entry."""
from __future__ import annotations

import io
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from PIL import Image

from conftest import PHOTOS
from feedgpu import DataLoader, Pipeline
from feedgpu.convert import folder_to_parquet, folder_to_tar

pytestmark = pytest.mark.timeout(180)

W, H = 40, 30
FILES = {"a": ["p0.bmp", "p1.bmp", "p2.bmp"], "b": ["p3.bmp", "p4.bmp"]}


def bmp(i: int) -> bytes:
    """A photo (of the shared photos) cut to W x H as an uncompressed BMP: every such file has
    the same size, whatever its pixels."""
    with Image.open(sorted(PHOTOS.glob("*.jpg"))[i]) as im:
        buf = io.BytesIO()
        im.convert("RGB").resize((W, H)).save(buf, "BMP")
    return buf.getvalue()


def dataset(root: Path, fmt: str) -> tuple[Path, Path]:
    """``(data path, the file holding p1.bmp's bytes)``."""
    folder = root / "folder"
    i = 0
    for cls, names in FILES.items():
        (folder / cls).mkdir(parents=True)
        for name in names:
            (folder / cls / name).write_bytes(bmp(i))
            i += 1
    if fmt == "folder":
        return folder, folder / "a" / "p1.bmp"
    out = root / fmt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (folder_to_tar if fmt == "tar" else folder_to_parquet)(folder, out)
    files = sorted(out.glob("*.tar" if fmt == "tar" else "*.parquet"))
    assert len(files) == 1
    return out, files[0]


def pipeline_file(root: Path, fmt: str, cache_dir: Path, mode: str) -> Path:
    spec = {"version": 1, "name": "rewrites", "source": {"format": fmt, "path": None},
            "stages": [{"op": "decode"}, {"op": "resize_center_crop", "resize": 28, "crop": 24}],
            "loader": {"batch_size": 8, "shuffle": False, "drop_last": False, "num_workers": 0, "seed": 0},
            "output": {"device": "cpu", "dtype": "uint8", "layout": "NHWC"},
            "cache": {"enabled": True, "dir": str(cache_dir), "fingerprint": mode}}
    path = root / "pipe.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def build(pipe: Path, data: Path):
    from feedgpu.cli.main import main

    res = CliRunner().invoke(main, ["cache", "build", "--pipeline", str(pipe), "--data", str(data), "--workers", "1"])
    assert res.exit_code == 0, res.output
    return res.output


def images(pipe: Path, data: Path, cached: bool) -> tuple[torch.Tensor, dict]:
    over = {"source.path": str(data)} if cached else {"source.path": str(data), "cache.enabled": False}
    loader = DataLoader(Pipeline.from_yaml(pipe, **over))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = torch.cat([b.images.clone() for b in loader])
        return out, loader.stats()
    finally:
        loader.shutdown()


def rewrite(path: Path, old: bytes, new: bytes, how: str) -> None:
    """Put ``new`` where ``old`` is in ``path`` (same length: the file keeps its size), then set
    its atime and mtime back to what they were."""
    st = path.stat()
    data = path.read_bytes()
    assert len(old) == len(new) and old in data
    data = data.replace(old, new)
    assert len(data) == st.st_size
    if how == "in place":
        with open(path, "r+b") as f:
            f.write(data)
    else:   # a new file (new inode) renamed over the old one
        tmp = path.with_name(".new-" + path.name)
        tmp.write_bytes(data)
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = path.stat()
    assert (now.st_size, now.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert (now.st_ino != st.st_ino) == (how == "by rename")


@pytest.mark.parametrize("mode", ["metadata", "content"])
@pytest.mark.parametrize("how", ["in place", "by rename"])
@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
def test_a_same_size_same_mtime_rewrite_is_never_served_from_the_cache(tmp_path, fmt, how, mode):
    """Before: the cached loader gave the old image, the uncached one the new."""
    data, holder = dataset(tmp_path / "d", fmt)
    pipe = pipeline_file(tmp_path, fmt, tmp_path / "cache", mode)
    assert "0 of 5 samples cached, 5 to build" in build(pipe, data)
    before, _ = images(pipe, data, cached=False)
    hit, stats = images(pipe, data, cached=True)
    entry = stats["cache"]["dir"]
    assert torch.equal(hit, before) and stats["stage_s"].get("decode", 0.0) == 0.0   # all served by the entry

    old, new = bmp(1), bmp(7)
    rewrite(holder, old, new, how)
    after, _ = images(pipe, data, cached=False)
    assert not torch.equal(after[1], before[1]) and torch.equal(after[[0, 2, 3, 4]], before[[0, 2, 3, 4]])
    got, stats = images(pipe, data, cached=True)
    assert torch.equal(got, after), "the cache served the old pixels"
    assert stats["stage_s"].get("decode", 0.0) > 0 and stats["cache"]["dir"] != entry   # a new entry
    assert "5 of 5 samples cached, 0 to build" in build(pipe, data)
    got, stats = images(pipe, data, cached=True)
    assert torch.equal(got, after) and stats["stage_s"].get("decode", 0.0) == 0.0


@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
def test_content_mode_keeps_the_entry_when_only_metadata_changes(tmp_path, fmt):
    """A file copied over itself (new inode, new mtime, same bytes), as a copy from another
    machine gives: the metadata fingerprint builds a new entry, the content one keeps its own."""
    data, holder = dataset(tmp_path / "d", fmt)
    pipes = {}
    for m in ("metadata", "content"):
        (tmp_path / m).mkdir()
        pipes[m] = pipeline_file(tmp_path / m, fmt, tmp_path / "cache", m)
    for m, pipe in pipes.items():
        assert "0 of 5 samples cached, 5 to build" in build(pipe, data), m
    copy = holder.with_name(".copy-" + holder.name)
    shutil.copyfile(holder, copy)
    os.replace(copy, holder)
    assert "5 of 5 samples cached, 0 to build" in build(pipes["content"], data)
    assert "0 of 5 samples cached, 5 to build" in build(pipes["metadata"], data)
