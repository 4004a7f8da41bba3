"""Decoding only what the window needs: ``Decode(reduce="rows")`` (the rows down to the window's,
bit-identical to full decode + the same crop and resize) and ``reduce="auto"`` (also DCT-scaled:
the scale it picks, its pixels against full decode + the same resize); the hard inputs on every
path, and the loader's steps (the same windows from the same draws; never fused across the
cache's cut; exact resume)."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import CASES, PHOTOS, REPO, case_files
from feedgpu import DataLoader, DecodeError, Pipeline
from feedgpu.exec.steps import StageStep, WindowDecodeStep, sample_steps, window_pair
from feedgpu.sources import open_source
from feedgpu.stages import Decode, HorizontalFlip, RandomResizedCrop, ResizeCenterCrop
from feedgpu.stages.draws import Draws
from feedgpu.stages.geometry import Resize

pytestmark = pytest.mark.timeout(180)

OFF, ROWS, AUTO = Decode(reduce="off"), Decode(reduce="rows"), Decode(reduce="auto")
#: bounds on the difference to full decode + resize, below what bench/results/decode_quality.md
#: finds over the photos at 224 px
MIN_PSNR, MAX_MEAN_ABS = 30.0, 2.0


def psnr(a, b) -> float:
    mse = np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def run(dec: Decode, data: bytes, stage, rng=None):
    """``(output image, size of the decoded image)`` of ``dec`` then ``stage`` as the fused step runs them."""
    img, box, out = dec.apply_window(data, lambda w, h: stage.window(w, h, rng))
    return stage.resize_window(img, box, out), img.size


def photo(name: str = "00_Autumn.jpg") -> Image.Image:
    return Image.open(PHOTOS / name).convert("RGB")


def encode(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def exif_bytes(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


STAGES = [RandomResizedCrop(224), ResizeCenterCrop(256, 224), Resize(256)]


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_off_gives_the_full_decode_then_the_stage(stage):
    """``reduce="off"``: apply_window + resize_window is apply() then the stage, to the bit."""
    for name in ["00_Autumn.jpg", "07_Flow.jpg"]:
        data = (PHOTOS / name).read_bytes()
        for k in range(4):
            rng = Draws(1, 0, k, 1)
            want = stage.apply(OFF.apply(data), rng)
            got, size = run(OFF, data, stage, rng)
            assert size == OFF.apply(data).size
            assert np.array_equal(np.asarray(got), np.asarray(want))


def test_scale_is_the_largest_that_keeps_the_output_size():
    data = (PHOTOS / "00_Autumn.jpg").read_bytes()    # 1600 x 1000
    # val: the box is 875 px high -> 1/2 keeps 437 >= 224, 1/4 would give 218
    _, size = run(AUTO, data, ResizeCenterCrop(256, 224))
    assert size[0] == 800 and size[1] < 500    # 1/2, and not the rows below the window
    # a resize of the short side to 120: 1000 / 8 = 125 >= 120
    out, size = run(AUTO, data, Resize(120))
    assert size == (200, 125) and out.size == (192, 120)
    # nothing reduces below the output: a 600 px target decodes at full size, bit-identical
    out, size = run(AUTO, data, Resize(600))
    assert size == (1600, 1000)
    assert np.array_equal(np.asarray(out), np.asarray(Resize(600).apply(OFF.apply(data))))
    # random windows: the reduced window is never smaller than 224 both ways
    rrc = RandomResizedCrop(224)
    for k in range(40):
        rng = Draws(3, 0, k, 1)
        (left, top, right, bottom), _ = rrc.window(1600, 1000, rng)
        _, size = run(AUTO, data, rrc, rng)
        s = 1600 // size[0]
        assert (right - left) / s >= 224 and (bottom - top) / s >= 224


def kinds() -> dict[str, bytes]:
    """The JPEG kinds whose decode rules differ, at a size the val recipe reduces (odd sizes:
    a partial last block)."""
    img = photo().crop((0, 0, 1203, 917))
    out = {"baseline_420": encode(img), "baseline_444": encode(img, subsampling=0),
           "progressive": encode(img, progressive=True), "restart_markers": encode(img, restart_marker_rows=1),
           "restart_progressive": encode(img, progressive=True, restart_marker_blocks=3),
           "gray": encode(img.convert("L")), "cmyk": encode(img.convert("CMYK"))}
    for k in range(1, 9):
        out[f"exif_{k}"] = encode(img, exif=exif_bytes(k))
    return out


@pytest.mark.parametrize("kind", sorted(kinds()))
def test_rows_decode_is_bit_identical_to_full_decode(kind):
    """``reduce="rows"``: over random windows of every JPEG kind (each EXIF orientation,
    progressive, restart markers, gray, CMYK, 4:4:4; odd sizes), the window cut from the
    partial decode is the full decode's window, and every stage's output (every resampling
    filter) is the full path's, to the bit; and rows were left out."""
    data = kinds()[kind]
    full = OFF.apply(data)
    partial = 0
    orientation = int(kind[5:]) if kind.startswith("exif_") else 1
    stages = [RandomResizedCrop(224, interpolation=f) for f in ("bilinear", "bicubic", "lanczos", "nearest", "box")]
    stages += [RandomResizedCrop(96, scale=(0.02, 0.3)), ResizeCenterCrop(256, 224), Resize(300)]
    for k in range(24):
        stage = stages[k % len(stages)]
        rng = Draws(5, 0, k, 1)
        img, box, out = ROWS.apply_window(data, lambda w, h: stage.window(w, h, rng))
        want_box, _ = stage.window(*full.size, rng)
        if all(float(v).is_integer() for v in want_box):   # the window's own pixels
            assert np.array_equal(np.asarray(img.crop(tuple(int(v) for v in box))),
                                  np.asarray(full.crop(tuple(int(v) for v in want_box)))), (kind, k)
        got = stage.resize_window(img, box, out)
        assert np.array_equal(np.asarray(got), np.asarray(stage.apply(full, rng))), (kind, k, stage)
        partial += img.size != full.size
    if orientation in (1, 2, 5, 8):   # where rows are left out (see Decode.apply_window)
        assert partial, "every window needed the whole image: the test would not test partial decode"
    else:
        assert not partial


@pytest.mark.parametrize("kind", ["baseline_420", "progressive", "gray", "exif_6", "exif_8", "cmyk"])
def test_a_common_jpeg_is_opened_once(kind, monkeypatch):
    """On the reduced path a JPEG whose markers the header reader reads (not CMYK) is opened by
    Pillow once, on the bytes it is decoded from; its size and orientation come from the markers.
    Others are opened as before (twice when rows are left out). The pixels are those of the test
    above."""
    import feedgpu.stages.decode as decode_module

    data, opened = kinds()[kind], []
    real_open = decode_module.Image.open

    def counting_open(fp, *args, **kwargs):
        opened.append(1)
        return real_open(fp, *args, **kwargs)

    stage = RandomResizedCrop(224, scale=(0.05, 0.1))
    for k in range(6):
        rng = Draws(7, 0, k, 1)
        opened.clear()
        with monkeypatch.context() as m:
            m.setattr(decode_module.Image, "open", counting_open)
            got, _ = run(ROWS, data, stage, rng)
        assert len(opened) == 1 if kind != "cmyk" else 1 <= len(opened) <= 2, (kind, k, len(opened))
        assert np.array_equal(np.asarray(got), np.asarray(stage.apply(OFF.apply(data), rng))), (kind, k)


@pytest.mark.parametrize("kind", sorted(kinds()))
@pytest.mark.parametrize("stage", STAGES[:2], ids=lambda s: s.name)
def test_reduced_pixels_are_close_to_full_decode(kind, stage):
    """Every JPEG kind (progressive, restart markers, 4:4:4, gray, CMYK, each EXIF orientation
    with odd sizes): decoded reduced, the same window as full decode + resize, within bounds;
    and the box is placed right: moved by half a reduced pixel either way, it matches worse."""
    data = kinds()[kind]
    full = OFF.apply(data)
    reduced = 0
    for k in range(6):
        rng = Draws(7, 0, k, 1)
        want = stage.apply(full, rng)
        img, box, out = AUTO.apply_window(data, lambda w, h: stage.window(w, h, rng))
        got = stage.resize_window(img, box, out)
        assert got.size == want.size and got.mode == "RGB"
        d = np.abs(np.asarray(got, np.int16) - np.asarray(want, np.int16))
        assert psnr(got, want) >= MIN_PSNR and d.mean() <= MAX_MEAN_ABS, (kind, k, psnr(got, want), d.mean())
        if img.size == full.size:
            continue
        reduced += 1
        for dx, dy in ((0.5, 0), (-0.5, 0), (0, 0.5), (0, -0.5)):
            moved = stage.resize_window(img, (box[0] + dx, box[1] + dy, box[2] + dx, box[3] + dy), out)
            assert psnr(got, want) >= psnr(moved, want) + 3, (kind, k, dx, dy)
    assert reduced, "no window was decoded reduced: the test would not test it"


@pytest.mark.parametrize("name", case_files())
def test_hard_cases_behave_alike_on_every_path(name):
    """Each hard input: the same error and reason, or an RGB output: the full decode's to the bit
    with ``reduce="rows"``, close to it with ``"auto"`` (an output small enough that the JPEGs
    among them are decoded reduced)."""
    data = (CASES / name).read_bytes()
    for k, stage in enumerate([RandomResizedCrop(16), RandomResizedCrop(16, scale=(0.05, 0.2)), ResizeCenterCrop(24, 16)]):
        rng = Draws(0, 0, k, 1)
        try:
            want = stage.apply(OFF.apply(data), rng)
        except DecodeError as e:
            for dec in (ROWS, AUTO):
                with pytest.raises(DecodeError) as got:
                    run(dec, data, stage, rng)
                assert (got.value.reason, got.value.detail) == (e.reason, e.detail)
            continue
        got, _ = run(ROWS, data, stage, rng)
        assert np.array_equal(np.asarray(got), np.asarray(want)), name
        got, _ = run(AUTO, data, stage, rng)
        assert got.mode == "RGB" and got.size == want.size
        assert np.abs(np.asarray(got, np.int16) - np.asarray(want, np.int16)).mean() <= 8, name


def test_non_jpeg_and_non_bytes_inputs_take_the_full_decode():
    stage = ResizeCenterCrop(32, 16)
    for name in ["gray16.png", "palette_trns.png", "png_named.jpg"]:
        data = (CASES / name).read_bytes()
        got, _ = run(AUTO, data, stage)
        assert np.array_equal(np.asarray(got), np.asarray(stage.apply(OFF.apply(data))))
    arr = np.asarray(photo())
    got, size = run(AUTO, arr, stage)
    assert size == (1600, 1000)
    assert np.array_equal(np.asarray(got), np.asarray(stage.apply(OFF.apply(arr))))


# -- the loader's steps ---------------------------------------------------------------------------
def test_steps_fuse_decode_and_the_window_stage_only_where_they_may():
    class Src:
        def key(self, i):
            return str(i)

    class Plan:
        def __init__(self, stages):
            self.sample_stages, self.draw_ids = stages, tuple(range(len(stages)))

    class Cut:
        def __init__(self, after):
            self.after = after

    auto = [Decode(reduce="auto"), RandomResizedCrop(224), HorizontalFlip()]
    assert window_pair(auto) and window_pair([Decode(), RandomResizedCrop(224)])
    assert not window_pair([Decode(reduce="off"), RandomResizedCrop(224)])
    steps = sample_steps(Src(), Plan(auto), 0)
    assert isinstance(steps[1], WindowDecodeStep) and len(steps) == 3

    class MyCrop(RandomResizedCrop):
        def apply(self, img, rng):   # a subclass's own apply is never bypassed
            return super().apply(img, rng)

    assert not window_pair([Decode(reduce="auto"), MyCrop(224)])
    # a cache cut between decode and the crop: decode's full image is what the cache keeps
    cut1 = sample_steps(Src(), Plan(auto), 0, cache=Cut(1))
    assert [type(s).__name__ for s in cut1] == ["CachedSteps", "StageStep", "StageStep"]
    assert isinstance(cut1[0].stages[0], StageStep)
    val = [Decode(reduce="auto"), ResizeCenterCrop(256, 224), HorizontalFlip()]
    cut2 = sample_steps(Src(), Plan(val), 0, cache=Cut(2))
    assert isinstance(cut2[0].stages[0], WindowDecodeStep) and len(cut2[0].stages) == 1 and len(cut2) == 2


@pytest.fixture(scope="module")
def photos_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    for i, f in enumerate(sorted(PHOTOS.glob("*.jpg"))[:12]):
        d = root / f"c{i % 2}"
        d.mkdir(exist_ok=True)
        (d / f.name).symlink_to(f)
    return root


@pytest.mark.parametrize("stage", [RandomResizedCrop(224), ResizeCenterCrop(256, 224)], ids=lambda s: s.name)
def test_loader_gets_the_same_windows_and_labels_with_reduced_decode(photos_ds, stage, no_leaked_workers):
    """Full-size photos through the loader (2 workers): the same labels in the same order and,
    row by row, the same window resized (close pixels), with reduce off and auto."""
    out = {}
    for reduce in ("off", "auto"):
        p = Pipeline(open_source("folder", str(photos_ds)), [Decode(reduce=reduce), stage, HorizontalFlip()], batch_size=4, shuffle=True,
                     num_workers=2, seed=3, device="cpu")
        loader = DataLoader(p, timeout=60)
        batches = [(b.images.clone(), b.labels.clone()) for b in loader]
        out[reduce] = [np.concatenate([x.numpy() for x, _ in batches]), np.concatenate([y.numpy() for _, y in batches])]
    (a, la), (b, lb) = out["off"], out["auto"]
    assert np.array_equal(la, lb) and a.shape == b.shape
    assert not np.array_equal(a, b)   # the reduced decode was used
    for i in range(len(a)):
        assert psnr(a[i], b[i]) >= MIN_PSNR, i


def test_reduce_is_a_pipeline_setting(photos_ds):
    """``decode: {reduce: auto}`` in YAML; another value is a ConfigError naming the key; the
    setting is in the stage's config (so in a cache's fingerprint) and defaults to rows."""
    from feedgpu import ConfigError
    from feedgpu import config as cfg

    base = cfg.merge(cfg.load_yaml(REPO / "pipelines" / "imagenet_val.yaml"), {"source.path": str(photos_ds)})
    assert Pipeline.from_config(base).stages[0].reduce == "rows"
    base["stages"][0]["reduce"] = "auto"
    p = Pipeline.from_config(base)
    assert p.stages[0].reduce == "auto" and p.stages[0].config()["reduce"] == "auto"
    assert Decode(**p.stages[0].config()).reduce == "auto"
    base["stages"][0]["reduce"] = "always"
    with pytest.raises(ConfigError, match=r"stages\[0\] \(decode\)\.reduce"):
        Pipeline.from_config(base)


def test_resume_mid_epoch_is_exact_with_reduced_decode(photos_ds, no_leaked_workers):
    """A run stopped after a batch and resumed (another worker count) gives the uninterrupted
    run's batches, pixels and labels, with ``reduce="auto"``."""
    def loader(nw):
        p = Pipeline(open_source("folder", str(photos_ds)), [Decode(reduce="auto"), RandomResizedCrop(224),
                     HorizontalFlip()], batch_size=3, shuffle=True, num_workers=nw, seed=11, device="cpu")
        return DataLoader(p, timeout=60)

    def collect(it):
        return [(b.images.clone(), b.labels.clone()) for b in it]

    full = loader(2)
    full.set_epoch(1)
    reference = collect(full)
    first = loader(2)
    first.set_epoch(1)
    it = iter(first)
    head = collect(next(it) for _ in range(2))
    state = first.state_dict()
    first.shutdown()
    del it
    again = loader(1)
    again.load_state_dict(state)
    got = head + collect(again)
    assert len(got) == len(reference) == 4
    for (x, y), (rx, ry) in zip(got, reference):
        assert torch.equal(x, rx) and torch.equal(y, ry)
