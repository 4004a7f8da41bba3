"""The compiled random transforms draw from torchvision's distributions: crop area and aspect
ratio of RandomResizedCrop (including the centre-crop fallback after 10 failed attempts) and its
placement, RandomCrop's placement, and the flip rate; each over >= 10,000 draws, compared with
torchvision's own ``get_params`` / ``torch.rand`` by a two-sample chi-square test on histograms
(bound: the 0.9999 quantile of the chi-square distribution, so a correct draw fails one run in
10,000 per histogram) and a two-proportion z-test."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as T2
from PIL import Image

from feedgpu.stages.draws import Draws
from feedgpu.torchvision.compile import compile_transform

N = 12_000
#: 0.9999 quantiles of chi-square with k degrees of freedom
CHI2_9999 = {9: 33.72, 19: 50.80}


def chi2_two_sample(a: np.ndarray, b: np.ndarray, bins) -> tuple[float, int]:
    """Two-sample chi-square statistic of equal-size samples ``a`` and ``b`` over ``bins``
    (bins with no count in either are dropped) and its degrees of freedom."""
    ha, _ = np.histogram(a, bins)
    hb, _ = np.histogram(b, bins)
    keep = (ha + hb) > 0
    ha, hb = ha[keep].astype(float), hb[keep].astype(float)
    return float(((ha - hb) ** 2 / (ha + hb)).sum()), int(keep.sum() - 1)


def assert_same_distribution(a, b, bins, what):
    stat, dof = chi2_two_sample(np.asarray(a, float), np.asarray(b, float), bins)
    if dof == 0:   # both in one bin
        return
    bound = CHI2_9999.get(dof) or dof + 4.5 * math.sqrt(2 * dof)
    assert stat < bound, f"{what}: chi-square {stat:.1f} over {dof} degrees of freedom (bound {bound:.1f})"


def assert_same_rate(k1: int, k2: int, n: int, what):
    p = (k1 + k2) / (2 * n)
    se = math.sqrt(max(p * (1 - p), 1e-12) * 2 / n)
    assert abs(k1 - k2) / n < 4.5 * se + 1e-12, f"{what}: {k1}/{n} vs {k2}/{n}"


def _op(transform):
    c = compile_transform(transform)
    assert len(c.ops) == 1 and not c.tail
    return c.ops[0]


def _windows_feedgpu(op, width, height, seed=1):
    """(top, left, h, w) of N crops the compiled op draws on an image of ``width`` x ``height``."""
    from feedgpu.stages.geometry import random_resized_crop_params

    t = op.t
    return np.array([random_resized_crop_params(width, height, t.scale, t.ratio, Draws(seed, 0, i, 99))
                     for i in range(N)])


def _windows_torchvision(t, width, height):
    torch.manual_seed(0)
    img = torch.empty(3, height, width)
    if hasattr(t, "make_params"):
        return np.array([[p["top"], p["left"], p["height"], p["width"]] for p in (t.make_params([img]) for _ in range(N))])
    return np.array([t.get_params(img, t.scale, t.ratio) for _ in range(N)])


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("width,height,scale,ratio", [
    (500, 375, (0.08, 1.0), (3 / 4, 4 / 3)),      # the ImageNet default on a typical photo
    (400, 60, (0.08, 1.0), (3 / 4, 4 / 3)),       # a thin image: many attempts fail, the fallback is frequent
    (300, 300, (0.9, 1.0), (0.5, 2.0)),           # large areas at wide ratios: attempts fail, fallback within ratio
])
def test_random_resized_crop_windows_match_torchvision(version, width, height, scale, ratio):
    mod = T if version == "v1" else T2
    t = mod.RandomResizedCrop(224, scale=scale, ratio=ratio)
    mine, ref = _windows_feedgpu(_op(t), width, height), _windows_torchvision(t, width, height)
    area_mine, area_ref = mine[:, 2] * mine[:, 3] / (width * height), ref[:, 2] * ref[:, 3] / (width * height)
    assert_same_distribution(area_mine, area_ref, np.linspace(0, 1, 21), "area fraction")
    lr = np.log(ratio)
    span = (min(lr[0], math.log(1 / height)), max(lr[1], math.log(width)))
    aspect_bins = np.linspace(span[0] - 1e-9, span[1] + 1e-9, 21)
    assert_same_distribution(np.log(mine[:, 3] / mine[:, 2]), np.log(ref[:, 3] / ref[:, 2]), aspect_bins, "log aspect")
    # the fallback: torchvision's centre crop clamped to ratio, after 10 attempts that did not fit
    def fallback(win):
        in_ratio = width / height
        if in_ratio < min(ratio):
            w, h = width, int(round(width / min(ratio)))
        elif in_ratio > max(ratio):
            h, w = height, int(round(height * max(ratio)))
        else:
            w, h = width, height
        return (win[:, 2] == h) & (win[:, 3] == w) & (win[:, 0] == (height - h) // 2) & (win[:, 1] == (width - w) // 2)
    fb_mine, fb_ref = int(fallback(mine).sum()), int(fallback(ref).sum())
    assert_same_rate(fb_mine, fb_ref, N, "fallback rate")
    if (width, height) == (400, 60):
        assert fb_ref > N // 10, "the thin image is meant to exercise the fallback"
    # placement: top and left uniform over the positions the window can take
    free_h, free_w = height - mine[:, 2] + 1, width - mine[:, 3] + 1
    rfree_h, rfree_w = height - ref[:, 2] + 1, width - ref[:, 3] + 1
    sel, rsel = free_h > 1, rfree_h > 1
    bins = np.linspace(0, 1, 11)
    assert_same_distribution(mine[sel, 0] / free_h[sel], ref[rsel, 0] / rfree_h[rsel], bins, "top")
    sel, rsel = free_w > 1, rfree_w > 1
    assert_same_distribution(mine[sel, 1] / free_w[sel], ref[rsel, 1] / rfree_w[rsel], bins, "left")


@pytest.mark.parametrize("p", [0.5, 0.3])
@pytest.mark.parametrize("cls", [T.RandomHorizontalFlip, T.RandomVerticalFlip, T2.RandomHorizontalFlip])
def test_flip_rate_matches_torchvision(cls, p):
    t = cls(p)
    op = _op(t)
    x = torch.arange(6, dtype=torch.uint8).reshape(1, 2, 3)
    flipped = sum(not torch.equal(op.apply(x, Draws(3, 0, i, 7)), x) for i in range(N))
    torch.manual_seed(0)
    ref = sum(not torch.equal(t(x), x) for _ in range(N))
    assert_same_rate(flipped, ref, N, "flip rate")
    assert abs(flipped / N - p) < 4.5 * math.sqrt(p * (1 - p) / N)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_random_crop_placement_matches_torchvision(version):
    mod = T if version == "v1" else T2
    t = mod.RandomCrop(24, padding=4)
    op = _op(t)
    img = Image.fromarray(np.arange(32 * 40 * 3, dtype=np.uint32).reshape(32, 40, 3).astype(np.uint8))
    # each pixel's position is encoded in a separate coordinate image: find where the crop came from
    ys, xs = np.meshgrid(np.arange(32), np.arange(40), indexing="ij")
    coord = Image.fromarray(np.stack([ys + 1, xs + 1, np.zeros_like(ys)], -1).astype(np.uint8))
    del img

    def origin(out):
        a = np.asarray(out) if isinstance(out, Image.Image) else out
        nz = np.argwhere(a[..., 0] > 0)
        r, c = nz[0]
        return int(a[r, c, 0]) - 1 - r, int(a[r, c, 1]) - 1 - c   # top, left in the unpadded image

    mine = np.array([origin(op.apply(coord, Draws(2, 0, i, 5))) for i in range(N)])
    torch.manual_seed(0)
    ref = np.array([origin(t(coord)) for _ in range(N)])
    bins = np.arange(-4.5, 13.5)
    assert_same_distribution(mine[:, 0], ref[:, 0], bins, "top")
    assert_same_distribution(mine[:, 1], ref[:, 1], np.arange(-4.5, 21.5), "left")
