"""A recognised torchvision dataset as a feedgpu pipeline definition (the YAML a user goes on
from): :func:`pipeline_config` and :func:`pipeline_yaml`; ``Pipeline.from_torchvision`` builds
the pipeline from it.

What a pipeline cannot say is left out and listed (``left_out``; a ``UserWarning`` from
:func:`pipeline_yaml` and ``from_torchvision``), never changed silently: a
``Subset``'s indices (the pipeline reads the whole folder), ``target_transform``, transforms with
no feedgpu stage (``CenterCrop`` or ``RandomCrop`` alone, ``Resize`` to a pair or with
``max_size``, every transform of the tail) and where feedgpu's stages differ from torchvision's
on the same parameters: ``resize_center_crop`` resamples the kept box of the source image in one
pass (pixels within a level or two of resize-then-crop), decode composites transparent pixels
onto the ImageNet mean where PIL's ``convert("RGB")`` drops alpha, and uint8 output is NHWC.
"""
from __future__ import annotations

import warnings
from typing import Any

import yaml

from .backend import TorchvisionBackend, backend_for
from .compile import FEEDGPU
from .ops import CenterCropOp, FlipOp, NormalizeOp, PureTensorOp, RandomResizedCropOp, ResizeOp, ToDtypeOp, ToTensorOp

__all__ = ["pipeline_config", "pipeline_yaml"]


def _interp(mode) -> str:
    return str(getattr(mode, "value", mode))


def _size2(size) -> Any:
    size = list(size) if not isinstance(size, int) else [size, size]
    return size[0] if len(size) == 1 or size[0] == size[1] else size


def _stages(backend: TorchvisionBackend, left_out: list[str]) -> tuple[list[dict], str]:
    ops = backend.compiled.ops
    stages: list[dict] = [{"op": "decode", "exif_orientation": False}]
    dtype, scaled, norm = "uint8", False, None
    i = 0
    while i < len(ops):
        op, t = ops[i], ops[i].t
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if isinstance(op, RandomResizedCropOp):
            stages.append({"op": "random_resized_crop", "size": _size2(t.size), "scale": list(t.scale),
                           "ratio": list(t.ratio), "interpolation": _interp(t.interpolation)})
        elif isinstance(op, ResizeOp) and isinstance(nxt, CenterCropOp) and isinstance(t.size, (int, list, tuple)) \
                and len([t.size] if isinstance(t.size, int) else t.size) == 1 and t.max_size is None:
            stages.append({"op": "resize_center_crop", "resize": t.size if isinstance(t.size, int) else t.size[0],
                           "crop": _size2(nxt.t.size), "interpolation": _interp(t.interpolation)})
            left_out.append(f"{type(t).__name__} + CenterCrop: resize_center_crop resamples the kept box in one pass "
                            "(pixels within a level or two of torchvision's)")
            i += 1
        elif isinstance(op, FlipOp):
            stages.append({"op": op.name, "p": float(t.p)})
        elif isinstance(op, ToTensorOp):
            dtype, scaled = ("float32", True) if op.kind == "float" else ("uint8", False)
        elif isinstance(op, ToDtypeOp) and dtype == "uint8" and t.dtype.is_floating_point \
                and (getattr(t, "scale", True) or op.name == "convert_image_dtype"):
            dtype, scaled = "float32", True
        elif isinstance(op, NormalizeOp) and scaled and norm is None:
            norm = {"op": "normalize", "mean": [float(m) for m in t.mean], "std": [float(s) for s in t.std]}
        elif isinstance(op, PureTensorOp):
            pass
        else:
            left_out.append(f"{type(t).__name__}: no feedgpu stage for it here")
        i += 1
    if dtype == "float32" and norm is None:
        norm = {"op": "normalize", "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}   # ToTensor's x / 255
    if norm is not None:
        stages.append(norm)
    if dtype == "uint8":
        left_out.append("uint8 output: feedgpu's uint8 batches are NHWC (torchvision's tensors are CHW)")
    return stages, dtype


def pipeline_config(dataset) -> tuple[dict, list[str]]:
    """``(definition, left_out)``: the pipeline definition (the mapping a YAML file holds) of a
    dataset the torchvision backend takes, and what it does not express. Raises ``ValueError``
    for a dataset the backend does not take (with the reason)."""
    backend, why = backend_for(dataset)
    if backend is None:
        raise ValueError(f"not a dataset feedgpu compiles: {why}")
    left_out: list[str] = []
    found = backend.found
    if found.chain:
        left_out.append("Subset: the pipeline reads the whole folder (its indices have no YAML form)")
    if found.base.target_transform is not None:
        left_out.append(f"target_transform {found.base.target_transform!r}")
    left_out += [f"{r.transform.split('(')[0]}: runs as Python ({r.why})" for r in backend.compiled.rows
                 if r.where != FEEDGPU]
    stages, dtype = _stages(backend, left_out)
    data = {"version": 1, "name": f"{type(found.base).__name__.lower()}",
            "source": {"format": "folder", "path": str(found.base.root)},
            "stages": stages,
            "output": {"dtype": dtype, "layout": "NCHW"} if dtype != "uint8" else {"dtype": "uint8", "layout": "NHWC"}}
    return data, left_out


def pipeline_yaml(dataset) -> str:
    """:func:`pipeline_config` as YAML text, with what it leaves out as comments at the top and
    in a ``UserWarning`` (as ``Pipeline.from_torchvision`` warns). Raises ``ValueError`` for a
    dataset the backend does not take."""
    data, left_out = pipeline_config(dataset)
    if left_out:
        warnings.warn("feedgpu.torchvision.pipeline_yaml left out: " + "; ".join(left_out), UserWarning, stacklevel=2)
    head = "# written by feedgpu from a torchvision dataset\n"
    if left_out:
        head += "# left out or changed here (feedgpu.DataLoader on the dataset itself runs them as torchvision does):\n"
        head += "".join(f"#   - {x}\n" for x in left_out)
    return head + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=110)
