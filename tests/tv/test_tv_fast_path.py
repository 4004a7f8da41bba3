"""How the torchvision backend makes its samples faster without changing them: a recipe that
starts with RandomResizedCrop decodes a JPEG only down to the window's rows (the pixels
pil_loader + resized_crop give, on every kind of input), and with workers and default_collate
the batches are written into reused shared-memory buffers (the values default_collate gives,
and its fallback for samples that do not fit)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader as TorchLoader, Subset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import pil_loader

import feedgpu
from feedgpu.stages.draws import Draws
from feedgpu.torchvision.ops import RandomResizedCropOp
from feedgpu.torchvision.slots import TorchvisionSlotWork, sample_layout
from feedgpu.torchvision.window import load_window
from recipes import MEAN, STD, jitter_train, uint8_train, v1_train, v1_val, v2_train

CASES_AND_PHOTOS = ("cases", "photos")


def _files(which: str) -> list:
    from conftest import CASES, PHOTOS

    root = CASES if which == "cases" else PHOTOS
    return sorted(p for p in root.iterdir() if p.is_file() and not p.name.endswith(".md"))


def _outcome(fn):
    try:
        return np.asarray(fn()), None
    except Exception as e:   # noqa: BLE001 - the error itself is compared
        return None, (type(e), str(e))


@pytest.mark.parametrize("which", CASES_AND_PHOTOS)
@pytest.mark.parametrize("size", [224, 32])
def test_window_decode_is_pil_loader_then_resized_crop(which, size):
    """Every case image (gray, CMYK, YCCK, EXIF-rotated, progressive, thin, truncated, not an
    image...) and every photograph: the same pixels, or the same error (type and message, which
    names the file), as torchvision."""
    op = RandomResizedCropOp(T.RandomResizedCrop(size))
    files = _files(which)
    rows_cut = 0
    for path in files:
        for k in range(4):
            u = Draws(3, 0, k, 1)
            want, want_err = _outcome(lambda: op.apply(pil_loader(path), u))
            got, got_err = _outcome(lambda: load_window(path, op, u))
            assert got_err == want_err, (path.name, want_err, got_err)
            if want is not None:
                assert got.shape == want.shape and np.array_equal(got, want), (path.name, k)
                top, _, h, _ = op.window(*pil_loader(path).size, u)
                rows_cut += top + h + 16 < pil_loader(path).height
    assert rows_cut >= len(files) // 2   # many windows end well above the bottom: rows were left out


def test_window_decode_in_the_loader_equals_full_decode(folder_ds):
    ds = Subset(ImageFolder(folder_ds, transform=v2_train()), list(range(0, 120, 3)))
    full = feedgpu.DataLoader(ds, batch_size=8, num_workers=0, seed=4)
    fast = feedgpu.DataLoader(ds, batch_size=8, num_workers=0, seed=4)
    next(iter(full))
    full._backend.work.window = False   # the same work reading whole images
    for (x, y), (x2, y2) in zip(full, fast, strict=True):
        assert torch.equal(y, y2) and torch.equal(x, x2)


@pytest.mark.parametrize("recipe", [v1_train, v1_val, uint8_train], ids=["v1_train", "v1_val", "uint8"])
def test_batches_in_shared_buffers_equal_collated_ones(folder_ds, recipe):
    """The buffered batches (workers) equal the batches of the same work without workers, which
    default_collate-equivalent code writes: values, dtype, type and labels."""
    ds = ImageFolder(folder_ds, transform=recipe())
    buffered = feedgpu.DataLoader(ds, batch_size=16, num_workers=2, seed=9)
    inline = feedgpu.DataLoader(ds, batch_size=16, num_workers=0, seed=9)
    got = [(x.clone(), y.clone(), type(b)) for b in buffered for x, y in [b]]
    assert isinstance(buffered._backend.work, TorchvisionSlotWork)
    ref = [(x, y, type(b)) for b in inline for x, y in [b]]
    assert len(got) == len(ref) == 8
    for (x, y, kind), (x2, y2, kind2) in zip(got, ref):
        assert kind is kind2 is list and type(x) is torch.Tensor
        assert x.dtype == x2.dtype and y.dtype == torch.int64 and torch.equal(y, y2) and torch.equal(x, x2)
    # in the main process (the DALI engine's inline epochs) the buffered work makes its batch without a buffer
    (x, y), report = buffered._backend.work.run_inline(0, 0, np.arange(16), np.array([], np.int64))
    assert report is None and torch.equal(x, ref[0][0]) and torch.equal(y, ref[0][1])


def test_batches_held_by_the_loop_keep_their_values(folder_ds):
    """A loop keeping every batch (more than the buffers it may hold) gets copies, not views of
    buffers the workers write again."""
    ds = ImageFolder(folder_ds, transform=v1_val())
    ref = [(x.clone(), y.clone()) for x, y in TorchLoader(ds, batch_size=8, num_workers=2)]
    held = list(feedgpu.DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True))
    again = list(feedgpu.DataLoader(ds, batch_size=8, num_workers=2))
    assert len(held) == len(ref) == 15
    for (x, y), (hx, hy), (ax, ay) in zip(ref, held, again):
        assert torch.equal(y, hy) and torch.equal(y, ay)
        assert torch.allclose(x, hx, atol=1.01 / 255 / min(STD)) and torch.equal(hx, ax)


def test_tail_batches_in_shared_buffers_as_default_collate(folder_ds):
    """ColorJitter's recipe: the tail's tensors are written into the buffers; with the same
    torch seed the batches equal those collated by default_collate (the work without buffers)."""
    ds = ImageFolder(folder_ds, transform=jitter_train())
    one = feedgpu.DataLoader(ds, batch_size=20, num_workers=1, seed=2, generator=torch.Generator().manual_seed(5))
    got = [(x.clone(), y.clone()) for x, y in one]
    assert isinstance(one._backend.work, TorchvisionSlotWork)
    one.shutdown()
    plain = feedgpu.DataLoader(ds, batch_size=20, num_workers=1, seed=2, generator=torch.Generator().manual_seed(5),
                               collate_fn=_own_collate)   # not torch's own function: collated, no buffers
    ref = [(x.clone(), y.clone()) for x, y in plain]
    assert not isinstance(plain._backend.work, TorchvisionSlotWork)
    for (x, y), (x2, y2) in zip(got, ref, strict=True):
        assert torch.equal(y, y2) and torch.equal(x, x2)


def _own_collate(items):
    return torch.utils.data.default_collate(items)


class _SizeFromLabel:
    """A user's transform that makes some samples another size: default_collate then fails."""

    def __init__(self, sizes):
        self.sizes = sizes
        self.calls = 0

    def __call__(self, img):
        self.calls += 1
        return T.functional.resize(img, [self.sizes[self.calls % len(self.sizes)]] * 2)


class _AsNumpy:
    def __call__(self, x):
        return x.numpy()


@pytest.mark.parametrize("sizes", [[224], [224, 200]], ids=["fits", "other_size"])
def test_samples_that_do_not_fit_are_collated_as_torch(folder_ds, sizes):
    """A tail that gives another size than the recipe implies: torch's default_collate runs
    (and raises as with torch's loader); a tail giving numpy arrays: collated by default_collate
    (tensors from arrays), as torch's loader."""
    tf = T.Compose([T.RandomResizedCrop(224), _SizeFromLabel(sizes), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = Subset(ImageFolder(folder_ds, transform=tf), list(range(24)))
    loader = feedgpu.DataLoader(ds, batch_size=8, num_workers=2)
    work = loader._backend.build_work()
    assert sample_layout(work.ops, work.tail) == ((3, 224, 224), np.dtype("float32"))
    if len(sizes) == 1:
        assert [x.shape for x, _ in loader] == [(8, 3, 224, 224)] * 3
    else:
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
            list(loader)
    ds2 = Subset(ImageFolder(folder_ds, transform=T.Compose([T.CenterCrop(64), T.ToTensor(), _AsNumpy()])),
                 list(range(12)))
    ref = list(TorchLoader(ds2, batch_size=6, num_workers=2))
    got = list(feedgpu.DataLoader(ds2, batch_size=6, num_workers=2))
    for (x, y), (x2, y2) in zip(ref, got, strict=True):
        assert type(x2) is torch.Tensor and torch.equal(x, x2) and torch.equal(y, y2)


def test_spawned_workers_write_the_same_batches(folder_ds):
    ds = Subset(ImageFolder(folder_ds, transform=v1_train()), list(range(32)))
    fork = [(x.clone(), y.clone()) for x, y in feedgpu.DataLoader(ds, batch_size=8, num_workers=2, seed=1)]
    spawn = feedgpu.DataLoader(ds, batch_size=8, num_workers=2, seed=1, multiprocessing_context="spawn")
    got = [(x.clone(), y.clone()) for x, y in spawn]
    assert isinstance(spawn._backend.work, TorchvisionSlotWork)
    for (x, y), (x2, y2) in zip(fork, got, strict=True):
        assert torch.equal(y, y2) and torch.equal(x, x2)
