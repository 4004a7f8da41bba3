"""Counter-based draws of the built-in random stages (feedgpu.stages.draws) and the batched
random resized crop windows computed from them."""
import math

import numpy as np
import pytest

from feedgpu.stages import HorizontalFlip, RandomResizedCrop
from feedgpu.stages.base import sample_rng, stage_random
from feedgpu.stages.draws import Draws, as_uniforms, sample_uniforms
from feedgpu.stages.geometry import RRC_DRAWS, random_resized_crop_params

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


def test_a_samples_draws_do_not_depend_on_its_batch():
    batch = sample_uniforms(5, 2, [7, 3, 1000, 3], 1, 6)
    assert batch.shape == (4, 6) and batch.dtype == np.float64
    alone = sample_uniforms(5, 2, [3], 1, 6)[0]
    np.testing.assert_array_equal(batch[1], alone)
    np.testing.assert_array_equal(batch[3], alone)
    # the first k draws are the same whatever k
    np.testing.assert_array_equal(sample_uniforms(5, 2, [3], 1, 2)[0], alone[:2])


@pytest.mark.parametrize("change", ["seed", "epoch", "index", "stage"])
def test_every_part_of_the_key_changes_the_draws(change):
    key = {"seed": 1, "epoch": 0, "index": 10, "stage": 1}
    base = sample_uniforms(key["seed"], key["epoch"], [key["index"]], key["stage"], 8)
    key[change] += 1
    other = sample_uniforms(key["seed"], key["epoch"], [key["index"]], key["stage"], 8)
    assert not np.any(base == other)


def test_negative_and_huge_seeds_wrap_like_sample_rng():
    np.testing.assert_array_equal(sample_uniforms(-1, 0, [1], 1, 3), sample_uniforms(2**64 - 1, 0, [1], 1, 3))
    assert np.all(np.isfinite(sample_uniforms(2**70, 3, [0], 1, 3)))


def test_draws_are_uniform_and_uncorrelated():
    u = sample_uniforms(0, 0, np.arange(50_000), 1, 4)
    assert u.min() >= 0.0 and u.max() < 1.0
    # each column: 20-bin chi-square against uniform (df 19: 99.9 % quantile 43.8)
    for c in range(4):
        counts = np.bincount((u[:, c] * 20).astype(int), minlength=20)
        expected = len(u) / 20
        assert ((counts - expected) ** 2 / expected).sum() < 43.8, c
    corr = np.corrcoef(u.T)
    assert np.abs(corr - np.eye(4)).max() < 0.02
    # neighbouring indices are not correlated either
    assert abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 0.02


def test_one_samples_draws_equal_the_batch_rows():
    """The Python engine (Draws, one sample) and the DALI engine (sample_uniforms, a batch) see
    the same floats, bit for bit."""
    rows = sample_uniforms(-3, 4, np.arange(300), 2, 25)
    for i in (0, 1, 17, 299):
        d = Draws(-3, 4, i, 2)
        assert [d[j] for j in range(25)] == rows[i].tolist()
    with pytest.raises(IndexError):
        Draws(0, 0, 0, 0)[-1]


def test_as_uniforms_takes_draws_or_a_generator():
    assert as_uniforms([0.25, 0.5], 2) == [0.25, 0.5]
    d = Draws(1, 0, 0, 1)
    assert as_uniforms(d, 100) is d
    g = as_uniforms(np.random.default_rng(3), 5)
    assert len(g) == 5 and all(0 <= x < 1 for x in g)
    with pytest.raises(ValueError, match="expected 3 uniform draws, got 2"):
        as_uniforms([0.25, 0.5], 3)


def test_stage_random_gives_draws_to_built_in_stages():
    crop, flip = RandomResizedCrop(224), HorizontalFlip()
    got = stage_random(crop, 4, 1, 9, 1)
    assert isinstance(got, Draws) and [got[j] for j in range(RRC_DRAWS)] == sample_uniforms(4, 1, [9], 1, RRC_DRAWS)[0].tolist()
    assert isinstance(stage_random(flip, 4, 1, 9, 2), Draws)


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (1, 1), (3000, 20), (20, 3000), (224, 224)])
def test_windows_fit_and_batch_rows_equal_draws(size):
    w, h = size
    u = sample_uniforms(0, 0, np.arange(400), 1, RRC_DRAWS)
    stage = RandomResizedCrop(224)
    args, out = stage.dali_params(np.tile([w, h], (400, 1)), u)
    assert out.tolist() == [[224, 224]] * 400
    start, end = args["roi_start"], args["roi_end"]
    assert np.all((start >= 0) & (end - start >= 1)) and np.all(end[:, 0] <= h) and np.all(end[:, 1] <= w)
    for i in range(0, 400, 37):
        top, left, hh, ww = random_resized_crop_params(w, h, SCALE, RATIO, Draws(0, 0, i, 1))
        assert start[i].tolist() == [top, left] and end[i].tolist() == [top + hh, left + ww]


def test_fallback_is_torchvisions_center_crop():
    """No attempt fits a 3000x20 image: torchvision clamps to the ratio range and centres."""
    u = np.full((1, RRC_DRAWS), 0.5)
    assert random_resized_crop_params(3000, 20, SCALE, RATIO, u[0]) == (0, (3000 - 27) // 2, 20, 27)
    assert random_resized_crop_params(20, 3000, SCALE, RATIO, u[0]) == ((3000 - 27) // 2, 0, 27, 20)
    # torchvision's rule: h = round(w / min(ratio)) for a tall image, w = round(h * max(ratio)) for a wide one
    assert round(20 / RATIO[0]) == 27 and round(20 * RATIO[1]) == 27


def test_window_area_and_ratio_follow_the_ranges():
    """A first attempt with an area fraction up to 0.5 always fits a square image: those windows
    have the first attempt's area (uniform in scale) and aspect ratio (log-uniform in ratio)."""
    n = 20_000
    u = sample_uniforms(1, 0, np.arange(n), 1, RRC_DRAWS)
    top, left, h, w = np.array([random_resized_crop_params(4000, 4000, SCALE, RATIO, r) for r in u.tolist()]).T
    area = h * w / 4000 ** 2
    assert area.min() >= 0.079 and area.max() <= 1.0
    first = SCALE[0] + (SCALE[1] - SCALE[0]) * u[:, 0]   # attempt 0: draws 0 (area) and 1 (ratio)
    sel = first <= 0.5
    np.testing.assert_allclose(area[sel], first[sel], rtol=2e-3)
    assert abs(first[sel].mean() - 0.29) < 0.005   # uniform on [0.08, 0.5]
    logr = np.log(w[sel] / h[sel])
    want = math.log(RATIO[0]) + (math.log(RATIO[1]) - math.log(RATIO[0])) * u[sel, 1]
    np.testing.assert_allclose(logr, want, atol=2e-3)
    # the window's position is uniform over where it fits
    rel = top / np.maximum(4000 - h, 1)
    assert abs(rel.mean() - 0.5) < 0.01


def test_numpy_integers_anywhere_give_the_same_draws():
    """Seeds, epochs, indices, stage positions and draw numbers as NumPy integers (a custom stage
    with ``draws`` indexing ``rng[np.int64(j)]``, a seed read from an array) give the draws of the
    same Python ints; before, ``Draws[np.int64(j)]`` and ``sample_rng(np.int64(-3), ...)`` raised
    OverflowError."""
    want = sample_uniforms(-3, 2, [7], 1, 4)[0].tolist()
    d = Draws(np.int64(-3), np.uint8(2), np.int64(7), np.int16(1))
    assert [d[np.int64(j)] for j in range(4)] == want
    assert [d[j] for j in np.arange(4)] == want
    assert sample_uniforms(np.int64(-3), np.int64(2), np.array([7], np.int32), np.int64(1), 4)[0].tolist() == want
    with pytest.raises(TypeError):
        d[1.0]
    a = sample_rng(np.int64(-3), np.int64(2), np.int64(7), np.int64(1)).random(3)
    np.testing.assert_array_equal(a, sample_rng(2**64 - 3, 2, 7, 1).random(3))


def test_a_subclass_can_ask_for_a_generator_again():
    """Subclasses of the built-in random stages that call ``rng.random()`` set ``draws = 0``."""
    class MyFlip(HorizontalFlip):
        draws = 0

        def apply(self, img, rng):
            return super().apply(img, rng) if rng.random() < 2 else img

    rng = stage_random(MyFlip(), 1, 0, 5, 2)
    assert isinstance(rng, np.random.Generator)
    assert isinstance(stage_random(HorizontalFlip(), 1, 0, 5, 2), Draws)
