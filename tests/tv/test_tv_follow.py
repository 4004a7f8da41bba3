"""A torchvision dataset changed after the loader was built is followed as torch's loader follows
it: a ``transform``, ``target_transform`` or ``Subset.indices`` reassigned (or grown) between
epochs takes effect at the next iteration; persistent workers keep the dataset they started with,
as torch's do. Compared side by side with torch's loader on deterministic recipes."""
from __future__ import annotations

import pytest
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader as TorchLoader, Subset
from torchvision.datasets import ImageFolder

import feedgpu


def _small(size):
    return T.Compose([T.Resize(size), T.CenterCrop(size), T.ToTensor()])


def _all(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def _same(a, b):
    assert len(a) == len(b)
    for (x, y), (x2, y2) in zip(a, b):
        assert x.shape == x2.shape and torch.equal(y, y2) and torch.equal(x, x2)


def _plus_7(y):
    return y + 7


@pytest.mark.parametrize("workers", [0, 2])
def test_transform_reassigned_between_epochs(folder_ds, workers):
    ds = ImageFolder(folder_ds, transform=_small(48))
    ref = TorchLoader(ds, batch_size=16, num_workers=workers)
    loader = feedgpu.DataLoader(ds, batch_size=16, num_workers=workers)
    _same(_all(ref), _all(loader))
    ds.transform = _small(24)   # a recipe swap (progressive resizing)
    assert "Resize(size=24" in loader.explain() and "Resize(size=48" not in loader.explain()
    got = _all(loader)
    assert got[0][0].shape[-2:] == (24, 24)
    _same(_all(ref), got)
    ds.transform.transforms[0].size = 32   # a parameter set in place: torch reads it too
    ds.transform.transforms[1].size = (32, 32)
    got = _all(loader)
    assert got[0][0].shape[-2:] == (32, 32)
    _same(_all(ref), got)
    ds.target_transform = _plus_7
    got = _all(loader)
    assert int(got[0][1].min()) >= 7
    _same(_all(ref), got)


@pytest.mark.parametrize("workers", [0, 2])
def test_subset_indices_reassigned_and_grown(folder_ds, workers):
    sub = Subset(ImageFolder(folder_ds, transform=_small(32)), list(range(10)))
    ref = TorchLoader(sub, batch_size=4, num_workers=workers)
    loader = feedgpu.DataLoader(sub, batch_size=4, num_workers=workers)
    _same(_all(ref), _all(loader))
    sub.indices = list(range(60, 70))   # other samples, with other labels
    got = _all(loader)
    _same(_all(ref), got)
    assert torch.cat([y for _, y in got]).tolist() == [sub.dataset.targets[i] for i in range(60, 70)]
    sub.indices = list(range(0, 120, 4))   # grown: 30 samples
    got = _all(loader)
    assert sum(len(y) for _, y in got) == 30 and len(loader) == 8
    _same(_all(ref), got)
    sub.indices.extend([1, 2, 3])   # grown in place: read at each sample
    _same(_all(ref), _all(loader))


def test_persistent_workers_keep_their_copy_as_in_torch(folder_ds):
    ds = ImageFolder(folder_ds, transform=_small(48))
    ref = TorchLoader(ds, batch_size=16, num_workers=2, persistent_workers=True)
    loader = feedgpu.DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True)
    ds.transform = _small(40)   # before the first iteration: the workers start with it
    _same(_all(ref), _all(loader))
    ds.transform = _small(24)
    got, expected = _all(loader), _all(ref)
    assert got[0][0].shape[-2:] == expected[0][0].shape[-2:] == (40, 40)   # torch's workers keep theirs too
    _same(expected, got)
    assert "they keep it as it was" in loader.explain()
    loader.shutdown()   # workers started anew take the dataset of now
    got = _all(loader)
    assert got[0][0].shape[-2:] == (24, 24)
    _same(_all(TorchLoader(ds, batch_size=16, num_workers=2)), got)
