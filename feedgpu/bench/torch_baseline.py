"""The torch baseline: what a user writes today with ``torch.utils.data`` and Pillow.

:func:`torch_loader` builds a stock ``torch.utils.data.DataLoader`` over a map-style Dataset that
reads the same records as a feedgpu pipeline's source (folder, tar shards, parquet) and applies
the torchvision transforms equivalent to the pipeline's stages, which each stage declares
(:meth:`~feedgpu.stages.base.Stage.torch_baseline`, with the transforms of
:mod:`feedgpu.torch_ref`, plain Pillow and torch: torchvision is not a dependency). Each follows
torchvision's code path for PIL images, so it costs what torchvision costs; the built-in stages:

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

from typing import Any, Callable, Sequence

import torch
import torch.utils.data as tud

from ..errors import ConfigError
from ..pipeline import Pipeline
from ..stages.base import BatchStage
from ..torch_ref import CenterCrop, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize, ToTensor, ToUint8HWC

__all__ = ["Compose", "TorchBaselineDataset", "build_transforms", "torch_loader"]


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


def build_transforms(pipeline: Pipeline) -> Compose:
    """The torchvision-style transform list equivalent to ``pipeline``'s stages, from the
    encoded bytes to the sample tensor: each stage's own
    :meth:`~feedgpu.stages.base.Stage.torch_baseline`. Raises :class:`ConfigError` for a stage
    that declares none (a third-party stage may not)."""
    out: list[Callable] = []
    for i, st in enumerate(pipeline.stages):
        try:
            out += list(st.torch_baseline())
        except NotImplementedError:
            raise ConfigError(f"stages[{i}] ({st.name}): the torch baseline has no equivalent of this stage "
                              "(it defines no torch_baseline()); run without the baseline (--no-baseline)") from None
    if not isinstance(pipeline.stages[-1], BatchStage):
        out.append(ToUint8HWC())
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
