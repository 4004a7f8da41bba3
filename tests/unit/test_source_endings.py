"""Folders given to a source: every file that is the source's is read whatever the case of its
ending (Parquet sub-folders too), the rest is named in one warning, compressed tar shards are
refused by name; the folder, tar and Parquet sources share one list of image endings."""
from __future__ import annotations

import gzip
import io
import os
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from conftest import PHOTOS
from feedgpu import FolderSource, ParquetSource, SourceError, TarShardSource
from feedgpu.sources import extensions
from feedgpu.sources.tar import members as tar_members


def photo(i: int) -> bytes:
    return sorted(PHOTOS.glob("*.jpg"))[i].read_bytes()


def encoded(i: int, fmt: str) -> bytes:
    """Photo ``i`` (cut small) encoded as ``fmt`` (a Pillow format name)."""
    with Image.open(io.BytesIO(photo(i))) as im:
        im = im.convert("L" if fmt == "PPM-gray" else "RGB").resize((40, 30))
        buf = io.BytesIO()
        im.save(buf, "PPM" if fmt == "PPM-gray" else fmt)
    return buf.getvalue()


def write_tar(path: Path, members) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def pairs(i: int, ext: str = "jpg") -> list:
    return [(f"k{i}.{ext}", photo(i)), (f"k{i}.cls", str(i).encode())]


def messages(w) -> list[str]:
    return [str(x.message) for x in w]


def test_one_list_of_image_endings():
    assert tar_members.IMAGE_SUFFIXES == tuple(e[1:] for e in extensions.IMAGE_EXTENSIONS)
    import inspect

    from feedgpu.sources import folder

    assert inspect.signature(folder.FolderSource).parameters["extensions"].default is extensions.IMAGE_EXTENSIONS
    assert ".pgm" in extensions.IMAGE_EXTENSIONS and "pgm" in tar_members.IMAGE_SUFFIXES


def test_a_tar_folder_reads_shards_of_any_case_and_names_what_it_leaves_out(tmp_path):
    write_tar(tmp_path / "a.tar", pairs(0) + pairs(1))
    write_tar(tmp_path / "B.TAR", pairs(2, "JPG") + pairs(3, "Jpeg"))
    write_tar(tmp_path / "c.Tar", [("k4.PGM", encoded(4, "PPM-gray")), ("k4.cls", b"4")])
    (tmp_path / "_classes.txt").write_text("")          # feedgpu's own files: no word
    (tmp_path / "a.tar.feedgpu-index").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("hello")
    write_tar((tmp_path / "sub").mkdir() or tmp_path / "sub" / "s.tar", pairs(5))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        src = TarShardSource(tmp_path, index_dir=False)
    assert [Path(s).name for s in src.shards] == ["B.TAR", "a.tar", "c.Tar"]
    assert sorted(src.labels.tolist()) == [0, 1, 2, 3, 4] and src.rejected == []
    left = [m for m in messages(w) if "left out" in m]
    assert len(left) == 1 and str(tmp_path / "notes.txt") in left[0] and "not tar shards" in left[0]
    assert f"1 shard(s) in sub-folders (give the sub-folder, a glob or a list to read them): {tmp_path / 'sub' / 's.tar'}" \
        in left[0]
    assert "_classes.txt" not in left[0] and "feedgpu-index" not in left[0]


@pytest.mark.parametrize("name", ["d.tar.gz", "e.tgz", "f.TAR.GZ", "g.tar.zst"])
def test_a_tar_folder_with_compressed_shards_is_refused_naming_them(tmp_path, name):
    """Before: the compressed shards were skipped without a word (2 of 8 samples read)."""
    write_tar(tmp_path / "a.tar", pairs(0))
    plain = write_tar(tmp_path / "plain.tmp", pairs(1)).read_bytes()
    (tmp_path / name).write_bytes(gzip.compress(plain))
    (tmp_path / "plain.tmp").unlink()
    with pytest.raises(SourceError, match="compressed shard") as e:
        TarShardSource(tmp_path, index_dir=False)
    assert str(tmp_path / name) in str(e.value) and "a.tar" not in str(e.value).split(":", 1)[1]


def _parquet(path: Path, i: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"image": pa.array([photo(i), photo(i + 1)], pa.binary()),
                             "label": pa.array([i, i + 1], pa.int64())}), path)


def test_a_parquet_folder_reads_any_case_and_sub_folders_as_pyarrow_datasets_do(tmp_path):
    """Before: 2 of 8 rows (only ``*.parquet`` at the top)."""
    _parquet(tmp_path / "p0.parquet", 0)
    _parquet(tmp_path / "P1.PARQUET", 2)
    _parquet(tmp_path / "p2.parq", 4)
    _parquet(tmp_path / "sub" / "part-3.parquet", 6)
    _parquet(tmp_path / "_tmp" / "part-9.parquet", 20)     # "_" and "." folders: pyarrow skips them
    _parquet(tmp_path / ".hidden.parquet", 22)
    (tmp_path / "_SUCCESS").write_bytes(b"")
    (tmp_path / "readme.md").write_text("x")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        src = ParquetSource(tmp_path)
    assert [str(Path(f).relative_to(tmp_path)) for f in src.files] == ["P1.PARQUET", "p0.parquet", "p2.parq",
                                                                      "sub/part-3.parquet"]
    assert sorted(src.labels.tolist()) == list(range(8))
    left = [m for m in messages(w) if "left out" in m]
    assert len(left) == 1 and str(tmp_path / "readme.md") in left[0] and "_SUCCESS" not in left[0]


def test_pyarrow_reads_the_same_parquet_files(tmp_path):
    import pyarrow.dataset as ds

    for rel, i in (("p0.parquet", 0), ("sub/part-3.parquet", 6), ("sub/deeper/x.parquet", 10)):
        _parquet(tmp_path / rel, i)
    src = ParquetSource(tmp_path)
    theirs = sorted(ds.dataset(tmp_path, format="parquet").files)
    assert sorted(src.files) == theirs


def test_the_folder_source_reads_every_image_ending_in_any_case(tmp_path):
    exts = extensions.IMAGE_EXTENSIONS
    fmts = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP", ".bmp": "BMP", ".ppm": "PPM",
            ".pgm": "PPM-gray", ".tif": "TIFF", ".tiff": "TIFF", ".gif": "GIF"}
    assert set(fmts) == set(exts)
    (tmp_path / "c").mkdir()
    for i, e in enumerate(exts):
        name = f"f{i}{e.upper() if i % 2 else e}"
        (tmp_path / "c" / name).write_bytes(encoded(i, fmts[e]))
    src = FolderSource(tmp_path, index_dir=False)
    assert len(src) == len(exts) and src.rejected == []
    assert np.array_equal(src.labels, np.zeros(len(exts), np.int64))


def test_the_folder_source_names_the_files_it_leaves_out_once(tmp_path):
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        (tmp_path / cls / "x.JPG").write_bytes(photo(0 if cls == "a" else 1))
    (tmp_path / "a" / "y.heic").write_bytes(b"ftypheic")
    (tmp_path / "b" / "notes.txt").write_text("x")
    (tmp_path / "b" / ".DS_Store").write_bytes(b"")        # hidden: no word
    for d in (tmp_path / "a", tmp_path / "b", tmp_path):
        os.utime(d, (1_500_000_000, 1_500_000_000))         # old folders: the index is saved
    for saved in (False, True):                              # walked, then from the saved index
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            src = FolderSource(tmp_path, index_dir=tmp_path.parent / f"{tmp_path.name}-idx")
        assert src.from_saved_index == saved
        left = [m for m in messages(w) if "left out" in m]
        assert len(src) == 2 and len(left) == 1, messages(w)
        assert "left out 2 file(s)" in left[0] and "a/y.heic" in left[0] and "b/notes.txt" in left[0]
        assert ".DS_Store" not in left[0]


def test_scan_guesses_the_format_of_any_case(tmp_path):
    from feedgpu.scan import guess_format

    (tmp_path / "t").mkdir()
    write_tar(tmp_path / "t" / "A.TAR", pairs(0))
    _parquet(tmp_path / "p" / "x.PARQ", 0)
    assert guess_format(tmp_path / "t") == "tar" and guess_format(tmp_path / "t" / "A.TAR") == "tar"
    assert guess_format(tmp_path / "p") == "parquet" and guess_format(tmp_path / "p" / "x.PARQ") == "parquet"


def test_a_table_source_reads_the_same_parquet_files(tmp_path):
    from feedgpu.tabular.source import TableSource

    for rel, i in (("p0.parquet", 0), ("P1.PARQUET", 2), ("sub/part-3.parq", 4)):
        _parquet(tmp_path / rel, i)
    t = TableSource(tmp_path, columns=["label"])
    assert [str(Path(f).relative_to(tmp_path)) for f in t.paths] == ["P1.PARQUET", "p0.parquet", "sub/part-3.parq"]


def test_a_parquet_folder_with_a_link_loop_is_listed_once(tmp_path):
    _parquet(tmp_path / "sub" / "a.parquet", 0)
    os.symlink(tmp_path, tmp_path / "sub" / "up")
    src = ParquetSource(tmp_path)
    assert [str(Path(f).relative_to(tmp_path)) for f in src.files] == ["sub/a.parquet"]
