"""The worker processes of a pool, whatever carries its work: the core that the map-style
:class:`~feedgpu.exec.pool.process_pool.ProcessPool` (a task queue and a result channel per
worker, interchangeable tasks) and an ``IterableDataset``'s
:class:`~feedgpu.exec.iterable.pool.WorkerSet` (a duplex pipe with credits per worker, one
stream each) share. :class:`WorkerProcesses` owns the processes; the pool owns the scheduling.

- **Start**: daemon processes of the pool's multiprocessing context
  (:func:`~feedgpu.exec.pool.start.resolve_context`), the garbage collector frozen around a fork
  (:func:`~feedgpu.exec.pool.start.frozen_gc`).
- **A stuck fork**: a forked worker that has not run its first line ``fork_start_s`` seconds
  after its fork is deadlocked in the interpreter (:func:`~feedgpu.exec.pool.start.stuck_fork`);
  :meth:`WorkerProcesses.overdue` kills it and the pool forks it again. A worker id whose forks
  never started :data:`MAX_STUCK` times raises :class:`~feedgpu.errors.WorkerError`: never a hang.
- **Deaths**: :meth:`~WorkerProcesses.ended` lists the workers whose process is gone, and
  :meth:`~WorkerProcesses.death` words one as torch does, then feedgpu's detail naming the worker
  and the pool's kind (:func:`~feedgpu.exec.pool.errors.death_message`).
- **Close**: each worker is sent its stop message, gets ``grace_s`` seconds to go (the pool drains
  what it writes meanwhile, so a worker blocked on a full channel sees its stop), and is then
  terminated and killed (:func:`~feedgpu.exec.pool.lifetime.end_processes`); its transport is
  closed. This runs at the pool's close, when the pool is garbage collected and at interpreter
  exit (before multiprocessing terminates daemonic children), and only in the process that
  started the workers, never in a forked copy.
"""
from __future__ import annotations

import collections
import multiprocessing.util as mputil
import os
import time
from typing import Callable, Protocol

from ...errors import WorkerError
from .errors import death_message, worker_death
from .lifetime import KILL_WAIT_S, end_processes
from .start import frozen_gc, resolve_context, stuck_fork

#: forks of one worker id that never started before the pool gives up (raises)
MAX_STUCK = 3
#: multiprocessing finalizers: a pool's close runs before queues' (10) and before daemonic
#: children are terminated
EXIT_PRIORITY = 20


class Member(Protocol):
    """One worker as its pool keeps it: its id, its process and the main process's end of its
    transport."""

    wid: int
    proc: object   # a multiprocessing process

    def ask_stop(self) -> None:
        """Send the worker its stop message; a transport already broken is no error."""

    def drain(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the worker to go, reading and dropping what it sends meanwhile
        where the transport allows it."""

    def drop(self) -> None:
        """Close the main process's end of the worker's transport."""


class WorkerProcesses:
    """The worker processes of one pool (see the module doc), by worker id in :attr:`members`.

    Args:
        context: start method or multiprocessing context (:func:`resolve_context`).
        kind: how messages name a worker: ``"IterableDataset"`` gives ``"IterableDataset worker 0
            (pid N) died unexpectedly (...)"``.
        fork_start_s: seconds a forked worker may take to run its first line (spawn and
            forkserver workers are not watched: their start runs no code of the parent's threads).
        grace_s: seconds the workers get to stop by themselves at :meth:`close` (default 1).
    """

    def __init__(self, context, kind: str, fork_start_s: float, grace_s: float = 1.0):
        self.ctx = resolve_context(context)
        self.method = self.ctx.get_start_method()
        self.kind, self.fork_start_s, self.grace_s = kind, fork_start_s, grace_s
        self.members: dict[int, Member] = {}
        self.closed = False
        self.stuck: collections.Counter = collections.Counter()   # worker id -> its forks killed as stuck
        self._forked: dict[int, float] = {}   # worker id -> when it was forked, while its start is watched
        self._stuck_pids: set[int] = set()    # processes killed for never starting
        self._owner = os.getpid()
        self._finalizer = None

    def close_with(self, pool) -> None:
        """Close the processes when ``pool`` is garbage collected, or at interpreter exit (also in
        a multiprocessing child, whose exit runs multiprocessing's finalizers) before
        multiprocessing terminates daemonic children."""
        self._finalizer = mputil.Finalize(pool, self.close, exitpriority=EXIT_PRIORITY)

    # -- start ------------------------------------------------------------------------------------
    def start(self, wid: int, target: Callable, args: tuple, name: str,
              member: Callable[[object], Member]) -> Member:
        """Start worker ``wid`` as a daemon process running ``target(*args)``, named ``name``;
        ``member(process)`` makes the pool's record of it, kept in :attr:`members` (a former
        worker ``wid`` is replaced)."""
        p = self.ctx.Process(target=target, name=name, daemon=True, args=args)
        with frozen_gc(self.method):
            p.start()
        if self.method == "fork":
            self._forked[wid] = time.monotonic()
        m = self.members[wid] = member(p)
        return m

    def watched(self, wid: int) -> bool:
        """Whether worker ``wid``'s start is still watched (forked, not yet heard from)."""
        return wid in self._forked

    def settled(self, wid: int) -> None:
        """Worker ``wid``'s start needs no more watching: it ran its first line, or it was told to
        stop."""
        self._forked.pop(wid, None)

    def overdue(self, started: Callable[[int], bool] | None = None) -> list[int]:
        """The forked workers that ran nothing ``fork_start_s`` seconds after their fork, each
        killed now and returned for the pool to fork again (or to report). ``started(wid)``:
        whether worker ``wid`` has run its first line, where the pool learns it otherwise than by
        :meth:`settled`. Raises :class:`~feedgpu.errors.WorkerError` when a worker id's forks have
        now been stuck :data:`MAX_STUCK` times."""
        now, out = time.monotonic(), []
        for wid, t in list(self._forked.items()):
            if started is not None and started(wid):
                self.settled(wid)
                continue
            m = self.members.get(wid)
            if now - t < self.fork_start_s or m is None:
                continue
            self.settled(wid)
            m.proc.kill()
            m.proc.join(KILL_WAIT_S)
            self._stuck_pids.add(m.proc.pid)
            self.stuck[wid] += 1
            if self.stuck[wid] >= MAX_STUCK:
                raise WorkerError(f"{self.kind} worker {wid} (pid {m.proc.pid}): {stuck_fork(self.fork_start_s)}; "
                                  f"{self.stuck[wid]} forks of it never started, so it is not forked again")
            out.append(wid)
        return out

    def was_stuck(self, m: Member) -> bool:
        """Whether ``m``'s process was killed for never starting."""
        return m.proc.pid in self._stuck_pids

    # -- deaths -----------------------------------------------------------------------------------
    def ended(self) -> list[int]:
        """Ids of the workers whose process has ended."""
        return [wid for wid, m in self.members.items() if m.proc.exitcode is not None]

    def death(self, m: Member, torch_words: bool = True) -> str:
        """How worker ``m`` ended: torch's words, then feedgpu's naming it (``torch_words`` False:
        feedgpu's only, for a log line)."""
        why = stuck_fork(self.fork_start_s) if self.was_stuck(m) else None
        word = death_message if torch_words else worker_death
        return word(m.proc, m.wid, self.kind, why)

    def reap(self, m: Member, wait_s: float) -> None:
        """Wait up to ``wait_s`` seconds for ``m``'s process to end (its transport broke: it is
        dying), then kill it."""
        m.proc.join(wait_s)
        if m.proc.exitcode is None:
            m.proc.kill()
            m.proc.join(KILL_WAIT_S)

    def remove(self, m: Member) -> None:
        """Forget worker ``m`` (its process has ended) and close its transport."""
        if self.members.get(m.wid) is m:
            del self.members[m.wid]
            self.settled(m.wid)
        _quietly(m.drop)

    # -- close ------------------------------------------------------------------------------------
    def close(self, grace_s: float | None = None) -> None:
        """Stop every worker: its stop message, ``grace_s`` seconds (default: :attr:`grace_s`) to
        go, then terminate and kill; close the transports. Only in the process that started them;
        once."""
        if self.closed or os.getpid() != self._owner:
            return
        self.closed = True
        if self._finalizer is not None:
            self._finalizer.cancel()
        members = list(self.members.values())
        for m in members:
            _quietly(m.ask_stop)
        deadline = time.monotonic() + (self.grace_s if grace_s is None else grace_s)
        for m in members:
            while m.proc.exitcode is None and (left := deadline - time.monotonic()) > 0:
                m.drain(min(0.05, left))
        end_processes([m.proc for m in members])
        for m in members:
            _quietly(m.drop)
        self.members.clear()
        self._forked.clear()


def _quietly(action: Callable[[], None]) -> None:
    try:
        action()
    except (OSError, ValueError, EOFError):
        pass
