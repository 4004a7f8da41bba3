"""The worker processes behind :class:`feedgpu.exec.iterable.runner.IterableRunner`, seen from the main
process: their messages (protocol in :mod:`feedgpu.exec.iterable.worker`), flow control, and
death and timeout detection. The processes themselves (start, stuck forks, deaths' wording, a
shutdown that never hangs) are the pools' shared core,
:class:`~feedgpu.exec.pool.processes.WorkerProcesses`.

Each worker has one duplex pipe; the main process reads every worker's pipe while it waits for
one of them, so no worker stays blocked on a full pipe. Each worker holds at most
``prefetch_factor`` credits, so at most that many of its batches are in flight. There is no
queue feeder thread on either side (pipes are written synchronously), and the processes are
daemons, closed at the end of a pass, when their iterator is dropped, at garbage collection and
at interpreter exit: asked to stop, then terminated, then killed.

A worker's first message says it started. A forked worker that has not said so
``fork_start_s`` seconds after its fork is deadlocked in the interpreter (see
:func:`~feedgpu.exec.pool.start.stuck_fork`): it is killed and forked again, and what the main
process had sent it is sent again (it ran nothing, so its stream is where it began). A worker
stuck :data:`~feedgpu.exec.pool.processes.MAX_STUCK` times raises :class:`WorkerError`.
"""
from __future__ import annotations

import collections
import logging
import multiprocessing.connection as mpc
import os
import time

from ...errors import LoaderTimeout, WorkerError
from ..pool import fd_limit
from ..pool.errors import timeout_message
from ..pool.processes import WorkerProcesses
from ..pool.start import FORK_START_S
from .worker import worker_loop

POLL_S = 0.1
GRACE_S = 1.0   # seconds the workers get to stop by themselves before they are terminated
KIND = "IterableDataset"   # how messages name a worker: "IterableDataset worker 0 (pid N) ..."
DYING_S = 5.0   # seconds a worker whose pipe closed gets to exit before it is killed


class _Pipe:
    """One worker: its process and the main process's end of its duplex pipe."""

    def __init__(self, wid: int, proc, conn):
        self.wid, self.proc, self.conn = wid, proc, conn

    def ask_stop(self) -> None:
        self.conn.send(("stop",))

    def drain(self, seconds: float) -> None:
        self.proc.join(seconds)   # a batch it is writing is not read: terminated after the grace

    def drop(self) -> None:
        self.conn.close()


class WorkerSet:
    """``runner.num_workers`` processes, each iterating its own copy of ``runner.dataset``."""

    def __init__(self, runner, base_seed: int, fork_start_s: float | None = None):
        self.base_seed = base_seed
        self.prefetch = int(runner.prefetch_factor)
        n = runner.num_workers
        self._args = (n, runner.dataset, base_seed, runner.worker_init_fn, runner.batch_size, runner.drop_last,
                      runner.collate_fn, runner.stateful, os.getpid())
        self.fork_start_s = FORK_START_S if fork_start_s is None else fork_start_s
        self._procs = WorkerProcesses(runner.multiprocessing_context, KIND, self.fork_start_s, GRACE_S)
        self._procs.close_with(self)   # at garbage collection and at exit
        self.queues = [collections.deque() for _ in range(n)]
        self.stopped: set[int] = set()     # workers told to exit: their exit is no death
        self.dead_conns: set[int] = set()
        self.sent: dict[int, list] = {}    # forked worker not yet heard from -> what was sent to it since
        try:
            for w in range(n):
                self._start(w)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return self._procs.closed

    def _worker(self, w: int) -> _Pipe:
        return self._procs.members[w]

    def _start(self, w: int) -> None:
        mine, theirs = self._procs.ctx.Pipe(duplex=True)
        try:
            self._procs.start(w, worker_loop, (w, *self._args[:2], theirs, *self._args[2:]), f"feedgpu-iterable-{w}",
                              lambda p: _Pipe(w, p, mine))
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.dead_conns.discard(w)
        if self._procs.watched(w):   # a fork: what it is sent is sent again if it never starts
            self.sent[w] = []

    def _restart_stuck(self) -> None:
        """Fork again each forked worker that has not started ``fork_start_s`` after its fork
        (the core killed it), sending it again what it was sent."""
        for w in self._procs.overdue():
            old, sent = self._worker(w), self.sent.pop(w, [])
            self._procs.remove(old)
            self._start(w)
            logging.getLogger("feedgpu.pool").warning(
                "%s; forked again as pid %d, sent its %d message(s) again", self._procs.death(old, torch_words=False),
                self._worker(w).proc.pid, len(sent))
            for msg in sent:
                self._send(w, msg)

    # -- sending -----------------------------------------------------------------------------------
    def _send(self, w: int, msg: tuple) -> None:
        if w in self.stopped or w in self.dead_conns:
            return
        if w in self.sent:
            self.sent[w].append(msg)
        try:
            self._worker(w).conn.send(msg)
        except (OSError, ValueError, EOFError):
            self.dead_conns.add(w)   # its death is reported when it is waited for

    def reset(self, w: int, epoch: int, state, pipe_seed: int | None = None) -> None:
        """Start pass ``epoch`` in worker ``w`` (from ``state`` when not None; ``pipe_seed``: reseed
        an ``IterDataPipe`` first)."""
        self.queues[w] = collections.deque(m for m in self.queues[w] if m[1] == epoch)
        self._send(w, ("reset", epoch, self.prefetch, state, pipe_seed))

    def credit(self, w: int, epoch: int) -> None:
        self._send(w, ("credit", epoch, 1))

    def stop(self, w: int) -> None:
        """Let worker ``w`` exit (its stream is exhausted and the workers do not persist)."""
        self._send(w, ("stop",))
        self.stopped.add(w)
        self._procs.settled(w)   # its exit is expected: a stuck fork of it is left to close()
        self.sent.pop(w, None)

    # -- receiving --------------------------------------------------------------------------------
    def _pump(self, wait_s: float) -> None:
        """Read what every worker has sent (waiting up to ``wait_s``); raise for a dead worker."""
        if self.closed:
            raise WorkerError(f"the {KIND} workers were stopped (the loader was shut down)")
        members = self._procs.members
        live = {m.conn: w for w, m in members.items() if w not in self.dead_conns}
        sentinels = [m.proc.sentinel for w, m in members.items() if w not in self.stopped]
        ready = mpc.wait(list(live) + sentinels, timeout=wait_s) if live or sentinels else []
        for c in ready:
            w = live.get(c)
            if w is None:
                continue
            try:
                while c.poll(0):
                    m = c.recv()
                    if m[0] == "started":
                        self._procs.settled(w)
                        self.sent.pop(w, None)
                    else:
                        self.queues[w].append(m)
            except (EOFError, OSError) as e:   # closed: the worker died (reported below) or is dying
                fd_limit.raise_if_out(e)
                self.dead_conns.add(w)
            except Exception as e:  # noqa: BLE001 - a message this process cannot rebuild
                fd_limit.raise_if_out(e)
                if members[w].proc.exitcode is None:
                    raise WorkerError(f"a batch from DataLoader worker (pid {members[w].proc.pid}) could not be "
                                      f"received ({type(e).__name__}: {e}); what a batch holds must be importable in "
                                      "the main process") from e
                self.dead_conns.add(w)
        self._restart_stuck()
        for w in self._procs.ended():
            if w not in self.stopped:
                self.stopped.add(w)
                raise WorkerError(self._procs.death(self._worker(w)))

    def get(self, w: int, epoch: int, timeout: float = 0) -> tuple:
        """Worker ``w``'s next message of pass ``epoch``. Raises :class:`LoaderTimeout` after
        ``timeout`` seconds without it (0: wait for ever) and :class:`WorkerError` when any
        worker died."""
        deadline = time.monotonic() + timeout if timeout else None
        q = self.queues[w]
        while True:
            while q:
                m = q.popleft()
                if m[1] == epoch:
                    return m
            if self.closed:
                raise WorkerError(f"the {KIND} workers were stopped (the loader was shut down)")
            if w in self.stopped:
                raise WorkerError(f"{KIND} worker {w} (pid {self._worker(w).proc.pid}) has stopped")
            if w in self.dead_conns:
                self._procs.reap(self._worker(w), DYING_S)   # its pipe broke: it is dying, report how
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            self._pump(wait)
            q = self.queues[w]
            if not q and deadline is not None and time.monotonic() >= deadline:
                pid = self._worker(w).proc.pid
                raise LoaderTimeout(timeout_message(timeout, f"{KIND} worker {w} (pid {pid}) sent none", as_given=True))

    def wait_ready(self, w: int, epoch: int, pos: dict, timeout: float | None = None) -> None:
        """Read worker ``w``'s "ready" of pass ``epoch`` (its start state) into
        ``pos["workers"][w]``, leaving its other messages queued."""
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            for m in self.queues[w]:
                if m[1] == epoch and m[0] in ("ready", "end", "error"):
                    if m[0] == "ready":
                        pos["workers"][w] = m[2]
                        self.queues[w].remove(m)
                    return
            if deadline is not None and time.monotonic() >= deadline:
                return
            self._pump(POLL_S)

    def pids(self) -> list[int]:
        """Process ids of the workers still running, in worker-id order."""
        return [m.proc.pid for w, m in sorted(self._procs.members.items())
                if w not in self.stopped and m.proc.exitcode is None]

    def close(self) -> None:
        """Stop every worker now."""
        self._procs.close()
