"""The conservation rule against inputs written by other tools and odd values a user meets:
labels that overflow int64, exit statuses of ``feedgpu convert``, and the like. Each test
fails on the defect it names."""
from __future__ import annotations

import io
import tarfile
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from conftest import PHOTOS
from feedgpu import ParquetSource, TarShardSource

pytestmark = pytest.mark.timeout(120)


def cli(*args):
    from feedgpu.cli.main import main

    return CliRunner().invoke(main, [str(a) for a in args])


def photo(i: int) -> bytes:
    return sorted(PHOTOS.glob("*.jpg"))[i].read_bytes()


from test_integrity import quiet, write_tar  # noqa: E402  the same helpers as the first integrity tests


def test_a_tar_label_over_int64_is_a_bad_label_not_a_crash(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [("k.jpg", photo(0)), ("k.cls", b"99999999999999999999999"),
                                           ("z.jpg", photo(1)), ("z.cls", b"1")])
    src = quiet(TarShardSource, shard)
    assert src.labels.tolist() == [1]
    assert src.rejected == [(f"{shard}:k.jpg", "bad label")]


def test_a_uint64_parquet_label_over_int64_is_a_bad_label_not_a_crash(tmp_path):
    path = tmp_path / "u.parquet"
    pq.write_table(pa.table({"image": pa.array([photo(0), photo(1), photo(2)], pa.binary()),
                             "label": pa.array([0, 2 ** 63 + 5, 2], pa.uint64())}), path)
    src = quiet(ParquetSource, path)
    assert src.labels.tolist() == [0, 2]
    assert src.rejected == [(f"{path}#1", "bad label")]
    assert "2**63" in src.rejected_details[f"{path}#1"]


def test_convert_errors_exit_2_and_name_what_it_reads(tmp_path):
    """Exit 1 means records were left out; an input convert cannot take is an error (2)."""
    shard = write_tar(tmp_path / "s.tar", [("k.jpg", photo(0)), ("k.cls", b"1")])
    r = cli("convert", shard, tmp_path / "out", "--to", "tar")
    assert r.exit_code == 2, r.output
    assert "already tar shards" in r.output
    pq_dir = tmp_path / "pq"
    pq_dir.mkdir()
    pq.write_table(pa.table({"image": pa.array([photo(0)], pa.binary()), "label": pa.array([0])}),
                   pq_dir / "part-0.parquet")
    for src in (pq_dir, pq_dir / "part-0.parquet"):
        r = cli("convert", src, tmp_path / "out2", "--to", "tar")
        assert r.exit_code == 2, r.output
        assert "Parquet" in r.output and "class sub-folders" not in r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_scan_names_the_records_of_a_source_with_none_left(tmp_path):
    """A shard whose every image is a duplicate key, or a class folder of empty files: the
    source has no sample left. Before: scan exited 2 with "no samples left", naming none."""
    import json

    shard = write_tar(tmp_path / "dup.tar", [("k.jpg", photo(0)), ("k.cls", b"1"), ("k.png", photo(1))])
    folder = tmp_path / "f"
    (folder / "a").mkdir(parents=True)
    (folder / "a" / "x.jpg").write_bytes(b"")
    (folder / "a" / "y.jpg").write_bytes(b"")
    for data, want in ((shard, {(f"{shard}:k.jpg", "duplicate key"), (f"{shard}:k.png", "duplicate key")}),
                       (folder, {(str(folder / "a" / "x.jpg"), "empty"), (str(folder / "a" / "y.jpg"), "empty")})):
        r = cli("scan", data, "--workers", "0", "--json", "-")
        assert r.exit_code == 1, r.output
        doc = json.loads(r.output)
        assert doc["samples"] == 0 and doc["bad_total"] == 2
        assert {(b["key"], b["reason"]) for b in doc["bad"]} == want
    with pytest.raises(Exception, match="no samples left") as info:
        quiet(TarShardSource, shard)
    assert len(info.value.rejected) == 2


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_every_cut_of_a_shard_keeps_labels_right_or_counts_the_loss(tmp_path, fmt):
    """A shard cut at every block boundary and inside each member: every sample indexed has the
    label written for it, and what is not indexed is named. Before: a shard cut just after its
    first image (before that image's .cls) was read as an unlabeled source, the image delivered
    with label -1 and no reject for it."""
    members = []
    for i in range(6):
        members += [(f"s{i:02d}.jpg", photo(i)[:1500 + 100 * i]), (f"s{i:02d}.cls", str(i + 1).encode())]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    full = buf.getvalue()
    cuts = sorted(set(range(512, len(full), 512)) | {c + d for c in range(512, len(full), 512) for d in (7, 300)})
    shard = tmp_path / "cut.tar"
    for cut in cuts:
        shard.write_bytes(full[:cut])
        try:
            src = quiet(TarShardSource, shard)
            got = {src.members[i]: int(src.labels[i]) for i in range(len(src))}
            rejected = src.rejected
        except Exception as e:   # noqa: BLE001 - nothing left: the error carries the rejects
            got, rejected = {}, e.rejected
        assert got == {k: int(k[1:3]) + 1 for k in got}, cut
        sample_rejects = {k.rsplit(":", 1)[1] for k, r in rejected if r == "truncated"}
        assert len(got) + len(sample_rejects) == 6 or any(r.endswith("shard") for _, r in rejected), cut
    shard.write_bytes(full[:512 + 1536])   # s00.jpg whole, its .cls cut off
    with pytest.raises(Exception, match="no samples left") as info:
        quiet(TarShardSource, shard)
    assert (f"{shard}:s00.jpg", "truncated") in info.value.rejected


def test_hidden_images_inside_a_class_are_named_not_dropped_silently(tmp_path):
    """torchvision's ImageFolder indexes ``cat/.ipynb_checkpoints/a-checkpoint.jpg`` and
    ``cat/.b.jpg`` (os.walk lists them); feedgpu leaves them out as documented. Before: with no
    word, only hidden folders directly under the root were named."""
    from feedgpu import FolderSource

    (tmp_path / "cat" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / "cat" / "a.jpg").write_bytes(photo(0))
    (tmp_path / "cat" / ".b.jpg").write_bytes(photo(1))
    (tmp_path / "cat" / ".ipynb_checkpoints" / "a-checkpoint.jpg").write_bytes(photo(0))
    (tmp_path / "cat" / ".git").mkdir()
    (tmp_path / "cat" / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        src = FolderSource(tmp_path)
    assert [Path(src.key(i)).name for i in range(len(src))] == ["a.jpg"]
    text = " ".join(str(w.message) for w in seen)
    assert str(tmp_path / "cat" / ".b.jpg") in text
    assert str(tmp_path / "cat" / ".ipynb_checkpoints") in text
    assert ".git" not in text   # no image in it: nothing to say


def test_scan_reads_images_beside_sub_folders_and_the_source_names_them(tmp_path):
    """A download of images with one ``thumbs/`` sub-folder. Before: scan took it for an
    ImageFolder, read the 1 thumbnail, said "0 bad" and exited 0 (the cut JPEG in the root
    unread); the folder source left the root's images out without a word."""
    import json

    from feedgpu import FolderSource

    (tmp_path / "thumbs").mkdir()
    (tmp_path / "thumbs" / "t.jpg").write_bytes(photo(0))
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(photo(i + 1))
    (tmp_path / "cut.jpg").write_bytes(photo(5)[:4000])
    r = cli("scan", tmp_path, "--workers", "0", "--json", "-")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.output)
    assert doc["samples"] == 5 and [b["key"] for b in doc["bad"]] == [str(tmp_path / "cut.jpg")]
    with pytest.warns(UserWarning, match=r"4 image file\(s\) in the dataset root .* not indexed"):
        src = FolderSource(tmp_path)
    assert len(src) == 1 and src.classes == ["thumbs"]


def test_a_shard_labelled_in_json_says_its_labels_are_minus_1(tmp_path):
    """WebDataset shards with ``k.jpg`` + ``k.json`` (``{"label": 2}``): feedgpu reads labels from
    ``.cls`` only. Before: every label -1, no word; now one warning says so."""
    shard = write_tar(tmp_path / "s.tar", [("k.jpg", photo(0)), ("k.json", b'{"label": 2}'),
                                           ("z.jpg", photo(1)), ("z.json", b'{"label": 1}')])
    with pytest.warns(UserWarning, match=r"no label member .* every label is -1 .*2 member\(s\) are \.json"):
        src = TarShardSource(shard)
    assert src.labels.tolist() == [-1, -1]
    labelled = write_tar(tmp_path / "l.tar", [("k.jpg", photo(0)), ("k.cls", b"2"), ("k.json", b"{}")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TarShardSource(labelled).labels.tolist() == [2]


def test_class_names_with_newlines_and_percents_round_trip(tmp_path):
    """Before: a class folder named "a\\nb" was written as two lines of _classes.txt, and the
    converted source named label 1 "b" (the folder's label 1 is "c")."""
    from feedgpu import FolderSource

    names = ["a\nb", "c", "d\u2028e", "f%0Ag", "r\rs"]
    for i, name in enumerate(names):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / f"{i}.jpg").write_bytes(photo(i))
    folder = FolderSource(tmp_path / "src")
    assert folder.classes == sorted(names)
    for to in ("tar", "parquet"):
        r = cli("convert", tmp_path / "src", tmp_path / to, "--to", to)
        assert r.exit_code == 0, r.output
        from feedgpu.sources import open_source

        got = quiet(open_source, to, tmp_path / to)
        assert got.classes == folder.classes, to
        assert got.labels.tolist() == folder.labels.tolist()


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_a_file_named_twice_is_read_once(tmp_path, fmt):
    """``["shards", "shards/s.tar"]``, or a link to the same shard. Before: every record was
    indexed twice, so delivered twice an epoch, without a word."""
    import os

    from feedgpu.sources import open_source

    (tmp_path / "d").mkdir()
    if fmt == "tar":
        one = write_tar(tmp_path / "d" / "s.tar", [("k.jpg", photo(0)), ("k.cls", b"1"),
                                                   ("z.jpg", photo(1)), ("z.cls", b"2")])
    else:
        one = tmp_path / "d" / "s.parquet"
        pq.write_table(pa.table({"image": pa.array([photo(0), photo(1)], pa.binary()), "label": pa.array([1, 2])}),
                       one)
    os.symlink(one, tmp_path / f"link.{fmt}")
    for spec in ([tmp_path / "d", one], [str(one), str(tmp_path / f"link.{fmt}")], str(tmp_path / "d" / f"*.{fmt}")):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            src = open_source(fmt, spec)
        assert src.labels.tolist() == [1, 2], spec
        assert any("named more than once" in str(w.message) for w in seen) == isinstance(spec, list)


def test_folder_order_is_torchvisions_with_names_that_sort_before_a_slash(tmp_path):
    """torchvision's make_dataset walks ``sorted(os.walk(class_dir, followlinks=True))`` and sorts
    the file names: by folder path, so ``sub-a/`` and ``sub.v2/`` come before ``sub/deep/``.
    Before: a depth-first walk put ``sub/deep/b.jpg`` first, so sample i differed from
    torchvision's with shuffle=False."""
    import os

    from feedgpu import FolderSource

    files = ["c/z.jpg", "c/Sub/d.jpg", "c/sub/a.jpg", "c/sub/deep/b.jpg", "c/sub-a/c.jpg", "c/sub.v2/e.jpg",
             "c/sub a/f.jpg", "d/x/y.jpg", "d/x-1/w.jpg"]
    for i, f in enumerate(files):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_bytes(photo(i))
    src = FolderSource(tmp_path)
    want = [(os.path.join(root, f), label) for label, c in enumerate(["c", "d"])
            for root, _, names in sorted(os.walk(tmp_path / c, followlinks=True)) for f in sorted(names)]
    assert [(src.key(i), int(src.labels[i])) for i in range(len(src))] == [(str(p), lab) for p, lab in want]


def test_a_cut_parquet_file_is_named_and_a_non_parquet_file_is_a_source_error(tmp_path):
    """Before: a Parquet file cut before its footer, or an empty one, raised a bare ArrowInvalid
    without the file's name (``feedgpu scan`` printed a traceback); the other files' rows were lost."""
    import json

    from feedgpu import SourceError

    good = tmp_path / "d" / "a.parquet"
    good.parent.mkdir()
    pq.write_table(pa.table({"image": pa.array([photo(0), photo(1)], pa.binary()), "label": pa.array([1, 2])}), good)
    (tmp_path / "d" / "b.parquet").write_bytes(good.read_bytes()[:len(good.read_bytes()) // 2])
    (tmp_path / "d" / "c.parquet").write_bytes(b"")
    src = quiet(ParquetSource, tmp_path / "d")
    assert src.labels.tolist() == [1, 2]
    assert src.rejected == [(str(tmp_path / "d" / "b.parquet"), "truncated file"),
                            (str(tmp_path / "d" / "c.parquet"), "truncated file")]
    r = cli("scan", tmp_path / "d", "--workers", "0", "--json", "-")
    assert r.exit_code == 1 and json.loads(r.output)["by_reason"] == {"truncated file": 2}, r.output
    (tmp_path / "e.parquet").write_bytes(b"<html>404</html>")
    with pytest.raises(SourceError, match="e.parquet is not a Parquet file"):
        ParquetSource(tmp_path / "e.parquet")


def test_a_damaged_label_page_names_its_rows_and_keeps_the_rest(tmp_path):
    """Before: a damaged page in one row group's label column raised a bare OSError ("Couldn't
    deserialize thrift") while indexing: no file name, every row lost."""
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"image": pa.array([photo(i) for i in range(4)], pa.binary()),
                             "label": pa.array([0, 1, 2, 3])}), path, row_group_size=2)
    data = bytearray(path.read_bytes())
    at = pq.ParquetFile(path).metadata.row_group(1).column(1).data_page_offset
    data[at:at + 20] = b"\xff" * 20
    path.write_bytes(bytes(data))
    src = quiet(ParquetSource, path)
    assert src.labels.tolist() == [0, 1]
    assert src.rejected == [(f"{path}#2", "corrupt file"), (f"{path}#3", "corrupt file")]
    assert "\n" not in src.rejected_details[f"{path}#2"]
