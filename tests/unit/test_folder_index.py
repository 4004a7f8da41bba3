"""The folder source's saved index: reused while the tree is unchanged, rebuilt after each kind of
change, ignored with a warning when corrupt or of another feedgpu version; the list-only walk
(``stat_files=False``)."""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest

from conftest import PHOTOS
from feedgpu import DataLoader, FolderSource, Pipeline
from feedgpu.errors import ConfigError
from feedgpu.sources import folder_index
from feedgpu.stages import Decode, ResizeCenterCrop

PICS = sorted(PHOTOS.glob("*.jpg"))


def photo(i: int) -> bytes:
    return PICS[i].read_bytes()


def age(root: Path, seconds: int = 600) -> None:
    """Set every folder's mtime (and the files') in the past, as for a data set written earlier:
    an index whose folders changed just now is not saved (see folder_index.RACY_NS)."""
    past = time.time_ns() - seconds * 10**9
    for d, dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                os.utime(p, ns=(past, past))
        os.utime(d, ns=(past, past))


@pytest.fixture
def tree(tmp_path) -> Path:
    """a/ (3 photos, one a link to a photo outside the tree), b/ (2 photos + sub/ with 1), and
    c/ with a dangling link; an outside folder the link points into."""
    root = tmp_path / "data"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.jpg").write_bytes(photo(9))
    for cls, files in {"a": ["a0.jpg", "a1.jpg"], "b": ["b0.jpg", "b1.jpg"], "c": ["c0.jpg"]}.items():
        (root / cls).mkdir(parents=True)
        for i, f in enumerate(files):
            (root / cls / f).write_bytes(photo(i + len(cls)))
    (root / "b" / "sub").mkdir()
    (root / "b" / "sub" / "s0.jpg").write_bytes(photo(5))
    os.symlink(outside / "o.jpg", root / "a" / "link.jpg")
    os.symlink(root / "nowhere.jpg", root / "c" / "dangling.jpg")
    age(tmp_path)
    return root


def open_(root, idx, **kw) -> FolderSource:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the dangling link's warning
        return FolderSource(root, index_dir=idx, **kw)


def same_index(a: FolderSource, b: FolderSource) -> None:
    assert [a.key(i) for i in range(len(a))] == [b.key(i) for i in range(len(b))]
    assert a.labels.tolist() == b.labels.tolist() and a.classes == b.classes
    assert a.rejected == b.rejected and a.rejected_details == b.rejected_details
    assert a.identity() == b.identity()


@pytest.mark.parametrize("stat_files", [True, False])
def test_an_unchanged_tree_reuses_the_saved_index(tree, tmp_path, stat_files):
    idx = tmp_path / "idx"
    first = open_(tree, idx, stat_files=stat_files)
    assert not first.from_saved_index and len(list(idx.glob("*.idx"))) == 1
    again = open_(tree, idx, stat_files=stat_files)
    assert again.from_saved_index
    same_index(again, first)
    same_index(again, open_(tree, False, stat_files=stat_files))
    assert again.rejected == [(str(tree / "c" / "dangling.jpg"), "dangling link")]
    # the other setting has its own file; the same root spelled through a link shares one
    assert not open_(tree, idx, stat_files=not stat_files).from_saved_index
    alias = tmp_path / "alias"
    os.symlink(tree, alias)
    via = open_(alias, idx, stat_files=stat_files)
    assert via.from_saved_index and via.key(0).startswith(str(alias) + os.sep)
    assert via.rejected == [(str(alias / "c" / "dangling.jpg"), "dangling link")]


def _add_file(r, o):
    (r / "a" / "a2.jpg").write_bytes(photo(7))


def _remove_file(r, o):
    (r / "b" / "b1.jpg").unlink()


def _rename_file(r, o):
    (r / "a" / "a0.jpg").rename(r / "a" / "a9.jpg")


def _add_in_subfolder(r, o):
    (r / "b" / "sub" / "s1.jpg").write_bytes(photo(8))


def _remove_subfolder(r, o):
    (r / "b" / "sub" / "s0.jpg").unlink()
    (r / "b" / "sub").rmdir()


def _add_class(r, o):
    (r / "d").mkdir()
    (r / "d" / "d0.jpg").write_bytes(photo(6))


def _rename_class(r, o):
    (r / "b").rename(r / "bb")


def _remove_class(r, o):
    for f in (r / "a").iterdir():
        f.unlink()
    (r / "a").rmdir()


def _repoint_link(r, o):
    (r / "a" / "link.jpg").unlink()
    os.symlink(r / "b" / "b0.jpg", r / "a" / "link.jpg")


def _link_target_gone(r, o):
    (o / "o.jpg").unlink()   # outside the tree: no folder of the tree changes


def _dangling_target_appears(r, o):
    (r / "nowhere.jpg").write_bytes(photo(3))


def _hidden_file(r, o):
    (r / "a" / ".x.jpg").write_bytes(photo(2))


CHANGES = [_add_file, _remove_file, _rename_file, _add_in_subfolder, _remove_subfolder, _add_class,
           _rename_class, _remove_class, _repoint_link, _link_target_gone, _dangling_target_appears,
           _hidden_file]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__[1:] for c in CHANGES])
def test_each_change_to_the_tree_rebuilds_the_index(tree, tmp_path, change):
    idx = tmp_path / "idx"
    before = open_(tree, idx)
    assert open_(tree, idx).from_saved_index
    change(tree, tmp_path / "outside")
    after = open_(tree, idx)
    assert not after.from_saved_index
    fresh = open_(tree, False)
    same_index(after, fresh)
    if change is not _hidden_file:
        assert after.identity() != before.identity()


def test_an_empty_file_written_in_place_rebuilds_the_index(tree, tmp_path):
    """A rejected entry is watched itself: writing into an empty file changes no folder."""
    idx = tmp_path / "idx"
    empty = tree / "b" / "e.jpg"
    empty.write_bytes(b"")
    age(tree)
    assert (str(empty), "empty") in open_(tree, idx).rejected
    assert open_(tree, idx).from_saved_index
    empty.write_bytes(photo(4))
    after = open_(tree, idx)
    assert not after.from_saved_index and str(empty) in [after.key(i) for i in range(len(after))]


def test_a_rewrite_in_place_keeps_the_index_and_changes_the_fingerprint(tree, tmp_path):
    """Same name, same size, new bytes and mtime: no folder changes, so the saved index is used;
    its sizes and mtimes are read again for the fingerprint, which follows the files as a fresh
    index's does, and the stale saved file is dropped."""
    idx = tmp_path / "idx"
    base = open_(tree, idx).identity()
    f = tree / "a" / "a1.jpg"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF                       # same size, other content
    f.write_bytes(bytes(data))
    reused = open_(tree, idx)
    assert reused.from_saved_index
    assert reused.identity() != base
    assert reused.identity() == open_(tree, False).identity()
    assert not list(idx.glob("*.idx"))     # dropped: the next run indexes afresh
    assert not open_(tree, idx).from_saved_index


def test_a_folder_changed_just_now_is_not_saved(tmp_path):
    root = tmp_path / "fresh"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.jpg").write_bytes(photo(0))
    open_(root, tmp_path / "idx")
    assert not list((tmp_path / "idx").glob("*.idx"))


def _only_index(idx: Path) -> Path:
    (path,) = idx.glob("*.idx")
    return path


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_corrupt_index_file_is_ignored_with_a_warning(tree, tmp_path, damage):
    idx = tmp_path / "idx"
    good = open_(tree, idx)
    path = _only_index(idx)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 9]
    elif damage == "garbage":
        data = bytearray(b"PK\x03\x04 not an index at all" * 10)
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"ignored the saved folder index .*indexing afresh"):
        src = FolderSource(tree, index_dir=idx)
    assert not src.from_saved_index
    same_index(src, good)
    assert open_(tree, idx).from_saved_index   # rewritten whole


def test_an_index_of_another_feedgpu_version_is_ignored_with_a_warning(tree, tmp_path, monkeypatch):
    import feedgpu

    idx = tmp_path / "idx"
    monkeypatch.setattr(feedgpu._version, "__version__", "0.0.1-other")   # the version source
    open_(tree, idx)
    monkeypatch.undo()
    with pytest.warns(UserWarning, match=r"written by feedgpu '0.0.1-other'.*this is " + feedgpu.__version__):
        src = FolderSource(tree, index_dir=idx)
    assert not src.from_saved_index
    assert open_(tree, idx).from_saved_index


def test_an_index_that_cannot_be_written_warns_and_the_source_works(tree, tmp_path):
    blocker = tmp_path / "idx"
    blocker.write_text("a file where the folder would go")
    with pytest.warns(UserWarning, match="could not save the folder index"):
        src = FolderSource(tree, index_dir=blocker)
    assert len(src) == 7


def test_the_default_index_lives_in_the_cache_dir(tree, tmp_path, monkeypatch):
    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(tmp_path / "cache"))
    open_(tree, None)
    assert len(list((tmp_path / "cache" / "folder-index").glob("*.idx"))) == 1
    assert open_(tree, None).from_saved_index
    assert folder_index.default_index_dir() == tmp_path / "cache" / "folder-index"


def test_list_only_walk_finds_empty_files_when_they_are_read(tree, tmp_path):
    """stat_files=False: the same records and rejects as the default walk, except that a zero-byte
    file is indexed and then counted (reason "empty") when read, as a Parquet source does."""
    (tree / "b" / "e.jpg").write_bytes(b"")
    with_stat = open_(tree, False)
    listed = open_(tree, False, stat_files=False)
    keys = [listed.key(i) for i in range(len(listed))]
    assert (str(tree / "b" / "e.jpg"), "empty") in with_stat.rejected
    assert keys == sorted([with_stat.key(i) for i in range(len(with_stat))] + [str(tree / "b" / "e.jpg")],
                          key=keys.index)
    assert [r for r in listed.rejected] == [r for r in with_stat.rejected if r[1] != "empty"]
    assert listed.sizes[keys.index(str(tree / "b" / "e.jpg"))] == 0   # read on first use
    p = Pipeline(listed, [Decode(), ResizeCenterCrop(32, 32)], batch_size=len(listed), shuffle=False, seed=0,
                 device="cpu", num_workers=0, on_error="skip", max_skipped=None)
    loader = DataLoader(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        labels = sorted({int(x) for b in loader for x in b.labels})
    st = loader.stats()
    assert labels == [0, 1, 2] and st["skipped"] == {"dangling link": 1, "empty": 1}


def test_pipeline_files_can_turn_the_per_file_stat_off(tree, tmp_path, monkeypatch):
    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(tmp_path / "cache"))
    yaml = Path(__file__).resolve().parents[2] / "feedgpu" / "pipelines" / "imagenet_train.yaml"
    (tree / "b" / "e.jpg").write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        listed = Pipeline.from_yaml(yaml, source={"path": str(tree), "stat_files": False}).source
        default = Pipeline.from_yaml(yaml, source={"path": str(tree)}).source
    assert len(listed) == len(default) + 1
    assert (str(tree / "b" / "e.jpg"), "empty") in default.rejected   # "auto" on a small tree stats
    assert (str(tree / "b" / "e.jpg"), "empty") not in listed.rejected
    with pytest.raises(ConfigError, match="source.stat_files: .*'auto'"):
        Pipeline.from_yaml(yaml, source={"path": str(tree), "stat_files": "sometimes"})


def test_cache_clear_and_info_cover_the_saved_indexes(tree, tmp_path, monkeypatch):
    """``feedgpu cache info`` counts the saved folder indexes (files, bytes) under
    ``$FEEDGPU_CACHE_DIR/folder-index``; ``cache clear`` asks, then deletes them with the cache
    entries (``--yes``: without asking); clearing one entry by fingerprint leaves them."""
    from click.testing import CliRunner

    from feedgpu.cli.cache import _human
    from feedgpu.cli.main import main

    env = tmp_path / "env"
    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(env))
    idx = env / "folder-index"
    assert folder_index.default_index_dir() == idx
    open_(tree, None)
    open_(tree, None, extensions=(".jpg",))           # other settings: a second file
    files = sorted(idx.glob("*.idx"))
    assert len(files) == 2 and open_(tree, None).from_saved_index
    size = sum(f.stat().st_size for f in files)

    def cli(*args, **kw):
        return CliRunner().invoke(main, list(args), **kw)

    res = cli("cache", "info")
    assert res.exit_code == 0, res.output
    assert f"folder indexes {idx}: 2 saved, {_human(size)}" in res.output and size > 0
    res = cli("cache", "clear", "0" * 32, "--yes")   # one entry by fingerprint: indexes stay
    assert res.exit_code == 0 and "folder index" not in res.output and len(list(idx.glob("*.idx"))) == 2
    res = cli("cache", "clear", input="n\n")
    assert res.exit_code == 1 and "saved folder indexes in" in res.output and len(list(idx.glob("*.idx"))) == 2
    res = cli("cache", "clear", "--yes")
    assert res.exit_code == 0 and "deleted 2 saved folder indexes" in res.output, res.output
    assert list(idx.glob("*.idx")) == []
    assert "folder indexes" in cli("cache", "info").output and ": 0 saved, 0 B" in cli("cache", "info").output
    assert not open_(tree, None).from_saved_index        # indexed afresh (and saved again)
    other = tmp_path / "elsewhere"
    open_(tree, other)
    res = cli("cache", "clear", "--yes", "--index-dir", str(other))
    assert "deleted 1 saved folder index " in res.output and list(other.glob("*.idx")) == []
    assert len(list(idx.glob("*.idx"))) == 1          # the default folder was not touched


@pytest.mark.parametrize("auto_max, stats", [(100, True), (3, False)])
def test_stat_files_auto_stats_small_trees_and_lists_large_ones(tree, tmp_path, monkeypatch, caplog, auto_max, stats):
    """The default, stat_files="auto": the same index as True for a listing of at most
    file_stats.AUTO_MAX image files (the zero-byte file rejected while indexing), as False above
    it (indexed, counted as "empty" when read, said at INFO); its saved index is its own."""
    from conftest import CASES
    from feedgpu.sources import file_stats

    (tree / "b" / "empty.jpg").write_bytes((CASES / "empty.jpg").read_bytes())
    age(tree.parent)
    monkeypatch.setattr(file_stats, "AUTO_MAX", auto_max)
    idx = tmp_path / "idx"
    with caplog.at_level("INFO", logger="feedgpu.sources"):
        auto = open_(tree, idx)
    same_index(auto, open_(tree, False, stat_files=stats))
    assert ((str(tree / "b" / "empty.jpg"), "empty") in auto.rejected) is stats
    assert ("listed, not stat-ed" in caplog.text) is not stats
    assert not open_(tree, idx, stat_files=stats).from_saved_index   # kept apart from True's and False's
    again = open_(tree, idx)
    assert again.from_saved_index
    same_index(again, auto)
    if not stats:
        p = Pipeline(again, [Decode(), ResizeCenterCrop(32, 32)], batch_size=len(again), shuffle=False, seed=0,
                     device="cpu", num_workers=0, on_error="skip", max_skipped=None)
        loader = DataLoader(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = sum(len(b.labels) for b in loader)
        assert rows == len(again)   # the batch keeps its size: a spare refills the empty file's row
        assert loader.stats()["skipped"] == {"dangling link": 1, "empty": 1}


def test_stat_files_takes_true_false_or_auto(tree):
    with pytest.raises(ValueError, match="stat_files must be True, False or 'auto'"):
        FolderSource(tree, index_dir=False, stat_files="yes")
