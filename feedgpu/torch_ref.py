"""torchvision's transforms for PIL images, written with Pillow and torch (torchvision is not a
dependency): what a stage's :meth:`~feedgpu.stages.base.Stage.torch_baseline` returns, so
``feedgpu bench`` can compare a pipeline with the stock ``torch.utils.data`` way of doing its
work (:mod:`feedgpu.bench.torch_baseline`).

Each follows torchvision's code path for PIL images (``torchvision/transforms/transforms.py``
and ``functional.py``), so it costs what torchvision costs. Random draws come from torch's
per-worker RNG, as with torchvision. This module imports nothing else of feedgpu: a stage passes
what it needs (its resampling filter, the EXIF transposes) to the constructors.
"""
from __future__ import annotations

import io
import math
from typing import Callable, Mapping

import numpy as np
import torch
from PIL import Image

__all__ = ["CenterCrop", "LoadImage", "Normalize", "PilCallable", "RandomHorizontalFlip", "RandomResizedCrop",
           "Resize", "ToTensor", "ToUint8HWC", "torchvision_rrc_params"]

_EXIF_ORIENTATION = 0x0112


class LoadImage:
    """``ImageFolder``'s loader on bytes: open, optional EXIF transpose, ``convert("RGB")``.

    Args:
        exif_orientation: apply the EXIF orientation tag.
        transposes: ``{orientation: Image.Transpose}`` (the decode stage's table); needed when
            ``exif_orientation`` is True.
    """

    def __init__(self, exif_orientation: bool = True, transposes: Mapping[int, int] | None = None):
        if exif_orientation and transposes is None:
            raise ValueError("LoadImage: exif_orientation=True needs the transposes table")
        self.exif_orientation = exif_orientation
        self._transposes = dict(transposes or {})

    def __call__(self, data) -> Image.Image:
        img = Image.open(io.BytesIO(data))
        if self.exif_orientation:
            method = self._transposes.get(img.getexif().get(_EXIF_ORIENTATION, 1))
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
    h, w = rrc_fallback_size(width, height, ratio)
    return (height - h) // 2, (width - w) // 2, h, w


def rrc_fallback_size(width: int, height: int, ratio) -> tuple[int, int]:
    """``(h, w)`` of torchvision's random-resized-crop fallback after 10 misses: the whole image,
    cut to the nearest bound of ``ratio`` (the window is then centred)."""
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return h, w


class RandomResizedCrop:
    """``torchvision.transforms.RandomResizedCrop`` on PIL images (``size`` is ``(h, w)``,
    ``resample`` a ``PIL.Image.Resampling`` filter)."""

    def __init__(self, size: tuple[int, int], scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                 resample=Image.Resampling.BILINEAR):
        self.size, self.scale, self.ratio = tuple(size), tuple(scale), tuple(ratio)
        self.resample = resample
        self.interpolation = _filter_name(resample)

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

    def __init__(self, size: int, resample=Image.Resampling.BILINEAR, upscale: bool = True):
        self.size, self.resample, self.upscale = int(size), resample, upscale
        self.interpolation = _filter_name(resample)

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
    """A user's callable on the PIL image (a ``python`` stage's ``fn``); a random one
    (``random=True``: ``fn(img, rng)``) gets a numpy Generator seeded from torch's RNG (so it
    follows the worker's seeding)."""

    def __init__(self, fn: Callable, random: bool = False, label: str = ""):
        self.fn, self.random, self.label = fn, bool(random), label or getattr(fn, "__qualname__", repr(fn))

    def __call__(self, img):
        if self.random:
            rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,)).item()))
            out = self.fn(img, rng)
        else:
            out = self.fn(img)
        return out if isinstance(out, Image.Image) else Image.fromarray(np.asarray(out))

    def __repr__(self) -> str:
        return f"PilCallable({self.label})"


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


class ToUint8HWC:
    """Pipelines without normalize deliver uint8 HWC: ``torch.from_numpy(np.array(img))``."""

    def __call__(self, img: Image.Image):
        return torch.from_numpy(np.array(img, np.uint8, copy=True))

    def __repr__(self) -> str:
        return "ToUint8HWC()"


def _filter_name(resample) -> str:
    return Image.Resampling(resample).name.lower()
