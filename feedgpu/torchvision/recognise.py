"""Which datasets the torchvision backend takes: ``ImageFolder`` or ``DatasetFolder`` reading
with torchvision's default loader (PIL), directly or inside ``torch.utils.data.Subset`` (nested
too). Nothing here imports torchvision: a dataset can only be one of its classes when the user
imported it already."""
from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["Found", "dataset_key", "recognise", "same_key"]


@dataclass(frozen=True)
class Found:
    """A recognised dataset: ``base`` the ``DatasetFolder``; ``chain`` the ``indices`` of each
    ``Subset`` around it, outermost first (a loader index ``i`` is ``base`` index
    ``chain[-1][...chain[0][i]]``); ``outer`` the dataset the loader was given."""

    base: object
    chain: tuple
    outer: object

    def base_index(self, i):
        for indices in self.chain:
            i = indices[i]
        return int(i)

    def describe(self) -> str:
        base = self.base
        what = f"{type(base).__name__}({getattr(base, 'root', '?')!s}, {len(base.samples)} files)"
        for _ in self.chain:
            what = f"Subset of {what}"
        return what


def recognise(dataset) -> tuple[Found | None, str]:
    """``(Found, "")`` for a dataset the backend takes, else ``(None, why not)``."""
    if "torchvision" not in sys.modules:
        return None, "not a torchvision dataset (torchvision is not imported)"
    from torch.utils.data import Subset
    from torchvision import get_image_backend
    from torchvision.datasets import DatasetFolder
    from torchvision.datasets.folder import default_loader, pil_loader

    chain = []
    d = dataset
    while isinstance(d, Subset):
        if type(d).__getitem__ is not Subset.__getitem__ or type(d).__getitems__ is not Subset.__getitems__:
            return None, f"{type(d).__name__} overrides Subset's __getitem__"
        chain.append(d.indices)
        d = d.dataset
    if not isinstance(d, DatasetFolder):
        return None, f"{type(d).__name__} is not an ImageFolder or DatasetFolder"
    if type(d).__getitem__ is not DatasetFolder.__getitem__ or hasattr(type(d), "__getitems__"):
        return None, f"{type(d).__name__} overrides DatasetFolder's __getitem__"
    if d.loader not in (default_loader, pil_loader):
        return None, f"{type(d).__name__} reads with its own loader ({getattr(d.loader, '__qualname__', d.loader)!r})"
    if get_image_backend() != "PIL":
        return None, f"torchvision's image backend is {get_image_backend()!r}, not PIL"
    return Found(d, tuple(chain), dataset), ""


def dataset_key(dataset) -> tuple:
    """What a compiled dataset depends on, to tell when it changed: the objects (each
    ``Subset`` and its ``indices``, the base dataset, its ``transform``, ``target_transform`` and
    ``loader``), compared by identity, and the transform's repr (a parameter set in place, an op
    added to a ``Compose``'s list). A list of indices changed in place needs no new key: it is
    read at each sample."""
    from torch.utils.data import Subset

    objs = []
    d = dataset
    while isinstance(d, Subset):
        objs += [d, d.indices]
        d = d.dataset
    tf = getattr(d, "transform", None)
    objs += [d, tf, getattr(d, "target_transform", None), getattr(d, "loader", None)]
    try:
        text = repr(tf)
    except Exception:   # a transform whose repr fails: identities only
        text = None
    return tuple(objs), text


def same_key(a: tuple, b: tuple) -> bool:
    """Whether two :func:`dataset_key` results name the same objects and transform."""
    return len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0])) and a[1] == b[1]
