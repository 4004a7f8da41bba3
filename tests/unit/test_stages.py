"""Stages: output size, dtype and values; crop parameters follow torchvision's distribution."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from PIL import Image

from conftest import PHOTOS
from feedgpu import ConfigError, DataLoader, Pipeline
from feedgpu.torch_ref import torchvision_rrc_params
from feedgpu.stages import (IMAGENET_MEAN, IMAGENET_STD, Decode, HorizontalFlip, Normalize, PythonStage,
                            RandomResizedCrop, ResizeCenterCrop, random_resized_crop_params, sample_rng)
from feedgpu.stages.draws import stage_draw_ids

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    return Image.open(sorted(PHOTOS.glob("*.jpg"))[3]).convert("RGB")


# -- RandomResizedCrop parameters vs torchvision -------------------------------------------------
def ks_statistic(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic (max distance between the empirical CDFs)."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / len(a)
    fb = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


def test_ks_statistic_can_tell_distributions_apart():
    rng = np.random.default_rng(0)
    assert ks_statistic(rng.uniform(0, 1, 4000), rng.uniform(0, 1, 4000)) < 0.05
    assert ks_statistic(rng.uniform(0, 1, 4000), rng.uniform(0, 1, 4000) ** 1.2) > 0.05


N_DRAWS = 4000
KS_LIMIT = 0.045  # ~ p = 0.001 for 4000 vs 4000 draws (seeds are fixed: the test is deterministic)


@pytest.mark.parametrize("width, height", [(500, 375), (375, 500), (166, 166), (640, 120), (40, 300), (3, 2)])
def test_random_resized_crop_params_follow_torchvision(width, height):
    torch.manual_seed(1234)
    ref = np.array([torchvision_rrc_params(width, height, SCALE, RATIO) for _ in range(N_DRAWS)])
    rng = np.random.default_rng(1234)
    ours = np.array([random_resized_crop_params(width, height, SCALE, RATIO, rng) for _ in range(N_DRAWS)])
    for params in (ref, ours):
        top, left, h, w = params.T
        assert (h >= 1).all() and (w >= 1).all()
        assert (top >= 0).all() and (left >= 0).all()
        assert (top + h <= height).all() and (left + w <= width).all()

    def area(p):
        return p[:, 2] * p[:, 3] / (width * height)

    def log_aspect(p):
        return np.log(p[:, 3] / p[:, 2])

    def center_x(p):
        return (p[:, 1] + p[:, 3] / 2) / width

    def center_y(p):
        return (p[:, 0] + p[:, 2] / 2) / height

    for stat in (area, log_aspect, center_x, center_y):
        d = ks_statistic(stat(ref), stat(ours))
        assert d < KS_LIMIT, f"{stat.__name__}: KS {d:.3f} for a {width}x{height} image"
    if width * height > 1000 and RATIO[0] <= width / height <= RATIO[1]:  # a real spread, not a fallback
        assert area(ours).min() < 0.2 and area(ours).max() > 0.9


@pytest.mark.parametrize("width, height", [(1, 500), (500, 1), (1000, 10), (10, 1000), (1, 1)])
def test_random_resized_crop_fallback_matches_torchvision_exactly(width, height):
    """On degenerate shapes every attempt fails: the result is torchvision's center crop."""
    torch.manual_seed(0)
    refs = {torchvision_rrc_params(width, height, SCALE, RATIO) for _ in range(200)}
    rng = np.random.default_rng(0)
    ours = {random_resized_crop_params(width, height, SCALE, RATIO, rng) for _ in range(200)}
    assert ours == refs
    if (width, height) != (1, 1):
        assert len(ours) == 1  # deterministic fallback


@pytest.mark.parametrize("size", [(1, 1), (1, 500), (500, 1), (166, 166), (3, 2), (640, 480)])
@pytest.mark.parametrize("out", [224, (160, 96)])
def test_random_resized_crop_gives_exact_size(size, out):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    st = RandomResizedCrop(out)
    oh, ow = (out, out) if isinstance(out, int) else out
    for seed in range(5):
        res = st.apply(img, np.random.default_rng(seed))
        assert res.size == (ow, oh) and res.mode == "RGB"
    assert st.out_spec(Decode().out_spec(None)).shape == (oh, ow, 3)


def test_random_resized_crop_takes_the_drawn_box(photo):
    """The output is the drawn (top, left, h, w) box resized: compare with crop-then-resize."""
    img = photo.resize((500, 375), Image.Resampling.BILINEAR)
    st = RandomResizedCrop(224)
    for seed in range(6):
        top, left, h, w = random_resized_crop_params(500, 375, st.scale, st.ratio, np.random.default_rng(seed))
        got = np.asarray(st.apply(img, np.random.default_rng(seed)), np.int16)
        want = np.asarray(img.crop((left, top, left + w, top + h)).resize((224, 224), Image.Resampling.BILINEAR),
                          np.int16)
        assert np.abs(got - want).mean() < 0.5, seed
        # and not the transposed box
        if (top, left) != (left, top) and top + w <= 375 and left + h <= 500:
            other = np.asarray(img.crop((top, left, top + h, left + w)).resize((224, 224)), np.int16)
            assert np.abs(got - other).mean() > 5


def test_random_resized_crop_is_a_function_of_its_rng(photo):
    st = RandomResizedCrop(96)
    a = np.asarray(st.apply(photo, np.random.default_rng(5)))
    b = np.asarray(st.apply(photo, np.random.default_rng(5)))
    c = np.asarray(st.apply(photo, np.random.default_rng(6)))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("kwargs, match", [
    ({"scale": (0.5, 0.2)}, "scale"), ({"scale": (0, 1)}, "scale"), ({"scale": (0.5, 1.5)}, "scale"),
    ({"ratio": (0, 1)}, "ratio"), ({"ratio": (2, 1)}, "ratio"), ({"size": 0}, "size"),
    ({"interpolation": "cubicx"}, "bicubic"),
])
def test_random_resized_crop_rejects_bad_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RandomResizedCrop(**kwargs)


# -- ResizeCenterCrop ---------------------------------------------------------------------------------
def resize_then_center_crop(img: Image.Image, resize: int, crop: int) -> np.ndarray:
    """torchvision's Resize(resize) + CenterCrop(crop) on a PIL image."""
    w, h = img.size
    if w <= h:
        size = (resize, int(resize * h / w))
    else:
        size = (int(resize * w / h), resize)
    r = img.resize(size, Image.Resampling.BILINEAR)
    top, left = int(round((size[1] - crop) / 2.0)), int(round((size[0] - crop) / 2.0))
    return np.asarray(r.crop((left, top, left + crop, top + crop)))


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (640, 427), (166, 166), (257, 1000), (224, 224)])
def test_resize_center_crop_equals_resize_then_crop(photo, size):
    img = photo.resize(size, Image.Resampling.BILINEAR)
    got = np.asarray(ResizeCenterCrop(256, 224).apply(img), np.int16)
    want = resize_then_center_crop(img, 256, 224).astype(np.int16)
    assert got.shape == (224, 224, 3)
    diff = np.abs(got - want)
    assert diff.mean() < 0.1 and diff.max() <= 2


@pytest.mark.parametrize("size", [(1, 1), (1, 500), (500, 1), (2, 3)])
def test_resize_center_crop_exact_size_on_degenerate_images(size):
    img = Image.fromarray(np.full((size[1], size[0], 3), 77, np.uint8))
    out = ResizeCenterCrop(256, (224, 200)).apply(img)
    assert out.size == (200, 224)
    assert np.abs(np.asarray(out, np.int16) - 77).max() <= 1  # a flat image stays flat


def test_resize_center_crop_rejects_crop_larger_than_resize():
    with pytest.raises(ConfigError, match="must be >= crop"):
        ResizeCenterCrop(200, 224)


# -- HorizontalFlip ---------------------------------------------------------------------------------
def test_horizontal_flip_probabilities(photo):
    src = np.asarray(photo)
    never, always, half = HorizontalFlip(0.0), HorizontalFlip(1.0), HorizontalFlip(0.5)
    for seed in range(20):
        np.testing.assert_array_equal(np.asarray(never.apply(photo, np.random.default_rng(seed))), src)
        np.testing.assert_array_equal(np.asarray(always.apply(photo, np.random.default_rng(seed))), src[:, ::-1])
    tiny = Image.fromarray(np.arange(6, dtype=np.uint8).reshape(1, 2, 3))
    flips = sum(np.asarray(half.apply(tiny, np.random.default_rng(s)))[0, 0, 0] == 3 for s in range(2000))
    assert 900 < flips < 1100
    with pytest.raises(ConfigError):
        HorizontalFlip(1.5)


# -- Normalize -------------------------------------------------------------------------------------
def _expected_normalized(img: np.ndarray) -> np.ndarray:
    mean, std = np.array(IMAGENET_MEAN, np.float64), np.array(IMAGENET_STD, np.float64)
    return (img / 255.0 - mean) / std


@pytest.mark.parametrize("dtype, layout", [("float32", "NCHW"), ("float32", "NHWC"), ("float16", "NCHW"),
                                           ("float16", "NHWC")])
def test_normalize_values(dtype, layout):
    img = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    img[0, 0] = 0
    img[0, 1] = 255
    st = Normalize(dtype=dtype, layout=layout)
    shape = (3, 7, 5) if layout == "NCHW" else (7, 5, 3)
    dst = np.full(shape, np.nan, dtype)
    st.write(dst, img)
    want = _expected_normalized(img)
    if layout == "NCHW":
        want = want.transpose(2, 0, 1)
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(dst.astype(np.float64), want, rtol=tol, atol=tol)
    lo = (0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    hi = (1 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    chw = dst if layout == "NCHW" else dst.transpose(2, 0, 1)
    np.testing.assert_allclose(chw[:, 0, 0], lo, rtol=tol, atol=tol)
    np.testing.assert_allclose(chw[:, 0, 1], hi, rtol=tol, atol=tol)
    # the torch path (used on the GPU after the copy) gives the same values
    y = st.apply_batch(torch.from_numpy(img[None]))
    assert y.dtype == getattr(torch, dtype) and tuple(y.shape) == (1, *shape)
    np.testing.assert_allclose(y[0].double().numpy(), dst.astype(np.float64), rtol=tol, atol=tol)
    assert st.out_spec(Decode().out_spec(None).with_(height=7, width=5)).shape == shape


@pytest.mark.parametrize("kwargs", [{"mean": (0.5, 0.5)}, {"std": (0.2, 0, 0.2)}, {"dtype": "uint8"},
                                    {"layout": "CHW"}])
def test_normalize_rejects_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        Normalize(**kwargs)


# -- PythonStage -------------------------------------------------------------------------------------
def paint_with_rng(img, rng):
    """A random user stage: fills the image with one colour drawn from the per-sample rng."""
    a = np.empty((16, 16, 3), np.uint8)
    a[:] = rng.integers(0, 256, 3, dtype=np.uint8)
    return a


def invert(img):
    return Image.fromarray(255 - np.asarray(img))


def test_python_stage_random_gets_a_per_sample_rng(folder_ds):
    """Same output for the same (seed, epoch, index), whatever the worker count."""
    from feedgpu import FolderSource

    src = FolderSource(folder_ds)
    stages = [Decode(), PythonStage(paint_with_rng, random=True, size=(16, 16))]
    runs = {}
    for nw in (0, 2):
        p = Pipeline(src, stages, batch_size=16, shuffle=False, num_workers=nw, seed=42, device="cpu")
        loader = DataLoader(p)
        loader.set_epoch(3)
        runs[nw] = torch.cat([b.images.clone() for b in loader])
    assert torch.equal(runs[0], runs[2])
    colours = runs[0][:, 0, 0, :].numpy()
    key = stage_draw_ids(stages)[1]   # the stage's draw key: its label and rank among its kind
    for idx in (0, 1, 50, len(src) - 1):
        want = sample_rng(42, 3, idx, key).integers(0, 256, 3, dtype=np.uint8)
        np.testing.assert_array_equal(colours[idx], want)
    assert len({tuple(c) for c in colours}) > len(src) - 3  # a different draw per sample


def test_python_stage_from_reference_and_checks():
    st = PythonStage("test_stages:invert")
    assert st.deterministic and st.config() == {"fn": "test_stages:invert", "random": False, "size": None}
    img = Image.fromarray(np.full((2, 2, 3), 10, np.uint8))
    assert np.asarray(st.apply(img)).max() == 245
    assert not PythonStage(paint_with_rng, random=True).deterministic
    with pytest.raises(ConfigError, match="fn\\(img, rng\\)"):
        PythonStage(invert, random=True)
    with pytest.raises(ConfigError, match="cannot import"):
        PythonStage("test_stages:no_such_function")
    with pytest.raises(ConfigError, match="module:callable"):
        PythonStage("invert")
    with pytest.raises(ConfigError, match="not callable"):
        PythonStage(42)


def test_python_stage_wrong_output_is_a_stage_error(folder_ds):
    from feedgpu import FolderSource, StageError

    p = Pipeline(FolderSource(folder_ds), [Decode(), ResizeCenterCrop(64, 32),
                                           PythonStage(lambda im: np.zeros((8, 8, 3), np.uint8))],
                 batch_size=4, num_workers=0, device="cpu")
    with pytest.raises(StageError, match=r"uint8 \(32, 32, 3\)"):
        next(iter(DataLoader(p)))


def test_stage_list_is_checked_when_the_pipeline_is_made(folder_ds):
    from feedgpu import FolderSource

    src = FolderSource(folder_ds)
    with pytest.raises(ConfigError, match="first stage must be 'decode'"):
        Pipeline(src, [ResizeCenterCrop()])
    with pytest.raises(ConfigError, match="not fixed"):
        Pipeline(src, [Decode(), HorizontalFlip()])
    with pytest.raises(ConfigError, match="must be the last stage"):
        Pipeline(src, [Decode(), Normalize(), ResizeCenterCrop()])


def test_stage_configs_round_trip():
    for st in (Decode(exif_orientation=False, max_pixels=10, background=(1, 2, 3)),
               RandomResizedCrop((100, 80), scale=(0.2, 0.9), ratio=(0.5, 2), interpolation="bicubic"),
               ResizeCenterCrop(300, 256, "lanczos"), HorizontalFlip(0.25), Normalize(dtype="float16")):
        again = type(st)(**st.config())
        assert again.config() == st.config()
        assert repr(again) == repr(st)
