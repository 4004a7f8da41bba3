"""The engine contract: what the epoch runner (:mod:`feedgpu.epoch`) asks of the work it runs
and of the pool that runs it.

A *work* object holds what one batch needs and turns task results into batches:
:class:`~feedgpu.exec.work.PipelineWork` (the Python engine: stages into shared-memory slots),
:class:`~feedgpu.exec.work.DatasetWork` (a torch Dataset and its ``collate_fn``),
:class:`~feedgpu.exec.dali.engine.DaliWork` (DALI, in the main process) and
:class:`~feedgpu.tabular.work.TableWork` (table features). They derive from :class:`WorkBase`,
whose defaults say what a work object does not do, so the runner never probes with ``hasattr``.

A *pool* runs tasks in workers: :class:`~feedgpu.exec.pool.process_pool.ProcessPool` (local
processes) and :class:`~feedgpu.exec.mixed_pool.MixedPool` (local and Ray workers).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Work(Protocol):
    """What one task is and how its result becomes a batch.

    A task is a tuple the pool sends to a worker's :meth:`handle`; its first two fields are
    ``(tag, seq)``, the iteration and the batch number it belongs to. ``orphans`` maps
    ``(tag, seq)`` to the tasks of an abandoned iteration still in flight."""

    orphans: dict
    #: True when the work runs batches ahead itself (:meth:`prefetch`; DALI's executor)
    runs_ahead: bool

    def can_submit(self) -> bool:
        """Whether a task can be made now (a free batch slot)."""

    def task(self, tag: int, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> tuple:
        """A task for batch ``seq`` of ``epoch``: ``indices`` (int64) and the ``spares`` that
        replace skipped samples."""

    def handle(self, task: tuple) -> Any:
        """Run a task (in a worker): the payload sent back."""

    def finish(self, task: tuple, payload: Any) -> Any:
        """The batch the training loop receives, from a task's payload (main process)."""

    def discard(self, task: tuple) -> None:
        """Forget a task whose result is not used (its slot is free again)."""

    def run_inline(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> tuple[Any, Any]:
        """Run a batch in the main process: ``(batch, report or None)``."""

    def prefetch(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> None:
        """Start batch ``seq`` ahead (only where :attr:`runs_ahead`)."""

    def describe(self, index: int) -> str:
        """The sample's name for messages (a path, ``shard.tar:member``, ``Dataset[i]``)."""

    def refresh(self) -> None:
        """Before workers start: bring what they inherit up to date (the cache index)."""

    def on_start(self) -> None:
        """In each worker as it starts."""

    def on_exit(self) -> None:
        """In each worker as it stops, and after an inline epoch."""

    def stats(self) -> dict | None:
        """The engine's counters for ``loader.stats()["engine"]``, or None."""

    def cache_entry(self) -> Any:
        """The cache entry the work fills and reads, or None."""

    def close(self) -> None:
        """Free buffers and threads."""


class WorkBase:
    """Defaults of the :class:`Work` contract for what a work object does not do."""

    runs_ahead = False

    def prefetch(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not run batches ahead")

    def describe(self, index: int) -> str:
        return f"sample {index}"

    def refresh(self) -> None:
        pass

    def on_start(self) -> None:
        pass

    def on_exit(self) -> None:
        pass

    def stats(self) -> dict | None:
        return None

    def cache_entry(self) -> Any:
        return None


@runtime_checkable
class Pool(Protocol):
    """Workers that run tasks and give their results back, in any order.

    ``get`` returns ``(tag, seq, worker id, ok, payload)``; ``tag`` None means a worker could
    not start (``payload`` holds the packed error). ``remote_workers`` is 0 and ``stats()``
    None for a pool without remote workers."""

    closed: bool
    num_workers: int
    remote_workers: int
    remote_started: Any

    def submit(self, task: tuple) -> None: ...

    def get(self, timeout: float | None = None) -> tuple: ...

    def pids(self) -> list[int]: ...

    def resize(self, n: int, park_s: float = 0.0) -> None: ...

    def retire_parked(self) -> int: ...

    def resize_remote(self, n: int) -> None: ...

    def flush(self) -> list[tuple]: ...

    def stats(self) -> dict | None: ...

    def close(self) -> None: ...
