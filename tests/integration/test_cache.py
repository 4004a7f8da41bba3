"""The local cache of a pipeline's deterministic prefix (``feedgpu.cache``) and ``feedgpu cache``.

Every test uses its own cache root under ``tmp_path`` (or ``$FEEDGPU_CACHE_DIR`` set with
monkeypatch where the default root is exercised). Pipelines resize to a 64 px short side before
the cache and crop 48 px after it, so the cached data stays small (~1 MB per entry).
"""
from __future__ import annotations

import collections
import hashlib
import importlib
import inspect
import json
import logging
import multiprocessing as mp
import os
import shutil
import stat
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import xxhash
import yaml
from click.testing import CliRunner

from conftest import CASES, N_IMAGES, REPO
from feedgpu import ConfigError, DataLoader, FolderSource, Pipeline, SkippedSampleWarning
from feedgpu.cache import CacheEntry, CacheSettings, entries, fingerprint, open_entry, parse_compression, parse_size, verify
from feedgpu.cache.fingerprint import NotFingerprintable, stage_key
from feedgpu.cache.checks import CorruptPart, CorruptRow
from feedgpu.cache.parts import Part, PartWriter, RowBuffer, RowEncoder
from feedgpu.stages import Decode, HorizontalFlip, Normalize, PythonStage, RandomResizedCrop, Resize

pytestmark = pytest.mark.timeout(120)

CACHED_YAML = REPO / "pipelines" / "imagenet_train_cached.yaml"
SIZE, CROP, BATCH = 64, 48, 16


# -- helpers ------------------------------------------------------------------------------------
def prefix(size: int = SIZE, **decode) -> list:
    return [Decode(**decode), Resize(size)]


def stages(size: int = SIZE, flip: float = 0.5, **decode) -> list:
    return prefix(size, **decode) + [RandomResizedCrop(CROP), HorizontalFlip(flip), Normalize()]


def pipe(src, cache=None, nw: int = 0, st=None, **kw) -> Pipeline:
    opts = dict(batch_size=BATCH, num_workers=nw, seed=0, device="cpu", drop_last=False, shuffle=True,
                persistent_workers=False)
    opts.update(kw)
    return Pipeline(src, st if st is not None else stages(), cache=cache, **opts)


def settings(root: Path, **kw) -> dict:
    return {"dir": str(root), **kw}


def run_epochs(loader: DataLoader, epochs: int = 1, stats: list | None = None) -> list[list[tuple]]:
    """``epochs`` full epochs, each a list of cloned (images, labels); ``stats`` receives
    ``loader.stats()`` after each epoch."""
    out = []
    for _ in range(epochs):
        out.append([(b.images.clone(), b.labels.clone()) for b in loader])
        if stats is not None:
            stats.append(loader.stats())
    return out


def same(a: list[list[tuple]], b: list[list[tuple]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(i, j) and torch.equal(k, m) for (i, k), (j, m) in zip(x, y))
        for x, y in zip(a, b))


def decode_s(stats_list: list[dict]) -> list[float]:
    """Seconds spent in decode during each epoch (stats are cumulative)."""
    totals = [s["stage_s"].get("decode", 0.0) for s in stats_list]
    return [t - (totals[i - 1] if i else 0.0) for i, t in enumerate(totals)]


_REFS: dict = {}


def reference(src, epochs: int = 2, **kw) -> list[list[tuple]]:
    """The uncached pipeline's batches (computed once per source and settings; results do not
    depend on the worker count)."""
    key = (id(src), epochs, tuple(sorted((k, repr(v)) for k, v in kw.items())))
    if key not in _REFS:
        loader = DataLoader(pipe(src, cache=None, nw=0, **kw))
        _REFS[key] = run_epochs(loader, epochs)
        loader.shutdown()
    return _REFS[key]


def entry_dir(root: Path) -> Path:
    dirs = [d for d in root.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def manifest(entry: Path) -> dict:
    return json.loads((entry / "manifest.json").read_text())


def part_files(entry: Path) -> list[Path]:
    return sorted(entry.glob("part-*.arrow"))


def fill(src, root: Path, nw: int = 0, **cache_kw) -> Path:
    """Fill a cache entry with one epoch of the default pipeline; returns the entry directory."""
    loader = DataLoader(pipe(src, settings(root, **cache_kw), nw=nw))
    run_epochs(loader, 1)
    assert loader.stats()["cache"]["cached"] == len(src)
    loader.shutdown()
    return entry_dir(root)


def flip_row_bytes(path: Path, row: int = 0) -> None:
    """Damage the stored pixels of one row in place (the Arrow structure stays readable)."""
    with pa.memory_map(str(path)) as mm:
        blob = pa.ipc.open_file(mm).read_all().column("data")[row].as_py()
    raw = bytearray(path.read_bytes())
    off = raw.find(blob)
    assert off > 0 and raw.find(blob, off + 1) == -1
    mid = off + len(blob) // 2
    raw[mid:mid + 8] = bytes(b ^ 0xFF for b in raw[mid:mid + 8])
    path.write_bytes(bytes(raw))


def cli_main():
    from feedgpu.cli.main import main

    return main


def cli(*args, **kw):
    return CliRunner().invoke(cli_main(), [str(a) for a in args], **kw)


@pytest.fixture(scope="module")
def src(sources):
    return sources["folder"]


@pytest.fixture
def small_ds(folder_ds, tmp_path) -> Path:
    """A private 12-image copy of the sample data (files may be touched or deleted)."""
    out = tmp_path / "small"
    for i, f in enumerate(sorted(folder_ds.rglob("*.jpg"))[:12]):
        d = out / ("a" if i < 6 else "b")
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, d / f.name)
    return out


# -- 1. cached batches are the uncached batches --------------------------------------------------
@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
def test_cached_epochs_equal_uncached(sources, fmt, nw, tmp_path, no_leaked_workers):
    src = sources[fmt]
    ref = reference(src)
    loader = DataLoader(pipe(src, settings(tmp_path / "c"), nw=nw))
    st: list[dict] = []
    got = run_epochs(loader, 2, st)  # epoch 1 fills, epoch 2 reads
    loader.shutdown()
    assert same(got, ref)
    assert [sum(len(lab) for _, lab in e) for e in got] == [N_IMAGES, N_IMAGES]
    c = st[0]["cache"]
    assert c["cached"] == N_IMAGES and c["samples"] == N_IMAGES and c["quarantined"] == 0 and c["complete"]
    d1, d2 = decode_s(st)
    assert d1 > 0 and d2 == 0.0, "epoch 2 must read every sample from the cache, decoding nothing"
    assert st[1]["stage_s"]["cache"] > 0
    m = manifest(Path(c["dir"]))
    assert sum(p["rows"] for p in m["parts"]) == N_IMAGES  # each sample stored once
    # a later run (new loader, same pipeline) reads the cache too and still matches
    loader = DataLoader(pipe(src, settings(tmp_path / "c"), nw=nw))
    st = []
    assert same(run_epochs(loader, 1, st), ref[:1])
    loader.shutdown()
    assert decode_s(st) == [0.0] and st[0]["cache"]["dir"] == c["dir"]


def test_persistent_workers_read_the_cache_in_epoch_2(src, tmp_path, no_leaked_workers):
    loader = DataLoader(pipe(src, settings(tmp_path / "c"), nw=2, persistent_workers=True))
    st: list[dict] = []
    got = run_epochs(loader, 3, st)
    loader.shutdown()
    assert same(got[:2], reference(src))
    rows = sum(p["rows"] for p in manifest(entry_dir(tmp_path / "c"))["parts"])
    assert rows == N_IMAGES, f"{rows} rows stored for {N_IMAGES} samples"
    assert st[0]["cache"]["cached"] == N_IMAGES
    assert decode_s(st)[1:] == [0.0, 0.0]


def test_drop_last_epoch_caches_what_it_visits(src, tmp_path):
    loader = DataLoader(pipe(src, settings(tmp_path / "c"), drop_last=True, shuffle=False))
    run_epochs(loader, 1)
    c = loader.stats()["cache"]
    loader.shutdown()
    assert c["cached"] == N_IMAGES // BATCH * BATCH and not c["complete"]


# -- 2. fingerprints -----------------------------------------------------------------------------
def fp(src, st) -> str:
    return fingerprint(src.identity(), st)


def test_fingerprint_follows_the_files(small_ds):
    base = fp(FolderSource(small_ds), prefix())
    f = sorted(small_ds.rglob("*.jpg"))[3]
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = fp(FolderSource(small_ds), prefix())
    assert touched != base
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    back = fp(FolderSource(small_ds), prefix())
    assert back not in (base, touched)   # the mtime set back: its ctime tells (a rewrite would look the same)
    assert fp(FolderSource(small_ds), prefix()) == back  # same files, same key
    content = FolderSource(small_ds).identity(content=True)
    with open(f, "ab") as fh:  # one byte more, same mtime
        fh.write(b"\0")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fp(FolderSource(small_ds), prefix()) not in (base, touched, back)
    assert FolderSource(small_ds).identity(content=True) != content
    f.rename(f.with_name("renamed.jpg"))
    assert fp(FolderSource(small_ds), prefix()) != base


def test_fingerprint_of_tar_and_parquet_sources_follows_their_files(folder_ds, tmp_path):
    from feedgpu import ParquetSource, TarShardSource
    from feedgpu.convert import folder_to_parquet, folder_to_tar

    folder_to_tar(folder_ds, tmp_path / "tar", samples_per_shard=60)
    folder_to_parquet(folder_ds, tmp_path / "pq", rows_per_file=60)
    for cls, path, pattern in ((TarShardSource, tmp_path / "tar", "*.tar"), (ParquetSource, tmp_path / "pq", "*.parquet")):
        base = fp(cls(path), prefix())
        f = sorted(path.glob(pattern))[1]
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert fp(cls(path), prefix()) != base, cls.__name__


def test_fingerprint_follows_the_cached_stages(src):
    base = fp(src, prefix())
    assert fp(src, prefix()) == base
    changed = {
        "resize size": prefix(72),
        "resize interpolation": [Decode(), Resize(SIZE, interpolation="bicubic")],
        "resize upscale": [Decode(), Resize(SIZE, upscale=False)],
        "decode exif_orientation": prefix(exif_orientation=False),
        "decode max_pixels": prefix(max_pixels=10**6),
        "decode background": prefix(background=(0, 0, 0)),
        "one stage more": prefix() + [Resize(32)],
    }
    keys = {name: fp(src, st) for name, st in changed.items()}
    assert base not in keys.values()
    assert len(set(keys.values())) == len(keys)
    # stage order
    assert fp(src, [Decode(), Resize(80), Resize(SIZE)]) != fp(src, [Decode(), Resize(SIZE), Resize(80)])


def test_fingerprint_follows_stage_and_feedgpu_versions(src, monkeypatch):
    import feedgpu

    base = fp(src, prefix())

    class Resize2(Resize):
        version = 2

    assert fp(src, [Decode(), Resize2(SIZE)]) != base
    monkeypatch.setattr(feedgpu._version, "__version__", "99.0")   # the version source
    assert fp(src, prefix()) != base


def test_loader_entry_follows_the_prefix_not_the_random_stages(src, tmp_path):
    """The loader's entry is ``<root>/<fingerprint of source + cached stages>``; parameters of
    stages after the cache (flip p, crop scale, normalize) do not change it."""
    root = tmp_path / "c"

    def dir_of(st) -> str:
        loader = DataLoader(pipe(src, settings(root), st=st))
        next(iter(loader))
        d = loader.stats()["cache"]["dir"]
        loader.shutdown()
        return d

    base = dir_of(stages())
    assert Path(base) == root / fp(src, prefix())
    assert dir_of(stages(flip=0.9)) == base
    assert dir_of(prefix() + [RandomResizedCrop(CROP, scale=(0.5, 1.0)), HorizontalFlip(), Normalize(std=(1, 1, 1))]) == base
    assert dir_of(stages(size=72)) == str(root / fp(src, prefix(72)))
    assert dir_of(stages(exif_orientation=False)) == str(root / fp(src, prefix(exif_orientation=False)))
    assert dir_of(stages(size=72)) != base


def _shrink(img):
    """A module-level prefix stage: fingerprinted by its source code."""
    return img.resize((img.width // 2, img.height // 2))


def test_lambda_before_the_cache_disables_it_with_a_warning(src, tmp_path):
    def local(img):
        return img

    for fn in (lambda img: img, local):
        st = [Decode(), Resize(SIZE), PythonStage(fn), RandomResizedCrop(CROP), HorizontalFlip(), Normalize()]
        loader = DataLoader(pipe(src, settings(tmp_path / "c"), st=st))
        with pytest.warns(UserWarning, match="cache disabled.*lambda or a local function"):
            batch = next(iter(loader))
        assert batch.images.shape == (BATCH, 3, CROP, CROP)
        assert loader.stats()["cache"] is None
        loader.shutdown()
        with pytest.raises(NotFingerprintable):
            fp(src, st[:3])
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_lambda_after_the_cache_is_fine(src, tmp_path):
    st = prefix() + [RandomResizedCrop(CROP), PythonStage(lambda img, rng: img, random=True), Normalize()]
    loader = DataLoader(pipe(src, settings(tmp_path / "c"), st=st))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_epochs(loader, 1)
    assert loader.stats()["cache"]["cached"] == N_IMAGES
    loader.shutdown()


def test_module_level_function_is_fingerprinted_by_its_source(src, tmp_path, monkeypatch):
    key = stage_key(PythonStage(_shrink))
    assert key["source"] == hashlib.blake2b(inspect.getsource(_shrink).encode(), digest_size=16).hexdigest()
    assert key["config"]["fn"].endswith(":_shrink")
    # the same module, edited: another key
    mod = tmp_path / "fg_user_stage.py"
    mod.write_text("def shrink(img):\n    return img.resize((img.width // 2, img.height // 2))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    m = importlib.import_module("fg_user_stage")
    try:
        k1 = fp(src, [Decode(), PythonStage(m.shrink)])
        assert fp(src, [Decode(), PythonStage(m.shrink)]) == k1
        mod.write_text("def shrink(img):\n    return img.resize((img.width // 3, img.height // 3))\n")
        importlib.invalidate_caches()
        m = importlib.reload(m)
        assert fp(src, [Decode(), PythonStage(m.shrink)]) != k1
    finally:
        sys.modules.pop("fg_user_stage", None)
    # and it caches: the entry is used, epoch 2 equals epoch 2 without cache
    st = [Decode(), Resize(SIZE), PythonStage(_shrink), RandomResizedCrop(CROP), HorizontalFlip(), Normalize()]
    ref = reference(src, st=st)
    loader = DataLoader(pipe(src, settings(tmp_path / "c"), st=st))
    stl: list[dict] = []
    assert same(run_epochs(loader, 2, stl), ref)
    loader.shutdown()
    assert stl[0]["cache"]["cached"] == N_IMAGES and decode_s(stl)[1] == 0.0


def _as_array(img):
    """A module-level prefix stage that hands a numpy array to the stages after it."""
    return np.asarray(img)


def test_stages_after_the_cache_get_the_same_type_on_a_miss_and_a_hit(src, tmp_path):
    """Documented contract: the stage after the cache boundary gets a PIL RGB image, whether
    the sample was just computed (even by a prefix that returns arrays) or read from the cache."""
    seen = set()

    def crop(x, rng):
        seen.add(type(x).__name__)
        return np.asarray(x)[:CROP, :CROP]

    st = [Decode(), Resize(SIZE), PythonStage(_as_array), PythonStage(crop, random=True, size=(CROP, CROP))]
    for _ in range(2):  # fill, then read
        loader = DataLoader(pipe(src, settings(tmp_path / "c"), st=st))
        run_epochs(loader, 1)
        loader.shutdown()
    assert seen == {"Image"}


def test_another_fingerprint_is_never_served(src, tmp_path):
    """An entry whose manifest names another fingerprint (a directory copied or renamed) is
    ignored: the pipeline's own output comes out."""
    root = tmp_path / "c"
    a = fill(src, root)                         # 64 px entry
    b = root / fp(src, prefix(72))              # where the 72 px pipeline looks
    shutil.copytree(a, b)
    st72 = stages(size=72)
    loader = DataLoader(pipe(src, settings(root), st=st72))
    stl: list[dict] = []
    assert same(run_epochs(loader, 1, stl), reference(src, epochs=1, st=st72))
    loader.shutdown()
    assert decode_s(stl)[0] > 0


def test_an_entry_with_a_foreign_manifest_is_rebuilt(src, tmp_path):
    root = tmp_path / "c"
    a = fill(src, root)
    b = root / fp(src, prefix(72))
    shutil.copytree(a, b)
    loader = DataLoader(pipe(src, settings(root), st=stages(size=72)))
    run_epochs(loader, 1)
    c = loader.stats()["cache"]
    loader.shutdown()
    assert manifest(b)["fingerprint"] == b.name
    assert c["cached"] == N_IMAGES


# -- 3. corruption, crashes -----------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["zstd:3", "none"])
def test_flipped_bytes_are_detected_dropped_and_recomputed(src, tmp_path, compression):
    root = tmp_path / "c"
    entry = fill(src, root, compression=compression, part_bytes=120_000)
    parts = part_files(entry)
    assert len(parts) >= 3
    bad = parts[1]
    flip_row_bytes(bad, row=2)
    loader = DataLoader(pipe(src, settings(root, compression=compression)))
    stl: list[dict] = []
    why = "checksum mismatch" if compression == "none" else "[^;]*([Cc]hecksum|[Cc]orrupt|[Ee]rror)"
    with pytest.warns(UserWarning, match=f"{bad.name} row 2: {why}.*; the part is dropped and its samples recomputed"):
        got = run_epochs(loader, 2, stl)
    loader.shutdown()
    assert same(got, reference(src))                   # never served: the sample was recomputed
    assert decode_s(stl)[0] > 0                          # ... by decoding it again
    names = [p["name"] for p in manifest(entry)["parts"]]
    assert bad.name not in names and not bad.exists()    # dropped from the manifest and the disk
    assert stl[1]["cache"]["cached"] == N_IMAGES         # rebuilt
    r = verify(entry, repair=False)
    assert r["bad_parts"] == [] and r["rows"] >= N_IMAGES


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_every_flipped_byte_of_a_part_is_detected_or_harmless(tmp_path, codec):
    """Each byte of a small part file (two record batches) flipped in turn -- pixels, keys, small
    columns, Arrow framing: the loader's path (open with the meta checksum, read every row)
    refuses the part or serves the original values, never others; ``verify_part`` flags every
    flip in the stored pixels and the keys, and passes only files whose values, keys included,
    are all the original ones."""
    from feedgpu.cache.store import verify_part

    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (6, 7, 3), dtype=np.uint8) for _ in range(4)]
    enc, buf = RowEncoder(codec, 1), RowBuffer(1 << 12)
    w = PartWriter(tmp_path, "p.arrow", enc)
    for i, a in enumerate(imgs):
        data, check = enc.encode(a)
        buf.add(100 + i, f"key-{i:04d}", 7 + i, 6, 7, check, data)
        if i == 1:
            w.write(buf)
            buf.clear()
    w.write(buf)
    entry = w.close()
    orig = (tmp_path / "p.arrow").read_bytes()

    def served(path):
        try:
            part = Part(str(path), entry["meta_xxh3"])
            return [(int(part.index[r]), int(part.labels[r]), part.pixels(r).tobytes()) for r in range(len(part))]
        except (OSError, ValueError, CorruptPart, CorruptRow):
            return None

    def keys(path):
        with pa.memory_map(str(path)) as mm:
            return pa.ipc.open_file(mm).read_all().column("key").to_pylist()

    want, want_keys = served(tmp_path / "p.arrow"), [f"key-{i:04d}" for i in range(4)]
    assert want == [(100 + i, 7 + i, a.tobytes()) for i, a in enumerate(imgs)]
    assert verify_part(tmp_path / "p.arrow", entry) is None and keys(tmp_path / "p.arrow") == want_keys
    blobs = [bytes(Part(str(tmp_path / "p.arrow")).raw(r)) for r in range(4)]
    regions = {}  # byte position -> the value it belongs to, and what verify must say
    for r in range(4):
        for blob, why in ((blobs[r], f"row {r}: checksum mismatch"), (want_keys[r].encode(), "checksum mismatch")):
            at = orig.find(blob)
            assert at > 0 and orig.find(blob, at + 1) == -1
            regions.update(dict.fromkeys(range(at, at + len(blob)), ("key" if why == "checksum mismatch" else "pixels", why)))
    outcomes = collections.Counter()
    for pos in range(len(orig)):
        flipped = bytearray(orig)
        flipped[pos] ^= 0xFF
        path = tmp_path / f"flip-{pos}.arrow"
        path.write_bytes(flipped)
        why, got = verify_part(path, entry), served(path)
        assert got is None or got == want, f"byte {pos}: other values served"
        if why is None:
            assert got == want and keys(path) == want_keys, f"byte {pos}: verify passed other values"
        what, expected = regions.get(pos, ("framing", None))
        if expected is not None:
            assert why == expected, (pos, why)
        outcomes[(what, why is not None, got is not None)] += 1
        path.unlink()
    assert outcomes[("pixels", True, False)] == sum(map(len, blobs))     # refused when read, flagged by verify
    assert outcomes[("key", True, True)] == sum(map(len, want_keys))     # keys are not served; verify flags them
    assert outcomes[("framing", True, False)] > 0 and outcomes[("framing", False, True)] > 0  # refused / padding


def test_a_part_another_process_dropped_is_no_longer_counted_as_cached(src, tmp_path):
    """A worker that finds a bad row drops its part from the manifest; the loader's own view of
    the entry (``stats()["cache"]``) follows on refresh instead of still counting those rows."""
    root = tmp_path / "c"
    entry = fill(src, root, part_bytes=120_000)
    bad = part_files(entry)[1]
    flip_row_bytes(bad, row=2)
    main = CacheEntry(CacheSettings(dir=root), entry.name, len(src))
    worker = CacheEntry(CacheSettings(dir=root), entry.name, len(src))
    assert main.cached == worker.cached == len(src) and main.complete
    pid = [p.path for p in worker.parts].index(str(bad))
    rows = int(np.count_nonzero(worker.part_of == pid))
    index = int(worker.parts[pid].index[2])
    with pytest.warns(UserWarning, match="the part is dropped"):
        assert worker.get(index) is None
    time.sleep(0.01)  # the manifest's mtime moves on
    main.refresh()
    assert main.cached == worker.cached == len(src) - rows
    assert not main.complete and main.get(index) is None
    main.close()
    worker.close()

@pytest.mark.parametrize("compression", ["zstd:3", "none"])
def test_cache_verify_reports_and_drops_a_damaged_part(src, tmp_path, compression):
    root = tmp_path / "c"
    entry = fill(src, root, compression=compression, part_bytes=120_000)
    bad = part_files(entry)[0]
    flip_row_bytes(bad, row=0)
    res = cli("cache", "verify", "--cache-dir", root, "--no-repair")
    assert res.exit_code == 1, res.output
    assert f"{bad.name}: row 0: checksum mismatch" in res.output and "(dropped)" not in res.output
    assert bad.exists()
    res = cli("cache", "verify", "--cache-dir", root)
    assert res.exit_code == 1 and f"{bad.name}: row 0: checksum mismatch (dropped)" in res.output
    assert "1 bad part(s)" in res.output
    assert not bad.exists() and bad.name not in [p["name"] for p in manifest(entry)["parts"]]
    res = cli("cache", "verify", "--cache-dir", root)
    assert res.exit_code == 0 and ": ok" in res.output
    # the next run recomputes what the part held
    loader = DataLoader(pipe(src, settings(root, compression=compression)))
    stl: list[dict] = []
    assert same(run_epochs(loader, 1, stl), reference(src, epochs=1))
    loader.shutdown()
    assert decode_s(stl)[0] > 0 and stl[0]["cache"]["cached"] == N_IMAGES


@pytest.mark.parametrize("compression", ["zstd:3", "none"])
def test_truncated_part_is_dropped_and_recomputed(src, tmp_path, compression, caplog):
    root = tmp_path / "c"
    entry = fill(src, root, compression=compression, part_bytes=120_000)
    bad = part_files(entry)[-1]
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size * 6 // 10)
    r = verify(entry, repair=False)
    assert [name for name, _ in r["bad_parts"]] == [bad.name]
    loader = DataLoader(pipe(src, settings(root, compression=compression)))
    stl: list[dict] = []
    with caplog.at_level(logging.WARNING, logger="feedgpu.cache"):
        got = run_epochs(loader, 1, stl)
    loader.shutdown()
    assert same(got, reference(src, epochs=1))
    assert any(bad.name in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
    assert bad.name not in [p["name"] for p in manifest(entry)["parts"]]
    assert stl[0]["cache"]["cached"] == N_IMAGES
    assert verify(entry, repair=False)["bad_parts"] == []


def test_stray_temporary_files_are_ignored_and_cleaned_when_old(src, tmp_path):
    root = tmp_path / "c"
    entry = fill(src, root, part_bytes=120_000)
    real = part_files(entry)[0]
    tmp = entry / f".part-{'0' * 32}.arrow.4242.123.tmp"     # a writer killed before its rename
    tmp.write_bytes(real.read_bytes()[:5000])
    orphan = entry / f"part-{'f' * 32}.arrow"                 # renamed, never listed (killed then)
    orphan.write_bytes(real.read_bytes())
    loader = DataLoader(pipe(src, settings(root)))
    stl: list[dict] = []
    assert same(run_epochs(loader, 1, stl), reference(src, epochs=1))
    loader.shutdown()
    assert decode_s(stl) == [0.0]
    assert orphan.name not in [p["name"] for p in manifest(entry)["parts"]]
    # young strays may belong to a live writer: kept
    r = verify(entry)
    assert r["bad_parts"] == [] and r["stray_files"] == [] and tmp.exists() and orphan.exists()
    old = time.time() - 2 * 3600
    for f in (tmp, orphan):
        os.utime(f, (old, old))
    res = cli("cache", "verify", "--cache-dir", root)
    assert res.exit_code == 0, res.output
    assert "2 stray file(s) from interrupted writes (removed)" in res.output
    assert not tmp.exists() and not orphan.exists() and real.exists()


@pytest.mark.parametrize("damage", ["deleted", "garbage"])
def test_lost_manifest_rebuilds_the_entry(src, tmp_path, damage):
    root = tmp_path / "c"
    entry = fill(src, root)
    if damage == "deleted":
        (entry / "manifest.json").unlink()
    else:
        (entry / "manifest.json").write_text('{"format": "feedgpu.cache/1", "parts": [')
    res = cli("cache", "verify", "--cache-dir", root, "--no-repair")
    assert res.exit_code == 1 and "manifest.json: missing or unreadable" in res.output
    loader = DataLoader(pipe(src, settings(root)))
    stl: list[dict] = []
    assert same(run_epochs(loader, 2, stl), reference(src))
    loader.shutdown()
    d1, d2 = decode_s(stl)
    assert d1 > 0 and d2 == 0.0
    m = manifest(entry)
    assert m["fingerprint"] == entry.name and sum(p["rows"] for p in m["parts"]) == N_IMAGES
    assert cli("cache", "verify", "--cache-dir", root).exit_code == 0


def test_damaged_label_column_is_never_served(src, tmp_path):
    root = tmp_path / "c"
    entry = fill(src, root, part_bytes=120_000)
    bad = part_files(entry)[0]
    with pa.memory_map(str(bad)) as mm:
        t = pa.ipc.open_file(mm).read_all()
    labels = t.column("label").to_numpy() + 1
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(labels, pa.int64()))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    bad.write_bytes(sink.getvalue().to_pybytes())
    loader = DataLoader(pipe(src, settings(root)))
    got = run_epochs(loader, 1)
    loader.shutdown()
    assert same(got, reference(src, epochs=1))


def test_rows_swapped_with_their_checksums_are_never_served(src, tmp_path):
    """Two rows' pixels and checks exchanged: each row is consistent on its own, but the part's
    meta checksum (which covers the check column and the row lengths) no longer matches."""
    root = tmp_path / "c"
    entry = fill(src, root, compression="none", part_bytes=120_000)
    bad = part_files(entry)[0]
    with pa.memory_map(str(bad)) as mm:
        t = pa.ipc.open_file(mm).read_all()
    order = list(range(t.num_rows))
    order[0], order[1] = 1, 0
    for name in ("check", "data"):
        col = t.column(name).take(order)
        t = t.set_column(t.schema.get_field_index(name), name, col)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    bad.write_bytes(sink.getvalue().to_pybytes())
    loader = DataLoader(pipe(src, settings(root, compression="none")))
    stl: list[dict] = []
    assert same(run_epochs(loader, 1, stl), reference(src, epochs=1))
    loader.shutdown()
    assert decode_s(stl)[0] > 0 and bad.name not in [p["name"] for p in manifest(entry)["parts"]]


@pytest.mark.parametrize("old", ["feedgpu.cache/1", "feedgpu.cache/2"])
def test_an_entry_of_a_previous_format_is_rebuilt_not_read(src, tmp_path, monkeypatch, old):
    """Format 1 stored CRC32 checks in a uint32 column, format 2 a checksum of the file's bytes
    (``file_xxh3``) and no check for zstd rows: their manifests are not accepted (and the format
    is part of the fingerprint, so a format-3 loader looks elsewhere anyway)."""
    fpm = importlib.import_module("feedgpu.cache.fingerprint")
    root = tmp_path / "c"
    entry = fill(src, root)
    m = manifest(entry)
    m["format"] = old
    (entry / "manifest.json").write_text(json.dumps(m))
    assert verify(entry, repair=False)["bad_parts"] == [("manifest.json", "missing or unreadable")]
    loader = DataLoader(pipe(src, settings(root)))
    stl: list[dict] = []
    assert same(run_epochs(loader, 1, stl), reference(src, epochs=1))
    loader.shutdown()
    assert decode_s(stl)[0] > 0 and manifest(entry)["format"] == "feedgpu.cache/3"
    base = fp(src, prefix())
    monkeypatch.setattr(fpm, "CACHE_FORMAT", old)
    assert fp(src, prefix()) != base


def test_row_buffer_grows_and_round_trips_through_a_part(tmp_path):
    """Rows larger than the buffer grow it; the part written from it reads back byte for byte,
    every row's ``check`` is the xxh3-64 of its stored bytes (zstd frames too), and the manifest
    entry's checksums are those of what is on disk: ``meta_xxh3`` of the small columns and row
    lengths, ``content_xxh3`` as documented (meta checksum, codec, keys), recomputed from the file
    without the writer's help."""
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((5, 7), (40, 30), (1, 1), (64, 64))]
    for codec, level in (("none", 0), ("zstd", 1)):
        enc, buf = RowEncoder(codec, level), RowBuffer(capacity=100)
        w = PartWriter(tmp_path, f"p-{codec}.arrow", enc)
        for batch in (imgs[:2], imgs[2:]):
            for i, a in enumerate(batch):
                data, check = enc.encode(a)
                buf.add(len(buf) + 10 * i, f"k{i}", i, a.shape[0], a.shape[1], check, data)
            w.write(buf)
            buf.clear()
        entry = w.close()
        path = str(tmp_path / entry["name"])
        assert set(entry) == {"name", "rows", "bytes", "content_xxh3", "meta_xxh3"}
        assert entry["rows"] == 4 and entry["bytes"] == os.path.getsize(path)
        part = Part(path, entry["meta_xxh3"])
        assert [np.array_equal(part.pixels(r), a) for r, a in enumerate(imgs)] == [True] * 4
        stored = [bytes(part.raw(r)) for r in range(4)]
        assert part.check.tolist() == [xxhash.xxh3_64_intdigest(b) for b in stored]
        assert (codec == "zstd") == (stored[1] != imgs[1].tobytes())
        lengths = np.array([len(b) for b in stored], "<i8")
        small = [np.array([0, 11, 0, 11], "<i8"), np.array([0, 1, 0, 1], "<i8"),
                 np.array([a.shape[0] for a in imgs], "<i4"), np.array([a.shape[1] for a in imgs], "<i4"),
                 part.check.astype("<u8"), lengths]
        meta = xxhash.xxh3_64_intdigest(b"".join(x.tobytes() for x in small))
        assert entry["meta_xxh3"] == meta == part.meta_checksum()
        keys = b"k0k1k0k1"
        spec = xxhash.xxh3_64_intdigest(meta.to_bytes(8, "little") + f"{codec}:{level}\n".encode()
                                        + np.full(4, 2, "<i8").tobytes() + keys)
        assert entry["content_xxh3"] == spec == part.content_checksum()
        with pytest.raises(Exception, match="do not match their checksum"):
            Part(path, entry["meta_xxh3"] ^ 1)


def _write_part(tmp_path, imgs, name="p.arrow", codec="none", **kw) -> tuple[str, dict]:
    enc, buf = RowEncoder(codec, 1), RowBuffer(capacity=1 << 16)
    w = PartWriter(tmp_path, name, enc, **kw)
    for i, a in enumerate(imgs):
        data, check = enc.encode(a)
        buf.add(i, f"k{i}", i, a.shape[0], a.shape[1], check, data)
    w.write(buf)
    return str(tmp_path / name), w.close()


def test_part_files_reach_the_kernel_in_aligned_pieces_of_at_most_256_kib(tmp_path, monkeypatch):
    """Large writes make the kernel use large page-cache folios, which on a VM with free page
    reporting come from memory the host took back (feedgpu/cache/sink.py). A 4.4 MiB record
    batch reaches the file in pieces of at most 256 KiB that never cross a multiple of 256 KiB,
    the small framing writes gathered, and a short write() is continued where it stopped."""
    from feedgpu.cache import sink

    rng = np.random.default_rng(1)
    imgs = [rng.integers(0, 256, (700, 700, 3), dtype=np.uint8) for _ in range(3)]
    pieces: list[tuple[int, int]] = []   # (file offset, size) of each write()
    real = os.write

    def spy(fd, data):
        n = real(fd, data)
        pieces.append((os.lseek(fd, 0, os.SEEK_CUR) - n, n))
        return n

    monkeypatch.setattr(sink.os, "write", spy)
    path, entry = _write_part(tmp_path, imgs)
    chunk = sink.WRITE_CHUNK
    assert chunk == 256 << 10
    assert sum(n for _, n in pieces) == entry["bytes"] == os.path.getsize(path) > 3 * imgs[0].nbytes
    assert all(at // chunk == (at + n - 1) // chunk for at, n in pieces)   # within one aligned stretch
    assert max(n for _, n in pieces) == chunk and len(pieces) <= entry["bytes"] // chunk + 8
    part = Part(path, entry["meta_xxh3"])
    assert all(np.array_equal(part.pixels(r), a) for r, a in enumerate(imgs))

    offered: list[int] = []

    def short(fd, data):  # the kernel takes at most 100 kB per call (write_chunk 8 MiB offers more)
        offered.append(memoryview(data).nbytes)
        return real(fd, memoryview(data)[:100_000])

    monkeypatch.setattr(sink.os, "write", short)
    path, entry = _write_part(tmp_path, imgs, name="short.arrow", write_chunk=8 << 20)
    assert max(offered) > 1 << 20 and len(offered) > entry["bytes"] // 100_000
    part = Part(path, entry["meta_xxh3"])
    assert all(np.array_equal(part.pixels(r), a) for r, a in enumerate(imgs))


def test_a_failed_part_write_raises_oserror_and_abort_leaves_nothing(tmp_path, monkeypatch):
    """ENOSPC in the middle of a record batch reaches the cache as OSError (it then stops caching
    with a warning); abort closes the file and removes the temporary part."""
    import errno

    from feedgpu.cache import sink

    enc, buf = RowEncoder("none", 0), RowBuffer(1 << 16)
    a = np.zeros((400, 400, 3), np.uint8)
    data, check = enc.encode(a)
    buf.add(0, "k", 0, 400, 400, check, data)
    w = PartWriter(tmp_path, "p.arrow", enc)
    real, calls = os.write, []

    def full(fd, data):
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(sink.os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        w.write(buf)
    w.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError):
        os.fstat(calls[0])                                  # the part's descriptor is closed


def test_writing_and_reading_parts_does_not_import_pandas(tmp_path):
    """pyarrow imports pandas (~0.25 s) on ``pa.array(...)`` and ``to_numpy()``; a filling worker
    would pay that in its first batch. Parts are built from and read through buffers instead."""
    import subprocess

    code = (
        "import sys, numpy as np\n"
        "from feedgpu.cache.parts import Part, PartWriter, RowBuffer, RowEncoder\n"
        "enc, buf = RowEncoder('none', 0), RowBuffer(1 << 16)\n"
        f"w = PartWriter({str(tmp_path)!r}, 'p.arrow', enc)\n"
        "a = np.zeros((4, 5, 3), np.uint8)\n"
        "data, check = enc.encode(a)\n"
        "buf.add(0, 'k', 1, 4, 5, check, data)\n"
        "w.write(buf)\n"
        "e = w.close()\n"
        f"part = Part({str(tmp_path / 'p.arrow')!r}, e['meta_xxh3'])\n"
        "assert (part.pixels(0) == a).all() and part.labels.tolist() == [1]\n"
        "print('pandas' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- 4. quarantine ------------------------------------------------------------------------------------
@pytest.fixture
def bad_ds(small_ds) -> Path:
    for name in ("truncated_half.jpg", "html_named.jpg"):
        shutil.copy(CASES / name, small_ds / "a" / name)
    return small_ds


def test_undecodable_samples_are_quarantined_and_never_decoded_again(bad_ds, tmp_path):
    src = FolderSource(bad_ds)
    n = len(src)
    assert n == 14
    root = tmp_path / "c"
    opts = dict(batch_size=4, shuffle=False, max_skipped=None)
    ref_loader = DataLoader(pipe(src, **opts))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSampleWarning)
        ref = run_epochs(ref_loader, 1)

    loader = DataLoader(pipe(src, settings(root), **opts))
    with pytest.warns(SkippedSampleWarning) as rec:
        got = run_epochs(loader, 1)
    assert same(got, ref)
    c = loader.stats()["cache"]
    loader.shutdown()
    msgs = sorted(str(w.message) for w in rec if issubclass(w.category, SkippedSampleWarning))
    assert len(msgs) == 2 and "html_named.jpg: not an image" in msgs[0] and "truncated_half.jpg: truncated" in msgs[1]
    assert c["quarantined"] == 2 and c["cached"] == n - 2 and c["complete"]
    q = {Path(x["key"]).name: x for x in manifest(Path(c["dir"]))["quarantine"]}
    assert {k: v["reason"] for k, v in q.items()} == {"html_named.jpg": "not an image", "truncated_half.jpg": "truncated"}
    assert {v["index"] for v in q.values()} == {i for i in range(n) if Path(src.key(i)).name in q}

    # the bad files are gone now: reading them again would fail with "unreadable"
    for name in q:
        (bad_ds / "a" / name).unlink()
    loader = DataLoader(pipe(src, settings(root), **opts))
    stl: list[dict] = []
    with pytest.warns(SkippedSampleWarning) as rec:
        got = run_epochs(loader, 1, stl)
    loader.shutdown()
    assert same(got, ref)
    msgs = sorted(str(w.message) for w in rec if issubclass(w.category, SkippedSampleWarning))
    assert len(msgs) == 2
    assert "html_named.jpg: not an image (quarantined in the cache)" in msgs[0]
    assert "truncated_half.jpg: truncated (quarantined in the cache)" in msgs[1]
    assert stl[0]["skipped"] == {"not an image": 1, "truncated": 1}
    assert decode_s(stl) == [0.0]


# -- 5. size budget --------------------------------------------------------------------------------
def test_budget_evicts_least_recently_used_entries_first(src, tmp_path):
    root = tmp_path / "c"
    sizes = {}
    for s in (56, 60, 68):  # three other pipelines' entries
        loader = DataLoader(pipe(src, settings(root), st=stages(size=s)))
        run_epochs(loader, 1)
        sizes[s] = Path(loader.stats()["cache"]["dir"])
        loader.shutdown()
    now = time.time()
    for age, s in ((3000, 60), (2000, 56), (1000, 68)):  # LRU order: 60, 56, 68
        os.utime(sizes[s] / "last_used", (now - age, now - age))
    probe = tmp_path / "probe"                  # how large the new entry will be
    fill(src, probe)
    mine = entries(probe)[0]["bytes"]
    size_of = {s: next(e["bytes"] for e in entries(root) if e["path"] == str(d)) for s, d in sizes.items()}
    total = sum(size_of.values()) + mine
    # room for all but the oldest entry (60 px) and half of the next oldest (56 px)
    budget = total - size_of[60] - size_of[56] // 2
    loader = DataLoader(pipe(src, settings(root, max_size=budget)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the entry in use fits: no warning
        got = run_epochs(loader, 1)
    c = loader.stats()["cache"]
    loader.shutdown()
    assert same(got, reference(src, epochs=1))
    left = {Path(e["path"]) for e in entries(root)}
    assert sizes[60] not in left and sizes[56] not in left  # the two least recently used went
    assert sizes[68] in left and Path(c["dir"]) in left      # the newest and the one in use stay
    assert c["cached"] == N_IMAGES
    assert sum(e["bytes"] for e in entries(root)) <= budget


def test_budget_smaller_than_the_entry_stops_it_growing(src, tmp_path):
    root = tmp_path / "c"
    other = fill(src, root / "x")  # noqa: F841 - a separate root: must not be touched
    shutil.move(str(root / "x" / other.name), str(root / other.name))
    shutil.rmtree(root / "x")
    probe_bytes = entries(root)[0]["bytes"]
    st = stages(size=72)
    budget = probe_bytes // 3
    loader = DataLoader(pipe(src, settings(root, max_size=budget, part_bytes=60_000), st=st))
    with pytest.warns(UserWarning, match="reached the budget"):
        got = run_epochs(loader, 1)
    c = loader.stats()["cache"]
    loader.shutdown()
    assert same(got, reference(src, epochs=1, st=st))        # output unchanged
    es = entries(root)
    assert [e["path"] for e in es] == [c["dir"]]               # others evicted, the one in use kept
    assert 0 < c["cached"] < N_IMAGES
    # it stops near the budget: at most one part over it
    assert es[0]["bytes"] <= budget + max(p["bytes"] for p in manifest(Path(c["dir"]))["parts"]) + 4096
    # the next run serves what is there and computes the rest
    loader = DataLoader(pipe(src, settings(root, max_size=budget, part_bytes=60_000), st=st))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert same(run_epochs(loader, 1), reference(src, epochs=1, st=st))
    loader.shutdown()


def test_entry_deleted_while_in_use_does_not_break_the_loader(src, tmp_path):
    root = tmp_path / "c"
    loader = DataLoader(pipe(src, settings(root, part_bytes=60_000)))
    it = iter(loader)
    b = next(it)
    got = [(b.images.clone(), b.labels.clone())]
    shutil.rmtree(loader.stats()["cache"]["dir"])  # a process that ignores the in-use lock
    with pytest.warns(UserWarning, match="caching stops"):
        got += [(b.images.clone(), b.labels.clone()) for b in it]
        loader.shutdown()
    assert same([got], reference(src, epochs=1))


def test_eviction_and_clear_leave_an_entry_in_use_alone(src, tmp_path):
    from feedgpu.cache import clear, evict_lru

    root = tmp_path / "c"
    loader = DataLoader(pipe(src, settings(root, part_bytes=60_000)))
    run_epochs(loader, 1)
    entry = Path(loader.stats()["cache"]["dir"])
    assert evict_lru(root, budget=0) == [] and entry.is_dir()  # the loader holds it open
    assert clear(root) == (0, 1) and entry.is_dir()
    loader.shutdown()  # releases it
    assert clear(root) == (1, 0) and not entry.exists()


# -- 6. several processes on one entry ------------------------------------------------------------
def _fill_in_child(src, root: str, seed: int, start) -> None:
    code = 1
    try:
        # torch's intra-op thread pool does not survive fork (the parent has used it): no torch
        # op here, only the loader (its stages are numpy and PIL)
        torch.set_num_threads(1)
        start.wait(30)
        loader = DataLoader(pipe(src, settings(Path(root), part_bytes=40_000), seed=seed))
        n = sum(len(b.labels) for b in loader)
        loader.shutdown()
        code = 0 if n == N_IMAGES else 3
    finally:
        os._exit(code)


@pytest.mark.timeout(90)
def test_two_processes_fill_one_entry_at_once(src, tmp_path, no_leaked_workers):
    root = tmp_path / "c"
    ctx = mp.get_context("fork")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_fill_in_child, args=(src, str(root), seed, start)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    entry = entry_dir(root)
    m = manifest(entry)
    listed = {p["name"] for p in m["parts"]}
    assert listed == {f.name for f in part_files(entry)}   # no part lost from the manifest
    assert len(listed) >= 6
    assert not list(entry.glob("*.tmp")) and not list(entry.glob(".*.tmp"))
    rows = {}
    for p in m["parts"]:
        with pa.memory_map(str(entry / p["name"])) as mm:
            idx = pa.ipc.open_file(mm).read_all().column("index").to_pylist()
        assert len(idx) == p["rows"]
        for i in idx:
            rows[i] = rows.get(i, 0) + 1
    assert set(rows) == set(range(N_IMAGES))
    r = verify(entry, repair=False)
    assert r["bad_parts"] == [] and r["rows"] == sum(rows.values())
    loader = DataLoader(pipe(src, settings(root), nw=2))
    stl: list[dict] = []
    assert same(run_epochs(loader, 2, stl), reference(src))
    loader.shutdown()
    assert decode_s(stl) == [0.0, 0.0]


# -- 7. settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value, want", [("zstd", ("zstd", 1)), ("zstd:3", ("zstd", 3)), ("zstd:22", ("zstd", 22)),
                                         ("none", ("none", 0)), ("ZSTD:5", ("zstd", 5))])
def test_compression_strings(value, want):
    assert parse_compression(value) == want


@pytest.mark.parametrize("value, msg", [
    ("zstd:0", "zstd level must be in 1..22"), ("zstd:23", "1..22"), ("lz4", "codec must be one of ['none', 'zstd']"),
    ("zstd:x", "the level must be an integer"), ("none:3", "'none' takes no level"), ("", "codec must be one of"),
])
def test_bad_compression_strings(value, msg, tmp_path):
    with pytest.raises(ConfigError, match=f"cache compression {value!r}") as e:
        parse_compression(value)
    assert msg in str(e.value)
    with pytest.raises(ConfigError, match="cache.compression: got "):
        CacheSettings.make({"dir": str(tmp_path), "compression": value or "zstd:99"})


@pytest.mark.parametrize("value, want", [("512MiB", 512 * 2**20), ("20GB", 20 * 10**9), ("1.5 GiB", 3 * 2**29),
                                         ("100kb", 100_000), ("4096", 4096), (1 << 20, 1 << 20), (None, None)])
def test_sizes(value, want):
    assert parse_size(value) == want


@pytest.mark.parametrize("value", ["lots", "12XB", "-1GB", "1.2.3GB", "GB", "5 giga"])
def test_bad_sizes(value):
    with pytest.raises(ConfigError, match="expected a number with a unit such as 512MiB or 20GB"):
        parse_size(value)


def test_settings_from_values(tmp_path, monkeypatch):
    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(tmp_path / "env"))
    assert CacheSettings.make(None) is None and CacheSettings.make(False) is None
    s = CacheSettings.make(True)
    assert s.dir == tmp_path / "env" / "cache" and s.compression == "none" and s.max_size is None
    s = CacheSettings.make(str(tmp_path / "x"))
    assert s.dir == tmp_path / "x"
    s = CacheSettings.make({"dir": str(tmp_path), "compression": "zstd:3", "max_size": "512MiB", "enabled": True})
    assert (s.compression, s.max_size) == ("zstd:3", 512 * 2**20)
    with pytest.raises(ConfigError, match=r"cache.compresion: unknown key 'compresion'; allowed keys: compression, dir"):
        CacheSettings.make({"compresion": "zstd"})
    with pytest.raises(ConfigError, match="expected True, a directory or a mapping"):
        CacheSettings.make(3)
    with pytest.raises(ConfigError, match="cache size 'big'"):
        CacheSettings.make({"max_size": "big"})


def _yaml_with(tmp_path, data_dir, cache: dict) -> Path:
    data = yaml.safe_load(CACHED_YAML.read_text())
    data["source"]["path"] = str(data_dir)
    data["cache"] = cache
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


@pytest.mark.parametrize("cache, where, msg", [
    ({"enabled": True, "compresion": "zstd"}, "cache.compresion: unknown key 'compresion'",
     "allowed keys: compression, dir, enabled, fingerprint, max_size"),
    ({"enabled": True, "compression": "lz4"}, "cache.compression", "allowed: none, zstd, zstd:1 ... zstd:22"),
    ({"enabled": True, "compression": "zstd:0"}, "cache.compression", "got 'zstd:0'"),
    ({"enabled": True, "max_size": "big"}, "cache.max_size", "big"),
    ({"enabled": True, "max_size": 0}, "cache.max_size", "greater than 0"),
    ({"enabled": "maybe"}, "cache.enabled", "maybe"),
    ({"enabled": True, "fingerprint": "mtime"}, "cache.fingerprint", "allowed: metadata, content"),
])
def test_yaml_cache_section_is_validated(tmp_path, folder_ds, cache, where, msg):
    f = _yaml_with(tmp_path, folder_ds, cache)
    with pytest.raises(ConfigError) as e:
        Pipeline.from_yaml(f)
    text = str(e.value)
    assert where in text and msg in text, text
    res = cli("pipeline", "validate", f)
    assert res.exit_code == 2 and where in res.stderr and "Traceback" not in res.output


def test_yaml_cache_section_reaches_the_loader(tmp_path, folder_ds, monkeypatch):
    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(tmp_path / "env"))
    f = _yaml_with(tmp_path, folder_ds, {"enabled": True, "compression": "zstd:3", "max_size": "1GiB"})
    p = Pipeline.from_yaml(f)
    assert p.cache == CacheSettings(tmp_path / "env" / "cache", "zstd:3", 2**30)
    assert Pipeline.from_yaml(f, **{"cache.enabled": False}).cache is None
    assert DataLoader(p, batch_size=32, cache=False).cache_settings is None
    assert DataLoader(p, batch_size=32, cache=str(tmp_path / "y")).cache_settings.dir == tmp_path / "y"
    assert "zstd:3" in p.explain("cpu") and "[cache]" in p.explain("cpu")


def test_compression_level_is_recorded(src, tmp_path):
    entry = fill(src, tmp_path / "c", compression="zstd:7")
    m = manifest(entry)
    assert m["compression"] == "zstd:7"
    for p in part_files(entry):
        with pa.memory_map(str(p)) as mm:
            meta = pa.ipc.open_file(mm).schema.metadata
        assert meta[b"codec"] == b"zstd" and meta[b"level"] == b"7"


# -- 8. files on disk --------------------------------------------------------------------------------
def test_files_are_not_world_writable_and_the_manifest_is_json(src, tmp_path):
    old = os.umask(0)  # the most permissive umask: modes must come from feedgpu, not the umask
    try:
        entry = fill(src, tmp_path / "c", part_bytes=120_000)
    finally:
        os.umask(old)
    for f in [entry, *part_files(entry), entry / "manifest.json", entry / ".lock"]:
        mode = stat.S_IMODE(f.stat().st_mode)
        assert not mode & stat.S_IWOTH, f"{f} is world-writable ({oct(mode)})"
    m = json.loads((entry / "manifest.json").read_text())  # JSON, no pickle
    assert m["format"] == "feedgpu.cache/3" and m["fingerprint"] == entry.name
    assert m["samples"] == N_IMAGES and m["compression"] == "none" and m["quarantine"] == []
    assert m["schema"] == {"dtype": "uint8", "layout": "HWC", "channels": 3}
    assert m["feedgpu_version"] and m["meta"]["stages"][1] == {"name": "resize", "config": Resize(SIZE).config()}
    for p in m["parts"]:
        f = entry / p["name"]
        assert p["bytes"] == f.stat().st_size
        assert "file_xxh3" not in p and isinstance(p["meta_xxh3"], int)
        assert p["content_xxh3"] == Part(str(f), p["meta_xxh3"]).content_checksum()
    assert sum(p["rows"] for p in m["parts"]) == N_IMAGES


def test_last_used_and_root_are_not_world_writable(src, tmp_path):
    old = os.umask(0)
    try:
        entry = fill(src, tmp_path / "c")
    finally:
        os.umask(old)
    for f in (entry / "last_used", tmp_path / "c"):
        assert not stat.S_IMODE(f.stat().st_mode) & stat.S_IWOTH, f


def test_opening_an_entry_marks_it_used(src, tmp_path):
    entry = fill(src, tmp_path / "c")
    old = time.time() - 5000
    os.utime(entry / "last_used", (old, old))
    assert entries(tmp_path / "c")[0]["last_used"] == pytest.approx(old)
    loader = DataLoader(pipe(src, settings(tmp_path / "c")))
    next(iter(loader))
    loader.shutdown()
    assert entries(tmp_path / "c")[0]["last_used"] > time.time() - 60


# -- 9. the command line ---------------------------------------------------------------------------
def test_cli_build_info_verify_clear(folder_ds, tmp_path, monkeypatch):
    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(tmp_path / "env"))
    root = tmp_path / "c"
    res = cli("cache", "build", "--pipeline", CACHED_YAML, "--data", folder_ds, "--cache-dir", root,
              "--set", "loader.batch_size=32")
    assert res.exit_code == 0, res.output
    assert f"0 of {N_IMAGES} samples cached, {N_IMAGES} to build" in res.output
    assert f"built {N_IMAGES} samples, quarantined 0" in res.output
    assert f"entry holds {N_IMAGES}/{N_IMAGES}" in res.output
    entry = entry_dir(root)
    m = manifest(entry)
    assert m["compression"] == "none" and sum(p["rows"] for p in m["parts"]) == N_IMAGES
    # again: nothing to do
    res = cli("cache", "build", "--pipeline", CACHED_YAML, "--data", folder_ds, "--cache-dir", root)
    assert res.exit_code == 0 and f"{N_IMAGES} of {N_IMAGES} samples cached, 0 to build" in res.output

    res = cli("cache", "info", "--cache-dir", root)
    assert res.exit_code == 0, res.output
    assert f"cache root {root}: 1 entry" in res.output
    assert entry.name in res.output and f"{N_IMAGES}/{N_IMAGES} rows" in res.output and "none" in res.output
    res = cli("cache", "info", "--cache-dir", root, "--json")
    info = json.loads(res.stdout)
    assert len(info) == 1
    e = info[0]
    assert (e["fingerprint"], e["rows"], e["samples"], e["quarantined"], e["compression"], e["manifest"]) == \
        (entry.name, N_IMAGES, N_IMAGES, 0, "none", True)
    assert e["bytes"] == sum(f.stat().st_size for f in entry.iterdir() if f.is_file())

    res = cli("cache", "verify", "--cache-dir", root)
    assert res.exit_code == 0 and f"{entry.name}: {len(m['parts'])} parts, {N_IMAGES} rows verified: ok" in res.output
    res = cli("cache", "verify", "0" * 32, "--cache-dir", root)
    assert res.exit_code != 0 and "no cache entries found" in res.output

    # the loader on the same pipeline reads what build wrote: nothing is decoded
    p = Pipeline.from_yaml(CACHED_YAML, **{"source.path": str(folder_ds), "cache.dir": str(root),
                                           "loader.batch_size": 40, "loader.num_workers": 0,
                                           "output.device": "cpu"})
    loader = DataLoader(p)
    n = sum(len(b.labels) for b in loader)
    st = loader.stats()
    loader.shutdown()
    assert n == N_IMAGES // 40 * 40 and st["stage_s"]["decode"] == 0.0 and st["stage_s"]["resize"] == 0.0
    assert st["cache"]["dir"] == str(entry)

    res = cli("cache", "clear", "--cache-dir", root, input="n\n")
    assert res.exit_code == 1 and entry.exists()
    res = cli("cache", "clear", "--cache-dir", root, "--yes")
    assert res.exit_code == 0 and "deleted 1 entry" in res.output and not entry.exists()
    assert "0 entries" in cli("cache", "info", "--cache-dir", root).output
    # without --cache-dir: the default root under $FEEDGPU_CACHE_DIR
    res = cli("cache", "info")
    assert res.exit_code == 0 and f"cache root {tmp_path / 'env' / 'cache'}: 0 entries" in res.output


def test_cli_build_default_root_and_compression(folder_ds, tmp_path, monkeypatch):
    monkeypatch.setenv("FEEDGPU_CACHE_DIR", str(tmp_path / "env"))
    res = cli("cache", "build", "--pipeline", CACHED_YAML, "--data", folder_ds, "--compression", "zstd:3",
              "--workers", "1")
    assert res.exit_code == 0, res.output
    entry = entry_dir(tmp_path / "env" / "cache")
    assert manifest(entry)["compression"] == "zstd:3"
    res = cli("cache", "clear", entry.name, "--yes")
    assert res.exit_code == 0 and "deleted 1 entry" in res.output
    res = cli("cache", "build", "--pipeline", CACHED_YAML, "--data", folder_ds, "--compression", "lz4")
    assert res.exit_code == 2 and "cache.compression: got 'lz4'" in res.stderr and "Traceback" not in res.output


def test_cli_build_quarantines_bad_files(bad_ds, tmp_path):
    root = tmp_path / "c"
    res = cli("cache", "build", "--pipeline", CACHED_YAML, "--data", bad_ds, "--cache-dir", root)
    assert res.exit_code == 0, res.output
    assert "built 12 samples, quarantined 2" in res.output and "entry holds 12/14" in res.output
    m = manifest(entry_dir(root))
    assert sorted(q["reason"] for q in m["quarantine"]) == ["not an image", "truncated"]
    res = cli("cache", "info", "--cache-dir", root)
    assert "12/14 rows  2 quarantined" in res.output


# -- 10. reading -------------------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["zstd:1", "none"])
def test_random_access_by_index_from_memory_maps(src, tmp_path, compression):
    """``CacheEntry.get(i)`` gives sample ``i``'s prefix output (the pixels the uncached path
    computes), in any order, without loading the parts into memory."""
    fill(src, tmp_path / "c", compression=compression, part_bytes=120_000)
    p = pipe(src, settings(tmp_path / "c", compression=compression))
    before = pa.total_allocated_bytes()
    entry = open_entry(p.cache, src, p.stages, p.plan("cpu"))
    assert entry.cached == N_IMAGES
    assert pa.total_allocated_bytes() - before < 64 << 10   # parts are mapped, not read into Arrow memory
    rng = np.random.default_rng(0)
    for i in rng.permutation(N_IMAGES)[:25].tolist():
        want = np.asarray(Resize(SIZE).apply(Decode().apply(src.read(i).payload)))
        got = entry.get(i)
        assert got.dtype == np.uint8 and np.array_equal(got, want), i
        assert entry.label(i) == int(src.labels[i])


def test_an_entry_is_served_whatever_compression_the_reader_is_set_to(src, tmp_path):
    """Compression is not part of the fingerprint: each part records its own codec and level."""
    root = tmp_path / "c"
    fill(src, root, compression="zstd:3")
    loader = DataLoader(pipe(src, settings(root, compression="none")))
    stl: list[dict] = []
    assert same(run_epochs(loader, 1, stl), reference(src, epochs=1))
    loader.shutdown()
    assert decode_s(stl) == [0.0]
