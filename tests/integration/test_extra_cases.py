"""Kinds of input next to the shared hard cases, made here from ``shared/data/photos``: animated
GIF and WebP (first frame), WebP lossy and lossless, progressive JPEG, names that disagree with
the content, and odd or non-UTF-8 names, in every source format, on the Python and DALI CPU
engines. Arithmetic-coded and 12-bit JPEGs cannot be written with Pillow: both are small files
shipped in ``tests/data`` (how each was made is written beside its test)."""
from __future__ import annotations

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
from PIL import Image, ImageOps, features

from conftest import PHOTOS
from feedgpu import DataLoader, Pipeline, SkippedSampleWarning
from feedgpu.sources import open_source
from feedgpu.stages import Decode, ResizeCenterCrop

pytestmark = pytest.mark.timeout(120)
HAS_WEBP = features.check("webp")
W, H = 48, 48
STAGE = ResizeCenterCrop(H, H)  # the images are already 48 x 48: a no-op resample


def _photo(k: int) -> Image.Image:
    return ImageOps.fit(Image.open(sorted(PHOTOS.glob("*.jpg"))[k]).convert("RGB"), (W, H))


def _save(img, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    if fmt == "JPEG":
        kw.setdefault("subsampling", 0)  # 4:4:4: 48 px photos lose too much colour to 4:2:0
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def extra() -> dict[str, tuple[bytes, np.ndarray, str]]:
    """``{file name: (bytes, expected RGB pixels, rule)}``; rule: ``exact`` or ``close``."""
    a, b = _photo(0), _photo(1)
    inv = ImageOps.invert(a)
    gif_frame0 = np.asarray(Image.open(io.BytesIO(_save(a, "GIF"))).convert("RGB"))
    out = {
        "anim.gif": (_save(a, "GIF", save_all=True, append_images=[inv], duration=100, loop=0), gif_frame0, "exact"),
        "progressive.jpg": (_save(b, "JPEG", quality=95, progressive=True), np.asarray(b), "close"),
        "jpeg_named.png": (_save(a, "JPEG", quality=95), np.asarray(a), "close"),
        "gif_named.png": (_save(a, "GIF"), gif_frame0, "exact"),
        "odd name é ü.jpg": (_save(b, "JPEG", quality=95), np.asarray(b), "close"),
        "dots.in.name.jpg": (_save(a, "JPEG", quality=95), np.asarray(a), "close"),
        "UPPER.JPG": (_save(b, "JPEG", quality=95), np.asarray(b), "close"),
        "caf\udce9.jpg": (_save(a, "JPEG", quality=95, progressive=True), np.asarray(a), "close"),  # b"caf\xe9"
    }
    if HAS_WEBP:  # this PIL build can write and read WebP (Pillow-SIMD often lacks libwebp)
        lossless = _save(a, "WEBP", lossless=True)
        lossy = _save(b, "WEBP", quality=90)
        out.update({
            # not "anim.webp": a WebDataset key is the name up to its first dot, and anim.gif has it
            "anim_frames.webp": (_save(a, "WEBP", save_all=True, append_images=[inv], lossless=True, duration=100),
                                 np.asarray(a), "exact"),
            "lossless.webp": (lossless, np.asarray(a), "exact"),
            # lossy VP8 with 4:2:0 chroma is ~7 levels off the photo: the reference is libwebp's decode
            "lossy.webp": (lossy, np.asarray(Image.open(io.BytesIO(lossy)).convert("RGB")), "exact"),
            "webp_named.jpg": (lossless, np.asarray(a), "exact"),
        })
    return out


def _check(name: str, got: np.ndarray, want: np.ndarray, rule: str, tol: float = 2.5) -> None:
    assert got.shape == want.shape == (H, W, 3) and got.dtype == np.uint8, name
    d = np.abs(got.astype(np.int16) - want.astype(np.int16))
    if rule == "exact":
        assert d.max() == 0, f"{name}: max diff {d.max()}"
    else:
        assert d.mean() < tol, f"{name}: mean diff {d.mean():.2f}"


def test_decode_gives_the_first_frame_and_the_right_pixels(extra):
    for name, (data, want, rule) in extra.items():
        _check(name, np.asarray(Decode().apply(data)), want, rule)
    # the first frame, not the second (the inverted photo)
    a = np.asarray(_photo(0)).astype(np.int16)
    for name in ("anim.gif", "anim_frames.webp") if HAS_WEBP else ("anim.gif",):
        got = np.asarray(Decode().apply(extra[name][0])).astype(np.int16)
        assert np.abs(got - a).mean() < 3 and np.abs(got - (255 - a)).mean() > 50, name


def _write(root: Path, fmt: str, files: dict) -> Path:
    root.mkdir(parents=True)
    if fmt == "folder":
        d = os.fsencode(root / "extra")
        os.mkdir(d)
        for name, (data, _, _) in files.items():
            with open(d + b"/" + os.fsencode(name), "wb") as f:
                f.write(data)
    elif fmt == "tar":
        with tarfile.open(root / "extra-000000.tar", "w", format=tarfile.GNU_FORMAT,
                          encoding="utf-8", errors="surrogateescape") as tf:
            for name, (data, _, _) in files.items():
                for member, blob in ((f"extra/{name}", data), (f"extra/{name.split('.')[0]}.cls", b"0")):
                    info = tarfile.TarInfo(member)
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
    else:
        names = list(files)
        pq.write_table(pa.table({"key": [n.encode("utf-8", "surrogateescape") for n in names],
                                 "image": pa.array([files[n][0] for n in names], pa.binary()),
                                 "label": pa.array([0] * len(names), pa.int64())}),
                       root / "extra.parquet", row_group_size=5)
    return root


def _names(fmt: str, root: Path, src) -> list[str]:
    if fmt == "parquet":
        return [k.decode("utf-8", "surrogateescape") for k in pq.read_table(root / "extra.parquet").column("key").to_pylist()]
    return [src.key(i).rsplit("/", 1)[-1] for i in range(len(src))]


@pytest.fixture(scope="module")
def datasets(extra, tmp_path_factory):
    base = tmp_path_factory.mktemp("extra")
    return {fmt: _write(base / fmt, fmt, extra) for fmt in ("folder", "tar", "parquet")}


def _run(src, engine):
    p = Pipeline(src, [Decode(), STAGE], batch_size=5, shuffle=False, num_workers=2, device="cpu",
                 engine=engine, max_skipped=0)
    loader = DataLoader(p, timeout=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedSampleWarning)
        images = torch.cat([b.images.clone() for b in loader])
    assert not [w for w in caught if issubclass(w.category, SkippedSampleWarning)]
    assert loader.stats()["skipped_total"] == 0
    loader.shutdown()
    return images.numpy()


@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
@pytest.mark.parametrize("engine", ["python", "dali-cpu"])
def test_every_kind_in_every_format_and_engine(extra, datasets, fmt, engine, no_leaked_workers):
    if engine == "dali-cpu":
        pytest.importorskip("nvidia.dali")
    root = datasets[fmt]
    src = open_source(fmt, root)
    names = _names(fmt, root, src)
    assert sorted(names) == sorted(extra), "a file was not indexed (odd name?)"
    images = _run(src, "python" if engine == "python" else {"name": "dali", "device": "cpu"})
    assert images.shape == (len(extra), H, W, 3)
    for i, name in enumerate(names):
        data, want, rule = extra[name]
        # DALI decodes JPEGs with its own IDCT and resamples itself: close, not bit-exact
        _check(f"{fmt}/{engine}/{name}", images[i], want, "close" if engine != "python" else rule,
               tol=2.5 if engine == "python" else 3.0)


#: a lossless WebP header (RIFF, WEBP, VP8L chunk, 48 x 48): recognised from its bytes
WEBP_HEADER = (b"RIFF" + (30).to_bytes(4, "little") + b"WEBPVP8L" + (10).to_bytes(4, "little") + b"\x2f"
               + ((W - 1) | (H - 1) << 14).to_bytes(4, "little") + bytes(5))


@pytest.mark.skipif(HAS_WEBP, reason="this PIL build decodes WebP: covered by the tests above")
@pytest.mark.filterwarnings("ignore:image file could not be identified because WEBP support not installed")
@pytest.mark.parametrize("engine", ["python", "dali-cpu"])
def test_webp_without_libwebp_is_skipped_as_unsupported_format(engine, no_leaked_workers):
    from feedgpu import DecodeError

    with pytest.raises(DecodeError) as info:
        Decode().apply(WEBP_HEADER)
    assert info.value.reason == "unsupported format" and "WebP" in info.value.detail
    if engine == "dali-cpu":
        pytest.importorskip("nvidia.dali")
    good = _save(_photo(0), "JPEG", quality=95)

    class Files(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return (WEBP_HEADER if i == 3 else good), 0

    p = Pipeline(Files(), [Decode(), STAGE], batch_size=5, shuffle=False, num_workers=2, device="cpu",
                 engine="python" if engine == "python" else {"name": "dali", "device": "cpu"}, max_skipped=None)
    loader = DataLoader(p, timeout=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedSampleWarning)
        n = sum(len(b.labels) for b in loader)
    assert n == 10 and loader.stats()["skipped"]["unsupported format"] >= 1
    assert any("Files[3]: unsupported format (WebP" in str(w.message) for w in caught)
    loader.shutdown()


#: An arithmetic-coded JPEG (SOF9) of ``_photo(0)``, 4:4:4, written by libjpeg-turbo 2.1.5's
#: ``cjpeg -arithmetic -quality 95 -sample 1x1`` (Debian's libjpeg-turbo-progs): Pillow cannot write one.
ARITHMETIC = Path(__file__).resolve().parents[1] / "data" / "arithmetic.jpg"


@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
@pytest.mark.parametrize("engine", ["python", "dali-cpu"])
def test_arithmetic_coded_jpeg_decodes_right(fmt, engine, tmp_path, no_leaked_workers):
    """libjpeg-turbo (Pillow-SIMD's and DALI's) decodes arithmetic coding: the photo's pixels
    on both engines, in every source format, no skip."""
    if engine == "dali-cpu":
        pytest.importorskip("nvidia.dali")
    data = ARITHMETIC.read_bytes()
    assert b"\xff\xc9" in data                        # the arithmetic-coded frame header
    files = {"arith.jpg": (data, np.asarray(_photo(0)), "close"),
             **{f"good{k}.jpg": (_save(_photo(k), "JPEG", quality=95), np.asarray(_photo(k)), "close")
                for k in (1, 2)}}
    root = _write(tmp_path / fmt, fmt, files)
    src = open_source(fmt, root)
    images = _run(src, "python" if engine == "python" else {"name": "dali", "device": "cpu"})
    for i, name in enumerate(_names(fmt, root, src)):
        _check(f"{fmt}/{engine}/{name}", images[i], files[name][1], "close", tol=3.0)


#: A real 12-bit JPEG (SOF1, precision 12; 96 x 64 RGB of photo 00 times 16), written by imagecodecs
#: 2026.3.6's ``jpeg8_encode(..., bitspersample=12)`` (libjpeg-turbo 3): Pillow cannot write one.
TWELVE_BIT = Path(__file__).resolve().parents[1] / "data" / "twelve_bit.jpg"


def test_twelve_bit_file_is_what_it_claims():
    from feedgpu.stages.jpeg_header import jpeg_precision

    data = TWELVE_BIT.read_bytes()
    sof = data.index(b"\xff\xc1")                     # extended sequential frame header
    assert data[sof + 4] == 12 and jpeg_precision(data) == 12
    assert jpeg_precision(_save(_photo(0), "JPEG")) == 8 and jpeg_precision(b"GIF89a") is None


@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
@pytest.mark.parametrize("engine", ["python", "dali-cpu"])
def test_twelve_bit_jpeg_is_a_named_unsupported_format_skip(fmt, engine, tmp_path, no_leaked_workers):
    """Pillow (and so the Python engine) decodes 8-bit JPEGs only: a 12-bit one is skipped as
    ``unsupported format`` naming the file and its precision, on both engines and in every
    source format; the other samples arrive with their own pixels."""
    if engine == "dali-cpu":
        pytest.importorskip("nvidia.dali")
    good = {f"good{k}.jpg": (_save(_photo(k), "JPEG", quality=95), np.asarray(_photo(k)), "close") for k in range(4)}
    files = {**good, "deep.jpg": (TWELVE_BIT.read_bytes(), None, "")}
    root = _write(tmp_path / fmt, fmt, files)
    src = open_source(fmt, root)
    names = _names(fmt, root, src)
    p = Pipeline(src, [Decode(), STAGE], batch_size=5, shuffle=False, num_workers=2, device="cpu",
                 engine="python" if engine == "python" else {"name": "dali", "device": "cpu"}, max_skipped=1)
    loader = DataLoader(p, timeout=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedSampleWarning)
        batches = [(b.images.clone(), b.labels.clone()) for b in loader]
    stats = loader.stats()
    loader.shutdown()
    assert stats["skipped"] == {"unsupported format": 1}
    message = [str(w.message) for w in caught if issubclass(w.category, SkippedSampleWarning)]
    bad = names.index("deep.jpg")
    assert message == [f"feedgpu skipped {src.key(bad)}: unsupported format (12-bit JPEG: Pillow decodes "
                       "8-bit JPEGs only)"]
    images = torch.cat([b[0] for b in batches]).numpy()
    assert images.shape == (5, H, W, 3)   # the bad row is refilled from a spare (counted above)
    for i, name in enumerate(names):
        if i != bad:
            _check(f"{fmt}/{engine}/{name}", images[i], good[name][1], "close", tol=3.0)
