"""Compile a torchvision transform (a v1 or v2 ``Compose``, or a single transform) into ops.

The transforms are taken in order. Each one feedgpu recognises (its exact class, not a subclass,
whose methods may differ) and can run on the kind of value before it becomes an op
(:mod:`feedgpu.torchvision.ops`); the first one it cannot compile and every transform after it
form the *tail*, run as the user's own objects in feedgpu's workers on what the compiled prefix
produced. Every transform gets a row saying where it runs and, when it is not compiled, why.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import ops

__all__ = ["Compiled", "Row", "compile_transform", "flatten"]

# a compiled op is not a pipeline stage (``feedgpu stages``): it runs torchvision's kernel with
# feedgpu's per-sample draws; Pipeline.from_torchvision maps the ops to stages where it can
FEEDGPU, PYTHON = "compiled op (feedgpu)", "python (your object, in the workers)"


@dataclass(frozen=True)
class Row:
    """One transform: ``transform`` (its repr), ``where`` it runs, the compiled op's name in
    ``stage`` (or ``"-"``; an op, not a pipeline stage) and ``why`` it is not compiled (``""``
    when it is)."""

    transform: str
    where: str
    stage: str
    why: str = ""


@dataclass
class Compiled:
    """``ops``: the compiled prefix; ``tail``: the user's transforms after it, in order;
    ``rows``: one :class:`Row` per transform (nested ``Compose`` flattened); ``kind``: what the
    prefix gives (``"pil"``, ``"uint8"``, ``"float"``)."""

    ops: list = field(default_factory=list)
    tail: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    kind: str = "pil"


def flatten(transform) -> list:
    """The transforms of ``transform`` in order: a v1/v2 ``Compose`` (nested ones too) as its
    list, ``None`` as none, anything else as itself."""
    if transform is None:
        return []
    from torchvision.transforms import Compose
    from torchvision.transforms.v2 import Compose as Compose2

    if type(transform) in (Compose, Compose2):
        out = []
        for t in transform.transforms:
            out.extend(flatten(t))
        return out
    return [transform]


def _table() -> dict:
    """Recognised classes -> a function making the op (or raising ``_NotHere`` with a reason)."""
    import torchvision.transforms as T
    import torchvision.transforms.v2 as T2

    table = {}
    for mod in (T, T2):
        table[mod.RandomResizedCrop] = ops.RandomResizedCropOp
        table[mod.Resize] = ops.ResizeOp
        table[mod.CenterCrop] = ops.CenterCropOp
        table[mod.RandomCrop] = ops.RandomCropOp
        table[mod.RandomHorizontalFlip] = lambda t: ops.FlipOp(t, vertical=False)
        table[mod.RandomVerticalFlip] = lambda t: ops.FlipOp(t, vertical=True)
        table[mod.Normalize] = ops.NormalizeOp
        table[mod.ConvertImageDtype] = ops.ConvertDtypeOp
        table[mod.PILToTensor] = lambda t: ops.ToTensorOp(t, "uint8")
    table[T.ToTensor] = lambda t: ops.ToTensorOp(t, "float")
    table[T2.ToImage] = lambda t: ops.ToTensorOp(t, "uint8")
    table[T2.ToDtype] = ops.ToDtypeOp
    table[T2.ToPureTensor] = ops.PureTensorOp
    return table


def _why_not(t, kind: str, table: dict) -> tuple[object | None, str]:
    """``(op, "")`` when ``t`` compiles on a value of ``kind``, else ``(None, reason)``."""
    cls = type(t)
    if cls not in table:
        base = next((c for c in table if isinstance(t, c)), None)
        if base is not None:
            return None, f"a subclass of {base.__module__}.{base.__name__}: its methods may differ"
        return None, f"feedgpu has no compiled op for {cls.__name__}"
    if cls.__name__ == "ToDtype" and not hasattr(t.dtype, "is_floating_point"):
        return None, "ToDtype with a dtype per input type: only one torch.dtype compiles"
    op = table[cls](t)
    if kind not in op.takes:
        return None, f"on a {kind} input ({cls.__name__} compiles on {', '.join(op.takes)})"
    return op, ""


def compile_transform(transform) -> Compiled:
    """Compile ``transform`` (see the module docstring). Never raises for an unknown transform:
    it goes to the tail with its reason."""
    table = _table()
    out = Compiled()
    first_python = None
    for t in flatten(transform):
        text = ops.describe(t)
        if first_python is None:
            op, why = _why_not(t, out.kind, table)
            if op is not None:
                out.ops.append(op)
                out.kind = op.out_kind(out.kind)
                out.rows.append(Row(text, FEEDGPU, op.name))
                continue
            first_python = type(t).__name__
            out.rows.append(Row(text, PYTHON, "-", why))
        else:
            out.rows.append(Row(text, PYTHON, "-", f"after {first_python}, which runs as Python: the rest does too"))
        out.tail.append(t)
    return out
