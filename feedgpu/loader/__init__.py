"""The loader: :class:`feedgpu.DataLoader` and the main-process machinery behind it.

Rooms:

* ``front``: the torch-facing ``DataLoader`` (torch's arguments and attributes); it picks a
  backend once (``pick_backend``) and delegates to it.
* ``options``: :class:`~feedgpu.loader.options.LoaderOptions`, torch's keywords and the pipeline
  resolved once (validated in :meth:`feedgpu.settings.LoaderSettings.from_torch`), and torch's
  refusals of argument combinations, in torch's words.
* ``backend``: the one protocol of the backends, and the table of which kind of dataset gets which.
* ``mapped``: what the map-style backends share: the order, the position, the work and the pool.
* ``kinds``: the pipeline, torchvision-on-DALI, torch Dataset and compiled torchvision backends.
* ``iterable``: the ``IterableDataset`` backend (:mod:`feedgpu.exec.iterable` runs it).
* ``epoch``: :class:`~feedgpu.loader.epoch.EpochRunner`, one pass over an epoch (the in-order
  window, the orphans, the commit of the position).
* ``listeners``: what subscribes to a pass: counters, skip budget, shard read-ahead, copy-on-read
  watch, balancer.
* ``state``: the :class:`~feedgpu.loader.state.Position` and the checkpoint schema of ``state_dict``.
* ``read_ahead``: the shard read-ahead and network totals of a loader, as one component.
* ``samplers``: the torch samplers the loader shows for its own order (a user's sampler is
  :class:`~feedgpu.order.user.UserOrder`).
* ``skips``: the per-epoch skip budget.
* ``prefetch``: the copy of batches to the GPU ahead of the training loop.
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
