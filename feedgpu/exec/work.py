"""What one task is, for each kind of dataset, and how its result becomes a batch.

* :class:`PipelineWork`: a feedgpu pipeline. Workers fill a shared-memory slot; the main process
  hands the slot to the training loop as tensors without a copy.
* :class:`DatasetWork`: a plain map-style torch Dataset with a ``collate_fn``. Workers return the
  collated batch; its tensors stay in the shared memory torch's collate puts them in, and their
  file descriptors travel with the batch (:mod:`feedgpu.exec.pool.fd_channel`).

Randomness: a pipeline's random stages draw per sample from ``(seed, epoch, index)``
(:mod:`feedgpu.stages.draws`), so its batches do not depend on the worker count or on torch's RNG.
A torch Dataset's randomness is torch's: its workers are seeded once, when they start, as torch's
DataLoader seeds them (see :class:`~feedgpu.exec.pool.process_pool.ProcessPool`'s ``base_seed``), and
with ``num_workers=0`` it draws from the training loop's RNG, as in torch.

Both pickle for workers started with ``spawn`` or ``forkserver`` (a pipeline's batch buffers as a
file descriptor, :class:`~feedgpu.exec.buffers.shm.BatchSlots`); the main process's bookkeeping stays.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from . import progress
from .assemble import Assembler, BatchReport
from .buffers.shm import BatchSlots
from .contract import Task, WorkBase


class Batch(NamedTuple):
    """A pipeline batch. ``images``: (N, C, H, W) or (N, H, W, C) tensor in the pipeline's
    dtype; ``labels``: int64 (N,). Unpacks like ``(images, labels)``."""

    images: Any
    labels: Any


class PipelineWork(WorkBase):
    """Tasks: a :class:`~feedgpu.exec.contract.Task` with its batch ``slot`` and ``spares``;
    payload: a :class:`BatchReport`."""

    def __init__(self, assembler: Assembler, batch_size: int, inflight: int, keep_views: int = 2,
                 populate: int | None = None):
        spec = assembler.plan.pool_spec
        self.assembler = assembler
        self.keep_views = keep_views
        self.slots = BatchSlots(inflight + keep_views, batch_size, spec.shape, spec.dtype,
                                populate=None if populate is None else populate + keep_views) if inflight else None
        self._shape, self._dtype, self._bs = spec.shape, spec.dtype, batch_size
        self.orphans: dict = {}   # (tag, seq) -> task of an abandoned iteration, still in flight

    def __getstate__(self) -> dict:
        if self.assembler.cache is not None:
            from ..errors import ConfigError

            raise ConfigError("a pipeline with a cache runs in forked workers only: use "
                              "multiprocessing_context='fork' (the default), or turn the cache off")
        return {**self.__dict__, "orphans": {}}

    def can_submit(self) -> bool:
        return self.slots.free > 0

    def describe(self, index: int) -> str:
        """The sample's name (path, shard and member, or file and row) for messages."""
        return self.assembler.source.key(index)

    def refresh(self) -> None:
        if self.assembler.cache is not None:
            self.assembler.cache.refresh()

    def on_start(self) -> None:
        """In each worker as it starts: map the batch buffers in (see :meth:`BatchSlots.map_in`)."""
        if self.slots is not None:
            self.slots.map_in()

    def cache_entry(self):
        cache = self.assembler.cache
        return cache.entry if cache is not None else None

    def on_exit(self) -> None:
        """In each worker as it stops or is asked to flush (and after inline epochs): the cache's
        ``pause`` event (its flush policy publishes what the worker cached)."""
        if self.assembler.cache is not None:
            self.assembler.cache.pause()

    def on_idle(self) -> None:
        """In each worker that has had no task for a while: as :meth:`on_exit`, the cache's
        ``pause`` event."""
        self.on_exit()

    def task(self, tag: int, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> Task:
        return Task(tag, seq, epoch, indices, spares, slot=self.slots.acquire())

    def handle(self, task: Task) -> BatchReport:
        images, labels = self.slots.arrays(task.slot)
        return self.assembler.fill(images, labels, task.indices, task.spares, task.epoch)

    def finish(self, task: Task, report: BatchReport) -> Batch:
        return Batch(*self.slots.deliver(task.slot, report.rows, self.keep_views))

    def discard(self, task: Task) -> None:
        self.slots.release(task.slot)

    def remote_handler(self) -> "RemoteFill":
        """What a remote worker runs for a task: fills new arrays instead of a shared slot."""
        return RemoteFill(self.assembler, self._bs, self._shape, self._dtype)

    def land(self, task: Task, payload: tuple) -> BatchReport:
        """Copy a remote worker's ``(images, labels, report)`` into the task's slot (one copy,
        in the main process), so :meth:`finish` hands it out as a local batch."""
        images, labels, report = payload
        dst_images, dst_labels = self.slots.arrays(task.slot)
        dst_images[:report.rows] = images
        dst_labels[:report.rows] = labels
        return report

    def run_inline(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> tuple[Batch, BatchReport]:
        import torch

        images = np.empty((self._bs, *self._shape), self._dtype)
        labels = np.empty(self._bs, np.int64)
        rep = self.assembler.fill(images, labels, indices, spares, epoch)
        return Batch(torch.from_numpy(images[:rep.rows]), torch.from_numpy(labels[:rep.rows])), rep

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
        if self.assembler.cache is not None:
            self.assembler.cache.close()


class RemoteFill:
    """A pipeline task run away from the loader's shared memory (on a Ray worker): the same
    :meth:`Assembler.fill` as a local worker, into new arrays.

    Called with a :class:`PipelineWork` task (its slot is not used here); returns
    ``(images, labels, report)``: ``images`` ``(rows, *shape)`` of the plan's dtype, ``labels``
    int64 ``(rows,)``, ``report`` a :class:`BatchReport`. Pickled once per remote worker."""

    def __init__(self, assembler: Assembler, batch_size: int, shape: tuple, dtype):
        self.assembler, self.batch_size, self.shape, self.dtype = assembler, batch_size, tuple(shape), dtype

    def __call__(self, task: Task) -> tuple:
        indices = task.indices
        images = np.empty((len(indices), *self.shape), self.dtype)
        labels = np.empty(len(indices), np.int64)
        rep = self.assembler.fill(images, labels, indices, task.spares, task.epoch)
        return images[:rep.rows], labels[:rep.rows], rep


class PayloadWork(WorkBase):
    """The work contract for results that travel back whole (pickled through the worker's
    channel, tensors as shared memory whose descriptors travel with them): a
    :class:`~feedgpu.exec.contract.Task` without spares or slot, no buffers to hold, nothing to
    flush. Subclasses give ``handle`` and ``finish``."""

    def __init__(self):
        self.orphans: dict = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "orphans": {}}   # main-process bookkeeping stays there

    def can_submit(self) -> bool:
        return True

    def refresh(self) -> None:
        pass

    def on_exit(self) -> None:
        pass

    def task(self, tag: int, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> Task:
        return Task(tag, seq, epoch, indices)

    def discard(self, task: Task) -> None:
        pass

    def remote_handler(self):
        """What a remote worker runs for a task: this work's own ``handle`` (pickled with it)."""
        return self.handle

    def land(self, task: Task, payload):
        """A remote worker's payload is already the batch."""
        return payload

    def close(self) -> None:
        pass


class DatasetWork(PayloadWork):
    """A torch Dataset: the payload is ``collate_fn``'s batch.

    ``seed`` (the loader's) is kept for the record only: nothing here seeds an RNG. Workers are
    seeded once at start, as torch's are, and a seed ``worker_init_fn`` sets holds for every
    batch after it.

    As torch's fetcher: with batches (``batched``), a dataset whose ``__getitems__`` is set gets
    the batch's keys in one call (``__getitems__(list) -> list of samples``), else one
    ``__getitem__`` per key; unbatched (``batch_size=None``), always ``__getitem__``."""

    def __init__(self, dataset, collate_fn: Callable, seed: int, batched: bool = True):
        super().__init__()
        self.dataset, self.collate_fn, self.seed = dataset, collate_fn, seed
        self.batched = batched

    def handle(self, task: Task):
        keys = task.indices.tolist()   # ints, or a user sampler's other keys as it gave them
        first = keys[0] if keys and isinstance(keys[0], int) else -1
        getitems = getattr(self.dataset, "__getitems__", None) if self.batched else None
        if getitems:
            progress.at("__getitems__", first)
            items = getitems(keys)
        else:
            items = []
            for i in keys:
                progress.at("__getitem__", i if isinstance(i, int) else -1)
                items.append(self.dataset[i])
        progress.at("collate_fn", first)
        return self.collate_fn(items)

    def describe(self, index: int) -> str:
        """``<Dataset class>[index]`` for messages."""
        return f"{type(self.dataset).__name__}[{index}]"

    def finish(self, task: Task, payload):
        return payload

    def run_inline(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray):
        """In the main process, as torch's ``num_workers=0``: the dataset draws from (and advances)
        the training loop's RNGs."""
        return self.handle(Task(0, seq, epoch, indices)), None
