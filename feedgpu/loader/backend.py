"""The one protocol behind :class:`feedgpu.DataLoader`, and the backend of each kind of dataset.

The loader picks its backend once, when it is made (:func:`feedgpu.loader.front.pick_backend`),
and delegates to it:

========================================  =========================================================
dataset                                   backend
========================================  =========================================================
a feedgpu :class:`~feedgpu.Pipeline`       :class:`~feedgpu.loader.kinds.PipelineBackend`
a torchvision dataset, ``engine="dali"``  :class:`~feedgpu.loader.kinds.TorchvisionDaliBackend`
a torchvision dataset it compiles         :class:`~feedgpu.loader.kinds.TorchvisionDatasetBackend`
any other map-style torch Dataset         :class:`~feedgpu.loader.kinds.DatasetBackend`
an ``IterableDataset``                    :class:`~feedgpu.loader.iterable.IterableBackend`
========================================  =========================================================
"""
from __future__ import annotations

from typing import Any, Iterator, Protocol

__all__ = ["Backend"]


class Backend(Protocol):
    """What the DataLoader delegates to (its methods have the loader's meaning)."""

    #: what the loader shows as its ``dataset``
    dataset: Any
    num_workers: int
    #: the skip budget in force (a pipeline's, or the one given); None: no limit, or no budget
    max_skipped: Any

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

