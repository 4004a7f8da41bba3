"""How pool workers start: the multiprocessing context a ``DataLoader`` argument names, the
workers' base seed (drawn as torch draws it) and each worker's seeding from it, the garbage
collector frozen around a fork, and how long a forked worker may take to run its first line.
Shared by the map-style pool and an ``IterableDataset``'s workers (the base seed also seeds an
``IterDataPipe``'s random stages)."""
from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import multiprocessing.context as mpcontext

from ...errors import ConfigError

#: seconds a forked worker may take to run its first line before the pool takes it for stuck
#: (see :func:`stuck_fork`); a healthy fork gets there at once, whatever the dataset
FORK_START_S = 30.0


def stuck_fork(seconds: float) -> str:
    """Why a forked worker that ran nothing in ``seconds`` was killed."""
    return (f"it had run nothing {seconds:g} s after its fork, so it was killed: on CPython 3.11 releases "
            "without the fix of gh-112275 a child forked while another thread of the parent (a framework's, "
            "a collective's) holds the interpreter's thread-list lock deadlocks before it starts")


def resolve_context(value) -> mpcontext.BaseContext:
    """The multiprocessing context for ``DataLoader(multiprocessing_context=value)``.

    ``None``: the start method set with ``multiprocessing.set_start_method`` if one was set
    (torch's default context), else ``fork`` where the platform has it (feedgpu's choice: workers
    inherit the source index and batch buffers instead of unpickling them). A string: that start
    method (``"fork"``, ``"spawn"``, ``"forkserver"``). A context object (``multiprocessing`` or
    ``torch.multiprocessing``): itself.

    Raises :class:`~feedgpu.errors.ConfigError` (a ``ValueError``) for an unknown start method and
    ``TypeError`` for anything else, with torch's wording."""
    if value is None:
        method = mp.get_start_method(allow_none=True)
        if method is None:
            method = "fork" if "fork" in mp.get_all_start_methods() else mp.get_start_method()
        return mp.get_context(method)
    if isinstance(value, str):
        valid = mp.get_all_start_methods()
        if value not in valid:
            raise ConfigError("multiprocessing_context option should specify a valid start method in "
                             f"{valid!r}, but got multiprocessing_context={value!r}")
        return mp.get_context(value)
    if isinstance(value, mpcontext.BaseContext):
        return value
    raise TypeError("multiprocessing_context option should be a valid context object or a string specifying "
                    f"the start method, but got multiprocessing_context={value}")


def draw_base_seed(generator=None) -> int:
    """The workers' base seed, drawn as torch's DataLoader draws it when its workers start: one
    int64 from ``generator``, or from torch's global RNG when ``generator`` is None."""
    import torch

    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def seed_worker(wid: int, base_seed: int, num_workers: int, dataset) -> int:
    """In worker ``wid``: seed it and publish its ``WorkerInfo`` as torch's DataLoader workers do;
    returns the worker's seed, ``base_seed + wid``.

    torch and ``random`` get that seed; numpy's global RNG the 4 words numpy's ``SeedSequence``
    makes of (worker id, base seed's low and high 32 bits): the same state torch's workers give it."""
    import random

    import numpy as np
    import torch
    import torch.utils.data._utils.worker as torch_worker

    seed = base_seed + wid
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(np.random.SeedSequence([wid, base_seed & 0xFFFFFFFF, base_seed >> 32]).generate_state(4))
    # torch.utils.data.get_worker_info() returns this module variable, and torch has no public way
    # to set it: assigning it is the only way for get_worker_info() to work in a feedgpu worker.
    torch_worker._worker_info = torch_worker.WorkerInfo(id=wid, num_workers=num_workers, seed=seed, dataset=dataset)
    return seed


@contextlib.contextmanager
def frozen_gc(method: str):
    """Around a fork: the objects of the parent go to the garbage collector's permanent
    generation, so a forked child never collects (and never finalizes) what it inherited.
    Unreachable objects of the parent, such as a dropped Ray actor handle whose finalizer talks
    to Ray's threads that the child does not have, would otherwise be finalized in the child
    and can hang it. The parent's collector is restored at once. No effect for spawn and
    forkserver (their children start empty)."""
    if method != "fork":
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
