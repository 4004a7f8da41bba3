"""A user's script unchanged but for the loader class: torch's DataLoader and feedgpu's on the
same ImageFolder and transform give the same shapes, dtypes and labels, the same pixels for the
deterministic recipes (within 1 level of 255) and the same per-channel statistics (within 1 %)
for the random ones, whose compiled transforms also equal torchvision's on the parameters feedgpu
drew (sample for sample)."""
from __future__ import annotations

import pytest
import torch
import torchvision.transforms.functional as F
from PIL import Image
from torch.utils.data import DataLoader as TorchLoader, Subset
from torchvision.datasets import ImageFolder

import feedgpu
from feedgpu.stages.draws import Draws, stage_draw_ids
from feedgpu.stages.geometry import random_resized_crop_params
from recipes import jitter_train, to_unit, uint8_train, v1_train, v1_val, v2_train, v2_val

RANDOM = {"v1_train": (v1_train, True), "v2_train": (v2_train, True), "uint8": (uint8_train, False),
          "jitter": (jitter_train, True)}
#: samples per loader for the statistics: at this count the per-channel mean and std of random
#: crops vary between two runs by about a quarter of the 1 % bound (one standard deviation)
STAT_SAMPLES = 3000


def _batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


@pytest.mark.parametrize("recipe", [v1_val, v2_val], ids=["v1_val", "v2_val"])
def test_deterministic_recipe_equals_torch_sample_for_sample(folder_ds, recipe):
    ds = ImageFolder(folder_ds, transform=recipe())
    ref = _batches(TorchLoader(ds, batch_size=32, num_workers=2))
    loader = feedgpu.DataLoader(ds, batch_size=32, num_workers=2)
    got = _batches(loader)
    assert "python" not in loader.explain().split("target_transform")[0].split("why not compiled")[1]
    assert len(got) == len(ref) == 4
    for (x, y), (x2, y2) in zip(ref, got):
        assert x2.shape == x.shape == (len(y), 3, 224, 224) and x2.dtype == x.dtype == torch.float32
        assert type(x2) is type(x) is torch.Tensor
        assert torch.equal(y, y2) and y2.dtype == torch.int64
        levels = ((to_unit(x, True) - to_unit(x2, True)).abs() * 255).max().item()
        assert levels <= 1.0, f"{levels:.3f} levels of 255 apart"


def _epoch_stats(loader, normalized: bool):
    """Per-channel mean and std of the epoch's pixels (0-1 scale), each sample's channel means
    (float64 (n, 3)), the labels, a sample's shape and the dtype."""
    total = torch.zeros(3, dtype=torch.float64)
    squares = torch.zeros(3, dtype=torch.float64)
    n, labels, per_sample, shape, dtype = 0, [], [], None, None
    for x, y in loader:
        shape, dtype = tuple(x.shape[1:]), x.dtype
        u = to_unit(x, normalized)
        total += u.sum((0, 2, 3))
        squares += (u * u).sum((0, 2, 3))
        per_sample.append(u.mean((2, 3)))
        n += u.numel() // 3
        labels.append(y)
    mean = total / n
    return mean, (squares / n - mean * mean).sqrt(), torch.cat(per_sample), torch.cat(labels), shape, dtype


def _compare_epochs(ds, normalized):
    m0, s0, p0, y0, shape0, dt0 = _epoch_stats(TorchLoader(ds, batch_size=250, num_workers=2), normalized)
    m1, s1, p1, y1, shape1, dt1 = _epoch_stats(feedgpu.DataLoader(ds, batch_size=250, num_workers=2), normalized)
    assert shape1 == shape0 == (3, 224, 224) and dt1 == dt0
    assert torch.equal(y0, y1)
    return (m0, s0, p0), (m1, s1, p1)


@pytest.mark.parametrize("name", ["v1_train", "v2_train", "uint8"])
def test_random_recipe_matches_torch_statistics(small_ds, name):
    recipe, normalized = RANDOM[name]
    base = ImageFolder(small_ds, transform=recipe())
    (m0, s0, _), (m1, s1, _) = _compare_epochs(Subset(base, [i % len(base) for i in range(STAT_SAMPLES)]), normalized)
    assert ((m1 / m0 - 1).abs() < 0.01).all(), (m0, m1)
    assert ((s1 / s0 - 1).abs() < 0.01).all(), (s0, s1)


def test_jitter_recipe_matches_torch_statistics(small_ds):
    """ColorJitter spreads each sample's mean far more than a crop does: a 1 % bound would need
    tens of thousands of samples, so the epoch means are held to 4.5 standard errors of their
    difference (measured from the samples), the stds to 2 %; test_tail_is_the_users_object_on_the_prefix
    checks the tail sample for sample."""
    base = ImageFolder(small_ds, transform=jitter_train())
    (m0, s0, p0), (m1, s1, p1) = _compare_epochs(Subset(base, [i % len(base) for i in range(STAT_SAMPLES)]), True)
    se = (p0.var(0) / len(p0) + p1.var(0) / len(p1)).sqrt()
    assert ((m1 - m0).abs() < 4.5 * se).all(), (m0, m1, se)
    assert ((s1 / s0 - 1).abs() < 0.02).all(), (s0, s1)


def test_tail_is_the_users_object_on_the_prefix(folder_ds):
    """With num_workers=0 the tail draws from the training loop's RNG, as torch's loader does:
    replaying the compiled prefix with feedgpu's draws and then the user's ColorJitter, ToTensor
    and Normalize from the same torch seed gives the loader's samples exactly."""
    recipe = jitter_train()
    ds = ImageFolder(folder_ds, transform=recipe)
    loader = feedgpu.DataLoader(ds, batch_size=6, num_workers=0, seed=5)
    torch.manual_seed(123)
    x, y = next(iter(loader))
    torch.manual_seed(123)
    crop_id, flip_id = stage_draw_ids([type("S", (), {"name": n}) for n in ("random_resized_crop", "horizontal_flip")])
    for i in range(6):
        with open(ds.samples[i][0], "rb") as f:
            img = Image.open(f).convert("RGB")
        top, left, h, w = random_resized_crop_params(img.width, img.height, (0.08, 1.0), (3 / 4, 4 / 3),
                                                     Draws(5, 0, i, crop_id))
        want = F.resized_crop(img, top, left, h, w, [224, 224], F.InterpolationMode.BILINEAR)
        if Draws(5, 0, i, flip_id)[0] < 0.5:
            want = F.hflip(want)
        for t in recipe.transforms[2:]:
            want = t(want)
        assert torch.equal(x[i], want), i


@pytest.mark.parametrize("name", ["v1_train", "v2_train", "uint8"])
def test_compiled_random_recipe_is_torchvision_on_the_drawn_parameters(folder_ds, name):
    """Each sample equals torchvision's functional transforms applied with the crop window and
    flip feedgpu drew for it from (seed, epoch, index)."""
    recipe, normalized = RANDOM[name]
    ds = ImageFolder(folder_ds, transform=recipe())
    loader = feedgpu.DataLoader(ds, batch_size=16, num_workers=0, seed=7)
    loader.set_epoch(3)
    crop_id, flip_id = stage_draw_ids([type("S", (), {"name": n}) for n in ("random_resized_crop", "horizontal_flip")])
    seen = 0
    for x, y in loader:
        for row in range(len(y)):
            i = seen + row
            path, label = ds.samples[i]
            assert y[row].item() == label
            with open(path, "rb") as f:
                img = Image.open(f).convert("RGB")
            top, left, h, w = random_resized_crop_params(img.width, img.height, (0.08, 1.0), (3 / 4, 4 / 3),
                                                         Draws(7, 3, i, crop_id))
            want = F.resized_crop(img, top, left, h, w, [224, 224], F.InterpolationMode.BILINEAR)
            if Draws(7, 3, i, flip_id)[0] < 0.5:
                want = F.hflip(want)
            want = F.pil_to_tensor(want)
            got = x[row] if not normalized else (to_unit(x[row:row + 1], True)[0] * 255).round()
            assert (got.double() - want.double()).abs().max().item() <= 1.0
        seen += len(y)
        if seen >= 48:
            break


@pytest.mark.parametrize("recipe", [v1_train, v2_train, uint8_train], ids=["v1_train", "v2_train", "uint8"])
def test_compiled_draws_do_not_depend_on_workers(folder_ds, recipe):
    ds = Subset(ImageFolder(folder_ds, transform=recipe()), list(range(0, 120, 2)))
    one = _batches(feedgpu.DataLoader(ds, batch_size=20, num_workers=0, seed=11, shuffle=True,
                                      generator=torch.Generator().manual_seed(1)))
    two = _batches(feedgpu.DataLoader(ds, batch_size=20, num_workers=2, seed=11, shuffle=True,
                                      generator=torch.Generator().manual_seed(1)))
    for (x, y), (x2, y2) in zip(one, two, strict=True):
        assert torch.equal(y, y2) and torch.equal(x, x2)


def test_jitter_recipe_runs_the_tail_as_python(folder_ds):
    ds = ImageFolder(folder_ds, transform=jitter_train())
    loader = feedgpu.DataLoader(ds, batch_size=30, num_workers=2)
    text = loader.explain()
    rows = [line for line in text.splitlines() if line[:2].strip().isdigit()]
    assert [("compiled op (feedgpu)" in r) for r in rows] == [True, True, False, False, False]
    assert "feedgpu has no compiled op for ColorJitter" in rows[2]
    assert "after ColorJitter" in rows[3] and "after ColorJitter" in rows[4]
    x, y = next(iter(loader))
    assert x.shape == (30, 3, 224, 224) and x.dtype == torch.float32 and y.tolist() == [ds.samples[i][1] for i in range(30)]


@pytest.mark.parametrize("fill", [0, 7.5, None, (1, 2, 3), [4, 5, 6], {Image.Image: (9, 8, 7), "others": 0},
                                  {"others": 3}, {torch.Tensor: 1, "others": (2, 2, 2)}])
def test_a_v2_fill_resolves_as_torchvision_resolves_it(fill):
    """RandomCrop's padding fill, read from the transform's public ``fill``: the value
    torchvision's own v2 code pads a PIL image with (its private per-type mapping)."""
    from torchvision.transforms import v2
    from torchvision.transforms.v2._utils import _get_fill   # torchvision's own rule, as the reference

    from feedgpu.torchvision.ops import fill_for

    t = v2.RandomCrop(8, padding=2, fill=fill)
    assert fill_for(t.fill, Image.Image) == _get_fill(t._fill, Image.Image)
