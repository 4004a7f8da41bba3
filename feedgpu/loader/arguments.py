"""torch's refusals of a :class:`feedgpu.DataLoader`'s argument combinations, in torch's words,
and the ``loader``/``output`` sections given with a pipeline."""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError

__all__ = ["UNSET", "refuse_combinations", "refuse_unagreed_seed", "with_sections"]

#: an argument not given (``None`` means something for several of them)
UNSET: Any = object()


def refuse_unagreed_seed(shuffle: bool, rank, world_size) -> None:
    """Refuse a shuffled order sharded by the loader's own ``rank``/``world_size`` whose seed
    would be drawn from each process's torch RNG: given explicitly, the ranks do not exchange
    rank 0's seed (as they do when the shards come from ``torch.distributed``), and ranks whose
    RNGs differ would read overlapping shards (samples repeated, others never read). Called when
    neither ``seed``, a ``generator`` nor a pipeline gives the seed. Raises :class:`ConfigError`."""
    if shuffle and (world_size or 1) > 1:
        raise ConfigError(f"rank={rank}, world_size={world_size} shard a shuffled order whose seed each process "
                          "draws from its own torch RNG: "
                          "give seed= (the same on every rank) or a generator seeded alike, so that every rank "
                          "draws the same permutation")


def refuse_combinations(in_order, pin_memory_device, batch_size, shuffle, sampler, batch_sampler, drop_last) -> None:
    """Raise :class:`ConfigError` for the argument combinations torch refuses (its own words) and
    for the two feedgpu cannot honour (``in_order=False``, ``pin_memory_device``)."""
    if not in_order:
        raise ConfigError("in_order=False: feedgpu always delivers batches in order (exact resume needs it)")
    if pin_memory_device:
        raise ConfigError("pin_memory_device is deprecated in torch; use device='cuda:N' instead")
    dropping = drop_last is not UNSET and bool(drop_last)   # torch tests truthiness, before drop_last's type
    if sampler is not None and shuffle:
        raise ConfigError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size is not UNSET and batch_size != 1 or shuffle or sampler is not None or dropping:
            raise ConfigError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                              "and drop_last")
    elif batch_size is None and dropping:
        raise ConfigError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")


def with_sections(dataset, loader, output):
    """``dataset`` with the ``loader``/``output`` settings given to the DataLoader: a pipeline
    with those sections replaced (:meth:`Pipeline.replace`, validated); ``dataset`` itself when
    neither is given. Raises :class:`ConfigError` for a torch Dataset (it takes torch's keywords)."""
    if loader is None and output is None:
        return dataset
    from ..pipeline import Pipeline

    if not isinstance(dataset, Pipeline):
        raise ConfigError("loader=/output= settings objects go with a feedgpu Pipeline; a torch Dataset takes "
                          "torch's keywords (batch_size=, shuffle=, num_workers=, ...)")
    return dataset.replace(**{k: v for k, v in (("loader", loader), ("output", output)) if v is not None})
