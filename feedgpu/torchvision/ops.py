"""The torchvision transforms feedgpu compiles, as ops with torchvision's parameters and meaning.

Each op holds the user's transform object and runs its work with torchvision's own kernels
(``torchvision.transforms.functional`` for v1 transforms, ``torchvision.transforms.v2.functional``
for v2 ones: Pillow(-SIMD) on PIL images, torch on tensors), so a deterministic op gives the
pixels torchvision gives. What feedgpu changes is where the random parameters come from: a random
op draws them from :class:`~feedgpu.stages.draws.Draws` keyed by ``(seed, epoch, sample index,
op)``, with torchvision's distributions (crop area, aspect ratio, the 10-attempt fallback, flip
rate), so a sample's crop and flip do not depend on the worker count, the worker that runs it or
torch's global RNG, and a resumed epoch draws what it would have drawn.

Each op declares the kind of value it takes and gives: ``"pil"`` (a PIL image), ``"uint8"`` (a
uint8 CHW tensor) or ``"float"`` (a floating-point CHW tensor); :mod:`feedgpu.torchvision.compile`
chains them.
"""
from __future__ import annotations

from typing import Any, ClassVar

from ..stages.geometry import RRC_DRAWS, random_resized_crop_params

__all__ = ["CenterCropOp", "ConvertDtypeOp", "FlipOp", "NormalizeOp", "Op", "PureTensorOp", "RandomCropOp", "RandomResizedCropOp",
           "ResizeOp", "ToDtypeOp", "ToTensorOp", "describe", "fill_for", "functional"]


def fill_for(fill, kind: type):
    """A v2 transform's ``fill`` for an input of type ``kind``, as torchvision resolves it: a
    mapping gives the value for ``kind`` (else its ``"others"`` entry); a number or None is used
    as is; a sequence becomes a list of floats."""
    if isinstance(fill, dict):
        fill = fill[kind] if kind in fill else fill.get("others")
    if fill is None or isinstance(fill, (int, float)):
        return fill
    return [float(v) for v in fill]


def functional(transform) -> Any:
    """torchvision's functional module of ``transform``'s API: v2's for ``transforms.v2`` classes,
    v1's otherwise."""
    if type(transform).__module__.startswith("torchvision.transforms.v2"):
        import torchvision.transforms.v2.functional as F
    else:
        import torchvision.transforms.functional as F
    return F


class Op:
    """One compiled transform. ``t``: the user's transform object (its parameters are read from
    it); ``name``: the feedgpu stage it compiles to (also the key of its random draws);
    ``draws``: uniform draws it takes per sample (0: deterministic); ``takes``/``gives``: the
    kinds of value (module docstring)."""

    name: ClassVar[str] = "op"
    draws: ClassVar[int] = 0
    takes: ClassVar[tuple[str, ...]] = ("pil",)
    gives: ClassVar[str | None] = None   # None: the kind it takes

    def __init__(self, t):
        self.t = t

    @property
    def F(self):   # noqa: N802 - torchvision's own name for its functional module
        """torchvision's functional module for :attr:`t` (looked up, not stored: ops pickle
        for workers started with spawn)."""
        return functional(self.t)

    @property
    def deterministic(self) -> bool:
        return self.draws == 0

    def out_kind(self, kind: str) -> str:
        return self.gives or kind

    def apply(self, x, u):
        """``x`` of a kind in :attr:`takes`; ``u``: the sample's draws (None when deterministic)."""
        raise NotImplementedError  # pragma: no cover - abstract


def _hw(img) -> tuple[int, int]:
    """(height, width) of a PIL image or a CHW tensor."""
    if hasattr(img, "size") and not callable(img.size):
        w, h = img.size
        return h, w
    return int(img.shape[-2]), int(img.shape[-1])


class RandomResizedCropOp(Op):
    """``RandomResizedCrop(size, scale, ratio, interpolation, antialias)`` on a PIL image: the
    window from :func:`~feedgpu.stages.geometry.random_resized_crop_params` (torchvision's
    ``get_params``: 10 attempts, then the centre crop clamped to ``ratio``), cropped and resized
    by torchvision's ``resized_crop``."""

    name = "random_resized_crop"
    draws = RRC_DRAWS
    takes = ("pil", "uint8", "float")

    def apply(self, img, u):
        h_in, w_in = _hw(img)
        return self.crop(img, self.window(w_in, h_in, u))

    def window(self, width: int, height: int, u) -> tuple[int, int, int, int]:
        """The window ``(top, left, h, w)`` drawn for an input of ``width`` x ``height`` pixels."""
        return random_resized_crop_params(width, height, self.t.scale, self.t.ratio, u)

    def crop(self, img, window: tuple[int, int, int, int]):
        """``window`` of ``img`` resized to the output size: torchvision's ``resized_crop``, which
        reads no pixel below the window's last row (``img`` may lack the rows under it)."""
        top, left, h, w = window
        return self.F.resized_crop(img, top, left, h, w, list(self.t.size), self.t.interpolation,
                                   antialias=self.t.antialias)


class ResizeOp(Op):
    """``Resize(size, interpolation, max_size, antialias)`` on a PIL image (torchvision's
    ``resize``: an int resizes the short side, the long one ``int(size * long / short)``)."""

    name = "resize"
    takes = ("pil", "uint8", "float")

    def apply(self, img, u=None):
        t = self.t
        return self.F.resize(img, t.size, t.interpolation, t.max_size, t.antialias)


class CenterCropOp(Op):
    """``CenterCrop(size)`` (padded with zeros where the crop is larger than the image, as
    torchvision does)."""

    name = "center_crop"
    takes = ("pil", "uint8", "float")

    def apply(self, img, u=None):
        return self.F.center_crop(img, list(self.t.size))


class RandomCropOp(Op):
    """``RandomCrop(size, padding, pad_if_needed, fill, padding_mode)``: torchvision's padding
    (v1 pads ``padding`` then, with ``pad_if_needed``, the right/bottom shortfall; v2 pads the
    shortfall on both sides) and a window placed uniformly from two draws. Raises
    ``ValueError`` as torchvision does when the image is smaller than the crop."""

    name = "random_crop"
    draws = 2
    takes = ("pil", "uint8", "float")

    def apply(self, img, u):
        if self.F.__name__.startswith("torchvision.transforms.v2"):
            return self._v2(img, u)
        t, F = self.t, self.F
        th, tw = t.size
        if t.padding is not None:
            img = F.pad(img, t.padding, t.fill, t.padding_mode)
        h, w = _hw(img)
        if t.pad_if_needed and w < tw:
            img = F.pad(img, [tw - w, 0], t.fill, t.padding_mode)
        if t.pad_if_needed and h < th:
            img = F.pad(img, [0, th - h], t.fill, t.padding_mode)
        h, w = _hw(img)
        if h < th or w < tw:
            raise ValueError(f"Required crop size {(th, tw)} is larger than input image size {(h, w)}")
        if w == tw and h == th:
            return img
        top, left = int(u[0] * (h - th + 1)), int(u[1] * (w - tw + 1))
        return F.crop(img, top, left, th, tw)

    def _v2(self, img, u):
        t, F = self.t, self.F
        ph, pw = _hw(img)
        left = right = top = bottom = 0
        if t.padding is not None:
            left, right, top, bottom = t.padding
            ph, pw = ph + top + bottom, pw + left + right
        ch, cw = t.size
        if t.pad_if_needed and ph < ch:
            d = ch - ph
            top, bottom, ph = top + d, bottom + d, ph + 2 * d
        if t.pad_if_needed and pw < cw:
            d = cw - pw
            left, right, pw = left + d, right + d, pw + 2 * d
        if ph < ch or pw < cw:
            raise ValueError(f"Required crop size {(ch, cw)} is larger than input image size {(ph, pw)}")
        if any((left, top, right, bottom)):
            img = F.pad(img, padding=[left, top, right, bottom], fill=fill_for(t.fill, type(img)),
                        padding_mode=t.padding_mode)
        y = int(u[0] * (ph - ch + 1)) if ph > ch else 0
        x = int(u[1] * (pw - cw + 1)) if pw > cw else 0
        return F.crop(img, y, x, ch, cw) if (ph > ch or pw > cw) else img


class FlipOp(Op):
    """``RandomHorizontalFlip(p)`` / ``RandomVerticalFlip(p)``: flipped when the draw is below
    ``p`` (torchvision: ``torch.rand(1) < p``); on PIL images and tensors."""

    draws = 1
    takes = ("pil", "uint8", "float")

    def __init__(self, t, vertical: bool):
        super().__init__(t)
        self.vertical = vertical
        self.name = "vertical_flip" if vertical else "horizontal_flip"   # type: ignore[misc]

    def apply(self, img, u):
        if u[0] < self.t.p:
            return self.F.vflip(img) if self.vertical else self.F.hflip(img)
        return img


class ToTensorOp(Op):
    """``ToTensor`` (float, scaled to [0, 1]), ``PILToTensor`` and v2 ``ToImage`` (uint8 CHW)
    on the PIL RGB image the default loader gives."""

    name = "to_tensor"

    def __init__(self, t, kind: str):
        super().__init__(t)
        self.kind = kind
        self.gives = kind   # type: ignore[misc]

    def apply(self, img, u=None):
        F, kind = self.F, type(self.t).__name__
        if kind == "ToTensor":
            return F.to_tensor(img)
        if kind == "ToImage":
            return F.to_image(img)
        return F.pil_to_tensor(img)


class ToDtypeOp(Op):
    """v2 ``ToDtype(dtype, scale)`` with one ``torch.dtype`` (not a per-type dict) on a tensor."""

    name = "to_dtype"
    takes = ("uint8", "float")

    def out_kind(self, kind: str) -> str:
        return "float" if self.t.dtype.is_floating_point else ("uint8" if str(self.t.dtype) == "torch.uint8" else "other")

    def apply(self, x, u=None):
        return self.F.to_dtype(x, self.t.dtype, scale=self.t.scale)


class ConvertDtypeOp(ToDtypeOp):
    """``ConvertImageDtype(dtype)`` (v1 and v2) on a tensor: scaled to the dtype's range."""

    name = "convert_image_dtype"

    def apply(self, x, u=None):
        if self.F.__name__.startswith("torchvision.transforms.v2"):
            return self.F.to_dtype(x, self.t.dtype, scale=True)
        return self.F.convert_image_dtype(x, self.t.dtype)


class PureTensorOp(Op):
    """v2 ``ToPureTensor``: a plain ``torch.Tensor`` of the same data (no copy)."""

    name = "to_pure_tensor"
    takes = ("uint8", "float")

    def apply(self, x, u=None):
        import torch

        return x.as_subclass(torch.Tensor)


class NormalizeOp(Op):
    """``Normalize(mean, std, inplace)`` on a float tensor."""

    name = "normalize"
    takes = ("float",)

    def apply(self, x, u=None):
        return self.F.normalize(x, self.t.mean, self.t.std, self.t.inplace)


def describe(t) -> str:
    """A transform's repr on one line: its class and all its parameters (only a repr longer than
    400 characters, a custom object's, is cut)."""
    text = " ".join(repr(t).split())
    return text if len(text) <= 400 else text[:397] + "..."
