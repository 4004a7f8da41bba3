"""Everything around the samples keeps torch's behaviour with a compiled torchvision dataset:
Subset, target_transform, collate_fn, drop_last, samplers, state_dict(); what is compiled shows in
explain() and one INFO line; compile=False and datasets the backend does not take run as a
plain Dataset."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader as TorchLoader, Subset, WeightedRandomSampler
from torchvision.datasets import DatasetFolder, ImageFolder
from torchvision.datasets.folder import default_loader

import feedgpu
from recipes import jitter_train, uint8_train, v1_train, v1_val


def _batches(loader, n=None):
    out = []
    for b in loader:
        out.append(b)
        if n is not None and len(out) == n:
            break
    return out


def _plus_100(y):
    return y + 100


def test_subset_and_target_transform_as_torch(folder_ds):
    base = ImageFolder(folder_ds, transform=v1_val(), target_transform=_plus_100)
    ds = Subset(Subset(base, list(range(119, -1, -3))), [0, 5, 7, 2, 39, 11, 3])
    ref = _batches(TorchLoader(ds, batch_size=3, num_workers=2))
    loader = feedgpu.DataLoader(ds, batch_size=3, num_workers=2)
    got = _batches(loader)
    assert "Subset of Subset of ImageFolder" in loader.explain()
    assert "target_transform: " in loader.explain() and "_plus_100" in loader.explain()
    assert [len(y) for _, y in got] == [3, 3, 1]
    for (x, y), (x2, y2) in zip(ref, got, strict=True):
        assert torch.equal(y, y2) and int(y2.min()) >= 100 and torch.equal(x, x2)


def test_explain_and_one_info_line(folder_ds, caplog):
    ds = ImageFolder(folder_ds, transform=T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(),
                                                     T.ToTensor(), T.RandomErasing(p=1.0), T.Lambda(torch.neg)]))
    loader = feedgpu.DataLoader(ds, batch_size=8, num_workers=0)
    text = loader.explain()
    assert "RandomResizedCrop" in text and "random_resized_crop" in text and "horizontal_flip" in text
    assert "feedgpu has no compiled op for RandomErasing" in text and "after RandomErasing" in text
    with caplog.at_level(logging.INFO, logger="feedgpu.torchvision"):
        x, _ = next(iter(loader))
        next(iter(loader))
    assert x.shape == (8, 3, 64, 64) and x.max() <= 0   # the tail ran: Lambda(neg) last
    assert ((x == 0).all(1).flatten(1).sum(1) > 0).all()   # and RandomErasing's zeros before it
    lines = [r.getMessage() for r in caplog.records if r.name == "feedgpu.torchvision"]
    assert len(lines) == 1 and "3 of 5 transforms compiled" in lines[0] and "RandomErasing" in lines[0]


def test_compile_false_and_unrecognised_datasets_run_as_plain_datasets(folder_ds, tmp_path):
    ds = ImageFolder(folder_ds, transform=v1_val())
    plain = feedgpu.DataLoader(ds, batch_size=4, compile=False)
    assert getattr(plain._backend, "compiled", None) is None and "compile=False" in plain.explain()
    x, y = next(iter(plain))
    x2, y2 = next(iter(TorchLoader(ds, batch_size=4)))
    assert torch.equal(x, x2) and torch.equal(y, y2)

    own = ImageFolder(folder_ds, transform=v1_val(), loader=lambda p: default_loader(p))
    assert "reads with its own loader" in feedgpu.DataLoader(own, batch_size=4).explain()

    class Mine(ImageFolder):
        def __getitem__(self, i):
            return super().__getitem__(i)

    assert "overrides DatasetFolder's __getitem__" in feedgpu.DataLoader(Mine(folder_ds), batch_size=4).explain()

    class MyCrop(T.CenterCrop):
        pass

    sub = feedgpu.DataLoader(ImageFolder(folder_ds, transform=T.Compose([MyCrop(32), T.ToTensor()])), batch_size=4)
    assert "a subclass of torchvision.transforms.transforms.CenterCrop" in sub.explain()
    assert next(iter(sub))[0].shape == (4, 3, 32, 32)


def test_dataset_folder_with_default_loader(folder_ds):
    ds = DatasetFolder(str(folder_ds), loader=default_loader, extensions=(".jpg",), transform=v1_val())
    loader = feedgpu.DataLoader(ds, batch_size=10, num_workers=2, drop_last=True)
    assert loader._backend.compiled is not None
    got = _batches(loader)
    ref = _batches(TorchLoader(ds, batch_size=10, num_workers=2, drop_last=True))
    assert len(got) == len(ref) == 12
    for (x, y), (x2, y2) in zip(ref, got):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_collate_fn_and_sampler(folder_ds):
    ds = ImageFolder(folder_ds, transform=uint8_train(32))

    def collate(items):
        return [s.shape for s, _ in items], [t for _, t in items]

    sampler = WeightedRandomSampler([1.0] * 3 + [0.0] * 117, num_samples=40, replacement=True,
                                    generator=torch.Generator().manual_seed(0))
    loader = feedgpu.DataLoader(ds, batch_size=40, sampler=sampler, collate_fn=collate, num_workers=2)
    shapes, targets = next(iter(loader))
    assert shapes == [torch.Size([3, 32, 32])] * 40 and set(targets) == {ds.samples[i][1] for i in range(3)}
    # repeats of a sample under a sampler with replacement draw new crops, as torch's RNG would
    x, _ = next(iter(feedgpu.DataLoader(ds, batch_size=40, sampler=sampler, num_workers=0)))
    assert len({bytes(row.numpy()) for row in x}) > 30


def test_state_dict_resumes_the_compiled_draws(folder_ds):
    ds = ImageFolder(folder_ds, transform=uint8_train(48))

    def make():
        return feedgpu.DataLoader(ds, batch_size=10, shuffle=True, num_workers=2, seed=4)

    whole = [x for x, _ in _batches(make())]
    first = make()
    it = iter(first)
    next(it), next(it), next(it)
    state = first.state_dict()
    del it
    second = make()
    second.load_state_dict(state)
    rest = [x for x, _ in _batches(second)]
    assert len(rest) == len(whole) - 3
    for a, b in zip(whole[3:], rest, strict=True):
        assert torch.equal(a, b)


def test_pipeline_from_torchvision(folder_ds):
    import yaml

    from feedgpu.torchvision import pipeline_yaml

    train = ImageFolder(folder_ds, transform=v1_train())
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing left out: no warning
        text = pipeline_yaml(train)
    data = yaml.safe_load(text)
    assert [s["op"] for s in data["stages"]] == ["decode", "random_resized_crop", "horizontal_flip", "normalize"]
    assert data["source"] == {"format": "folder", "path": str(folder_ds)} and "left out" not in text
    p = feedgpu.Pipeline.from_torchvision(train, **{"loader.batch_size": 8, "loader.num_workers": 0})
    x, y = next(iter(feedgpu.DataLoader(p)))
    assert x.shape == (8, 3, 224, 224) and x.dtype == torch.float32

    jitter = Subset(ImageFolder(folder_ds, transform=jitter_train()), [0, 1])
    with pytest.warns(UserWarning, match="ColorJitter: runs as Python.*Subset|Subset.*ColorJitter"):
        feedgpu.Pipeline.from_torchvision(jitter)
    with pytest.warns(UserWarning, match="pipeline_yaml left out: Subset.*ColorJitter: runs as Python"):
        text = pipeline_yaml(jitter)   # listed in a warning, as the docs say, and at the top of the YAML
    assert "#   - ColorJitter: runs as Python" in text and "#   - Subset: the pipeline reads the whole" in text
    with pytest.raises(ValueError, match="not an ImageFolder"):
        feedgpu.Pipeline.from_torchvision(torch.utils.data.TensorDataset(torch.zeros(2)))


def test_spawned_workers_give_the_same_batches(folder_ds):
    ds = Subset(ImageFolder(folder_ds, transform=v1_train(64)), list(range(24)))
    inline = [x for x, _ in feedgpu.DataLoader(ds, batch_size=8, num_workers=0, seed=9)]
    spawned = [x for x, _ in feedgpu.DataLoader(ds, batch_size=8, num_workers=1, seed=9,
                                                multiprocessing_context="spawn")]
    assert len(spawned) == 3 and all(torch.equal(a, b) for a, b in zip(inline, spawned))


def test_ranks_share_the_epoch_once_with_labels(folder_ds):
    ds = ImageFolder(folder_ds, transform=uint8_train(32))
    seen = []
    for rank in (0, 1):
        loader = feedgpu.DataLoader(ds, batch_size=16, shuffle=True, num_workers=1, seed=3, rank=rank, world_size=2)
        for x, y in loader:
            assert x.shape[1:] == (3, 32, 32)
            seen += y.tolist()
    labels = sorted(t for _, t in ds.samples)
    assert sorted(seen) == labels   # every sample once (120 = 2 x 60: no padding), with its label


def test_a_bad_file_raises_as_in_torch(folder_ds, tmp_path):
    import shutil

    root = tmp_path / "train"
    shutil.copytree(folder_ds, root)
    bad = sorted(root.rglob("*.jpg"))[5]
    bad.write_bytes(b"not a jpeg at all")
    ds = ImageFolder(root, transform=v1_val())
    with pytest.raises(Exception) as theirs:
        list(TorchLoader(ds, batch_size=8))
    with pytest.raises(Exception) as ours:
        list(feedgpu.DataLoader(ds, batch_size=8, num_workers=1))
    assert str(bad) in str(theirs.value) and str(bad) in str(ours.value)
    assert isinstance(ours.value, type(theirs.value)), (type(ours.value), type(theirs.value))


def test_each_epoch_draws_anew(folder_ds):
    ds = Subset(ImageFolder(folder_ds, transform=uint8_train(32)), list(range(20)))
    loader = feedgpu.DataLoader(ds, batch_size=10, num_workers=1, persistent_workers=True)
    first, second = [x for x, _ in loader], [x for x, _ in loader]
    assert not any(torch.equal(a, b) for a, b in zip(first, second))


def test_explain_labels_compiled_ops_and_shows_every_parameter(folder_ds):
    from feedgpu.stages.registry import stage_classes

    recipe = T.Compose([T.RandomResizedCrop(224, scale=(0.35, 1.0), ratio=(0.75, 1.3333)), T.RandomHorizontalFlip(),
                        T.Resize(256, antialias=True), T.CenterCrop(224), T.ToTensor(),
                        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    text = feedgpu.DataLoader(ImageFolder(folder_ds, transform=recipe)).explain()
    rows = [line for line in text.splitlines() if line[:2].strip().isdigit()]
    assert not any("feedgpu stage" in r for r in rows)   # compiled ops are not pipeline stages
    assert len(rows) == 6 and all("compiled op (feedgpu)" in r for r in rows)
    ops = [r.split("compiled op (feedgpu)")[1].split()[0] for r in rows]
    assert ops == ["random_resized_crop", "horizontal_flip", "resize", "center_crop", "to_tensor", "normalize"]
    assert {"center_crop", "to_tensor"}.isdisjoint(stage_classes())   # why the label matters
    assert "they are not pipeline stages" in text
    # every parameter shows: the transform column wraps instead of cutting
    flat = " ".join(text.split())
    for t in recipe.transforms:
        for word in repr(t).replace(",", " ").replace("(", " ").replace(")", " ").split():
            assert word in flat, (word, t)
    for param in ("ratio=(0.75, 1.3333)", "antialias=True)", "0.225])"):
        assert param in flat
