"""torch's handling of an ``IterDataPipe`` given to the loader, through torch's public
``torch.utils.data.graph_settings``.

* ``shuffle=True``/``False`` is applied to the pipe's ``Shuffler`` stages
  (``apply_shuffle_settings``: a ``Shuffler`` is appended, with torch's warning, when the pipe
  has none), as torch's loader applies it, instead of being refused as for another
  ``IterableDataset``.
* At the start of every pass, seeds are drawn from the loader's ``generator`` (torch's global
  RNG by default) as torch's loader draws them and given to the pipe's random stages
  (``apply_random_seed``): in the main process before new workers start (or before a pass
  without workers), and sent to persistent workers with each later pass, so the shuffle is the
  same in every worker (a ``sharding_filter`` then splits it) and follows the generator.
* ``sharding_filter`` stages split the pipe over the process group's ranks, then the workers
  (``apply_sharding``), as torch's loader splits it.
"""
from __future__ import annotations

import functools

import torch

from ..pool.start import draw_base_seed


def is_datapipe(dataset) -> bool:
    try:
        from torch.utils.data import IterDataPipe
    except ImportError:   # a torch without datapipes
        return False
    return isinstance(dataset, IterDataPipe)


def with_shuffle(dataset, shuffle):
    """``dataset`` with ``shuffle`` applied when it is an ``IterDataPipe`` and ``shuffle`` is given."""
    if shuffle is None or not is_datapipe(dataset):
        return dataset
    from torch.utils.data import graph_settings

    return graph_settings.apply_shuffle_settings(dataset, shuffle=bool(shuffle))


def apply_seed(dataset, seed: int) -> None:
    """Seed an ``IterDataPipe``'s random stages with ``seed`` (in place)."""
    from torch.utils.data import graph_settings

    graph_settings.apply_random_seed(dataset, torch.Generator().manual_seed(int(seed)))


def reseed(dataset, generator) -> None:
    """Seed an ``IterDataPipe``'s random stages for a new pass from ``generator``."""
    if is_datapipe(dataset):
        apply_seed(dataset, draw_base_seed(generator))


def distributed() -> tuple[int, int]:
    """``(world_size, rank)`` of the default process group, ``(1, 0)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def sharded(dataset, num_workers: int, worker_init_fn):
    """The ``worker_init_fn`` to run for an ``IterDataPipe`` (``worker_init_fn`` itself for
    another dataset). Its ``sharding_filter`` stages split the data over the ranks of the
    process group and then over the workers: in the main process now when ``num_workers`` is
    0, else in each worker before ``worker_init_fn``."""
    if not is_datapipe(dataset):
        return worker_init_fn
    world, rank = distributed()
    if num_workers == 0:
        from torch.utils.data import graph_settings

        graph_settings.apply_sharding(dataset, world, rank)
        return worker_init_fn
    return functools.partial(shard_in_worker, worker_init_fn, world, rank)


def shard_in_worker(worker_init_fn, world: int, rank: int, worker_id: int) -> None:
    """Worker ``worker_id``'s share of the pipe: ranks first, then workers (``get_worker_info``)."""
    from torch.utils.data import get_worker_info, graph_settings

    info = get_worker_info()
    graph_settings.apply_sharding(info.dataset, info.num_workers * world, worker_id * world + rank)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)
