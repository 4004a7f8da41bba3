"""The conservation rule: every record of a source is delivered once with its right label, or is
counted under a reason and named -- in every source, in ``feedgpu convert``, in ``feedgpu scan``
and on both engines. One test (or more) per defect kind, each holding the right value."""
from __future__ import annotations

import errno
import io
import json
import os
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from PIL import Image

from conftest import CASES, PHOTOS, clone_all
from feedgpu import DataLoader, FolderSource, ParquetSource, Pipeline, SourceError, TarShardSource
from feedgpu.errors import ConfigError, DecodeError
from feedgpu.scan import scan_source
from feedgpu.stages import Decode, ResizeCenterCrop

pytestmark = pytest.mark.timeout(120)


def cli(*args):
    from feedgpu.cli.main import main

    return CliRunner().invoke(main, [str(a) for a in args])


def photo(i: int) -> bytes:
    return sorted(PHOTOS.glob("*.jpg"))[i].read_bytes()


def small_jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def write_tar(path: Path, members, fmt=tarfile.PAX_FORMAT) -> Path:
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def quiet(make, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make(*a, **kw)


def payloads(src) -> list[tuple[int, bytes]]:
    return [(int(r.label), bytes(r.payload)) for r in (src.read(i) for i in range(len(src)))]


# -- 1. the tar key rule, duplicates, members without label or image -------------------------------------
def test_dotted_member_names_pair_with_their_labels(tmp_path):
    """``img.v2.0001.jpg`` + ``img.v2.0001.cls``: WebDataset groups both under key ``img`` (first
    dot); the qualifier ``v2.0001`` pairs them. Before: label -1, and the second image was lost."""
    a, b, c = small_jpeg(1), small_jpeg(2), small_jpeg(3)
    shard = write_tar(tmp_path / "s.tar", [("d/img.v2.0001.jpg", a), ("d/img.v2.0001.cls", b"3"),
                                           ("d/img.v2.0002.jpg", b), ("d/img.v2.0002.cls", b"5"),
                                           ("plain.jpg", c), ("plain.cls", b" 7\n")])
    src = TarShardSource(shard)
    assert src.rejected == []
    assert [src.members[i] for i in range(len(src))] == ["d/img.v2.0001.jpg", "d/img.v2.0002.jpg", "plain.jpg"]
    assert payloads(src) == [(3, a), (5, b), (7, c)]


def test_qualified_images_share_the_groups_label_and_extra_fields_are_named(tmp_path):
    a, b, c, d = (small_jpeg(i) for i in range(4))
    shard = write_tar(tmp_path / "s.tar", [("k.a.jpg", a), ("k.b.jpg", b), ("k.cls", b"2"),
                                           ("x.jpg", c), ("x.seg.png", d), ("x.cls", b"4")])
    with pytest.warns(UserWarning, match=r"x\.seg\.png while indexing: extra image in sample"):
        src = TarShardSource(shard)
    assert payloads(src) == [(2, a), (2, b), (4, c)]
    assert src.rejected == [(f"{shard}:x.seg.png", "extra image in sample")]


def test_duplicate_keys_are_named_never_first_image_with_last_label(tmp_path):
    """Two images of one key, or one member name twice: which label is meant cannot be told, so
    each image of the key is left out and named. Before: the first image with the last label."""
    good, a, b, c, d = (small_jpeg(i) for i in range(5))
    shard = write_tar(tmp_path / "s.tar", [("ok.jpg", good), ("ok.cls", b"0"),
                                           ("x.jpg", a), ("x.png", b), ("x.cls", b"1"),
                                           ("y.jpg", c), ("y.cls", b"2"), ("y.jpg", d), ("y.cls", b"3")])
    with pytest.warns(UserWarning, match="duplicate key"):
        src = TarShardSource(shard)
    assert payloads(src) == [(0, good)]
    assert src.rejected == [(f"{shard}:x.jpg", "duplicate key"), (f"{shard}:x.png", "duplicate key"),
                            (f"{shard}:y.jpg", "duplicate key"), (f"{shard}:y.jpg", "duplicate key")]
    assert src.index_skips == {"duplicate key": [f"{shard}:x.jpg", f"{shard}:x.png", f"{shard}:y.jpg",
                                                 f"{shard}:y.jpg"]}


def test_missing_labels_bad_labels_and_label_only_members_are_named(tmp_path):
    imgs = [small_jpeg(i) for i in range(4)]
    shard = write_tar(tmp_path / "s.tar", [("a.jpg", imgs[0]), ("a.cls", b"1"), ("b.jpg", imgs[1]),
                                           ("c.cls", b"2"), ("d.jpg", imgs[2]), ("d.cls", b"-1"),
                                           ("e.jpg", imgs[3]), ("e.cls", b"x7")])
    src = quiet(TarShardSource, shard)
    assert payloads(src) == [(1, imgs[0])]
    assert sorted(src.rejected) == sorted([(f"{shard}:b.jpg", "missing label"), (f"{shard}:c.cls", "no image"),
                                           (f"{shard}:d.jpg", "bad label"), (f"{shard}:e.jpg", "bad label")])
    assert len(src) + len(src.rejected) == 5   # every record of the shard, delivered or named


def test_a_hidden_image_member_has_no_key_and_is_named(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [("a.jpg", small_jpeg(0)), ("a.cls", b"0"), ("d/.x.jpg", small_jpeg(1)),
                                           ("README", b"text")])
    src = quiet(TarShardSource, shard)
    assert len(src) == 1 and src.rejected == [(f"{shard}:d/.x.jpg", "no key")]


def test_a_shard_without_any_label_is_unlabeled(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [("a.jpg", small_jpeg(0)), ("b.jpg", small_jpeg(1))])
    src = TarShardSource(shard)
    assert src.labels.tolist() == [-1, -1] and src.rejected == []


# -- 2. convert: every file with its label, unique keys, verified, atomic ---------------------------------
@pytest.fixture
def colliding_folder(tmp_path) -> Path:
    """``x.jpg`` and ``x.png`` (one stem), and two names with dots."""
    root = tmp_path / "in"
    (root / "c0").mkdir(parents=True)
    (root / "c1").mkdir()
    png = io.BytesIO()
    Image.open(io.BytesIO(small_jpeg(9))).save(png, "PNG")
    (root / "c0" / "x.jpg").write_bytes(small_jpeg(1))
    (root / "c0" / "x.png").write_bytes(png.getvalue())
    (root / "c1" / "img.v2.0001.jpg").write_bytes(small_jpeg(2))
    (root / "c1" / "img.v2.0002.jpg").write_bytes(small_jpeg(3))
    return root


@pytest.mark.parametrize("to", ["tar", "parquet"])
def test_convert_keeps_every_file_with_its_label(colliding_folder, tmp_path, to):
    """Before: ``--to tar`` printed "wrote 1 tar file(s)", exit 0, and read back 2 samples of 4,
    one with label -1."""
    out = tmp_path / "out"
    res = cli("convert", colliding_folder, out, "--to", to)
    assert res.exit_code == 0, res.output
    assert "4 samples, read back with their labels" in res.output
    folder = FolderSource(colliding_folder)
    back = TarShardSource(out) if to == "tar" else ParquetSource(out)
    assert back.rejected == [] and payloads(back) == payloads(folder)
    assert back.labels.tolist() == [0, 0, 1, 1]
    if to == "tar":
        with tarfile.open(next(out.glob("*.tar"))) as tf:
            names = tf.getnames()
        assert names == ["c0/x%2Ejpg.jpg", "c0/x%2Ejpg.cls", "c0/x%2Epng.png", "c0/x%2Epng.cls",
                         "c1/img%2Ev2%2E0001.jpg", "c1/img%2Ev2%2E0001.cls",
                         "c1/img%2Ev2%2E0002.jpg", "c1/img%2Ev2%2E0002.cls"]
    else:
        keys = pq.read_table(out, columns=["key"]).column("key").to_pylist()
        assert keys == ["c0/x%2Ejpg", "c0/x%2Epng", "c1/img%2Ev2%2E0001", "c1/img%2Ev2%2E0002"]
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]


def test_sample_keys_are_unique_and_dot_free():
    from feedgpu.convert import sample_keys

    names = ["a/x.jpg", "a/x.png", "a/x.jpg.png", "a/x%2Ejpg.gif", "b/y.z.jpg", "b/y%z.jpg"]
    keys = sample_keys(names)
    assert len(set(keys)) == len(keys)
    assert all("." not in k.rpartition("/")[2] for k in keys)
    assert keys[4:] == ["b/y%2Ez", "b/y%25z"]


def test_convert_writes_nothing_when_it_fails(colliding_folder, tmp_path, monkeypatch):
    from feedgpu.convert import folder_to_tar

    calls = []
    real = FolderSource.read

    def failing(self, i):
        calls.append(i)
        if len(calls) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, i)

    monkeypatch.setattr(FolderSource, "read", failing)
    with pytest.raises(OSError):
        folder_to_tar(colliding_folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]   # no partial folder either
    monkeypatch.setattr(FolderSource, "read", real)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "old.tar").write_bytes(b"")
    with pytest.raises(ConfigError, match="not an empty folder"):
        folder_to_tar(colliding_folder, tmp_path / "busy")
    res = cli("convert", colliding_folder, tmp_path / "busy", "--to", "tar")
    assert res.exit_code == 2 and "not an empty folder" in res.output


def test_convert_round_trips_long_and_non_utf8_names(tmp_path):
    root = tmp_path / "in"
    (root / "c").mkdir(parents=True)
    long = "n" * 180 + ".jpg"
    raw = os.fsdecode(b"caf\xe9.jpg")
    (root / "c" / long).write_bytes(small_jpeg(1))
    (root / "c" / raw).write_bytes(small_jpeg(2))
    folder = FolderSource(root)
    res = cli("convert", root, tmp_path / "tar", "--to", "tar")
    assert res.exit_code == 0, res.output
    tar = TarShardSource(tmp_path / "tar")
    assert payloads(tar) == payloads(folder)
    assert sorted(tar.members[i] for i in range(2)) == sorted(["c/" + "n" * 180 + ".jpg", "c/" + os.fsdecode(b"caf\xe9") + ".jpg"])
    res = cli("convert", tmp_path / "tar", tmp_path / "pq")
    assert res.exit_code == 0, res.output
    assert payloads(ParquetSource(tmp_path / "pq")) == payloads(tar)
    keys = pq.read_table(tmp_path / "pq", columns=["key"]).column("key").to_pylist()
    assert sorted(keys) == sorted(["c/caf%E9", "c/" + "n" * 180])


def test_convert_lists_what_the_source_left_out_and_exits_1(tmp_path):
    root = tmp_path / "in"
    (root / "c").mkdir(parents=True)
    (root / "c" / "a.jpg").write_bytes(small_jpeg(1))
    (root / "c" / "empty.jpg").write_bytes(b"")
    with pytest.warns(UserWarning, match="empty"):
        res = cli("convert", root, tmp_path / "out", "--to", "tar")
    assert res.exit_code == 1
    assert "1 samples, read back" in res.output and "left out 1 record(s)" in res.output
    assert str(root / "c" / "empty.jpg") in res.output


# -- 3. Parquet labels --------------------------------------------------------------------------------------
def test_parquet_null_labels_are_counted_and_scan_reports_them(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": pa.array([small_jpeg(i) for i in range(4)], pa.binary()),
                             "label": pa.array([0, None, 2, -5], pa.int64())}), path, row_group_size=2)
    src = quiet(ParquetSource, path)
    assert src.labels.tolist() == [0, 2]   # never a -1
    assert src.rejected == [(f"{path}#1", "missing label"), (f"{path}#3", "bad label")]
    assert [src.key(i) for i in range(2)] == [f"{path}#0", f"{path}#2"]
    res = cli("scan", path, "--workers", 0)
    assert res.exit_code == 1
    assert "missing label: 1" in res.output and f"{path}#1" in res.output and "bad label: 1" in res.output
    unlabeled = tmp_path / "u.parquet"
    pq.write_table(pa.table({"image": pa.array([small_jpeg(0)], pa.binary()), "label": pa.array([-1])}), unlabeled)
    assert ParquetSource(unlabeled).labels.tolist() == [-1]   # no row has a label: unlabeled


# -- 4. truncated tar shards --------------------------------------------------------------------------------
def ten_sample_shard(path: Path) -> tuple[Path, list[int]]:
    """10 samples (``s<i>.jpg`` + ``s<i>.cls``); returns the header offset of each ``.jpg``."""
    members = []
    for i in range(10):
        members += [(f"s{i}.jpg", small_jpeg(i)), (f"s{i}.cls", str(i).encode())]
    write_tar(path, members)
    with tarfile.open(path) as tf:
        heads = [m.offset for m in tf.getmembers() if m.name.endswith(".jpg")]
    return path, heads


@pytest.mark.parametrize("cut", ["in-header", "block-boundary", "in-data", "no-end-marker"])
def test_truncated_shards_index_up_to_the_damage_and_count_the_loss(tmp_path, cut):
    """Before: 6 of 10 samples and no word (cut in a header or at a block boundary), or a bare
    tarfile.ReadError naming no shard (cut inside member data)."""
    shard, heads = ten_sample_shard(tmp_path / "s.tar")
    data = shard.read_bytes()
    with tarfile.open(shard) as tf:
        s6 = tf.getmember("s6.jpg")
        last_end = max(m.offset_data + m.size for m in tf.getmembers())
    at = {"in-header": heads[6] + 100, "block-boundary": heads[6], "in-data": s6.offset_data + 50,
          "no-end-marker": (last_end + 511) // 512 * 512}[cut]
    shard.write_bytes(data[:at])
    with pytest.warns(UserWarning, match="truncated shard"):
        src = TarShardSource(shard)
    n = 10 if cut == "no-end-marker" else 6
    assert src.labels.tolist() == list(range(n))
    reasons = dict((k, r) for k, r in src.rejected)
    assert reasons[str(shard)] == "truncated shard"
    if cut == "in-data":
        assert reasons[f"{shard}:s6.jpg"] == "truncated"
    assert str(at) in src.rejected_details[str(shard)] or cut == "in-data"
    res = cli("scan", shard, "--workers", 0)
    assert res.exit_code == 1, res.output
    assert "truncated shard: 1" in res.output and "Traceback" not in res.output


def test_scan_errors_exit_2_without_a_traceback(tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"\x01" * 4096)
    res = cli("scan", junk, "--workers", 0)
    assert res.exit_code == 2 and "error:" in res.output and "Traceback" not in res.output
    gz = tmp_path / "x.tar"
    gz.write_bytes(b"\x1f\x8b" + b"\x00" * 600)
    res = cli("scan", gz, "--workers", 0)
    assert res.exit_code == 2 and "compressed" in res.output


def test_a_shard_cut_after_one_sample_still_reads_other_shards(tmp_path):
    good = write_tar(tmp_path / "a.tar", [("a.jpg", small_jpeg(1)), ("a.cls", b"1")])
    cut = tmp_path / "b.tar"
    cut.write_bytes(b"")
    src = quiet(TarShardSource, tmp_path)
    assert src.labels.tolist() == [1]
    assert src.rejected == [(str(cut), "truncated shard")]
    assert good.exists()


# -- 5. the engines agree on bad JPEGs ------------------------------------------------------------------
def half_then_whole() -> bytes:
    a = photo(0)
    return a[:len(a) // 2] + photo(1)


def motion_without_eoi() -> bytes:
    """A JPEG without its end marker followed by other data (a motion photo's video) that ends in
    FF D9, so only the markers, not the last bytes, tell the image stops short."""
    a = photo(2)
    video = b"\x00\x00\x00\x18ftypmp42" + np.random.default_rng(3).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    return a[:-2] + video + b"\xff\xd9"


def test_cut_jpegs_followed_by_data_are_corrupt_for_both_paths():
    from feedgpu.stages.jpeg_header import scan_end_error

    d = Decode()
    for data in (half_then_whole(), motion_without_eoi()):
        assert scan_end_error(data) is not None
        for call in (d.apply, d.header):   # the Python engine's decode, the DALI engine's probe
            with pytest.raises(DecodeError) as info:
                call(data)
            assert info.value.reason == "corrupt"
    whole = photo(2)
    motion_ok = whole + b"\x00\x00\x00\x18ftypmp42" + b"\xff\xd8\xff\xc0" * 100 + b"\xff\xd9"
    assert scan_end_error(whole) is None and scan_end_error(motion_ok) is None   # data after EOI: ignored
    assert np.array_equal(np.asarray(d.apply(motion_ok)), np.asarray(d.apply(whole)))
    for name in ("ok_rgb.jpg", "gray.jpg", "cmyk_adobe.jpg", "ycck.jpg", "truncated_half.jpg",
                 *(f"exif_orient_{k}.jpg" for k in range(1, 9))):
        assert scan_end_error((CASES / name).read_bytes()) is None, name
    for p in sorted(PHOTOS.glob("*.jpg")):
        assert scan_end_error(p.read_bytes()) is None, p.name


def engine_dataset(root: Path, fmt: str) -> tuple[Path, set]:
    """3 good photos per class and one cut JPEG in each class, in ``fmt``; returns the root and
    the keys of the two cut files."""
    items = [(f"a/good{i}.jpg", photo(3 + i), 0) for i in range(3)] + [(f"b/good{i}.jpg", photo(6 + i), 1)
                                                                       for i in range(3)]
    items += [("a/half_then_whole.jpg", half_then_whole(), 0), ("b/motion_no_eoi.jpg", motion_without_eoi(), 1)]
    root.mkdir(parents=True)
    if fmt == "folder":
        for rel, data, _ in items:
            (root / rel).parent.mkdir(exist_ok=True)
            (root / rel).write_bytes(data)
        return root, {str(root / rel) for rel, _, _ in items[-2:]}
    if fmt == "tar":
        write_tar(root / "s.tar", [m for rel, data, lab in items
                                   for m in ((rel, data), (rel[:-4] + ".cls", str(lab).encode()))])
        return root, {f"{root / 's.tar'}:{rel}" for rel, _, _ in items[-2:]}
    pq.write_table(pa.table({"image": pa.array([d for _, d, _ in items], pa.binary()),
                             "label": pa.array([lab for _, _, lab in items])}), root / "p.parquet", row_group_size=3)
    return root, {f"{root / 'p.parquet'}#6", f"{root / 'p.parquet'}#7"}


def run_engine(src, engine):
    p = Pipeline(src, [Decode(), ResizeCenterCrop(64, 56)], batch_size=4, shuffle=False, seed=0, device="cpu",
                 engine=engine, num_workers=0, on_error="skip", max_skipped=None)
    loader = DataLoader(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = clone_all(loader)
    return out, loader.stats()


@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
def test_engines_agree_on_cut_jpegs(tmp_path, fmt):
    """Before: the DALI engine returned the half-decoded pixels of both files (no skip); the
    Python engine skipped them as corrupt."""
    pytest.importorskip("nvidia.dali")
    root, want = engine_dataset(tmp_path / "d", fmt)
    src = open_any(fmt, root)
    py, sp = run_engine(src, "python")
    da, sd = run_engine(src, {"name": "dali", "device": "cpu"})
    for stats in (sp, sd):
        assert stats["skipped"] == {"corrupt": 2}
        assert {k for k, _ in stats["skipped_keys"]} == want
    assert sd["engine"].get("dali_errors", 0) == 0
    import torch

    assert torch.equal(torch.cat([b.labels for b in py]), torch.cat([b.labels for b in da]))
    assert sum(len(b.labels) for b in da) == 8   # refilled from spares: 2 batches of 4


# -- 6. float and wide-integer TIFFs --------------------------------------------------------------------
def tiff(array: np.ndarray, mode: str, **tags) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, "TIFF", **tags)
    return buf.getvalue()


def test_float_tiffs_in_0_1_are_scaled_not_black():
    g = np.linspace(0, 1, 64 * 256, dtype=np.float32).reshape(64, 256)
    out = np.asarray(Decode().apply(tiff(g, "F")))
    assert out.shape == (64, 256, 3)
    assert np.array_equal(out[..., 0], np.rint(g.astype(np.float64) * 255).astype(np.uint8))
    assert len(np.unique(out)) == 256          # before: values 0 and 1 only (black)
    for bad in (g * 4, np.full_like(g, np.nan)):
        with pytest.raises(DecodeError) as info:
            Decode().apply(tiff(bad, "F"))
        assert info.value.reason == "unsupported pixel format"


def test_20_bit_integer_tiffs_are_scaled_not_clipped():
    v = np.linspace(0, 2**20 - 1, 64 * 256).astype(np.int32).reshape(64, 256)
    out = np.asarray(Decode().apply(tiff(v, "I")))[..., 0]
    top = 2**20 - 1
    assert np.array_equal(out, ((v.astype(np.int64) * 255 + top // 2) // top).astype(np.uint8))
    assert (out == 255).mean() < 0.01          # before: 94 % white
    assert np.all(np.diff(out.ravel().astype(int)) >= 0) and len(np.unique(out)) == 256
    v16 = np.linspace(0, 65535, 64 * 256).astype(np.int32).reshape(64, 256)   # 16-bit data in mode I
    out16 = np.asarray(Decode().apply(tiff(v16, "I")))[..., 0]
    assert np.array_equal(out16, ((v16.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8))
    with pytest.raises(DecodeError) as info:
        Decode().apply(tiff(v - 5, "I"))
    assert info.value.reason == "unsupported pixel format"


# -- 7. folder sources --------------------------------------------------------------------------------------
def test_hidden_folders_do_not_become_classes(tmp_path):
    """Before: ``.ipynb_checkpoints`` was class 0 and moved every label after it."""
    for cls in ("cat", "dog", ".ipynb_checkpoints"):
        (tmp_path / cls).mkdir()
    (tmp_path / "cat" / "a.jpg").write_bytes(small_jpeg(1))
    (tmp_path / "dog" / "b.jpg").write_bytes(small_jpeg(2))
    (tmp_path / "dog" / "._b.jpg").write_bytes(b"\x00\x05\x16\x07AppleDouble")
    (tmp_path / ".ipynb_checkpoints" / "c.jpg").write_bytes(small_jpeg(3))
    with pytest.warns(UserWarning, match=r"hidden folder.*\.ipynb_checkpoints"):
        src = FolderSource(tmp_path)
    assert src.classes == ["cat", "dog"] and src.labels.tolist() == [0, 1]
    assert [Path(src.key(i)).name for i in range(len(src))] == ["a.jpg", "b.jpg"]


def test_empty_class_folders_raise_as_torchvision_or_are_kept(tmp_path):
    for cls in ("a", "b", "c"):
        (tmp_path / cls).mkdir()
    (tmp_path / "a" / "x.jpg").write_bytes(small_jpeg(1))
    (tmp_path / "c" / "y.jpg").write_bytes(small_jpeg(2))
    (tmp_path / "b" / "notes.txt").write_text("no image")
    with pytest.raises(SourceError, match=r"class folder\(s\) b "):
        FolderSource(tmp_path)
    src = FolderSource(tmp_path, allow_empty=True)
    assert src.classes == ["a", "b", "c"] and src.labels.tolist() == [0, 2]   # c keeps its label


def test_unreadable_class_folders_raise_naming_them(tmp_path, monkeypatch):
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        (tmp_path / cls / "x.jpg").write_bytes(small_jpeg(1))
    locked = tmp_path / "b"
    real = os.scandir

    def scandir(path="."):
        if os.fspath(path) == str(locked):
            raise PermissionError(errno.EACCES, "Permission denied", str(locked))
        return real(path)

    os.chmod(locked, 0)   # no effect as root: the scandir patch stands in for it
    try:
        monkeypatch.setattr(os, "scandir", scandir)
        with pytest.raises(SourceError, match=rf"cannot list the folder {locked}: Permission denied"):
            FolderSource(tmp_path)
    finally:
        os.chmod(locked, 0o755)


def test_links_are_followed_once_and_broken_links_are_named(tmp_path):
    root = tmp_path / "d"
    (root / "a").mkdir(parents=True)
    (root / "c").mkdir()
    (root / "a" / "x.jpg").write_bytes(small_jpeg(1))
    (root / "c" / "z.jpg").write_bytes(small_jpeg(3))
    elsewhere, other = tmp_path / "elsewhere", tmp_path / "other"
    elsewhere.mkdir()
    other.mkdir()
    (elsewhere / "y.jpg").write_bytes(small_jpeg(2))
    (other / "w.jpg").write_bytes(small_jpeg(4))
    os.symlink(elsewhere, root / "a" / "linked")          # a sub-folder by link: followed
    os.symlink(root / "a", root / "a" / "loop")            # back to its parent: a loop
    os.symlink(root, root / "a" / "to_root")               # back to the dataset's root: a loop
    os.symlink(root / "c", root / "a" / "to_c")            # into another class: c's images stay c's
    os.symlink(elsewhere, root / "a" / "z_again")          # a second path to a folder indexed
    os.symlink(tmp_path / "gone.jpg", root / "a" / "dangling.jpg")
    os.symlink("self.jpg", root / "a" / "self.jpg")        # a link to itself
    os.symlink(other, root / "b")                          # a class folder by link
    with pytest.warns(UserWarning, match="dangling link"):
        src = FolderSource(root)
    assert src.classes == ["a", "b", "c"]
    assert [(src.paths[i], int(src.labels[i])) for i in range(len(src))] == [
        ("a/x.jpg", 0), ("a/linked/y.jpg", 0), ("b/w.jpg", 1), ("c/z.jpg", 2)]
    reasons = {Path(k).name: r for k, r in src.rejected}
    assert reasons == {"dangling.jpg": "dangling link", "self.jpg": "symlink loop", "loop": "symlink loop",
                       "to_root": "symlink loop", "to_c": "duplicate folder", "z_again":
                       "duplicate folder"}
    res = cli("scan", root, "--workers", 0)
    assert res.exit_code == 1 and "dangling link: 1" in res.output and "symlink loop: 3" in res.output


# -- 8. index-time rejects, exposed for the loader's stats ---------------------------------------------
def test_index_skips_group_every_index_time_reject_by_reason(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [("a.jpg", small_jpeg(1)), ("a.cls", b"1"), ("b.jpg", b""),
                                           ("b.cls", b"2"), ("c.cls", b"3")])
    src = quiet(TarShardSource, shard)
    assert src.index_skips == {"empty": [f"{shard}:b.jpg"], "no image": [f"{shard}:c.cls"]}
    report = scan_source(src, workers=0, progress=False)
    assert {(b.key, b.reason) for b in report.bad} == {(f"{shard}:b.jpg", "empty"), (f"{shard}:c.cls", "no image")}


# -- 9. Parquet row groups over 2 GiB --------------------------------------------------------------------
def test_parquet_reads_a_row_group_in_chunks_it_never_joins(tmp_path, monkeypatch):
    """A row group's image column is kept as the chunks it is read in (pieces of about
    ``READ_PIECE`` bytes, and Arrow gives a ``binary`` column of more than 2 GiB as several
    chunks): joining them would overflow ``binary``'s 32-bit offsets (``ArrowInvalid: offset
    overflow while concatenating arrays`` on the first batch, before). Here pieces of one row
    make a small group of 7 images 7 chunks, whole and in slices, for both column types; a real
    2.2 GiB row group was checked by hand."""
    import feedgpu.sources.parquet_parts as parts

    imgs = [small_jpeg(i) for i in range(7)]
    monkeypatch.setattr(parts, "READ_PIECE", 1)
    for typ in (pa.binary(), pa.large_binary()):
        path = tmp_path / f"{typ}.parquet"
        pq.write_table(pa.table({"image": pa.array(imgs, typ), "label": list(range(7))}), path)
        src = ParquetSource(path)
        assert payloads(src) == list(enumerate(imgs))
        whole = src._parts.entries[(0, 0, -1)]
        assert len(whole.chunks) == 7 and whole.chunks[0].type == typ
    # slices of a group over the slice budget: whole numbers of pieces, kept as chunks
    monkeypatch.setattr(parts, "READ_PIECE", 100_000)
    rng = np.random.default_rng(1)
    blobs = [rng.integers(0, 256, 30_000 + i, dtype=np.uint8).tobytes() for i in range(100)]   # ~3 MB
    path = tmp_path / "sliced.parquet"
    pq.write_table(pa.table({"image": pa.array(blobs, pa.binary()), "label": list(range(100))}), path,
                   row_group_size=100, compression="none")
    src = ParquetSource(path, cache_bytes=1 << 20)
    order = [99, 0, 50, 51, 3, 98, 33]
    assert [bytes(src.read(i).payload) for i in order] == [blobs[i] for i in order]
    k = src._parts.slicing[(0, 0)]
    assert k == 33 and all(len(p.chunks) == 11 for key, p in src._parts.entries.items() if key[2] < 3)


def test_loader_stats_can_count_index_time_rejects(tmp_path):
    """What the loader needs to put index-time rejects in ``stats()["skipped"]``: one call of
    ``LoaderStats.add_index_skips(source)`` when the loader is made (wired in feedgpu/loader/front.py)."""
    from feedgpu.metrics import LoaderStats

    shard = write_tar(tmp_path / "s.tar", [("a.jpg", small_jpeg(1)), ("a.cls", b"1"), ("b.jpg", b""),
                                           ("b.cls", b"2")])
    src = quiet(TarShardSource, shard)
    stats = LoaderStats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the source warned already
        stats.add_index_skips(src)
    d = stats.as_dict()
    assert d["skipped"] == {"empty": 1} and d["skipped_keys"] == [(f"{shard}:b.jpg", "empty")]
    assert d["skipped_while_indexing"] == 1


# -- skip accounting: one count per bad sample ------------------------------------------------------------
def test_a_bad_sample_met_again_as_a_spare_is_one_skip():
    """Before: a batch of 1 whose spares drew the same bad file again reported "5 bad samples in
    one batch of 1", and the budget counted one file 3 times."""
    from feedgpu.errors import SampleError, SkipBudgetExceeded
    from feedgpu.exec.assemble import Spares

    tried = []

    def fn(i):
        tried.append(i)
        if i in (1, 3):
            raise SampleError(f"k{i}", "corrupt")
        return i

    skipped: list = []
    s = Spares(np.array([1, 1, 3, 1, 2]), "skip", skipped, 1)
    assert s.run(fn, 3) == 2
    assert skipped == [("k3", "corrupt", ""), ("k1", "corrupt", "")] and tried == [3, 1, 2]   # each read once
    s = Spares(np.array([1, 3, 1, 3]), "skip", [], 1)
    with pytest.raises(SkipBudgetExceeded, match="^2 bad sample"):
        s.run(fn, 1)


@pytest.mark.parametrize("engine", ["python", "dali"])
def test_two_bad_files_among_four_are_two_skips(tmp_path, engine):
    if engine == "dali":
        pytest.importorskip("nvidia.dali")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "0.jpg").write_bytes(photo(0))
    (tmp_path / "a" / "1.jpg").write_bytes(b"<html>not found</html>")
    (tmp_path / "a" / "2.jpg").write_bytes(photo(1))
    (tmp_path / "a" / "3.jpg").write_bytes(photo(2)[:5000])
    src = FolderSource(tmp_path)
    for seed in range(4):
        p = Pipeline(src, [Decode(), ResizeCenterCrop(32, 32)], batch_size=1, shuffle=True, seed=seed, device="cpu",
                     engine=engine if engine == "python" else {"name": "dali", "device": "cpu"}, num_workers=0,
                     on_error="skip", max_skipped=2)
        loader = DataLoader(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = sum(len(b.labels) for b in loader)
        assert rows == 4
        assert loader.stats()["skipped"] == {"not an image": 1, "truncated": 1}, seed


def test_a_tiff_compression_without_its_decoder_is_unsupported_not_corrupt():
    """LZW / JPEG-in-TIFF on a PIL build without libtiff: "unsupported format", not "corrupt"."""
    import struct

    from PIL import features

    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "TIFF")
    d = bytearray(buf.getvalue())
    ifd = struct.unpack("<I", d[4:8])[0]
    for i in range(struct.unpack("<H", d[ifd:ifd + 2])[0]):
        e = ifd + 2 + 12 * i
        if struct.unpack("<H", d[e:e + 2])[0] == 259:   # Compression
            d[e + 8:e + 10] = struct.pack("<H", 5)       # LZW (the strip is not LZW data)
    with pytest.raises(DecodeError) as info:
        Decode().apply(bytes(d))
    assert info.value.reason == ("corrupt" if features.check("libtiff") else "unsupported format")


# -- scan reads every file of a download ----------------------------------------------------------------
def test_scan_reads_a_flat_folder_and_ignores_a_stray_tar(tmp_path):
    """Before: "has no class sub-folders" on a flat folder, and a scan of only the .tar when one
    sat among the class folders."""
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.jpg").write_bytes(photo(0))
    (flat / "b.jpg").write_bytes((CASES / "truncated_half.jpg").read_bytes())
    (flat / "c.png").write_bytes((CASES / "gray16.png").read_bytes())
    res = cli("scan", flat, "--workers", 0, "--json", "-")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.output)
    assert doc["samples"] == 3 and [(Path(b["key"]).name, b["reason"]) for b in doc["bad"]] == [("b.jpg", "truncated")]
    classes = tmp_path / "classes"
    (classes / "x").mkdir(parents=True)
    (classes / "x" / "a.jpg").write_bytes(photo(1))
    (classes / "x" / "b.jpg").write_bytes(b"")
    write_tar(classes / "extra.tar", [("k.jpg", photo(2)), ("k.cls", b"0")])
    res = cli("scan", classes, "--workers", 0, "--json", "-")
    doc = json.loads(res.output)
    assert res.exit_code == 1 and doc["format"] == "folder" and doc["samples"] == 1
    assert [(Path(b["key"]).name, b["reason"]) for b in doc["bad"]] == [("b.jpg", "empty")]


# -- property: random datasets with a random mix of bad records, every format, both engines ---------------
#: kind -> (formats it applies to, what happens to it: "good", ("index", reason) or ("decode", reason))
KINDS = {
    "good": ("ftp", "good"),
    "dotted": ("ftp", "good"),                    # img.v2.<id>.jpg
    "non_utf8": ("ft", "good"),                   # a name with a Latin-1 byte
    "truncated": ("ftp", ("decode", "truncated")),
    "cut_then_whole": ("ftp", ("decode", "corrupt")),
    "html": ("ftp", ("decode", "not an image")),
    "empty_index": ("ft", ("index", "empty")),
    "empty_read": ("p", ("decode", "empty")),     # Parquet finds it when the row is read
    "dangling": ("f", ("index", "dangling link")),
    "missing_label": ("tp", ("index", "missing label")),
    "duplicate": ("t", ("index", "duplicate key")),   # two images of one key: both records named
}


def random_dataset(rng, fmt: str, root: Path, n: int = 16):
    """Records with label = record id, 10 good ones and 6 of random kinds; returns ``({id:
    outcome}, records)`` (a duplicate is two records)."""
    letter = fmt[0]
    kinds = [k for k, (fmts, _) in KINDS.items() if letter in fmts]
    picks = ["good"] * 10 + list(rng.choice(kinds, size=n - 10))
    rng.shuffle(picks)
    expect, members, rows = {}, [], []
    root.mkdir(parents=True)
    for i, kind in enumerate(picks):
        data = photo(int(rng.integers(0, 30)))
        name = {"dotted": f"img.v2.{i:04d}.jpg", "non_utf8": os.fsdecode(b"caf\xe9%d.jpg" % i)}.get(kind, f"p{i}.jpg")
        if kind == "truncated":
            data = data[:len(data) // 2]
        elif kind == "cut_then_whole":
            data = data[:len(data) // 2] + photo(0)
        elif kind == "html":
            data = b"<html><body>404</body></html>"
        elif kind in ("empty_index", "empty_read"):
            data = b""
        expect[i] = KINDS[kind][1]
        if fmt == "folder":
            (root / f"c{i:02d}").mkdir()
            path = root / f"c{i:02d}" / name
            if kind == "dangling":
                os.symlink(root / "nowhere.jpg", path)
            else:
                path.write_bytes(data)
        elif fmt == "tar":
            members.append((f"c{i:02d}/{name}", data))
            if kind == "duplicate":
                members.append((f"c{i:02d}/{name[:-4]}.png", photo(1)))
            if kind != "missing_label":
                members.append((f"c{i:02d}/{name[:-4]}.cls", str(i).encode()))
        else:
            rows.append((data, None if kind == "missing_label" else i))
    if fmt == "tar":
        write_tar(root / "s-000000.tar", members)
    elif fmt == "parquet":
        pq.write_table(pa.table({"image": pa.array([d for d, _ in rows], pa.binary()),
                                 "label": pa.array([lab for _, lab in rows], pa.int64())}), root / "p.parquet",
                       row_group_size=4)
    records = len(expect) + sum(1 for i, k in enumerate(picks) if k == "duplicate")
    return expect, records


def open_any(fmt, root):
    return quiet({"folder": FolderSource, "tar": TarShardSource, "parquet": ParquetSource}[fmt], root)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
def test_random_datasets_conserve_every_record(tmp_path, fmt, seed):
    expect, records = random_dataset(np.random.default_rng([seed, len(fmt)]), fmt, tmp_path / fmt)
    src = open_any(fmt, tmp_path / fmt)
    good = {i for i, o in expect.items() if o == "good"}
    decode_bad = {i: o[1] for i, o in expect.items() if o != "good" and o[0] == "decode"}
    index_bad = [o[1] for o in expect.values() if o != "good" and o[0] == "index"]
    index_bad += ["duplicate key"] * (records - len(expect))
    # the source: every record indexed with its label, or named with its reason
    assert sorted(r for _, r in src.rejected) == sorted(index_bad)
    assert sorted(src.labels.tolist()) == sorted(good | set(decode_bad))
    assert len(src) + len(src.rejected) == records
    engines = ["python"]
    try:
        import nvidia.dali  # noqa: F401

        engines.append({"name": "dali", "device": "cpu"})
    except ImportError:
        pass
    for engine in engines:
        # one batch: its spares hold every sample, so the bad ones are always replaced
        p = Pipeline(src, [Decode(), ResizeCenterCrop(40, 32)], batch_size=32, shuffle=False, seed=seed, device="cpu",
                     engine=engine, num_workers=0, on_error="skip", max_skipped=None)
        loader = DataLoader(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            labels = [int(x) for b in loader for x in b.labels]
        st = loader.stats()
        # delivered: every good record (spares repeat some); skipped: each bad one once, by reason
        assert set(labels) == good, engine
        assert len(labels) == len(src)
        # stats count what the source left out while indexing too
        assert sorted(r for r, c in st["skipped"].items() for _ in range(c)) == \
            sorted(index_bad + list(decode_bad.values())), engine
        assert st["skipped_while_indexing"] == len(src.rejected), engine
        assert st["skipped_total"] + len(set(labels)) == records, engine
    # scan: every bad record named once, with its reason
    report = scan_source(src, workers=0, progress=False)
    assert sorted(b.reason for b in report.bad) == sorted(index_bad + list(decode_bad.values()))
    assert len(report.bad) + len(good) == records
    # convert, each direction that exists: the same records with their labels, the rest listed
    from feedgpu.convert import folder_to_parquet, folder_to_tar, shards_to_parquet

    outs = {"folder": [(folder_to_tar, TarShardSource), (folder_to_parquet, ParquetSource)],
            "tar": [(shards_to_parquet, ParquetSource)], "parquet": []}[fmt]
    for k, (convert, reader) in enumerate(outs):
        done = quiet(convert, tmp_path / fmt, tmp_path / f"out{k}")
        assert done.samples == len(src) and done.left_out == src.rejected
        back = reader(tmp_path / f"out{k}")
        assert back.rejected == [] and payloads(back) == payloads(src)


def test_the_jpeg_end_check_reads_signed_buffers_as_bytes():
    """A Parquet payload is a memoryview of format "b" (signed): read as unsigned bytes, the
    check gives the answer it gives for bytes (the property test above found the DALI engine
    decoding a cut JPEG from Parquet)."""
    from feedgpu.stages.jpeg_header import scan_end_error

    data = half_then_whole()
    signed = memoryview(pa.py_buffer(data))
    assert signed.format == "b"
    assert scan_end_error(signed) == scan_end_error(data) is not None
    with pytest.raises(DecodeError):
        Decode().header(signed)


def test_parquet_reads_a_large_row_group_in_bounded_slices(tmp_path):
    """A row group bigger than the slice budget is never held whole: reads in any order give the
    right bytes, and the process holds about cache_bytes plus one slice."""
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, 30_000 + i, dtype=np.uint8).tobytes() for i in range(100)]   # ~3 MB
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"image": pa.array(blobs, pa.binary()), "label": list(range(100))}), path,
                   row_group_size=100, compression="none")
    assert pq.ParquetFile(path).num_row_groups == 1
    src = ParquetSource(path, cache_bytes=1 << 20)
    order = list(range(100)) + rng.permutation(100).tolist()
    most = 0
    for i in order:
        rec = src.read(i)
        assert bytes(rec.payload) == blobs[i] and rec.label == i
        most = max(most, src._parts.cached)
    k = src._parts.slicing[(0, 0)]
    assert 0 < k < 100 and all(key[2] >= 0 for key in src._parts.entries)
    assert most <= (1 << 20) + k * 31_000


def test_many_index_rejects_warn_twenty_names_and_a_count(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [("ok.jpg", small_jpeg(0)), ("ok.cls", b"0")]
                      + [(f"e{i:02d}.jpg", b"") for i in range(25)] + [(f"e{i:02d}.cls", b"1") for i in range(25)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = TarShardSource(shard)
    msgs = [str(w.message) for w in caught]
    assert len(src.rejected) == 25 and len(msgs) == 21
    assert msgs[-1].startswith("feedgpu: skipped 5 more records while indexing (empty: 5)")


def test_converted_parquet_pages_stay_small(colliding_folder, tmp_path):
    """A reader holds a whole page: converted files keep pages of ~1 MiB and no dictionary on
    the image column, whatever the image size."""
    from feedgpu.convert import folder_to_parquet

    files = folder_to_parquet(colliding_folder, tmp_path / "pq")
    md = pq.ParquetFile(files[0]).metadata.row_group(0)
    image = next(md.column(j) for j in range(md.num_columns) if md.column(j).path_in_schema == "image")
    assert "RLE_DICTIONARY" not in image.encodings and "PLAIN_DICTIONARY" not in image.encodings


def test_an_archive_appended_to_a_shard_is_named_not_dropped_silently(tmp_path):
    a = write_tar(tmp_path / "a.tar", [("a.jpg", small_jpeg(0)), ("a.cls", b"0")])
    b = write_tar(tmp_path / "b.tar", [("b.jpg", small_jpeg(1)), ("b.cls", b"1")])
    both = tmp_path / "both" / "ab.tar"
    both.parent.mkdir()
    both.write_bytes(a.read_bytes() + b.read_bytes())
    src = quiet(TarShardSource, both)
    assert src.labels.tolist() == [0] and src.rejected == [(str(both), "corrupt shard")]
    assert "appended" in src.rejected_details[str(both)]
    assert TarShardSource(a).rejected == []   # a plain shard's zero padding is not data


def test_markers_libjpeg_passes_over_are_not_a_cut():
    """TEM (FF 01) inside the data and fill bytes before EOI are what libjpeg passes over: not
    corrupt; a reserved marker (FF 3F) is what it stops on."""
    from feedgpu.stages.jpeg_header import scan_end_error

    whole = photo(4)
    assert scan_end_error(whole[:-2] + b"\xff\x01\xff\xff\xff\xd9") is None
    assert scan_end_error(whole[:-2] + b"\xff\x3f\xff\xd9") is not None
