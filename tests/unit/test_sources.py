"""Sources: the same data through folder, tar shards and Parquet; keys; indexing; index arrays."""
from __future__ import annotations

import hashlib
import io
import os
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from conftest import N_IMAGES, PHOTOS
from feedgpu import DatasetSource, FolderSource, ParquetSource, SourceError, TarShardSource
from feedgpu.sources import open_source


def _content(src) -> list[tuple[int, str]]:
    return sorted((src.read(i).label, hashlib.sha1(bytes(src.read(i).payload)).hexdigest()) for i in range(len(src)))


def test_three_formats_hold_the_same_samples(sources, folder_ds):
    folder = sources["folder"]
    assert len(folder) == N_IMAGES
    assert folder.classes == sorted(d.name for d in folder_ds.iterdir() if d.is_dir())
    expected = _content(folder)
    assert len({h for _, h in expected}) == N_IMAGES  # every image is distinct
    assert len({lab for lab, _ in expected}) == len(folder.classes)
    for fmt in ("tar", "parquet"):
        assert len(sources[fmt]) == N_IMAGES, fmt
        assert _content(sources[fmt]) == expected, fmt


def test_folder_records_match_files(sources, folder_ds):
    src = sources["folder"]
    for i in (0, 57, N_IMAGES - 1):
        rec = src.read(i)
        path = Path(rec.key)
        assert path.is_file() and path.is_relative_to(folder_ds)
        assert bytes(rec.payload) == path.read_bytes()
        assert src.classes[rec.label] == path.parent.name
        assert src.key(i) == rec.key


def test_tar_keys_name_shard_and_member(sources, tar_ds, folder_ds):
    src = sources["tar"]
    for i in (0, 60, N_IMAGES - 1):
        rec = src.read(i)
        shard, _, member = rec.key.rpartition(":")
        assert Path(shard).parent == tar_ds and shard.endswith(".tar")
        with tarfile.open(shard) as tf:
            assert tf.extractfile(member).read() == bytes(rec.payload)
        # convert keeps <class>/<name>: the member names the original file
        assert (folder_ds / member).read_bytes() == bytes(rec.payload)


def test_parquet_keys_name_file_and_row(sources, parquet_ds):
    src = sources["parquet"]
    seen_files = set()
    for i in range(len(src)):
        rec = src.read(i)
        file, sep, row = rec.key.rpartition("#")
        assert sep and Path(file).parent == parquet_ds, rec.key
        assert row.isdigit(), f"key {rec.key!r} should end with '#<row in file>'"
        table = pq.read_table(file, columns=["image", "label"])
        assert table.column("image")[int(row)].as_py() == bytes(rec.payload), rec.key
        assert table.column("label")[int(row)].as_py() == rec.label
        seen_files.add(file)
    assert len(seen_files) == 3


def _no_per_sample_python_objects(src, n):
    for name, value in vars(src).items():
        if isinstance(value, (list, tuple, dict, set)):
            assert len(value) < n, f"{type(src).__name__}.{name} holds one Python object per sample"


def test_index_is_numpy_arrays(sources):
    folder, tar, parquet = sources["folder"], sources["tar"], sources["parquet"]
    for arr in (folder.paths.blob, folder.paths.offsets, folder.labels, folder.sizes, folder.mtimes,
                tar.members.blob, tar.members.offsets, tar.shard_ids, tar.offsets, tar.sizes, tar.labels,
                parquet.file_ids, parquet.row_groups, parquet.rows, parquet.labels):
        assert isinstance(arr, np.ndarray)
    for src in (folder, tar, parquet):
        assert src.labels.dtype == np.int64 and src.labels.shape == (N_IMAGES,)
        assert src.labels.min() >= 0
        _no_per_sample_python_objects(src, N_IMAGES)
    assert len(folder.paths) == len(tar.members) == N_IMAGES
    assert folder.paths.blob.dtype == np.uint8


def test_identity_is_stable_and_tracks_content(folder_ds, tmp_path):
    a, b = FolderSource(folder_ds), FolderSource(folder_ds)
    assert a.identity() == b.identity()
    # the same files under another root with one file changed
    copy = tmp_path / "copy"
    for p in sorted(folder_ds.rglob("*.jpg"))[:20]:
        (copy / p.parent.name).mkdir(parents=True, exist_ok=True)
        (copy / p.parent.name / p.name).write_bytes(p.read_bytes())
    before = FolderSource(copy).identity()
    victim = sorted(copy.rglob("*.jpg"))[3]
    victim.write_bytes(victim.read_bytes() + b"\0")
    assert FolderSource(copy).identity() != before
    assert len({FolderSource(folder_ds).identity(), TarShardSource(_tar_of(copy, tmp_path)).identity()}) == 2


def _tar_of(folder: Path, tmp: Path) -> Path:
    out = tmp / "one.tar"
    with tarfile.open(out, "w") as tf:
        for p in sorted(folder.rglob("*.jpg")):
            tf.add(p, arcname=f"{p.parent.name}/{p.name}")
    return out


# -- empty files are found while indexing -------------------------------------------------------
def _jpeg(seed=0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 48, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_folder_rejects_empty_files_while_indexing(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.jpg").write_bytes(_jpeg(1))
    (tmp_path / "a" / "empty.jpg").write_bytes(b"")
    (tmp_path / "b" / "y.JPG").write_bytes(_jpeg(2))
    (tmp_path / "b" / "notes.txt").write_text("not indexed")
    with pytest.warns(UserWarning, match=r"empty\.jpg.*empty"):
        src = FolderSource(tmp_path)
    assert src.rejected == [(str(tmp_path / "a" / "empty.jpg"), "empty")]
    assert len(src) == 2
    assert src.classes == ["a", "b"]
    assert src.labels.tolist() == [0, 1]
    assert [Path(src.key(i)).name for i in range(2)] == ["x.jpg", "y.JPG"]


def test_tar_rejects_empty_members_while_indexing(tmp_path):
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tf:
        for name, data in (("k1.jpg", _jpeg(1)), ("k1.cls", b"3"), ("k2.jpg", b""), ("k2.cls", b"1"),
                           ("k3.png", _jpeg(3)), ("k4.cls", b"0"), ("../evil.jpg", _jpeg(4)), ("../evil.cls", b"2")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with pytest.warns(UserWarning, match=r"k2\.jpg.*empty"):
        src = TarShardSource(shard)
    # k3 has no label in a labelled shard, k4 a label but no image: both named, never a -1
    assert src.rejected == [(f"{shard}:k2.jpg", "empty"), (f"{shard}:k4.cls", "no image"),
                            (f"{shard}:k3.png", "missing label")]
    assert [src.key(i) for i in range(len(src))] == [f"{shard}:k1.jpg", f"{shard}:../evil.jpg"]
    assert src.labels.tolist() == [3, 2]
    assert bytes(src.read(0).payload) == _jpeg(1)
    assert bytes(src.read(1).payload) == _jpeg(4)
    assert not (tmp_path.parent / "evil.jpg").exists()  # member names are keys, never paths


def test_parquet_null_and_empty_images_are_read_as_empty(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": pa.array([_jpeg(1), b"", None, _jpeg(2)], pa.binary()),
                             "label": pa.array([1, 2, 0, None], pa.int32())}), path)
    with pytest.warns(UserWarning, match=r"t\.parquet#3 while indexing: missing label"):
        src = ParquetSource(path)
    assert len(src) == 3
    assert src.labels.tolist() == [1, 2, 0]  # the null label is left out, never a -1
    assert src.rejected == [(f"{path}#3", "missing label")]
    assert bytes(src.read(0).payload) == _jpeg(1)
    assert len(src.read(1).payload) == 0 and len(src.read(2).payload) == 0


# -- errors while opening ------------------------------------------------------------------------
def test_source_errors(tmp_path):
    with pytest.raises(SourceError, match="not a directory"):
        FolderSource(tmp_path / "missing")
    with pytest.raises(SourceError, match="class sub-folders"):
        FolderSource(tmp_path)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "readme.txt").write_text("x")
    with pytest.raises(SourceError, match="no images"):
        FolderSource(tmp_path)
    with pytest.raises(SourceError, match="no shards"):
        TarShardSource(tmp_path / "nothing-*.tar")
    gz = tmp_path / "x.tar"
    with tarfile.open(gz, "w:gz") as tf:
        info = tarfile.TarInfo("a.jpg")
        data = _jpeg()
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(SourceError, match="uncompressed"):
        TarShardSource(gz)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"img": [b"x"], "label": [1]}), bad)
    with pytest.raises(SourceError, match="no column 'image'"):
        ParquetSource(bad)
    pq.write_table(pa.table({"image": ["text"], "label": [1]}), bad)
    with pytest.raises(SourceError, match="expected binary"):
        ParquetSource(bad)
    with pytest.raises(ValueError, match="allowed: folder, tar, parquet"):
        open_source("zip", tmp_path)


def test_parquet_columns_are_configurable(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"jpeg": pa.array([_jpeg(1), _jpeg(2)], pa.binary()), "cls": [5, 7]}), path)
    src = ParquetSource(str(tmp_path / "*.parquet"), image_column="jpeg", label_column="cls")
    assert src.labels.tolist() == [5, 7]
    assert bytes(src.read(1).payload) == _jpeg(2)
    unlabeled = ParquetSource([path], image_column="jpeg", label_column=None)
    assert unlabeled.labels.tolist() == [-1, -1]


def test_parquet_reads_after_fork_use_their_own_handles(sources):
    """The row-group cache is per process: a forked child reads correct bytes."""
    src = sources["parquet"]
    want = bytes(src.read(5).payload)  # fills the parent's cache
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            ok = bytes(src.read(5).payload) == want and bytes(src.read(100).payload) == bytes(src.read(100).payload)
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1"


# -- torch Dataset -------------------------------------------------------------------------------
class PhotoDataset(torch.utils.data.Dataset):
    """Items: (PIL image, label); like torchvision's ImageFolder without transforms."""

    classes = ["p0", "p1", "p2"]

    def __init__(self):
        self.files = sorted(PHOTOS.glob("*.jpg"))[:3]

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return Image.open(self.files[i]), i


def test_dataset_source_wraps_a_torch_dataset():
    ds = PhotoDataset()
    src = DatasetSource(ds)
    assert len(src) == 3 and src.classes == ["p0", "p1", "p2"]
    rec = src.read(2)
    assert rec.key == "PhotoDataset[2]" and rec.label == 2
    assert isinstance(rec.payload, Image.Image)

    class Unlabeled(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.zeros((4, 4, 3), np.uint8)

    rec = DatasetSource(Unlabeled()).read(1)
    assert rec.label == -1 and rec.payload.shape == (4, 4, 3)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield 1

    with pytest.raises(SourceError, match="map-style"):
        DatasetSource(Stream())
    assert DatasetSource(ds).identity() == DatasetSource(PhotoDataset()).identity()


def test_pipeline_over_a_torch_dataset_decodes_pil_and_arrays():
    from feedgpu import DataLoader, Pipeline
    from feedgpu.stages import Decode, ResizeCenterCrop

    class Mixed(torch.utils.data.Dataset):
        def __init__(self):
            self.files = sorted(PHOTOS.glob("*.jpg"))[:4]

        def __len__(self):
            return 4

        def __getitem__(self, i):
            img = Image.open(self.files[i])
            if i == 1:
                return np.asarray(img.convert("RGB")), i          # HWC uint8 array
            if i == 2:
                return torch.from_numpy(np.asarray(img.convert("RGB")).copy()), i  # HWC uint8 tensor
            if i == 3:
                return self.files[i].read_bytes(), i              # encoded bytes
            return img, i                                         # PIL image

    p = Pipeline(Mixed(), [Decode(), ResizeCenterCrop(64, 48)], batch_size=4, shuffle=False, num_workers=0,
                 device="cpu")
    (batch,) = list(DataLoader(p))
    assert batch.images.shape == (4, 48, 48, 3) and batch.images.dtype == torch.uint8
    assert batch.labels.tolist() == [0, 1, 2, 3]
    ref = ResizeCenterCrop(64, 48)
    for i, f in enumerate(Mixed().files):
        want = np.asarray(ref.apply(Image.open(f).convert("RGB")))
        np.testing.assert_array_equal(batch.images[i].numpy(), want)


def test_open_source_by_name(folder_ds, tar_ds, parquet_ds):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report for clean data
        assert isinstance(open_source("folder", folder_ds), FolderSource)
        assert isinstance(open_source("tar", str(tar_ds / "*.tar")), TarShardSource)
        assert isinstance(open_source("parquet", [str(p) for p in sorted(parquet_ds.glob("*.parquet"))]),
                          ParquetSource)
