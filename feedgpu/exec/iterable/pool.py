"""The worker processes behind :class:`feedgpu.exec.iterable.runner.IterableRunner`, seen from the main
process: starting them, their messages (protocol in :mod:`feedgpu.exec.iterable.worker`),
flow control, death and timeout detection, and a shutdown that never hangs.

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
stuck ``MAX_STUCK`` times raises :class:`WorkerError`.
"""
from __future__ import annotations

import collections
import logging
import multiprocessing.connection as mpc
import os
import time
import weakref

from ...errors import LoaderTimeout, WorkerError
from ..pool import fd_limit
from ..pool.errors import death_message, timeout_message
from ..pool.lifetime import end_processes
from ..pool.start import FORK_START_S, frozen_gc, stuck_fork
from .worker import worker_loop

POLL_S = 0.1
GRACE_S = 1.0   # seconds the workers get to stop by themselves before they are terminated
MAX_STUCK = 3   # forks of one worker that never started before the pass gives up
KIND = "IterableDataset"   # how messages name a worker: "IterableDataset worker 0 (pid N) ..."
DYING_S = 5.0   # seconds a worker whose pipe closed gets to exit before it is killed


def _close(owner: int, procs: list, conns: list, grace_s: float = GRACE_S) -> None:
    if os.getpid() != owner:   # a forked copy of this object in a worker: not ours to stop
        return
    for c in conns:
        try:
            c.send(("stop",))
        except (OSError, ValueError, EOFError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    end_processes(procs)
    for c in conns:
        try:
            c.close()
        except OSError:
            pass


class WorkerSet:
    """``runner.num_workers`` processes, each iterating its own copy of ``runner.dataset``."""

    def __init__(self, runner, base_seed: int, fork_start_s: float | None = None):
        self.base_seed = base_seed
        self.prefetch = int(runner.prefetch_factor)
        n = runner.num_workers
        self._ctx = runner.multiprocessing_context
        self._method = self._ctx.get_start_method()
        self._args = (n, runner.dataset, base_seed, runner.worker_init_fn, runner.batch_size, runner.drop_last,
                      runner.collate_fn, runner.stateful, os.getpid())
        self.fork_start_s = FORK_START_S if fork_start_s is None else fork_start_s
        self.procs: list = []
        self.conns: list = []
        self.queues = [collections.deque() for _ in range(n)]
        self.stopped: set[int] = set()     # workers told to exit: their exit is no death
        self.dead_conns: set[int] = set()
        # forked worker not yet heard from -> (when it was forked, what was sent to it since)
        self.unheard: dict[int, tuple[float, list]] = {}
        self.stuck = collections.Counter()  # worker -> forks of it killed for never starting
        self.closed = False
        self._finalizer = weakref.finalize(self, _close, os.getpid(), self.procs, self.conns)
        try:
            for w in range(n):
                p, mine = self._start(w)
                self.procs.append(p)
                self.conns.append(mine)
        except BaseException:
            self.close()
            raise

    def _start(self, w: int) -> tuple:
        mine, theirs = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=worker_loop, name=f"feedgpu-iterable-{w}", daemon=True,
                              args=(w, *self._args[:2], theirs, *self._args[2:]))
        with frozen_gc(self._method):
            p.start()
        theirs.close()
        if self._method == "fork":   # spawn and forkserver children inherit no parent thread's lock
            self.unheard[w] = (time.monotonic(), [])
        return p, mine

    def _restart_stuck(self) -> None:
        """Kill and fork again each forked worker that has not started ``fork_start_s`` after its
        fork, sending it again what it was sent."""
        now = time.monotonic()
        for w in [w for w, (t, _) in self.unheard.items() if now - t >= self.fork_start_s and w not in self.stopped]:
            old, (_, sent) = self.procs[w], self.unheard.pop(w)
            old.kill()
            old.join(1.0)
            self.conns[w].close()
            self.stuck[w] += 1
            why = f"IterableDataset worker {w} (pid {old.pid}): {stuck_fork(self.fork_start_s)}"
            if self.stuck[w] >= MAX_STUCK:
                self.stopped.add(w)
                raise WorkerError(f"{why}; {self.stuck[w]} forks of it never started, so the pass stops")
            self.procs[w], self.conns[w] = self._start(w)
            self.dead_conns.discard(w)
            logging.getLogger("feedgpu.pool").warning("%s; forked again as pid %d, sent its %d message(s) again",
                                                      why, self.procs[w].pid, len(sent))
            for msg in sent:
                self._send(w, msg)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- sending -----------------------------------------------------------------------------------
    def _send(self, w: int, msg: tuple) -> None:
        if w in self.stopped or w in self.dead_conns:
            return
        if w in self.unheard:
            self.unheard[w][1].append(msg)
        try:
            self.conns[w].send(msg)
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

    # -- receiving --------------------------------------------------------------------------------
    def _pump(self, wait_s: float) -> None:
        """Read what every worker has sent (waiting up to ``wait_s``); raise for a dead worker."""
        live = {self.conns[w]: w for w in range(len(self.procs)) if w not in self.dead_conns}
        sentinels = [self.procs[w].sentinel for w in range(len(self.procs)) if w not in self.stopped]
        ready = mpc.wait(list(live) + sentinels, timeout=wait_s) if live or sentinels else []
        for c in ready:
            w = live.get(c)
            if w is None:
                continue
            try:
                while c.poll(0):
                    m = c.recv()
                    if m[0] == "started":
                        self.unheard.pop(w, None)
                    else:
                        self.queues[w].append(m)
            except (EOFError, OSError) as e:   # closed: the worker died (reported below) or is dying
                fd_limit.raise_if_out(e)
                self.dead_conns.add(w)
            except Exception as e:  # noqa: BLE001 - a message this process cannot rebuild
                fd_limit.raise_if_out(e)
                if self.procs[w].exitcode is None:
                    raise WorkerError(f"a batch from DataLoader worker (pid {self.procs[w].pid}) could not be "
                                      f"received ({type(e).__name__}: {e}); what a batch holds must be importable in "
                                      "the main process") from e
                self.dead_conns.add(w)
        self._restart_stuck()
        for w, p in enumerate(self.procs):
            if w not in self.stopped and p.exitcode is not None:
                self.stopped.add(w)
                raise WorkerError(death_message(p, w, KIND))

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
            if w in self.stopped:
                raise WorkerError(f"IterableDataset worker {w} (pid {self.procs[w].pid}) has stopped")
            if w in self.dead_conns and self.procs[w].exitcode is None:
                self.procs[w].join(DYING_S)   # its pipe broke: it is dying, report how
                if self.procs[w].exitcode is None:
                    self.procs[w].kill()
                    self.procs[w].join(1.0)
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            self._pump(wait)
            q = self.queues[w]
            if not q and deadline is not None and time.monotonic() >= deadline:
                pid = self.procs[w].pid
                raise LoaderTimeout(timeout_message(timeout, f"{KIND} worker {w} (pid {pid}) sent none"))

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
        return [p.pid for w, p in enumerate(self.procs) if w not in self.stopped and p.is_alive()]

    def close(self) -> None:
        """Stop every worker now."""
        self.closed = True
        if self._finalizer.alive:
            self._finalizer()
