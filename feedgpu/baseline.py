"""The torch baseline: what a user writes today with ``torch.utils.data`` and Pillow.

:func:`torch_loader` builds a stock ``torch.utils.data.DataLoader`` over a map-style Dataset that
reads the same records as a feedgpu pipeline's source (folder, tar shards, parquet) and applies
the torchvision transforms equivalent to the pipeline's stages, written with plain Pillow and
torch (torchvision is not a dependency). Each transform follows torchvision's code path for PIL
images (``torchvision/transforms/transforms.py`` and ``functional.py``), so it costs what
torchvision costs:

* decode: ``Image.open(BytesIO(bytes)).convert("RGB")`` as ``ImageFolder``'s ``pil_loader`` (plus
  the EXIF transpose when the pipeline's decode applies it);
* ``RandomResizedCrop``: ``get_params`` with torch's RNG, then ``img.crop(box).resize(size,
  BILINEAR)`` as ``F.resized_crop`` does on PIL images;
* ``Resize(short side)`` + ``CenterCrop``; ``RandomHorizontalFlip`` with ``torch.rand``;
* ``ToTensor`` (float CHW in [0, 1]) and ``Normalize`` (``sub_(mean).div_(std)``);
* batches from ``default_collate``; ``pin_memory=False``. Errors raise, as in torch.

Random draws come from torch's per-worker RNG, as with torchvision, so the crops are not the
same ones feedgpu draws: the work per sample is the same in distribution, not sample by sample.
"""
from __future__ import annotations

import io
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.utils.data as tud
from PIL import Image

from . import stages as fs
from .errors import ConfigError
from .pipeline import Pipeline
from .stages.decode import _EXIF_ORIENTATION, _TRANSPOSE
from .stages.geometry import INTERPOLATIONS

__all__ = ["CenterCrop", "Compose", "LoadImage", "Normalize", "PilCallable", "RandomHorizontalFlip",
           "RandomResizedCrop", "Resize", "ToTensor", "TorchBaselineDataset", "build_transforms",
           "torch_loader"]


class Compose:
    """``torchvision.transforms.Compose``."""

    def __init__(self, transforms: Sequence[Callable]):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x

    def __repr__(self) -> str:
        return "Compose(" + ", ".join(repr(t) for t in self.transforms) + ")"


class LoadImage:
    """``ImageFolder``'s loader on bytes: open, optional EXIF transpose, ``convert("RGB")``."""

    def __init__(self, exif_orientation: bool = True):
        self.exif_orientation = exif_orientation

    def __call__(self, data) -> Image.Image:
        img = Image.open(io.BytesIO(data))
        if self.exif_orientation:
            method = _TRANSPOSE.get(img.getexif().get(_EXIF_ORIENTATION, 1))
            if method is not None:
                img = img.transpose(method)
        return img.convert("RGB")

    def __repr__(self) -> str:
        return f"LoadImage(exif_orientation={self.exif_orientation})"


def torchvision_rrc_params(width: int, height: int, scale, ratio) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` line for line, drawing from torch's global
    RNG: ``(top, left, h, w)`` (torchvision/transforms/transforms.py)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class RandomResizedCrop:
    """``torchvision.transforms.RandomResizedCrop`` on PIL images (``size`` is ``(h, w)``)."""

    def __init__(self, size: tuple[int, int], scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interpolation="bilinear"):
        self.size, self.scale, self.ratio = tuple(size), tuple(scale), tuple(ratio)
        self.interpolation = interpolation
        self.resample = INTERPOLATIONS[interpolation]

    @staticmethod
    def get_params(img: Image.Image, scale, ratio) -> tuple[int, int, int, int]:
        return torchvision_rrc_params(img.width, img.height, scale, ratio)

    def __call__(self, img: Image.Image) -> Image.Image:
        i, j, h, w = self.get_params(img, self.scale, self.ratio)
        # F.resized_crop on PIL: crop, then resize to (w, h) with the interpolation.
        img = img.crop((j, i, j + w, i + h))
        return img.resize((self.size[1], self.size[0]), self.resample)

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, {self.interpolation})"


class Resize:
    """``torchvision.transforms.Resize(int)``: the short side to ``size``, the long side
    ``int(size * long / short)`` (truncated, torchvision's rule). ``upscale=False`` leaves images
    with a shorter short side alone (feedgpu's ``resize`` option; torchvision always resizes)."""

    def __init__(self, size: int, interpolation="bilinear", upscale: bool = True):
        self.size, self.interpolation, self.upscale = int(size), interpolation, upscale
        self.resample = INTERPOLATIONS[interpolation]

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        short, long = (w, h) if w <= h else (h, w)
        if short < self.size and not self.upscale:
            return img
        new_short, new_long = self.size, int(self.size * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        if (new_w, new_h) == (w, h):
            return img
        return img.resize((new_w, new_h), self.resample)

    def __repr__(self) -> str:
        return f"Resize({self.size}, {self.interpolation})"


class CenterCrop:
    """``torchvision.transforms.CenterCrop`` (``size`` is ``(h, w)``); areas outside the image
    are black, as torchvision's zero padding."""

    def __init__(self, size: tuple[int, int]):
        self.size = tuple(size)

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        ch, cw = self.size
        top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
        return img.crop((left, top, left + cw, top + ch))

    def __repr__(self) -> str:
        return f"CenterCrop({self.size})"


class RandomHorizontalFlip:
    """``torchvision.transforms.RandomHorizontalFlip``."""

    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        if torch.rand(1) < self.p:
            return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return img

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class PilCallable:
    """A feedgpu :class:`~feedgpu.stages.PythonStage`'s callable on the PIL image; a random one
    gets a numpy Generator seeded from torch's RNG (so it follows the worker's seeding)."""

    def __init__(self, stage: fs.PythonStage):
        self.stage = stage

    def __call__(self, img):
        if self.stage.random:
            rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,)).item()))
            out = self.stage.fn(img, rng)
        else:
            out = self.stage.fn(img)
        return out if isinstance(out, Image.Image) else Image.fromarray(np.asarray(out))

    def __repr__(self) -> str:
        return f"PilCallable({self.stage.label})"


class ToTensor:
    """``torchvision.transforms.ToTensor`` for 8-bit images: float32 CHW in [0, 1]."""

    def __call__(self, pic: Image.Image):
        img = torch.from_numpy(np.array(pic, np.uint8, copy=True))
        img = img.view(pic.size[1], pic.size[0], len(pic.getbands()))
        img = img.permute((2, 0, 1)).contiguous()
        return img.to(dtype=torch.get_default_dtype()).div(255)

    def __repr__(self) -> str:
        return "ToTensor()"


class Normalize:
    """``torchvision.transforms.Normalize`` (not in place), then the pipeline's output dtype and
    layout (``float16`` -> ``.half()``, ``NHWC`` -> ``permute(1, 2, 0)``)."""

    def __init__(self, mean, std, dtype: str = "float32", layout: str = "NCHW"):
        self.mean, self.std, self.dtype, self.layout = list(mean), list(std), dtype, layout

    def __call__(self, tensor):
        tensor = tensor.clone()
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
        tensor = tensor.sub_(mean).div_(std)
        if self.layout == "NHWC":
            tensor = tensor.permute(1, 2, 0).contiguous()
        return tensor.half() if self.dtype == "float16" else tensor

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, layout={self.layout})"


class _ToUint8HWC:
    """Pipelines without normalize deliver uint8 HWC: ``torch.from_numpy(np.array(img))``."""

    def __call__(self, img: Image.Image):
        return torch.from_numpy(np.array(img, np.uint8, copy=True))

    def __repr__(self) -> str:
        return "ToUint8HWC()"


_resize_stage = getattr(fs, "Resize", None)  # feedgpu's short-side resize stage, where this version has it


def build_transforms(pipeline: Pipeline) -> Compose:
    """The torchvision-style transform list equivalent to ``pipeline``'s stages, from the
    encoded bytes to the sample tensor. Raises :class:`ConfigError` for a stage it has no
    equivalent for (third-party stages)."""
    out: list[Callable] = []
    for i, st in enumerate(pipeline.stages):
        if isinstance(st, fs.Decode):
            out.append(LoadImage(st.exif_orientation))
        elif isinstance(st, fs.RandomResizedCrop):
            out.append(RandomResizedCrop(st.size, st.scale, st.ratio, st.interpolation))
        elif _resize_stage is not None and isinstance(st, _resize_stage):
            out.append(Resize(st.size, st.interpolation, getattr(st, "upscale", True)))
        elif isinstance(st, fs.ResizeCenterCrop):
            out += [Resize(st.resize, st.interpolation), CenterCrop(st.crop)]
        elif isinstance(st, fs.HorizontalFlip):
            out.append(RandomHorizontalFlip(st.p))
        elif isinstance(st, fs.PythonStage):
            out.append(PilCallable(st))
        elif isinstance(st, fs.Normalize):
            out += [ToTensor(), Normalize(st.mean, st.std, st.dtype, st.layout)]
        else:
            raise ConfigError(f"stages[{i}] ({st.name}): the torch baseline has no equivalent of this stage; "
                              "run without the baseline (--no-baseline)")
    if not isinstance(pipeline.stages[-1], fs.Normalize):
        out.append(_ToUint8HWC())
    return Compose(out)


class TorchBaselineDataset(tud.Dataset):
    """Map-style Dataset: ``(transform(source.read(i).payload), label)``."""

    def __init__(self, source, transform: Callable):
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        rec = self.source.read(index)
        return self.transform(rec.payload), rec.label


def torch_loader(pipeline: Pipeline, num_workers: int | None = None, batch_size: int | None = None, *,
                 shuffle: bool | None = None, drop_last: bool | None = None, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, pin_memory: bool = False, seed: int | None = None):
    """A stock ``torch.utils.data.DataLoader`` doing ``pipeline``'s work the torchvision way.

    Unset arguments come from the pipeline (workers, batch size, shuffle, drop_last, prefetch,
    seed). Returns the DataLoader; its dataset is a :class:`TorchBaselineDataset`.
    """
    p = pipeline
    workers = p.num_workers if num_workers is None else int(num_workers)
    ds = TorchBaselineDataset(p.source, build_transforms(p))
    g = torch.Generator()
    g.manual_seed(p.seed if seed is None else int(seed))
    kw: dict[str, Any] = {}
    if workers > 0:
        kw.update(prefetch_factor=p.prefetch_factor if prefetch_factor is None else int(prefetch_factor),
                  persistent_workers=persistent_workers)
    return tud.DataLoader(ds, batch_size=p.batch_size if batch_size is None else int(batch_size),
                          shuffle=p.shuffle if shuffle is None else bool(shuffle),
                          drop_last=p.drop_last if drop_last is None else bool(drop_last),
                          num_workers=workers, pin_memory=pin_memory, generator=g, **kw)
