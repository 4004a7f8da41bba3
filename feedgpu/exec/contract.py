"""The engine contract: what the epoch runner (:mod:`feedgpu.loader.epoch`) asks of the work it runs
and of the pool that runs it, and the messages between them.

A *work* object holds what one batch needs and turns task results into batches:
:class:`~feedgpu.exec.work.PipelineWork` (the Python engine: stages into shared-memory slots),
:class:`~feedgpu.exec.work.DatasetWork` (a torch Dataset and its ``collate_fn``),
:class:`~feedgpu.exec.dali.engine.DaliWork` (DALI, in the main process) and
:class:`~feedgpu.tabular.work.TableWork` (table features). They derive from :class:`WorkBase`,
whose defaults say what a work object does not do, so the runner never probes with ``hasattr``;
what only some engines can do is a protocol of its own (:class:`Elastic`, :class:`RunsAhead`).

A *pool* runs tasks in workers: :class:`~feedgpu.exec.pool.process_pool.ProcessPool` (local
processes) and :class:`~feedgpu.exec.remote.mixed_pool.MixedPool` (local and Ray workers). It sends a
:class:`Task` to a worker and gives back a :class:`Result`; control messages carry a
:class:`Control` tag instead of an iteration's.
"""
from __future__ import annotations

import enum
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np


class Control(enum.Enum):
    """Tags of the pool's own messages (an iteration's tag is an int)."""

    #: a flush: the worker runs ``on_exit`` and answers with a result of this tag and the same seq
    FLUSH = "flush"
    #: a worker could not start (unpickling what it runs, ``on_start``, ``worker_init_fn``): the
    #: result's payload is the packed error, its seq -1
    START_FAILED = "start_failed"


class Task(NamedTuple):
    """One batch of work for a worker.

    ``tag``: the iteration it belongs to (an int) or a :class:`Control`; ``seq``: the batch
    number; ``(tag, seq)`` is unique among the tasks in flight. ``epoch``: the epoch the batch's
    random draws come from. ``indices``: the batch's sample indices (int64 ``(N,)``, or a user
    sampler's keys as it gave them). ``spares``: int64 indices that replace skipped samples
    (None where the work has no skips). ``slot``: the shared-memory batch slot the worker
    writes into (-1: none, the result travels back whole)."""

    tag: Any
    seq: int
    epoch: int = 0
    indices: Any = None
    spares: Any = None
    slot: int = -1


class Result(NamedTuple):
    """What a worker sends back for a :class:`Task`: its ``tag`` and ``seq``, the worker id
    ``wid``, ``ok`` (False: ``payload`` is the packed exception,
    :func:`~feedgpu.exec.pool.errors.unpack_exception`) and the work's ``payload``."""

    tag: Any
    seq: int
    wid: int
    ok: bool
    payload: Any


@runtime_checkable
class Work(Protocol):
    """What one task is and how its result becomes a batch.

    A :class:`Task` is what the pool sends to a worker's :meth:`handle`. ``orphans`` maps
    ``(tag, seq)`` to the tasks of an abandoned iteration still in flight."""

    orphans: dict

    def can_submit(self) -> bool:
        """Whether a task can be made now (a free batch slot)."""

    def task(self, tag: int, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> Task:
        """A task for batch ``seq`` of ``epoch``: ``indices`` (int64) and the ``spares`` that
        replace skipped samples."""

    def handle(self, task: Task) -> Any:
        """Run a task (in a worker): the payload sent back."""

    def finish(self, task: Task, payload: Any) -> Any:
        """The batch the training loop receives, from a task's payload (main process)."""

    def discard(self, task: Task) -> None:
        """Forget a task whose result is not used (its slot is free again)."""

    def run_inline(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> tuple[Any, Any]:
        """Run a batch in the main process: ``(batch, report or None)``."""

    def describe(self, index: int) -> str:
        """The sample's name for messages (a path, ``shard.tar:member``, ``Dataset[i]``)."""

    def refresh(self) -> None:
        """Before workers start: bring what they inherit up to date (the cache index)."""

    def on_start(self) -> None:
        """In each worker as it starts."""

    def on_idle(self) -> None:
        """In each worker when it has had no task for a while (e.g. write buffered cache rows)."""

    def on_exit(self) -> None:
        """In each worker as it stops or is asked to flush, and after an inline epoch."""

    def stats(self) -> dict | None:
        """The engine's counters for ``loader.stats()["engine"]``, or None."""

    def cache_entry(self) -> Any:
        """The cache entry the work fills and reads, or None."""

    def close(self) -> None:
        """Free buffers and threads."""


class WorkBase:
    """Defaults of the :class:`Work` contract for what a work object does not do."""

    def describe(self, index: int) -> str:
        return f"sample {index}"

    def refresh(self) -> None:
        pass

    def on_start(self) -> None:
        pass

    def on_idle(self) -> None:
        pass

    def on_exit(self) -> None:
        pass

    def stats(self) -> dict | None:
        return None

    def cache_entry(self) -> Any:
        return None


@runtime_checkable
class Elastic(Protocol):
    """A work that sizes its own threads (the DALI engine): the balancer's decision goes to
    :meth:`set_threads` instead of a pool's ``resize``."""

    def set_threads(self, threads: int, ahead: int | None = None) -> None:
        """Run with ``threads`` (>= 1) threads and ``ahead`` batches ahead (None: unchanged)."""


@runtime_checkable
class RunsAhead(Protocol):
    """A work that runs batches ahead itself when the loader runs it inline (the DALI engine,
    on its own threads): the loader starts each batch of the window once, in order, through
    :meth:`prefetch`, before it runs the one asked for."""

    def lookahead(self, depth: int) -> int:
        """How many batches after the one asked for to start ahead, given the loader's prefetch
        depth ``depth`` (``prefetch_factor``, or the balancer's); 0: none now."""

    def prefetch(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> None:
        """Start batch ``seq`` of ``epoch`` (``indices``, ``spares`` as for :meth:`Work.task`)."""


@runtime_checkable
class Pool(Protocol):
    """Workers that run tasks and give their results back, in any order.

    ``get`` returns a :class:`Result`; its tag is :attr:`Control.START_FAILED` where a worker
    could not start (``payload`` holds the packed error). ``remote_workers`` is 0 and
    ``stats()`` None for a pool without remote workers."""

    closed: bool
    num_workers: int
    remote_workers: int
    remote_started: Any

    def submit(self, task: Task) -> None: ...

    def get(self, timeout: float | None = None) -> Result: ...

    def pids(self) -> list[int]: ...

    def resize(self, n: int, park_s: float = 0.0) -> None: ...

    def retire_parked(self) -> int: ...

    def resize_remote(self, n: int) -> None: ...

    def flush(self) -> list[Result]: ...

    def stats(self) -> dict | None: ...

    def close(self) -> None: ...
