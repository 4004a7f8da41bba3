"""The conversion at the end of a compiled recipe, fused: ``ToTensor`` (or ``PILToTensor`` /
``ToImage``) and the per-pixel ops after it (``ToDtype``, ``ConvertImageDtype``, ``Normalize``,
``ToPureTensor``) as one table lookup per channel (in the main process written straight into
the batch; in a worker into the tensor default_collate stacks into shared memory).

Each of those ops maps a channel's uint8 value to one output value, whatever the other pixels,
so the table is made by running the user's own transforms (torchvision's kernels) on a probe
image holding every value 0-255 in every channel: the lookup gives the values torchvision
computes, to the bit, in one pass over the pixels instead of one pass (and one tensor) per op.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from ..exec.pixels import rgb_array
from .ops import ConvertDtypeOp, NormalizeOp, PureTensorOp, ToDtypeOp, ToTensorOp

__all__ = ["FusedConvert", "fuse"]

_POINTWISE = (ToDtypeOp, ConvertDtypeOp, NormalizeOp, PureTensorOp)


class FusedConvert:
    """``ops`` (a :class:`ToTensorOp` then per-pixel ops) as per-channel tables ``lut`` (3, 256)
    of the output ``dtype`` (a torch dtype). Input: a PIL RGB image (what the ops before it
    give); output: a plain ``torch.Tensor`` (3, H, W), or rows written by :meth:`write`."""

    name = "to_tensor"
    draws = 0
    deterministic = True
    takes = ("pil",)

    def __init__(self, ops: list):
        import torch

        self.ops = list(ops)
        probe = Image.frombytes("RGB", (256, 1), np.repeat(np.arange(256, dtype=np.uint8), 3).tobytes())
        x = probe
        for op in self.ops:
            x = op.apply(x, None)
        if type(x) is not torch.Tensor or tuple(x.shape) != (3, 1, 256):
            raise ValueError(f"the fused ops give {type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
        self.dtype = x.dtype
        self.lut = x[:, 0, :].contiguous().numpy()

    def out_kind(self, kind: str) -> str:
        return "float" if self.dtype.is_floating_point else "uint8"

    def write(self, img: Image.Image, out: np.ndarray) -> None:
        """Write ``img``'s (H, W) pixels into ``out`` (3, H, W) of the table's dtype."""
        a = rgb_array(img)
        for c in range(3):
            np.take(self.lut[c], a[:, :, c], out=out[c])

    def apply(self, img: Image.Image, u=None):
        import torch

        out = torch.empty((3, img.height, img.width), dtype=self.dtype)
        self.write(img, out.numpy())
        return out


def fuse(ops: list) -> list:
    """``ops`` with a trailing run ``ToTensorOp`` + per-pixel ops replaced by a
    :class:`FusedConvert` (when the run ends the list and gives a plain tensor); else as given."""
    start = next((k for k, op in enumerate(ops) if isinstance(op, ToTensorOp)), None)
    if start is None or not all(isinstance(op, _POINTWISE) for op in ops[start + 1:]):
        return list(ops)
    try:
        return list(ops[:start]) + [FusedConvert(ops[start:])]
    except ValueError:   # a tv_tensors.Image at the end (no ToPureTensor): left as torchvision's ops
        return list(ops)
