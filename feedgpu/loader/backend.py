"""The one protocol behind :class:`feedgpu.DataLoader`, and the choice of a backend per kind of dataset.

The loader picks its backend once, when it is made (:func:`pick_backend`), and delegates to it:

=====================================  =================================================
dataset                                backend
=====================================  =================================================
a feedgpu :class:`~feedgpu.Pipeline`    :class:`~feedgpu.loader.kinds.PipelineBackend`
a torchvision dataset it compiles      :class:`~feedgpu.loader.kinds.TorchvisionDatasetBackend`
any other map-style torch Dataset      :class:`~feedgpu.loader.kinds.DatasetBackend`
an ``IterableDataset``                 :class:`~feedgpu.loader.iterable.IterableBackend`
=====================================  =================================================
"""
from __future__ import annotations

from typing import Iterator, Protocol

import torch.utils.data as tud

from ..pipeline import Pipeline
from ..torchvision import backend_for
from .iterable import IterableBackend
from .kinds import DatasetBackend, PipelineBackend, TorchvisionDatasetBackend
from .options import LoaderOptions

__all__ = ["Backend", "pick_backend"]


class Backend(Protocol):
    """What the DataLoader delegates to (its methods have the loader's meaning)."""

    num_workers: int

    def __iter__(self) -> Iterator: ...

    def __len__(self) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def set_epoch(self, epoch: int) -> None: ...

    def shutdown(self) -> None: ...

    def worker_pids(self) -> list[int]: ...

    def stats(self) -> dict: ...

    def explain(self) -> str: ...

    def torch_attributes(self, given: dict) -> dict: ...


def pick_backend(dataset, given: dict) -> Backend:
    """The backend of a loader over ``dataset`` made with the keyword arguments ``given``. Raises
    :class:`~feedgpu.errors.ConfigError` for the arguments it refuses (see
    :meth:`LoaderOptions.resolve <feedgpu.loader.options.LoaderOptions.resolve>`)."""
    if isinstance(dataset, tud.IterableDataset):  # run as torch runs it (feedgpu.exec.iterable)
        return IterableBackend(dataset, given)
    pipeline = isinstance(dataset, Pipeline)
    compiled, why = (None, "a Pipeline") if pipeline else backend_for(dataset, given["compile"])
    own_order = given["sampler"] is None and given["batch_sampler"] is None
    options = LoaderOptions.resolve(dataset, given, own_order)
    if pipeline:
        return PipelineBackend(dataset, options, given)
    if compiled is not None:
        return TorchvisionDatasetBackend(dataset, options, given, compiled, given["compile"])
    return DatasetBackend(dataset, options, given, why)
