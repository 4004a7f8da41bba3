"""The tar source's vectorised scan of plain shards and its saved index (small sizes)."""
from __future__ import annotations

import io
import os
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest

import feedgpu
from feedgpu.sources.tar import index as tar_index, local as tar_local
from feedgpu.sources.tar import TarShardSource
from feedgpu.sources.tar.members import IMAGE_SUFFIXES, LABEL_SUFFIXES
from feedgpu.sources.tar.scan import _octal_fields, scan_plain

CASES = Path(__file__).resolve().parents[2].parent / "shared" / "cases" / "images"
OLD = 1_600_000_000   # an mtime far in the past: a saved index is written for the shard


def write_tar(path: Path, members, fmt=tarfile.USTAR_FORMAT, old: bool = True) -> Path:
    with tarfile.open(path, "w", format=fmt) as tf:
        for m in members:
            name, data = m[:2]
            info = tarfile.TarInfo(name)
            if len(m) > 2:
                info.type = m[2]
                info.linkname = "x.jpg"
            info.size = len(data) if info.type == tarfile.REGTYPE else 0
            tf.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    if old:
        os.utime(path, ns=(OLD * 10**9, OLD * 10**9))
    return path


def pairs(n: int, prefix: str = "s", payload=lambda i: bytes([255, 216]) + bytes(i % 7 + 1), ext="jpg"):
    out = []
    for i in range(n):
        out += [(f"{prefix}{i:04d}.{ext}", payload(i)), (f"{prefix}{i:04d}.cls", str(i * 37 % 1000).encode())]
    return out


def index_of(path, monkeypatch=None, slow: bool = False, tables: bool = False, **kw):
    """(members, offsets, sizes, labels, rejected, identity) of a source, through tarfile when
    ``slow``; member tables beside the shards are used only with ``tables``."""
    with pytest.MonkeyPatch.context() as mp:
        if slow:
            mp.setattr(tar_local, "scan_plain", lambda *a: None)
        if not tables:
            mp.setattr(tar_local, "load_table", lambda p: (None, None, False))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            src = TarShardSource(path, index_dir=False, **kw)
    return ([src.members[i] for i in range(len(src))], src.offsets.tolist(), src.sizes.tolist(),
            src.labels.tolist(), sorted(src.rejected), src.identity())


def case_members():
    out = []
    for i, f in enumerate(sorted(p for p in CASES.iterdir() if p.is_file())):
        stem, ext = f.name.split(".", 1)
        out += [(f"cases/{stem}.{ext}", f.read_bytes()), (f"cases/{stem}.cls", str(i).encode())]
    return out


# -- the scan gives exactly what tarfile gives ----------------------------------------------------
def odd_shards(tmp: Path) -> dict[str, tuple[Path, bool]]:
    """name -> (shard, whether the scan takes it: True for plain shards, False for the rest)."""
    base = pairs(12)
    out = {"plain": (write_tar(tmp / "plain.tar", base), True),
           "plain pax format": (write_tar(tmp / "paxfmt.tar", base, tarfile.PAX_FORMAT), True),
           "gnu format": (write_tar(tmp / "gnu.tar", base, tarfile.GNU_FORMAT), False),
           "label first, folders in names, upper case": (write_tar(
               tmp / "mixed.tar", [(f"d{i % 3}/K{i}.CLS" if j == 0 else f"d{i % 3}/K{i}.JPG", d)
                                   for i in range(6) for j, d in enumerate([str(i).encode(), b"\xff\xd8jpg"])]), True),
           "long names, gnu": (write_tar(tmp / "long_gnu.tar", pairs(3, "x" * 120 + "/y"), tarfile.GNU_FORMAT), False),
           "long names, pax": (write_tar(tmp / "long_pax.tar", pairs(3, "x" * 120 + "/y"), tarfile.PAX_FORMAT), False),
           "long names, ustar prefix": (write_tar(tmp / "long_ustar.tar", pairs(3, "p" * 120 + "/y")), False),
           "non-ascii names, pax": (write_tar(tmp / "utf8.tar", pairs(3, "é"), tarfile.PAX_FORMAT), False),
           "duplicate key": (write_tar(tmp / "dup.tar", base + [("s0001.png", b"\x89PNG")]), False),
           "missing label": (write_tar(tmp / "nolabel.tar", base + [("z.jpg", b"\xff\xd8")]), False),
           "bad label": (write_tar(tmp / "badlabel.tar", base[:-1] + [("s0011.cls", b"-3")]), False),
           "label with blanks": (write_tar(tmp / "blank.tar", base[:-1] + [("s0011.cls", b" 3\n")]), False),
           "qualified": (write_tar(tmp / "qual.tar", base + [("s0000.seg.png", b"\x89PNG")]), False),
           "json member": (write_tar(tmp / "json.tar", base + [("s0000.json", b"{}")]), False),
           "symlink": (write_tar(tmp / "link.tar", base + [("l.jpg", b"", tarfile.SYMTYPE)]), False),
           "empty image": (write_tar(tmp / "empty.tar", [("e.jpg", b""), ("e.cls", b"1")] + base), False),
           "tar inside a member": (write_tar(tmp / "nested.tar", [("n.jpg", (tmp / "plain.tar").read_bytes()),
                                                                    ("n.cls", b"4")] + base), False),
           "hard cases": (write_tar(tmp / "cases.tar", case_members()), False)}
    data = (tmp / "plain.tar").read_bytes()
    with tarfile.open(tmp / "plain.tar") as tf:
        ms = tf.getmembers()
    end = ms[-1].offset_data + 512
    for cut, at in {"in a header": ms[8].offset + 100, "at a header": ms[8].offset, "in data": ms[8].offset_data + 1,
                    "no end marker": end}.items():
        p = tmp / f"cut_{at}.tar"
        p.write_bytes(data[:at])
        out[f"truncated {cut}"] = (p, False)
    p = tmp / "appended.tar"
    p.write_bytes(data + data)
    out["archive appended"] = (p, False)
    p = tmp / "badsum.tar"
    p.write_bytes(data[:ms[4].offset + 3] + b"Q" + data[ms[4].offset + 4:])
    out["bad checksum"] = (p, False)
    return out


def test_the_scan_gives_tarfiles_index_or_declines(tmp_path, monkeypatch):
    shards = odd_shards(tmp_path)
    assert (CASES / "empty.jpg").exists()
    for name, (shard, plain) in shards.items():
        got = scan_plain(str(shard), IMAGE_SUFFIXES, LABEL_SUFFIXES)
        assert (got is not None) == plain, name
        try:
            slow = index_of(shard, monkeypatch, slow=True)
        except feedgpu.errors.SourceError:
            with pytest.raises(feedgpu.errors.SourceError):
                index_of(shard)
            continue
        assert index_of(shard) == slow, name
    members, offsets, sizes, labels, rejected, _ = index_of(shards["label first, folders in names, upper case"][0])
    assert members == [f"d{i % 3}/K{i}.JPG" for i in range(6)] and labels == list(range(6)) and not rejected
    with tarfile.open(shards["plain"][0]) as tf:
        jpgs = [m for m in tf.getmembers() if m.name.endswith(".jpg")]
    members, offsets, sizes, labels, _, _ = index_of(shards["plain"][0])
    assert offsets == [m.offset_data for m in jpgs] and sizes == [m.size for m in jpgs]
    assert labels == [i * 37 % 1000 for i in range(12)]


def rewrite_header(data: bytes, at: int, **fields) -> bytes:
    """``data`` with the header at byte ``at`` given new field bytes (``name=b"..."``: the bytes
    at the field's offset) and its checksum recomputed as tarfile computes it."""
    offsets = {"name": 0, "mode": 100, "mtime": 136, "type": 156}
    h = bytearray(data[at:at + 512])
    for k, v in fields.items():
        h[offsets[k]:offsets[k] + len(v)] = v
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return data[:at] + bytes(h) + data[at + 512:]


def test_headers_that_differ_beyond_name_and_size_are_read_as_tarfile_reads_them(tmp_path, monkeypatch):
    """The scan checks a header field that every header shares once, on the first header, and the
    fields that differ header by header one by one: a shard whose mtimes, modes and type flags
    (``0`` and NUL) differ is still plain and indexed as tarfile indexes it; a name with a NUL inside
    it (tarfile ends the name there) is not plain, and the tarfile path decides."""
    base = write_tar(tmp_path / "base.tar", pairs(12))
    data = base.read_bytes()
    with tarfile.open(base) as tf:
        heads = [m.offset for m in tf.getmembers()]
    for i, at in enumerate(heads):
        data = rewrite_header(data, at, mtime=b"%011o" % (OLD + i), mode=b"%07o" % (0o644 if i % 3 else 0o600),
                              type=b"\0" if i % 2 else b"0")
    mixed = tmp_path / "mixed.tar"
    mixed.write_bytes(data)
    os.utime(mixed, ns=(OLD * 10**9, OLD * 10**9))
    assert scan_plain(str(mixed), IMAGE_SUFFIXES, LABEL_SUFFIXES) is not None
    assert index_of(mixed) == index_of(mixed, monkeypatch, slow=True)
    assert index_of(mixed)[3] == [i * 37 % 1000 for i in range(12)]
    nul = tmp_path / "nul.tar"
    data = rewrite_header(base.read_bytes(), heads[4], name=b"s0\0002.jpg\0")   # "s0" to tarfile
    nul.write_bytes(rewrite_header(data, heads[5], name=b"s0\0002.cls\0"))
    os.utime(nul, ns=(OLD * 10**9, OLD * 10**9))
    assert scan_plain(str(nul), IMAGE_SUFFIXES, LABEL_SUFFIXES) is None
    with tarfile.open(nul) as tf:
        assert [m.name for m in tf.getmembers()[4:6]] == ["s0", "s0"]
    assert index_of(nul) == index_of(nul, monkeypatch, slow=True)


@pytest.mark.parametrize("rows", [
    [b"00000000521\0", b"00000000001\0", b"77777777777\0"],            # one form (tarfile's): one product
    [b"0000000521\0\0", b"00000000001 ", b"0000000001  ", b"00000000521\0"],   # forms mixed row by row
    [b"00000000521\0"] * 3,                                              # one value in every row
    [b"     521 \0\0\0", b"00000000001\0"],                               # leading blanks: through nti
])
def test_octal_fields_read_as_tarfile_reads_them(rows):
    f = np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), -1)
    want = [tarfile.nti(r) for r in rows]
    assert _octal_fields(f).tolist() == want
    assert _octal_fields(f, constant=len(set(rows)) == 1).tolist() == want
    bad = np.frombuffer(b"".join(rows[:-1] + [b"0000000x521\0"]), np.uint8).reshape(len(rows), -1)
    assert _octal_fields(bad) is None   # tarfile rejects such a header: so does the scan


# -- the saved index ------------------------------------------------------------------------------
def open_saved(path, folder):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        src = TarShardSource(path, index_dir=folder)
    return src, [str(x.message) for x in w]


def test_a_saved_index_is_reused_and_rebuilt_after_a_change(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    a = write_tar(shards / "a.tar", pairs(5))
    b = write_tar(shards / "b.tar", pairs(4, "t") + [("t0000.png", b"\x89PNG")])   # a duplicate key: rejects
    folder = tmp_path / "idx"
    first, _ = open_saved(shards, folder)
    assert first.saved_shards == 0 and len(list(folder.glob("*.idx"))) == 2
    again, _ = open_saved(shards, folder)
    assert again.from_saved_index and again.saved_shards == 2
    assert again.identity() == first.identity() and again.rejected == first.rejected
    assert [again.read(i).payload for i in range(len(again))] == [first.read(i).payload for i in range(len(first))]
    write_tar(a, pairs(40))                    # another size (past tar's 10 KiB record), mtime kept
    changed, _ = open_saved(shards, folder)
    assert changed.saved_shards == 1 and len(changed) == len(first) + 35
    write_tar(b, pairs(4, "u"), old=False)     # a recent shard: indexed, not saved
    os.utime(b, ns=(OLD * 10**9, OLD * 10**9))
    size = b.stat().st_size
    write_tar(b, pairs(4, "v"), old=False)     # same size, another mtime
    assert b.stat().st_size == size
    os.utime(b, ns=((OLD + 5) * 10**9, (OLD + 5) * 10**9))
    renamed, _ = open_saved(shards, folder)
    assert renamed.saved_shards == 1 and renamed.members[len(renamed) - 1] == "v0003.jpg"
    assert open_saved(shards, folder)[0].saved_shards == 2


def test_a_recent_shard_is_not_saved(tmp_path):
    shard = write_tar(tmp_path / "a.tar", pairs(3), old=False)
    folder = tmp_path / "idx"
    open_saved(shard, folder)
    assert not list(folder.glob("*.idx"))
    assert open_saved(shard, tmp_path / "none")[0].saved_shards == 0


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "foreign version"])
def test_a_corrupt_or_foreign_index_is_ignored_with_a_warning(tmp_path, damage, monkeypatch):
    shard = write_tar(tmp_path / "a.tar", pairs(5))
    folder = tmp_path / "idx"
    if damage == "foreign version":
        monkeypatch.setattr(feedgpu._version, "__version__", "0.0.0-other")
    good, _ = open_saved(shard, folder)
    monkeypatch.undo()
    (file,) = folder.glob("*.idx")
    data = bytearray(file.read_bytes())
    if damage == "flipped byte":
        data[-3] ^= 0xFF
    elif damage == "truncated":
        data = data[:-8]
    file.write_bytes(bytes(data))
    src, warned = open_saved(shard, folder)
    assert src.saved_shards == 0
    assert any("ignored the saved tar index" in w for w in warned), warned
    assert src.identity() == good.identity() and src.labels.tolist() == good.labels.tolist()
    assert open_saved(shard, folder)[0].saved_shards == 1     # rewritten whole


def test_index_files_hold_sixteen_bytes_a_sample_plus_key_bytes(tmp_path):
    shard = write_tar(tmp_path / "a.tar", pairs(2000))
    open_saved(shard, tmp_path / "idx")
    src, _ = open_saved(shard, tmp_path / "idx")
    assert src.from_saved_index
    per_sample = (src.offsets.nbytes + src.sizes.nbytes + src.labels.nbytes) / len(src)
    assert per_sample <= 16 and src.offsets.dtype == np.uint32
    assert src.members.offsets.dtype == np.uint32 and src.members.blob.nbytes == len(src) * len("s0000.jpg")
    assert tar_index.index_file(tmp_path / "idx", str(shard)).exists()


def test_cache_info_and_clear_cover_the_saved_tar_indexes(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from feedgpu.cli.main import main

    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(tmp_path / "env"))
    idx = tmp_path / "env" / "tar-index"
    assert tar_index.default_index_dir() == idx
    write_tar(tmp_path / "a.tar", pairs(3))
    write_tar(tmp_path / "b.tar", pairs(3, "t"))
    TarShardSource([tmp_path / "a.tar", tmp_path / "b.tar"])
    assert len(list(idx.glob("*.idx"))) == 2
    res = CliRunner().invoke(main, ["cache", "info"])
    assert res.exit_code == 0 and f"tar shard indexes {idx}: 2 saved" in res.output, res.output
    res = CliRunner().invoke(main, ["cache", "clear", "--yes"])
    assert res.exit_code == 0 and "deleted 2 saved tar shard indexes" in res.output, res.output
    assert list(idx.glob("*.idx")) == [] and TarShardSource(tmp_path / "a.tar").saved_shards == 0


def test_shards_feedgpu_convert_writes_are_scanned_plain(tar_ds, monkeypatch):
    shards = sorted(tar_ds.glob("*.tar"))
    assert shards and all(scan_plain(str(s), IMAGE_SUFFIXES, LABEL_SUFFIXES) is not None for s in shards)
    assert index_of(tar_ds) == index_of(tar_ds, monkeypatch, slow=True)
