"""Normalize: uint8 HWC images -> float ``(x / 255 - mean) / std`` in the batch's dtype and layout."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from ..spec import ImageSpec
from .base import BatchStage
from .params import PositiveFloat

#: ImageNet statistics (torchvision's reference scripts, on the 0-1 scale).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
FLOAT_DTYPES = ("float32", "float16")
LAYOUTS = ("NCHW", "NHWC")


class Normalize(BatchStage):
    """``y = (x / 255 - mean) / std`` per channel.

    Args:
        mean, std: per-channel statistics on the 0-1 scale (default ImageNet's).
        dtype: ``"float32"`` (default) or ``"float16"``.
        layout: ``"NCHW"`` (default) or ``"NHWC"`` for the batch.

    The CPU path computes in float32 and stores in ``dtype``; :meth:`apply_batch` does the
    same with torch ops on whatever device its input lives on.
    """

    name = "normalize"
    #: in YAML, the batch's dtype and layout are the output section's
    from_output = ("dtype", "layout")

    def __init__(self, mean: tuple[float, float, float] = IMAGENET_MEAN,
                 std: tuple[PositiveFloat, PositiveFloat, PositiveFloat] = IMAGENET_STD,
                 dtype: str = "float32", layout: str = "NCHW"):
        if len(mean) != 3 or len(std) != 3:
            raise ConfigError(f"{self.name}: mean and std need 3 values, got {list(mean)}, {list(std)}")
        if any(s <= 0 for s in std):
            raise ConfigError(f"{self.name}: std must be > 0, got {list(std)}")
        if dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{self.name}: dtype {dtype!r} is not one of {list(FLOAT_DTYPES)}")
        if layout not in LAYOUTS:
            raise ConfigError(f"{self.name}: layout {layout!r} is not one of {list(LAYOUTS)}")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.dtype, self.layout = dtype, layout
        self._scale = np.array([1.0 / (255.0 * s) for s in self.std], np.float32)
        self._shift = np.array([-m / s for m, s in zip(self.mean, self.std)], np.float32)
        self._tmp: np.ndarray | None = None
        self._tiled: tuple[np.ndarray, np.ndarray] | None = None

    def config(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "std": list(self.std), "dtype": self.dtype, "layout": self.layout}

    def torch_baseline(self) -> list:
        """``ToTensor()`` then ``Normalize(mean, std)``, then this stage's dtype and layout."""
        from ..torch_ref import Normalize as TorchNormalize, ToTensor

        return [ToTensor(), TorchNormalize(self.mean, self.std, self.dtype, self.layout)]

    def out_spec(self, spec: ImageSpec) -> ImageSpec:
        return spec.with_(dtype=self.dtype, layout="CHW" if self.layout == "NCHW" else "HWC")

    def write(self, dst: np.ndarray, img: np.ndarray) -> None:
        """``img``: HWC uint8; ``dst``: one row of the batch, CHW or HWC, float32/float16.

        Computed in float32 with numpy (NHWC as a 2-D ``(H, W*3)`` product against a tiled
        scale, avoiding a slow length-3 broadcast), then cast to float16 with torch's copy
        (numpy's float32->float16 cast is many times slower).
        """
        if dst.dtype == np.float32:
            self._float32(dst, img)
            return
        if self._tmp is None or self._tmp.shape != dst.shape:
            self._tmp = np.empty(dst.shape, np.float32)
        self._float32(self._tmp, img)
        import torch

        torch.from_numpy(dst).copy_(torch.from_numpy(self._tmp))

    def _float32(self, out: np.ndarray, img: np.ndarray) -> None:
        if self.layout == "NCHW":
            np.multiply(img.transpose(2, 0, 1), self._scale[:, None, None], out=out)
            out += self._shift[:, None, None]
            return
        h, w, c = img.shape
        if self._tiled is None or self._tiled[0].shape[0] != w * c:
            self._tiled = (np.tile(self._scale, w), np.tile(self._shift, w))
        flat = out.reshape(h, w * c)
        np.multiply(img.reshape(h, w * c), self._tiled[0], out=flat)
        flat += self._tiled[1]

    has_dali = True

    def dali(self, x, args, device):
        """``crop_mirror_normalize`` with mean/std on the 0-255 scale, to dtype and layout.
        ``args["mirror"]`` (optional, per sample 0/1) also flips left-right in the same pass: the
        DALI engine folds a ``horizontal_flip`` that comes right before normalize into it."""
        from nvidia.dali import fn, types

        kw = {"mirror": args["mirror"]} if "mirror" in args else {}
        return fn.crop_mirror_normalize(
            x, dtype=types.FLOAT if self.dtype == "float32" else types.FLOAT16,
            output_layout="CHW" if self.layout == "NCHW" else "HWC",
            mean=[m * 255.0 for m in self.mean], std=[s * 255.0 for s in self.std], device=device, **kw)

    def apply_batch(self, x):
        """``x``: uint8 NHWC torch tensor on any device -> normalized tensor in dtype/layout."""
        import torch

        dt = torch.float32 if self.dtype == "float32" else torch.float16
        scale = torch.as_tensor(self._scale, device=x.device)
        shift = torch.as_tensor(self._shift, device=x.device)
        y = torch.addcmul(shift, x.to(torch.float32), scale)  # broadcasts over C (last dim)
        if self.layout == "NCHW":
            y = y.permute(0, 3, 1, 2).contiguous(memory_format=torch.contiguous_format)
        return y.to(dt)
