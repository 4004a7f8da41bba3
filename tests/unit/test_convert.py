"""``feedgpu convert`` (and ``feedgpu.convert``): folders and tar shards to Parquet files, folders
to tar shards; what comes out reads back, through the sources, as the same (label, bytes)."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from PIL import Image

from conftest import CASES, N_IMAGES, batches_equal, clone_all, open_format
from feedgpu import DataLoader, FolderSource, ParquetSource, Pipeline, TarShardSource
from feedgpu.stages import Decode, HorizontalFlip, Normalize, RandomResizedCrop

pytestmark = pytest.mark.timeout(60)


def cli(*args):
    from feedgpu.cli.main import main

    return CliRunner().invoke(main, [str(a) for a in args])


def records(src) -> list[tuple[int, bytes]]:
    return [(int(r.label), bytes(r.payload)) for r in (src.read(i) for i in range(len(src)))]


@pytest.fixture(scope="module")
def folder_records(sources):
    return records(sources["folder"])


def stem(folder_src: FolderSource, i: int) -> str:
    return str(Path(folder_src.paths[i]).with_suffix(""))


def test_folder_to_parquet(folder_ds, sources, folder_records, tmp_path):
    out = tmp_path / "pq"
    res = cli("convert", folder_ds, out, "--to", "parquet", "--per-file", 50)
    assert res.exit_code == 0, res.output
    assert f"wrote 3 parquet file(s) to {out}" in res.output
    files = sorted(out.glob("*.parquet"))
    assert [f.name for f in files] == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert [pq.ParquetFile(f).metadata.num_rows for f in files] == [50, 50, 20]
    src = ParquetSource(out)
    assert len(src) == N_IMAGES and records(src) == folder_records
    # metadata columns: the key (class/name), and format and size from the image header
    t = pq.read_table(files, columns=["key", "format", "width", "height", "label"])
    folder = sources["folder"]
    assert t.column("key").to_pylist() == [stem(folder, i) for i in range(N_IMAGES)]
    assert set(t.column("format").to_pylist()) == {"JPEG"}
    for i in (0, 57, N_IMAGES - 1):
        with Image.open(folder.key(i)) as im:
            assert (t.column("width")[i].as_py(), t.column("height")[i].as_py()) == im.size
    assert t.column("label").to_pylist() == folder.labels.tolist()


def test_tar_shards_to_parquet(tar_ds, folder_records, tmp_path):
    out = tmp_path / "pq"
    res = cli("convert", tar_ds, out, "--per-file", 1000)  # --to parquet is the default
    assert res.exit_code == 0, res.output
    assert "wrote 1 parquet file(s)" in res.output
    src = ParquetSource(out)
    assert records(src) == folder_records
    keys = pq.read_table(out, columns=["key"]).column("key").to_pylist()
    tar = TarShardSource(tar_ds)
    assert keys == [str(Path(tar.members[i]).with_suffix("")) for i in range(len(tar))]


def test_one_tar_shard_to_parquet(tar_ds, folder_records, tmp_path):
    shard = sorted(Path(tar_ds).glob("*.tar"))[1]
    res = cli("convert", shard, tmp_path / "pq")
    assert res.exit_code == 0, res.output
    assert records(ParquetSource(tmp_path / "pq")) == folder_records[50:100]


def test_folder_to_tar(folder_ds, folder_records, sources, tmp_path):
    out = tmp_path / "tar"
    res = cli("convert", folder_ds, out, "--to", "tar", "--per-file", 50)
    assert res.exit_code == 0, res.output
    assert f"wrote 3 tar file(s) to {out}" in res.output
    shards = sorted(out.glob("*.tar"))
    assert [s.name for s in shards] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    src = TarShardSource(out)
    assert records(src) == folder_records
    with tarfile.open(shards[0]) as tf:
        names = tf.getnames()
    folder = sources["folder"]
    assert names[:2] == [f"{stem(folder, 0)}.jpg", f"{stem(folder, 0)}.cls"] and len(names) == 100


def test_tar_to_tar_is_refused(tar_ds, tmp_path):
    res = cli("convert", tar_ds, tmp_path / "out", "--to", "tar")
    assert res.exit_code == 2 and "already tar shards" in res.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bad_arguments(folder_ds, tmp_path):
    res = cli("convert", tmp_path / "missing", tmp_path / "out")
    assert res.exit_code == 2 and "does not exist" in res.output
    res = cli("convert", folder_ds, tmp_path / "out", "--to", "zip")
    assert res.exit_code == 2 and "'zip' is not one of 'parquet', 'tar'" in res.output


def test_converted_parquet_gives_the_folder_batches(folder_ds, tmp_path):
    cli("convert", folder_ds, tmp_path / "pq", "--per-file", 40)

    def batches(src):
        p = Pipeline(src, [Decode(), RandomResizedCrop(48), HorizontalFlip(), Normalize()], batch_size=16,
                     num_workers=0, device="cpu", seed=3)
        loader = DataLoader(p)
        out = clone_all(loader)
        loader.shutdown()
        return out

    got, want = batches(ParquetSource(tmp_path / "pq")), batches(FolderSource(folder_ds))
    assert len(got) == 8 and batches_equal(got, want)


def test_hard_cases_are_converted_as_they_are(cases_datasets, tmp_path):
    """Bad files go through unchanged (they are skipped when read); the empty file is left out
    while indexing; the header columns tell what each file is."""
    folder = open_format("folder", cases_datasets["folder"])
    assert [Path(k).name for k, _ in folder.rejected] == ["empty.jpg"]
    with pytest.warns(UserWarning, match="empty.jpg while indexing: empty"):
        res = cli("convert", cases_datasets["folder"], tmp_path / "pq")
    # exit 1: written, but a record of the source is left out (named, with its reason)
    assert res.exit_code == 1 and "left out 1 record(s)" in res.output and "empty.jpg" in res.output, res.output
    pqsrc = ParquetSource(tmp_path / "pq")
    assert records(pqsrc) == records(folder)
    t = pq.read_table(tmp_path / "pq").to_pydict()
    rows = {Path(k).name: i for i, k in enumerate(t["key"])}
    assert "empty" not in rows
    fmt = {name: (t["format"][i], t["width"][i], t["height"][i]) for name, i in rows.items()}
    assert fmt["html_named"] == (None, -1, -1)
    assert fmt["png_named"][0] == "PNG"
    assert fmt["cmyk_adobe"][0] == "JPEG"
    with Image.open(CASES / "thin_1x500.jpg") as im:
        assert fmt["thin_1x500"] == ("JPEG", *im.size)
    assert fmt["truncated_half"][0] == "JPEG"  # the header is intact; decoding fails later
    with pytest.warns(UserWarning, match="empty.jpg while indexing: empty"):
        res = cli("convert", cases_datasets["folder"], tmp_path / "tar", "--to", "tar")
    assert res.exit_code == 1 and "empty: 1" in res.output, res.output
    assert records(TarShardSource(tmp_path / "tar")) == records(folder)


def test_library_functions_write_row_groups_of_about_the_given_size(folder_ds, tmp_path):
    from feedgpu.convert import folder_to_parquet

    files = folder_to_parquet(folder_ds, tmp_path / "pq", rows_per_file=60, row_group_bytes=200_000)
    assert len(files) == 2
    f = pq.ParquetFile(files[0])
    assert f.num_row_groups >= 5
    assert f.metadata.row_group(0).column(1).compression == "UNCOMPRESSED"
    data = io.BytesIO(files[0].read_bytes())
    assert pq.read_table(data).num_rows == 60


@pytest.mark.parametrize("to", ["parquet", "tar"])
def test_converted_datasets_keep_the_class_names(folder_ds, tmp_path, to):
    from feedgpu import TarShardSource

    cli("convert", folder_ds, tmp_path / to, "--to", to, "--per-file", 40)
    folder = FolderSource(folder_ds)
    src = ParquetSource(tmp_path / to) if to == "parquet" else TarShardSource(tmp_path / to)
    assert src.classes == folder.classes and not folder.classes[0].isdigit()
    # without the names file: the labels as strings, as before
    (tmp_path / to / "_classes.txt").unlink()
    src = ParquetSource(tmp_path / to) if to == "parquet" else TarShardSource(tmp_path / to)
    assert src.classes == [str(i) for i in range(len(folder.classes))]


def test_class_folders_named_in_another_encoding_convert_to_tar(tmp_path):
    """A class folder whose name is not UTF-8 (b"caf\\xe9", Latin-1): the names file keeps its
    bytes, so the tar source's class names equal the folder source's; before, folder_to_tar raised
    UnicodeEncodeError writing _classes.txt. A names file in another encoding opens too."""
    import os

    from feedgpu.convert import folder_to_tar

    root = tmp_path / "in"
    root.mkdir()
    os.mkdir(os.path.join(os.fsencode(root), b"caf\xe9"))
    (root / "ok").mkdir()
    latin = os.fsdecode(b"caf\xe9")
    (root / latin / "a.jpg").write_bytes((CASES / "ok_rgb.jpg").read_bytes())
    (root / "ok" / "b.jpg").write_bytes((CASES / "gray.jpg").read_bytes())
    folder = FolderSource(root)
    assert folder.classes == [latin, "ok"]
    folder_to_tar(root, tmp_path / "tar")
    assert (tmp_path / "tar" / "_classes.txt").read_bytes() == b"caf\xe9\nok\n"
    tar = TarShardSource(tmp_path / "tar")
    assert tar.classes == folder.classes and records(tar) == records(folder)
    (tmp_path / "tar" / "_classes.txt").write_bytes("ni\u00f1o\ncaf\u00e9\n".encode("latin-1"))
    assert TarShardSource(tmp_path / "tar").classes == [os.fsdecode(b"ni\xf1o"), latin]
