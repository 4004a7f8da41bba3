"""A pool of worker processes that run tasks and report results; it can grow, shrink and
replace dead workers while tasks are in flight.

The pool knows nothing about images: the loader gives it a ``handler(task) -> payload`` and
reorders results itself. Workers are forked by default (the handler, the source index and the
shared-memory batch buffers are inherited, never pickled); with ``context="spawn"`` or
``"forkserver"`` (or a multiprocessing context object) the handler, ``worker_init_fn`` and the
dataset are pickled once per worker start, the batch buffers travel as file descriptors (see
:mod:`feedgpu.exec.buffers.shm`), and an object that cannot be unpickled in the new process raises
:class:`WorkerError` saying so.

Each worker starts as torch's DataLoader workers do: ``torch.set_num_threads(1)``, seeds
``base_seed + worker_id`` for ``torch``, ``random`` and (as torch derives it) numpy's global
RNG, and ``torch.utils.data.get_worker_info()`` returning its ``WorkerInfo``; then
``worker_init_fn(worker_id)``.

Each worker has its own task queue and its own result pipe, and the pool remembers which tasks
each worker holds. That is what makes the rest possible:

* :meth:`ProcessPool.resize` adds workers (forked at once) or retires some: a retiring worker
  finishes the tasks it holds, runs ``on_exit`` and stops, so no task is lost or run twice. With
  ``park_s``, a shrink parks the surplus workers instead (they finish what they hold and take no
  new task) for that many seconds, and a grow within them takes a parked worker back, warm, before
  it forks one: what the balancer does for a step that it may undo.
* A worker that dies (segfault, SIGKILL, OOM) is replaced and the tasks it held are given to
  the replacement, in order (``respawn=True``, the default). So is a forked worker that has not
  run its first line ``fork_start_s`` seconds after its fork (it is killed first): on CPython
  3.11 releases without the fix of gh-112275 such a child is deadlocked (see
  :func:`~feedgpu.exec.pool.start.stuck_fork`) and would hold its tasks for ever. A task whose worker died
  ``max_task_deaths`` times, more than ``max_respawns`` deaths in all, or a worker id whose forks
  never started :data:`~feedgpu.exec.pool.processes.MAX_STUCK` times raises
  :class:`WorkerError` naming the exit code or signal, never a hang. A result that a dead worker
  sent completely is kept; its task is not run again.
* A worker's exception is sent back with its traceback and re-raised in the main process
  (same type where it pickles, else :class:`WorkerError`), with the worker id and traceback
  attached as an exception note (see :func:`~feedgpu.exec.pool.errors.unpack_exception`).
* Workers ignore SIGINT (Ctrl-C interrupts the main process, which shuts them down) and exit
  by themselves when their parent dies.
* The processes themselves (start, stuck forks, deaths, close) are the core this pool shares with
  an ``IterableDataset``'s workers, :class:`~feedgpu.exec.pool.processes.WorkerProcesses`.
  :meth:`ProcessPool.close` runs on normal end, on exceptions, at garbage collection and at
  interpreter exit (also when the pool lives in a multiprocessing child, whose exit runs
  multiprocessing's finalizers: the pool's comes before the child's daemonic workers are
  terminated); it asks, then terminates, then kills, so no process is left behind. Task queues
  never make an exit wait (``cancel_join_thread``: a queue's feeder thread blocked writing a
  large task to a worker that is gone would otherwise be joined for ever).
* A worker's death raises :class:`WorkerError` beginning as torch's does (``DataLoader worker
  (pid N) is killed by signal: Killed.``, ``... exited unexpectedly with exit code C.``), and no
  batch within ``timeout`` raises :class:`LoaderTimeout` beginning ``DataLoader timed out after
  T seconds``, each followed by feedgpu's detail. A task whose handler raised is only a result
  (``ok`` False): the pool goes on with the other tasks.

torch's DataLoader also gives each worker its own index queue; unlike it, results come back on
one channel per worker (``multiprocessing.connection.wait`` watches them all), so a worker killed
while writing can corrupt only its own channel, which is dropped with it. A channel
(:mod:`feedgpu.exec.pool.fd_channel`) is a Unix socket that carries a result's shared-memory tensor
descriptors with the result itself, where torch's reductions fetch each one from the worker over
a new connection.
"""
from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import pickle
import time
from typing import Any, Callable

from ...errors import LoaderTimeout, WorkerError
from ..contract import Control, Result, Task
from ..progress import MAX_WORKERS, Board
from . import fd_limit
from .fd_channel import Channel
from .errors import timeout_message, unpack_exception
from .processes import WorkerProcesses
from .start import FORK_START_S
from .worker import WorkerLoad, worker_main

log = logging.getLogger("feedgpu.pool")
POLL_S = 0.1
MAX_SEED = 2**63 - 1               # worker seeds stay int64 (collatable, torch.manual_seed accepts them)
KIND = "feedgpu"                   # how a death names a worker: "feedgpu worker 3 (pid N) died ..."


class _Worker:
    """One process, its task queue, the main process's end of its result channel and the tasks
    it holds."""

    def __init__(self, wid: int, proc, tasks, conn):
        self.wid, self.proc, self.tasks, self.conn = wid, proc, tasks, conn
        self.held: dict[tuple, tuple] = {}   # (tag, seq) -> task, in submission order
        self.retiring = False
        self.parked_until: float | None = None   # parked (takes no task) until then, then retired; never retiring
        self.put_count = 0                    # items put on its queue (tasks, flushes, the sentinel)
        self.ordinal: dict[tuple, int] = {}   # (tag, seq) -> which item of the queue it was

    @property
    def taking(self) -> bool:
        """Takes new tasks: neither retiring nor parked."""
        return not self.retiring and self.parked_until is None

    def put(self, item, key: tuple | None = None) -> None:
        """Queue ``item`` (a task whose key is ``key``, a flush, or None: stop)."""
        self.put_count += 1
        if key is not None:
            self.held[key] = item
            self.ordinal[key] = self.put_count
        self.tasks.put(item)

    def running(self, board) -> tuple | None:
        """The key of the held task it took last (what it was running if it died), from its
        progress slot; None when that was no held task."""
        n = board.taken(self.wid)
        return next((k for k, i in self.ordinal.items() if i == n), None) if n else None

    # -- as a member of the pool's WorkerProcesses ---------------------------------------------------
    def ask_stop(self) -> None:
        self.put(None)

    def drain(self, seconds: float) -> None:
        try:  # read and drop results, so a worker blocked writing one can see its sentinel
            if self.conn.poll(seconds):
                self.conn.skip()
        except (EOFError, OSError, ValueError):
            self.proc.join(seconds)

    def drop(self) -> None:
        for closer in (self.tasks.cancel_join_thread, self.tasks.close, self.conn.close):
            try:
                closer()
            except (OSError, ValueError):
                pass


class ProcessPool:
    """Worker processes running ``handler`` on tasks; resizable while tasks are in flight.

    Args:
        handler: ``handler(task) -> payload``; a task is a :class:`~feedgpu.exec.contract.Task`
            (or any tuple whose first two items are a tag and a sequence number), its tag and seq
            echoed back in the :class:`~feedgpu.exec.contract.Result`. ``(tag, seq)`` must be
            unique among the tasks in flight.
        num_workers: processes to start (>= 1).
        worker_init_fn: called as ``worker_init_fn(worker_id)`` in each worker before any task;
            worker ids are the smallest free ids in ``0..``, a replacement takes the dead
            worker's id.
        on_exit: called in each worker when it is asked to stop or flush.
        on_idle: called in each worker when it has had no task for ``IDLE_S`` seconds (e.g. to
            write buffered cache rows).
        on_start: called in each worker first, before ``worker_init_fn`` (e.g. to map buffers in).
        grace_s: seconds workers get to stop (and flush) before they are terminated, also at
            garbage collection and interpreter exit (default 1).
        name: process name prefix.
        respawn: replace a worker that dies and give its tasks to the replacement (default True);
            False raises :class:`WorkerError` at the first death.
        max_task_deaths: a task whose workers died this many times raises :class:`WorkerError`
            (default 2: a sample that crashes the decoder is not retried forever).
        max_respawns: deaths replaced over the pool's life before :class:`WorkerError` (default 8).
        describe: ``describe(sample_index) -> name`` for timeout messages, which name the stage and
            sample each busy worker is in (see :mod:`feedgpu.exec.progress`).
        context: start method or multiprocessing context (see :func:`~feedgpu.exec.pool.start.resolve_context`; default
            ``fork``). With ``spawn`` and ``forkserver``, ``handler``, ``worker_init_fn``,
            ``on_exit``, ``on_idle``, ``on_start`` and ``dataset`` must pickle; they are pickled together for
            each worker started (replacements and added workers too).
        base_seed: when given (an int, e.g. :func:`~feedgpu.exec.pool.start.draw_base_seed`),
            worker ``i`` seeds torch and ``random`` with ``base_seed + i`` and numpy's global RNG
            as torch does, before
            ``on_start`` and ``worker_init_fn``, and sets torch's ``WorkerInfo(id=i,
            num_workers=<the pool's size then>, seed=base_seed + i, dataset=dataset)`` for
            ``torch.utils.data.get_worker_info()``. Lowered to keep every seed below 2**63.
            None: workers are not seeded and get no ``WorkerInfo``.
        dataset: the ``WorkerInfo``'s dataset (the worker's own copy with spawn and forkserver).
        fork_start_s: seconds a forked worker may take to run its first line before it is
            killed and replaced as stuck (None: ``start.FORK_START_S``); spawn and forkserver
            workers are not watched (their start runs no code of the parent's threads).

    The handler runs in each worker until the pool closes; a handler's exception is a result
    (``ok`` False) and the worker takes the next task.
    """

    def __init__(self, handler: Callable[[tuple], Any], num_workers: int,
                 worker_init_fn: Callable[[int], None] | None = None, on_exit: Callable[[], None] | None = None,
                 name: str = "feedgpu-worker", grace_s: float = 1.0, respawn: bool = True,
                 max_task_deaths: int = 2, max_respawns: int = 8,
                 describe: Callable[[int], str] | None = None, on_start: Callable[[], None] | None = None,
                 context=None, base_seed: int | None = None, dataset=None, fork_start_s: float | None = None,
                 on_idle: Callable[[], None] | None = None):
        if num_workers < 1:
            raise WorkerError(f"a process pool needs at least one worker, got {num_workers}")
        if num_workers > MAX_WORKERS:
            raise WorkerError(f"a process pool runs at most {MAX_WORKERS} workers, got {num_workers}")
        import torch.multiprocessing  # noqa: F401  registers tensor reductions for the pipes

        self.fork_start_s = FORK_START_S if fork_start_s is None else fork_start_s
        self.grace_s = grace_s
        self._procs = WorkerProcesses(context, KIND, self.fork_start_s, grace_s)
        self.method = self._procs.method
        objs = (handler, worker_init_fn, on_exit, on_idle, on_start, dataset)
        self._load = WorkerLoad(objs, pickled=self.method != "fork")
        self.base_seed = None if base_seed is None else min(int(base_seed), MAX_SEED - MAX_WORKERS)
        self._target = num_workers     # the size asked for: a WorkerInfo's num_workers
        self._name = name
        self._parent = os.getpid()
        self.respawn, self.max_task_deaths, self.max_respawns = respawn, max_task_deaths, max_respawns
        self.board, self._describe = Board(), describe
        self.respawns = 0              # dead workers replaced so far
        self.retired = 0               # workers retired by resize
        self._task_deaths: dict[tuple, int] = {}
        self._flushes = 0
        self._salvaged: list[Result] = []   # complete results read from a worker found dead
        self._procs.close_with(self)   # at garbage collection and at exit
        try:
            for _ in range(num_workers):
                self._spawn()
        except BaseException:
            self.close(grace_s=0.1)
            raise
        log.debug("started %d workers: %s", num_workers, self.pids())

    # -- size -----------------------------------------------------------------------------------
    @property
    def _workers(self) -> dict[int, _Worker]:
        return self._procs.members

    remote_workers = 0      # the pool contract (exec/contract.py): local workers only
    remote_started = None

    def stats(self) -> None:
        """No remote workers: no executor counters (see :class:`~feedgpu.exec.contract.Pool`)."""
        return None

    @property
    def num_workers(self) -> int:
        """Workers taking new tasks (retiring and parked ones are not counted)."""
        return sum(w.taking for w in self._workers.values())

    @property
    def closed(self) -> bool:
        return self._procs.closed

    def pids(self) -> list[int]:
        """Process ids of the workers taking tasks, by worker id."""
        return [w.proc.pid for _, w in sorted(self._workers.items()) if w.taking]

    def _spawn(self, wid: int | None = None) -> _Worker:
        if wid is None:
            wid = next(i for i in range(len(self._workers) + 1) if i not in self._workers)
        tasks = self._procs.ctx.Queue()
        # Never wait for its feeder thread at exit: blocked writing a large task to a worker that
        # is gone, it would be joined for ever. Undelivered tasks of a pool that goes are moot.
        tasks.cancel_join_thread()
        reader, writer = Channel.pair()
        seeding = None if self.base_seed is None else (self.base_seed, self._target)
        self.board.expect(wid)
        try:
            return self._procs.start(
                wid, worker_main, (wid, self._load, tasks, writer, self._parent, self.board, seeding, self.method),
                f"{self._name}-{wid}", lambda p: _Worker(wid, p, tasks, reader))
        finally:
            writer.close()  # the worker holds the only other end: its death reads as EOF here

    def resize(self, n: int, park_s: float = 0.0) -> None:
        """Run ``n`` (>= 1) workers from now on. Parked workers are taken back first (the last
        parked first), then new ones forked at once; surplus ones finish the tasks they hold, run
        ``on_exit`` and stop (the least loaded go first), or with ``park_s`` > 0 (seconds) are
        parked: they finish what they hold, take no new task, and are retired once ``park_s``
        have passed (checked at each :meth:`submit`) or at :meth:`retire_parked`."""
        if n < 1:
            raise WorkerError(f"a process pool needs at least one worker, got {n}")
        if n > MAX_WORKERS:
            raise WorkerError(f"a process pool runs at most {MAX_WORKERS} workers, got {n}")
        self._target = n
        active = [w for w in self._workers.values() if w.taking]
        parked = sorted((w for w in self._workers.values() if w.parked_until is not None),
                        key=lambda w: -w.parked_until)
        back = parked[:max(0, n - len(active))]
        for w in back:
            w.parked_until = None
        for _ in range(n - len(active) - len(back)):
            self._spawn()
        for w in sorted(active, key=lambda w: (len(w.held), -w.wid))[:max(0, len(active) - n)]:
            if park_s > 0:
                w.parked_until = time.monotonic() + park_s
            else:
                self._retire(w)
        if n != len(active):
            log.debug("pool resized from %d to %d workers%s", len(active), n,
                      f" ({len(active) - n} parked for {park_s:g} s)" if park_s > 0 and n < len(active) else "")

    def _retire(self, w: _Worker) -> None:
        w.parked_until = None
        w.retiring = True
        w.put(None)
        self.retired += 1

    def retire_parked(self, due_only: bool = False) -> int:
        """Retire the parked workers (``due_only``: those whose time is up); returns how many."""
        now = time.monotonic()
        due = [w for w in self._workers.values()
               if w.parked_until is not None and (not due_only or w.parked_until <= now)]
        for w in due:
            self._retire(w)
        return len(due)

    # -- tasks ----------------------------------------------------------------------------------
    def submit(self, task: Task) -> None:
        """Give ``task`` to the active worker holding the fewest tasks."""
        self.retire_parked(due_only=True)
        w = min((w for w in self._workers.values() if w.taking), key=lambda w: (len(w.held), w.wid))
        w.put(task, (task[0], task[1]))

    def least_held(self) -> int:
        """Tasks held by the least loaded worker taking tasks (what :meth:`submit` picks)."""
        return min((len(w.held) for w in self._workers.values() if w.taking), default=0)

    def get(self, timeout: float | None = None, wake=None) -> Result | None:
        """Next :class:`~feedgpu.exec.contract.Result`; ``None`` when ``wake`` (an object with
        ``fileno()``, e.g. the read end of a pipe another thread writes to) became readable first.

        Raises :class:`WorkerError` when a worker died and could not be replaced (see the class
        doc), and :class:`LoaderTimeout` after ``timeout`` seconds without a result (None or 0:
        wait forever)."""
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            if self._salvaged:
                return self._salvaged.pop(0)
            conns = {w.conn: w for w in self._workers.values()}
            ready = mpc.wait(list(conns) + ([wake] if wake is not None else []), timeout=POLL_S)
            if wake is not None and wake in ready:
                return None
            for conn in ready:
                w = conns[conn]
                try:
                    result = conn.recv()
                except (EOFError, OSError, pickle.UnpicklingError) as e:
                    fd_limit.raise_if_out(e)
                    self._ended(w)
                    continue
                except Exception as e:  # noqa: BLE001 - torch's rebuild of a storage out of descriptors
                    fd_limit.raise_if_out(e)
                    raise
                if self._accept(w, result):
                    return result
            self._procs.overdue(self.board.started)   # a stuck fork is killed: ended below
            for wid in self._procs.ended():
                self._ended(self._workers[wid])
            if deadline is not None and time.monotonic() > deadline:
                raise LoaderTimeout(timeout_message(timeout, self.holding()))

    def holding(self) -> str:
        """What each busy worker is doing, from its progress slot."""
        parts = []
        for w in self._workers.values():
            if not w.held:
                continue
            where = self.board.read(w.wid)
            what = f"worker {w.wid} (pid {w.proc.pid}) holds batch(es) {[k[1] for k in w.held]}"
            if where is not None:
                stage, idx, secs = where
                try:
                    name = self._describe(idx) if self._describe is not None else f"sample {idx}"
                except Exception:  # noqa: BLE001 - the message must not fail
                    name = f"sample {idx}"
                what += f" and has been in stage {stage!r} on {name} for {secs:.1f} s"
            parts.append(what)
        return "; ".join(parts) or "no worker holds a task"

    def _accept(self, w: _Worker, result: Result) -> bool:
        key = (result.tag, result.seq)
        if isinstance(result.tag, Control):   # a failed start, a flush's answer: held by no worker
            return True
        if w.held.pop(key, None) is None:  # already redone elsewhere after this worker was given up
            return False
        w.ordinal.pop(key, None)
        self._task_deaths.pop(key, None)
        return True

    def _ended(self, w: _Worker) -> None:
        """``w``'s pipe closed or its process is gone: keep every complete result it sent, then
        retire it quietly, or replace it and redo what it held."""
        if self._workers.get(w.wid) is not w:
            return
        try:  # results it sent completely count: their tasks are not redone
            while w.conn.poll(0):
                result = w.conn.recv()
                if self._accept(w, result):
                    self._salvaged.append(result)
        except Exception:  # noqa: BLE001 - e.g. a tensor whose memory died with the worker: redone
            pass
        self._procs.reap(w, 1.0)   # its pipe closed but it still runs: it is treated as dead
        self._procs.remove(w)
        if w.retiring and not w.held and w.proc.exitcode == 0:
            return
        what, died = self._procs.death(w, torch_words=False), self._procs.death(w)
        if not self.respawn or self.closed:
            raise WorkerError(died)
        key = w.running(self.board)
        if key in w.held:  # the task it was running when it died
            self._task_deaths[key] = self._task_deaths.get(key, 0) + 1
            if self._task_deaths[key] >= self.max_task_deaths:
                raise WorkerError(f"{died}; task {key[1]} has now killed {self._task_deaths[key]} "
                                  "workers, so it is not retried (a sample that crashes a stage?)")
        self.respawns += 1
        if self.respawns > self.max_respawns:
            raise WorkerError(f"{died}; {self.respawns} workers have died, more than max_respawns="
                              f"{self.max_respawns}")
        if w.retiring and not w.held:
            log.warning("%s while retiring; nothing was lost", what)
            return
        new = self._spawn(w.wid)
        new.parked_until = w.parked_until   # parked, it stays parked
        if w.retiring:  # it was leaving anyway: the replacement finishes its tasks, then leaves
            new.retiring = True
        log.warning("%s; replaced by pid %d, which redoes %d task(s)", what, new.proc.pid, len(w.held))
        for key, task in w.held.items():
            new.put(task, key)
        if new.retiring:
            new.put(None)

    def flush(self, timeout: float = 60.0) -> list[Result]:
        """Run ``on_exit`` in every worker (each once) and wait for all of them; returns the task
        results that arrived meanwhile, for the caller to handle."""
        self._flushes += 1
        waiting: dict[int, _Worker] = {}
        for w in self._workers.values():
            if not w.retiring:
                w.put(Task(Control.FLUSH, self._flushes))
                waiting[w.wid] = w
        other = []
        # a worker that dies meanwhile is not waited for: its replacement starts with nothing buffered
        while any(self._workers.get(wid) is w for wid, w in waiting.items()):
            r = self.get(timeout)
            if r.tag is Control.FLUSH and r.seq == self._flushes:
                if not r.ok:
                    raise unpack_exception(r.payload, "while flushing")
                waiting.pop(r.wid, None)
            else:
                other.append(r)
        return other

    def close(self, grace_s: float | None = None) -> None:
        """Ask workers to stop, wait ``grace_s`` seconds (default: the pool's), then terminate
        and kill."""
        self._procs.close(grace_s)
