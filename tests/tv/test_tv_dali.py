"""``engine="dali"`` on a torchvision dataset (DALI's CPU operators here, ``device_id=None``):
the recipe as feedgpu's stages on DALI, same shapes, dtypes and labels as torch's loader, the
per-channel statistics within 1 %, the deterministic recipes within resampling differences of
torchvision's pixels; recipes DALI cannot run whole are refused, saying why."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader, Subset
from torchvision.datasets import ImageFolder

import feedgpu
from recipes import jitter_train, to_unit, v1_train, v1_val, v2_train, v2_val

pytest.importorskip("nvidia.dali")

EPOCHS = 25   # x 120 images: 3,000 samples, as tests/tv/test_tv_recipes.py's statistics


@pytest.mark.parametrize("recipe", [v1_val, v2_val], ids=["v1_val", "v2_val"])
def test_dali_val_recipe_close_to_torch(folder_ds, recipe):
    ds = ImageFolder(folder_ds, transform=recipe())
    ref = list(TorchLoader(ds, batch_size=40, num_workers=2))
    got = list(feedgpu.DataLoader(ds, batch_size=40, num_workers=2, engine="dali"))
    assert len(got) == len(ref) == 3
    for (x, y), (x2, y2) in zip(ref, got):
        assert x2.shape == x.shape and x2.dtype == x.dtype and x2.device.type == "cpu"
        assert torch.equal(y, y2)
        diff = (to_unit(x, True) - to_unit(x2, True)).abs() * 255
        assert diff.mean().item() < 0.5, diff.mean().item()   # DALI's resize against Pillow's, per pixel


@pytest.mark.parametrize("recipe", [v1_train, v2_train], ids=["v1_train", "v2_train"])
def test_dali_train_recipe_matches_torch_statistics(small_ds, recipe):
    ds = ImageFolder(small_ds, transform=recipe())

    def stats(loader):
        total, squares, n, labels = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 0, []
        for e in range(EPOCHS):
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(e)
            for x, y in loader:
                assert x.shape[1:] == (3, 224, 224) and x.dtype == torch.float32
                u = to_unit(x, True)
                total += u.sum((0, 2, 3))
                squares += (u * u).sum((0, 2, 3))
                n += u.numel() // 3
                labels.append(y)
        m = total / n
        return m, (squares / n - m * m).sqrt(), torch.cat(labels)

    m0, s0, y0 = stats(TorchLoader(ds, batch_size=120, num_workers=2))
    m1, s1, y1 = stats(feedgpu.DataLoader(ds, batch_size=120, num_workers=2, engine="dali"))
    assert torch.equal(y0, y1)
    assert ((m1 / m0 - 1).abs() < 0.01).all(), (m0, m1)
    assert ((s1 / s0 - 1).abs() < 0.01).all(), (s0, s1)


def test_dali_refuses_what_it_cannot_run_whole(folder_ds):
    with pytest.raises(feedgpu.ConfigError, match="ColorJitter"):
        feedgpu.DataLoader(ImageFolder(folder_ds, transform=jitter_train()), engine="dali")
    with pytest.raises(feedgpu.ConfigError, match="Subset"):
        feedgpu.DataLoader(Subset(ImageFolder(folder_ds, transform=v1_val()), [0, 1]), engine="dali")
    with pytest.raises(feedgpu.ConfigError, match="collate_fn"):
        feedgpu.DataLoader(ImageFolder(folder_ds, transform=v1_val()), engine="dali", collate_fn=list)
    with pytest.raises(feedgpu.ConfigError, match="engine='dali' runs a torchvision dataset only.*batch_size=None"):
        feedgpu.DataLoader(ImageFolder(folder_ds, transform=v1_val()), engine="dali", batch_size=None)


def test_dali_refuses_a_recipe_changed_after_the_loader_was_built(folder_ds):
    ds = ImageFolder(folder_ds, transform=v1_val())
    loader = feedgpu.DataLoader(ds, batch_size=40, engine="dali")
    assert len(next(iter(loader))[1]) == 40
    ds.transform = v1_train()   # DALI holds the val recipe it was built with: refused, not run as it was
    with pytest.raises(feedgpu.ConfigError, match="transform changed since the loader was built"):
        next(iter(loader))


def test_dali_names_what_changed_and_refuses_edited_samples(folder_ds):
    ds = ImageFolder(folder_ds, transform=v1_val())
    loader = feedgpu.DataLoader(ds, batch_size=40, engine="dali")
    ds.target_transform = int
    with pytest.raises(feedgpu.ConfigError, match="target_transform changed since"):
        next(iter(loader))
    ds.target_transform = None
    assert len(next(iter(loader))[1]) == 40   # as it was: runs again
    ds.samples[0] = (ds.samples[0][0], 1 - ds.samples[0][1])   # relabelled in place
    with pytest.raises(feedgpu.ConfigError, match="samples changed since"):
        next(iter(loader))
    ds.samples = ds.samples[:8]   # cut: a new list
    with pytest.raises(feedgpu.ConfigError, match="samples changed since"):
        next(iter(loader))


def test_dali_refuses_a_dataset_whose_samples_the_folder_source_does_not_list(folder_ds):
    # the pipeline reads the root itself: a sample list of the dataset's own must not be replaced silently
    left_out = ImageFolder(folder_ds).samples[0][0]
    kept = ImageFolder(folder_ds, transform=v1_val(), is_valid_file=lambda p: p != left_out)
    assert len(kept) == len(ImageFolder(folder_ds)) - 1
    with pytest.raises(feedgpu.ConfigError, match="other samples than the dataset"):
        feedgpu.DataLoader(kept, engine="dali")

    class Reversed(ImageFolder):
        def find_classes(self, directory):
            classes, _ = super().find_classes(directory)
            return classes, {c: len(classes) - 1 - i for i, c in enumerate(classes)}

    with pytest.raises(feedgpu.ConfigError, match="with label"):
        feedgpu.DataLoader(Reversed(folder_ds, transform=v1_val()), engine="dali")
    edited = ImageFolder(folder_ds, transform=v1_val())
    edited.samples = edited.samples[:10]
    with pytest.raises(feedgpu.ConfigError, match="10 samples in the dataset"):
        feedgpu.DataLoader(edited, engine="dali")


def test_a_dali_loader_shows_its_dataset_and_made_again_compiles_it_as_it_is(folder_ds):
    ds = ImageFolder(folder_ds, transform=v1_val())
    loader = feedgpu.DataLoader(ds, batch_size=40, engine="dali")
    assert loader.dataset is ds and loader.dataset.classes == ds.classes
    ds.transform = v1_train(size=96)
    with pytest.raises(feedgpu.ConfigError, match="transform changed"):
        next(iter(loader))
    again = feedgpu.DataLoader(loader.dataset, batch_size=loader.batch_size, engine=loader.engine)   # as Lightning
    x, _ = next(iter(again))
    assert x.shape[1:] == (3, 96, 96)   # the recipe as it is now, not the one the first loader holds
