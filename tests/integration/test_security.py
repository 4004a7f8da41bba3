"""Security: tar members are never written or followed, YAML is plain data, the cache never
unpickles, and nothing feedgpu creates is world-writable."""
from __future__ import annotations

import ast
import io
import json
import os
import pickle
import tarfile
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import CASES, REPO
from feedgpu import ConfigError, DataLoader, Pipeline, SkippedSampleWarning, TarShardSource
from feedgpu.cli.main import main as cli
from feedgpu.stages import Decode, ResizeCenterCrop

pytestmark = pytest.mark.timeout(120)
JPEG = (CASES / "ok_rgb.jpg").read_bytes()
PNG = (CASES / "png_named.jpg").read_bytes()


def _add(tf: tarfile.TarFile, name, data: bytes = b"", **attrs) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in attrs.items():
        setattr(info, k, v)
    tf.addfile(info, io.BytesIO(data) if data else None)


@pytest.fixture
def hostile_tar(tmp_path) -> Path:
    """A shard whose members try to escape: absolute, ``..``, symlinks, hard links, odd names."""
    shard_dir = tmp_path / "data" / "shards"
    shard_dir.mkdir(parents=True)
    path = shard_dir / "evil-000000.tar"
    # latin-1 member names: b"caf\xe9" is not UTF-8
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tf:
        _add(tf, "good.jpg", JPEG)   # no labels: an unlabeled shard (one .cls would make the others "missing label")
        _add(tf, "../../escape.jpg", JPEG)
        _add(tf, "/tmp/feedgpu-abs-escape.jpg", PNG)
        _add(tf, "link.jpg", type=tarfile.SYMTYPE, linkname="/etc/passwd")
        _add(tf, "rel_link.png", type=tarfile.SYMTYPE, linkname="../../outside.png")
        _add(tf, "hard.jpg", type=tarfile.LNKTYPE, linkname="good.jpg")
        _add(tf, "caf\xe9.jpg", JPEG)
        _add(tf, "dir/with space/and  two.dots.jpg", JPEG)
        _add(tf, "somedir", type=tarfile.DIRTYPE)
        _add(tf, "fifo.jpg", type=tarfile.FIFOTYPE)
    (tmp_path / "outside.png").write_bytes(b"must never be read")
    return path


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_tar_members_are_keys_never_paths(hostile_tar, tmp_path, monkeypatch):
    monkeypatch.chdir(hostile_tar.parent)
    before = _tree(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = TarShardSource(hostile_tar.parent)
    members = sorted(src.members[i] for i in range(len(src)))
    assert members == sorted(["good.jpg", "../../escape.jpg", "/tmp/feedgpu-abs-escape.jpg", "caf\udce9.jpg",
                              "dir/with space/and  two.dots.jpg"])
    # links and fifos are left out, named, never followed (directories are not records)
    left_out = {k.rsplit(":", 1)[1]: r for k, r in src.rejected}
    assert left_out == {"link.jpg": "link member, not followed", "rel_link.png": "link member, not followed",
                        "hard.jpg": "link member, not followed", "fifo.jpg": "not a regular file"}
    assert sum("link member" in str(w.message) for w in caught) == 3
    # reading gives the member's own bytes, through pread on the shard
    by_name = {src.members[i]: i for i in range(len(src))}
    assert bytes(src.read(by_name["../../escape.jpg"]).payload) == JPEG
    assert bytes(src.read(by_name["/tmp/feedgpu-abs-escape.jpg"]).payload) == PNG
    assert src.key(by_name["caf\udce9.jpg"]) == f"{hostile_tar}:caf\udce9.jpg"

    p = Pipeline(src, [Decode(), ResizeCenterCrop(32, 32)], batch_size=5, shuffle=False, num_workers=2,
                 device="cpu")
    loader = DataLoader(p, timeout=60)
    rows = sum(len(b.labels) for b in loader)
    st = loader.stats()
    assert rows == 5 and st["skipped_total"] == st["skipped_while_indexing"] == len(src.rejected)
    loader.shutdown()
    # nothing was written next to, above or outside the dataset
    assert _tree(tmp_path) == before
    assert not Path("/tmp/feedgpu-abs-escape.jpg").exists()


def test_scan_reports_odd_member_names(hostile_tar):
    r = CliRunner().invoke(cli, ["scan", str(hostile_tar.parent), "--json", "-", "--workers", "0"])
    assert r.exit_code == 1, r.output  # the links are reported
    d = json.loads(r.output)
    assert d["samples"] == 5 and d["by_reason"] == {"link member, not followed": 3, "not a regular file": 1}
    assert sorted(b["key"].rsplit(":", 1)[1] for b in d["bad"]) == ["fifo.jpg", "hard.jpg", "link.jpg", "rel_link.png"]


def test_yaml_loads_plain_data_only(tmp_path):
    evil = tmp_path / "evil.yaml"
    marker = tmp_path / "pwned"
    evil.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Pipeline.from_yaml(evil)
    evil.write_text("source: !!python/object:feedgpu.sources.FolderSource {root: /}\nstages: [{op: decode}]\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Pipeline.from_yaml(evil)
    r = CliRunner().invoke(cli, ["pipeline", "validate", str(evil)])
    assert r.exit_code == 2 and "not valid YAML" in r.output
    good = REPO / "feedgpu" / "pipelines" / "imagenet_val.yaml"
    r = CliRunner().invoke(cli, ["pipeline", "validate", str(good), "--set",
                                 f"loader.seed=!!python/object/apply:os.system ['touch {marker}']"])
    assert r.exit_code == 2 and "--set" in r.output
    assert not marker.exists()


def test_cache_code_never_unpickles():
    """No pickle, marshal, shelve, np.load or torch.load in the cache's code ..."""
    for f in sorted((REPO / "feedgpu" / "cache").glob("*.py")):
        tree = ast.parse(f.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not ({"pickle", "marshal", "shelve", "dill", "cloudpickle"} & (names | mods)), f
        assert "allow_pickle" not in f.read_text() and "torch.load" not in f.read_text(), f


def test_cache_round_trip_runs_without_pickle(folder_ds, tmp_path, monkeypatch):
    """... and a cached epoch (write, then read back) runs with pickle's loaders disabled."""
    import _pickle

    def refuse(*a, **k):
        raise AssertionError("the cache unpickled something")

    src_pipe = lambda: Pipeline({"format": "folder", "path": str(folder_ds)},  # noqa: E731
                                [Decode(), ResizeCenterCrop(40, 32)], batch_size=16, num_workers=0, device="cpu",
                                cache={"dir": str(tmp_path / "c")}, shuffle=False)
    for mod in (pickle, _pickle):
        monkeypatch.setattr(mod, "loads", refuse)
        monkeypatch.setattr(mod, "load", refuse)
    first = [b.images.clone() for b in DataLoader(src_pipe())]
    loader = DataLoader(src_pipe())
    again = [b.images.clone() for b in loader]
    assert loader.stats()["cache"]["complete"]
    assert all((a == b).all() for a, b in zip(first, again))


def test_cache_files_are_not_world_writable_under_umask_0(folder_ds, tmp_path):
    root = tmp_path / "deep" / "er" / "cache"
    old = os.umask(0)
    try:
        p = Pipeline({"format": "folder", "path": str(folder_ds)}, [Decode(), ResizeCenterCrop(40, 32)],
                     batch_size=32, num_workers=0, device="cpu", cache={"dir": str(root)})
        loader = DataLoader(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedSampleWarning)
            for _ in loader:
                pass
        loader.shutdown()
    finally:
        os.umask(old)
    made = [tmp_path / "deep", tmp_path / "deep" / "er", *sorted([root, *root.rglob("*")])]
    assert any(f.name == "manifest.json" for f in made) and any(f.suffix == ".arrow" for f in made)
    for f in made:
        mode = f.stat().st_mode & 0o777
        assert not mode & 0o002, f"{f} is world-writable ({oct(mode)})"
        assert not mode & 0o020, f"{f} is group-writable ({oct(mode)})"
