"""The loader: :class:`feedgpu.DataLoader` and the main-process machinery behind it.

Rooms:

* ``front``: the torch-facing ``DataLoader`` (torch's arguments and attributes, ``state_dict``).
* ``arguments``: torch's argument refusals, the worker count, the hand-over of an ``IterableDataset``.
* ``epoch``: one pass over an epoch (the in-order window, the commit of the position).
* ``prefetch``: the copy of batches to the GPU ahead of the training loop.
* ``samplers``: the torch samplers the loader shows for its own order, and a user's sampler.
* ``skips``: the per-epoch skip budget.
* ``state``: the checkpoint schema of ``state_dict`` / ``load_state_dict``.
* ``stats``: ``DataLoader.stats()``.

The order itself (which batches a rank reads) is :mod:`feedgpu.order`.

``DataLoader`` is imported on first use (:pep:`562`): importing a room (the skip budget's rules,
the state schema) does not import torch.
"""
import importlib

__all__ = ["DataLoader"]


def __getattr__(name: str):
    if name == "DataLoader":
        return importlib.import_module(".front", __name__).DataLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
