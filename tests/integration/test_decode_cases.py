"""Hard inputs (``shared/cases/images``) in every source format: decode, or skip and name; never crash.

Expectations follow ``shared/cases/README.md``. A file added there later is covered by the loader
tests automatically (it must decode or be skipped with a named key, never crash or hang).
"""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageOps

from conftest import CASES, N_GOOD, REPO, case_files, open_format
from feedgpu import DataLoader, DecodeError, Pipeline, SampleError, SkippedSampleWarning
from feedgpu.sources import open_source
from feedgpu.stages import Decode, HorizontalFlip, RandomResizedCrop, ResizeCenterCrop
from feedgpu.stages.base import stage_random
from feedgpu.stages.draws import stage_draw_ids
from feedgpu.stages.decode import IMAGENET_MEAN_PIXEL

pytestmark = pytest.mark.timeout(120)

FORMATS = ("folder", "tar", "parquet")
SKIP = {"truncated_half.jpg": "truncated", "truncated.png": "truncated", "empty.jpg": "empty",
        "bomb_20000x20000.png": "too many pixels", "html_named.jpg": "not an image"}
EITHER = {"corrupt_entropy.jpg"}  # decodes or skips, never crashes
DECODE = {"ok_rgb.jpg", "cmyk_adobe.jpg", "ycck.jpg", "gray.jpg", "gray_alpha.png", "palette_trns.png",
          "rgba_transparent.png", "gray16.png", "tiny_1x1.jpg", "thin_1x500.jpg", "small_166.jpg", "png_named.jpg",
          *(f"exif_orient_{k}.jpg" for k in range(1, 9))}
#: Found while indexing (folder, tar): never reaches the loader there.
AT_INDEX = {"empty.jpg": "empty"}


def expectation(name: str) -> str:
    return "skip" if name in SKIP else "decode" if name in DECODE else "either"


def test_every_case_file_has_an_expectation():
    """The table above is complete for the files present today (others get 'either')."""
    assert set(SKIP) | EITHER | DECODE == set(case_files())


# -- where each case file sits in each format ---------------------------------------------------------
def case_index(fmt: str, src) -> dict[str, tuple[int, str]]:
    """``{file name: (index in the source, key)}`` for the case files (class 0) the source indexed."""
    out = {}
    if fmt == "parquet":
        file = src.files[0]
        rels = pq.read_table(file, columns=["key"]).column("key").to_pylist()
        for i in range(len(src)):
            assert src.key(i) == f"{file}#{i}"
            if rels[i].startswith("cases/"):
                out[rels[i].split("/", 1)[1]] = (i, src.key(i))
    else:
        for i in range(len(src)):
            key = src.key(i)
            if src.labels[i] == 0:
                out[key.rsplit("/", 1)[-1]] = (i, key)
    return out


def expected_key(fmt: str, root: Path, name: str) -> str:
    if fmt == "folder":
        return str(root / "cases" / name)
    if fmt == "tar":
        return f"{root / 'cases-000000.tar'}:cases/{name}"
    rels = pq.read_table(root / "cases.parquet", columns=["key"]).column("key").to_pylist()
    return f"{root / 'cases.parquet'}#{rels.index('cases/' + name)}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_indexing_finds_empty_files(cases_datasets, fmt):
    root = cases_datasets[fmt]
    if fmt == "parquet":
        src = open_format(fmt, root)
        assert src.rejected == []  # image bytes are not read while indexing Parquet
        assert len(src) == len(case_files()) + N_GOOD
        return
    with pytest.warns(UserWarning, match="empty.jpg while indexing: empty"):
        src = open_source(fmt, root)
    assert src.rejected == [(expected_key(fmt, root, "empty.jpg"), "empty")]
    assert len(src) == len(case_files()) - 1 + N_GOOD
    assert set(case_index(fmt, src)) == set(case_files()) - set(AT_INDEX)


# -- the loader over every case file, on_error="skip" --------------------------------------------------
def _reference_row(payload, idx: int, seed: int, reduce: str = "off") -> np.ndarray:
    """What the pipeline's stages give for sample ``idx`` of epoch 0, done here in-process: the
    full decode, then the stages (``reduce="rows"`` must give exactly that); ``reduce="auto"``:
    the window drawn from the header's size, the JPEG decoded at its scale."""
    crop, flip = RandomResizedCrop(224), HorizontalFlip()
    keys = stage_draw_ids([Decode(reduce="off"), crop, flip])
    draws = stage_random(crop, seed, 0, idx, keys[1])
    if reduce in ("off", "rows"):
        img = crop.apply(Decode(reduce="off").apply(payload), draws)
    else:
        img = crop.resize_window(*Decode(reduce=reduce).apply_window(payload, lambda w, h: crop.window(w, h, draws)))
    img = flip.apply(img, stage_random(flip, seed, 0, idx, keys[2]))
    return np.asarray(img)


@pytest.mark.parametrize("reduce", ["off", "rows", "auto"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_loader_skips_bad_files_and_decodes_the_rest(cases_datasets, fmt, reduce, no_leaked_workers):
    """Every decode path: ``"off"`` (the whole image), ``"rows"`` (decode and crop as one step,
    the rows the window needs: the same pixels to the bit), ``"auto"`` (also at a DCT scale
    where the window is at least twice the output: some of the good photos here)."""
    root = cases_datasets[fmt]
    src = open_format(fmt, root)
    where = case_index(fmt, src)
    bs, seed = 8, 5
    p = Pipeline(src, [Decode(reduce=reduce), RandomResizedCrop(224), HorizontalFlip()], batch_size=bs, shuffle=False,
                 max_skipped=None,
                 num_workers=2, seed=seed, on_error="skip", device="cpu")
    loader = DataLoader(p, timeout=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [(b.images.clone(), b.labels.clone()) for b in loader]
    images = torch.cat([x for x, _ in batches])
    labels = torch.cat([y for _, y in batches])

    # every batch keeps its size: skipped samples are replaced
    assert [len(y) for _, y in batches] == [min(bs, len(src) - k * bs) for k in range(len(loader))]
    assert images.shape == (len(src), 224, 224, 3) and images.dtype == torch.uint8

    expected_skips = {name: SKIP[name] for name in where if name in SKIP}
    stats = loader.stats()
    keys_by_reason = defaultdict(set)
    for key, reason in stats["skipped_keys"]:
        keys_by_reason[reason].add(key)
    for name, reason in expected_skips.items():
        assert where[name][1] in keys_by_reason[reason], f"{name} not skipped as {reason!r}: {stats['skipped']}"
        assert where[name][1] == expected_key(fmt, root, name)
    allowed = {where[n][1] for n in where if expectation(n) != "decode"}
    allowed |= {key for key, _ in src.rejected}  # left out while indexing (e.g. an empty file)
    assert set().union(*keys_by_reason.values()) <= allowed, "a good file was skipped"
    assert sum(stats["skipped"].values()) == stats["skipped_total"] == len(stats["skipped_keys"])
    for reason, keys in keys_by_reason.items():
        assert stats["skipped"][reason] >= len(keys)
    if fmt == "parquet":
        assert "empty" in stats["skipped"]

    # one warning per skip, naming where the sample came from and why
    msgs = [str(w.message) for w in caught if issubclass(w.category, SkippedSampleWarning)]
    assert len(msgs) == stats["skipped_total"] - stats["skipped_while_indexing"]
    for name, reason in expected_skips.items():
        assert any(where[name][1] in m and reason in m for m in msgs), (name, msgs)

    # the samples that decode come out as the stages make them, row by row
    for name, (i, _) in where.items():
        if expectation(name) == "decode":
            want = _reference_row(src.read(i).payload, i, seed, reduce)
            np.testing.assert_array_equal(images[i].numpy(), want, err_msg=name)
            assert labels[i] == 0
    good = [i for i in range(len(src)) if src.labels[i] == 1]
    for i in good:
        np.testing.assert_array_equal(images[i].numpy(), _reference_row(src.read(i).payload, i, seed, reduce))
    if reduce == "auto":   # some windows here were decoded reduced (not the full decode's pixels)
        assert any(not np.array_equal(images[i].numpy(), _reference_row(src.read(i).payload, i, seed)) for i in good)


@pytest.mark.parametrize("reduce", ["off", "rows", "auto"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(SKIP))
def test_on_error_raise_names_the_file_and_reason(cases_datasets, fmt, name, reduce, no_leaked_workers):
    root = cases_datasets[fmt]
    src = open_format(fmt, root)
    where = case_index(fmt, src)
    if name not in where:
        assert fmt != "parquet" and name in AT_INDEX
        assert (expected_key(fmt, root, name), AT_INDEX[name]) in src.rejected
        return
    good = int(np.flatnonzero(src.labels == 1)[0])
    p = Pipeline(src, [Decode(reduce=reduce), ResizeCenterCrop(64, 64)], batch_size=2, num_workers=2,
                 on_error="raise", device="cpu")
    loader = DataLoader(p, sampler=[good, where[name][0]], timeout=60)
    with pytest.raises(DecodeError) as info:
        list(loader)
    e = info.value
    assert isinstance(e, SampleError)
    assert e.key == where[name][1] == expected_key(fmt, root, name)
    assert e.reason == SKIP[name]
    assert e.key in str(e) and e.reason in str(e)
    st = loader.stats()
    assert st["skipped_total"] == st["skipped_while_indexing"]  # nothing skipped while loading


def test_either_files_decode_or_raise_a_decode_error():
    for name in sorted(EITHER | (set(case_files()) - set(SKIP) - DECODE)):
        try:
            img = Decode().apply((CASES / name).read_bytes())
        except DecodeError as e:
            assert e.reason in ("truncated", "corrupt", "not an image", "too many pixels", "empty")
        else:
            assert img.mode == "RGB" and min(img.size) >= 1


# -- decoded pixels ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoded(cases_datasets) -> dict[str, dict[str, Image.Image]]:
    """``{format: {file name: decoded image}}`` for the files expected to decode, read from each source."""
    out = {}
    for fmt in FORMATS:
        src = open_format(fmt, cases_datasets[fmt])
        imgs = {}
        for name, (i, _) in case_index(fmt, src).items():
            if expectation(name) == "decode":
                payload = src.read(i).payload
                assert bytes(payload) == (CASES / name).read_bytes()
                imgs[name] = Decode().apply(payload)
        assert set(imgs) == DECODE
        out[fmt] = imgs
    return out


def _arr(img) -> np.ndarray:
    return np.asarray(img).astype(np.int16)


def _pil(name: str) -> Image.Image:
    return Image.open(CASES / name)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoded_images_are_rgb_uint8_as_viewers_show_them(decoded, fmt):
    for name, img in decoded[fmt].items():
        assert img.mode == "RGB", name
        assert img.size == ImageOps.exif_transpose(_pil(name)).size, name
        a = np.asarray(img)
        assert a.dtype == np.uint8 and a.shape[2] == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_cmyk_and_ycck_are_not_inverted(decoded, fmt):
    ok = _arr(decoded[fmt]["ok_rgb.jpg"])
    for name in ("cmyk_adobe.jpg", "ycck.jpg"):
        got = _arr(decoded[fmt][name])
        np.testing.assert_array_equal(got, _arr(_pil(name).convert("RGB")))
        # the same photo as ok_rgb.jpg: an inverted decode would differ by ~100 levels
        assert np.abs(got - ok).mean() < 5, name
        assert np.abs((255 - got) - ok).mean() > 50


@pytest.mark.parametrize("fmt", FORMATS)
def test_gray_is_replicated_to_three_channels(decoded, fmt):
    a = _arr(decoded[fmt]["gray.jpg"])
    np.testing.assert_array_equal(a[..., 0], a[..., 1])
    np.testing.assert_array_equal(a[..., 0], a[..., 2])
    np.testing.assert_array_equal(a[..., 0], _arr(_pil("gray.jpg")))
    assert a.std() > 10


@pytest.mark.parametrize("fmt", FORMATS)
def test_gray16_is_scaled_not_clipped(decoded, fmt):
    raw = np.asarray(_pil("gray16.png")).astype(np.int64)
    assert raw.max() > 255  # really 16-bit data
    a = _arr(decoded[fmt]["gray16.png"])
    assert (a[..., 0] == a[..., 1]).all() and (a[..., 0] == a[..., 2]).all()
    flat = a[..., 0].ravel()
    order = np.argsort(raw.ravel(), kind="stable")
    assert (np.diff(flat[order]) >= 0).all(), "the gradient is not monotonic"
    assert len(np.unique(flat)) >= 200
    np.testing.assert_array_equal(a[..., 0], (raw * 255 + 32767) // 65535)


@pytest.mark.parametrize("fmt", FORMATS)
def test_alpha_is_composited_onto_the_documented_background(decoded, fmt):
    bg = np.array(IMAGENET_MEAN_PIXEL)
    assert tuple(bg) == (124, 116, 104)
    rt = _arr(decoded[fmt]["rgba_transparent.png"])
    assert (rt == bg).all(), "a fully transparent image becomes the background colour"
    for name in ("palette_trns.png", "gray_alpha.png"):
        rgba = np.asarray(_pil(name).convert("RGBA")).astype(np.float64)
        a = rgba[..., 3:] / 255.0
        want = rgba[..., :3] * a + bg * (1 - a)
        got = _arr(decoded[fmt][name])
        assert np.abs(got - want).max() <= 1, name
    palette = np.asarray(_pil("palette_trns.png").convert("RGBA"))
    clear = palette[..., 3] == 0
    assert clear.any() and (~clear).any()
    assert (_arr(decoded[fmt]["palette_trns.png"])[clear] == bg).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_exif_orientation_is_applied(decoded, fmt):
    """The eight files store the same pixels with tags 1-8: decoded, each shows the tag's
    transpose of orientation 1 (what ImageOps.exif_transpose and viewers show)."""
    base = _arr(decoded[fmt]["exif_orient_1.jpg"])
    np.testing.assert_array_equal(base, _arr(_pil("ok_rgb.jpg").convert("RGB")))
    transposes = {2: np.fliplr, 3: lambda a: np.rot90(a, 2), 4: np.flipud, 5: lambda a: a.transpose(1, 0, 2),
                  6: lambda a: np.rot90(a, -1), 7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
                  8: lambda a: np.rot90(a, 1)}
    for k in range(2, 9):
        got = _arr(decoded[fmt][f"exif_orient_{k}.jpg"])
        np.testing.assert_array_equal(got, transposes[k](base), err_msg=f"orientation {k}")
        np.testing.assert_array_equal(got, _arr(ImageOps.exif_transpose(_pil(f"exif_orient_{k}.jpg")).convert("RGB")))
    assert decoded[fmt]["exif_orient_6.jpg"].size == (240, 320)


def test_exif_orientation_can_be_turned_off():
    raw = Decode(exif_orientation=False)
    base = _arr(raw.apply((CASES / "exif_orient_1.jpg").read_bytes()))
    for k in range(2, 9):
        data = (CASES / f"exif_orient_{k}.jpg").read_bytes()
        off = _arr(raw.apply(data))
        np.testing.assert_array_equal(off, base)
        on = _arr(Decode().apply(data))
        assert on.shape != off.shape or not np.array_equal(on, off)
    assert Decode(exif_orientation=False).config() != Decode().config()  # part of the cache key


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_comes_from_the_bytes(decoded, fmt):
    np.testing.assert_array_equal(_arr(decoded[fmt]["png_named.jpg"]), _arr(_pil("png_named.jpg").convert("RGB")))
    assert _pil("png_named.jpg").format == "PNG"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stage", [RandomResizedCrop(224), ResizeCenterCrop(256, 224)], ids=["rrc", "rcc"])
def test_small_and_degenerate_images_augment_to_the_exact_size(decoded, fmt, stage):
    for name, size in (("tiny_1x1.jpg", (1, 1)), ("thin_1x500.jpg", (1, 500)), ("small_166.jpg", (166, 166))):
        img = decoded[fmt][name]
        assert img.size == size
        for seed in range(3):
            assert stage.apply(img, np.random.default_rng(seed)).size == (224, 224)


@pytest.mark.parametrize("name, reason", sorted(SKIP.items()))
def test_decode_stage_reasons(name, reason):
    with pytest.raises(DecodeError) as info:
        Decode().apply((CASES / name).read_bytes())
    assert info.value.reason == reason


def test_pixel_limit_is_configurable():
    data = (CASES / "ok_rgb.jpg").read_bytes()  # 320 x 240 = 76,800 pixels
    with pytest.raises(DecodeError, match="too many pixels") as info:
        Decode(max_pixels=76_799).apply(data)
    assert "320x240" in info.value.detail
    assert Decode(max_pixels=76_800).apply(data).size == (320, 240)


def test_pixel_bomb_is_rejected_with_bounded_memory():
    """Rejected from its header: decoding it would take >= 400 MB."""
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(REPO)!r})
        from feedgpu.errors import DecodeError
        from feedgpu.stages.decode import Decode
        data = open({str(CASES / 'bomb_20000x20000.png')!r}, "rb").read()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for limit in (89_478_485, 10**12):
            try:
                Decode(max_pixels=limit).apply(data)
                print("decoded")
            except DecodeError as e:
                print(e.reason)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    *reasons, grown_mb = out.stdout.split("\n")[:-1]
    assert reasons == ["too many pixels", "too many pixels"]
    assert int(grown_mb) < 100


def test_batches_stack_gray_and_rgb_files():
    """Gray, palette, 16-bit and RGB files in one batch: every row is 3-channel."""
    names = ["gray.jpg", "ok_rgb.jpg", "gray16.png", "palette_trns.png", "cmyk_adobe.jpg", "tiny_1x1.jpg"]

    class Files(torch.utils.data.Dataset):
        def __len__(self):
            return len(names)

        def __getitem__(self, i):
            return (CASES / names[i]).read_bytes(), i

    p = Pipeline(Files(), [Decode(), ResizeCenterCrop(256, 224)], batch_size=6, shuffle=False, num_workers=0,
                 on_error="raise", device="cpu")
    (batch,) = list(DataLoader(p))
    assert batch.images.shape == (6, 224, 224, 3)
    g = batch.images[0].to(torch.int16)
    assert torch.equal(g[..., 0], g[..., 1]) and torch.equal(g[..., 0], g[..., 2])


def test_decode_accepts_arrays_and_rejects_other_objects():
    rgba = np.zeros((4, 5, 4), np.uint8)
    out = Decode(background=(10, 20, 30)).apply(rgba)
    assert out.size == (5, 4) and np.asarray(out)[0, 0].tolist() == [10, 20, 30]
    gray = np.full((3, 3, 1), 9, np.uint8)
    assert np.asarray(Decode().apply(gray)).tolist() == [[[9, 9, 9]] * 3] * 3
    with pytest.raises(DecodeError, match="not an image"):
        Decode().apply(np.zeros((3, 3, 3), np.float32))
    with pytest.raises(DecodeError, match="empty"):
        Decode().apply(memoryview(b""))
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (1, 2, 3)).save(buf, "BMP")
    assert np.asarray(Decode().apply(bytearray(buf.getvalue())))[1, 2].tolist() == [1, 2, 3]


def test_skips_and_spares_do_not_depend_on_worker_count(cases_datasets):
    src = open_format("folder", cases_datasets["folder"])
    runs = []
    for nw in (0, 2):
        p = Pipeline(src, [Decode(), RandomResizedCrop(64)], batch_size=8, num_workers=nw, seed=1, device="cpu", max_skipped=None)
        loader = DataLoader(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedSampleWarning)
            runs.append([(b.images.clone(), b.labels.clone()) for b in loader])
        assert loader.stats()["skipped_total"] >= 4
    assert len(runs[0]) == len(runs[1])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*runs))


def test_a_batch_that_runs_out_of_spares_raises_skip_budget_exceeded(no_leaked_workers):
    from feedgpu import SkipBudgetExceeded

    class MostlyJunk(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return ((CASES / "ok_rgb.jpg").read_bytes() if i == 0 else b"<html>not found</html>"), 0

    p = Pipeline(MostlyJunk(), [Decode(), ResizeCenterCrop(64, 64)], batch_size=8, num_workers=2, device="cpu",
                 max_skipped=None)
    loader = DataLoader(p, timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSampleWarning)
        with pytest.raises(SkipBudgetExceeded, match="not an image"):
            list(loader)
