"""Checks across ranks before training, so that uneven data fails loudly instead of hanging.

feedgpu shards one dataset over the ranks (:mod:`feedgpu.order.sharded`): every rank must index the
same samples, and then every rank gets the same number of batches (the shard is padded by
repeating the epoch order's head, up to ``world_size - 1`` repeats per epoch). When a
:class:`~feedgpu.DataLoader` takes its rank and world size from an initialized
``torch.distributed`` process group, its constructor is a collective: every rank reports its
sample count (or the error it met opening its source) with ``all_gather_object``, and every
rank raises the same :class:`~feedgpu.errors.ConfigError` when

* a rank could not open its data or has no samples (the rank and its error are named), or
* ranks hold different sample counts (each rank's count is listed),

so no rank starts training while another one waits for a batch that never comes. With an
explicit ``rank``/``world_size`` there is no collective and no check.
"""
from __future__ import annotations

from typing import Callable

from ..errors import ConfigError


def initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` when none is initialized."""
    import torch.distributed as dist

    if initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree_on_length(get_len: Callable[[], int]) -> int:
    """Call ``get_len()`` on every rank and compare: returns the common sample count.

    Raises :class:`ConfigError` (on every rank) when a rank failed or holds no sample, or the
    counts differ. Collective: every rank of the default group must call it."""
    return agree(get_len, 0)[0]


def agree(get_len: Callable[[], int], seed: int) -> tuple[int, int]:
    """:func:`agree_on_length`, and rank 0's ``seed``: ``(samples, seed)``.

    Every rank must shuffle with the same seed, or the ranks' shards of their different
    permutations overlap; a torch Dataset's loader draws its seed from torch's RNG, which
    ranks need not have seeded alike, so every rank takes rank 0's. Collective."""
    import torch.distributed as dist

    n, err, own = None, None, None
    try:
        n = int(get_len())
    except Exception as e:  # noqa: BLE001 - any error (a torch Dataset's __len__ may raise anything):
        # report it to the other ranks first, then raise it here too; raised alone, the other
        # ranks would wait in the collective for ever
        err, own = f"{type(e).__name__}: {e}", e
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (n, err, int(seed)))
    me = dist.get_rank()
    failed = [(r, e) for r, (_, e, _) in enumerate(gathered) if e is not None]
    empty = [r for r, (k, e, _) in enumerate(gathered) if e is None and k == 0]
    if failed or empty:
        lines = [f"  rank {r}: {e}" for r, e in failed] + [f"  rank {r}: no samples" for r in empty]
        raise ConfigError(f"rank {me}: not every rank has data, so ranks would get different numbers of "
                          "batches and training would hang; every rank must index the same dataset "
                          "(feedgpu shards it):\n" + "\n".join(lines)) from own
    counts = [k for k, _, _ in gathered]
    if len(set(counts)) > 1:
        raise ConfigError(f"rank {me}: ranks index different numbers of samples ({', '.join(f'rank {r}: {k}' for r, k in enumerate(counts))}); "
                          "every rank must index the same dataset (feedgpu shards it over the ranks), "
                          "else ranks get different numbers of batches and training hangs")
    return n, gathered[0][2]


def rank_world_of(rank: int | None, world_size: int | None, sharding_sampler=None) -> tuple[int, int, bool]:
    """``(rank, world_size, from_the_process_group)`` for a loader's next iteration: the loader's
    own ``rank``/``world_size`` when given, else a ``DistributedSampler``'s (``sharding_sampler``),
    else the process group's (0 of 1 without one)."""
    if rank is not None or world_size is not None:
        return rank or 0, world_size or 1, False
    if sharding_sampler is not None:
        return int(sharding_sampler.rank), int(sharding_sampler.num_replicas), initialized()
    r, w = rank_world()
    return r, w, w > 1
