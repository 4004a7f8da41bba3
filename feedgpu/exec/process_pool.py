"""A pool of forked worker processes that run tasks and report results in a queue.

The pool knows nothing about images: the loader gives it a ``handler(task) -> payload``
(inherited by the workers through ``fork``, never pickled) and reorders results itself.

* A worker's exception is sent back with its traceback and re-raised in the main process
  (same type where it pickles, else :class:`WorkerError`), with the worker id and traceback
  attached as an exception note.
* A worker that dies (segfault, SIGKILL, OOM) is reported as :class:`WorkerError` naming its
  exit code or signal while the main process waits, never as a hang.
* Workers ignore SIGINT (Ctrl-C interrupts the main process, which shuts them down) and exit
  by themselves when their parent dies.
* :meth:`ProcessPool.close` runs on normal end, on exceptions, at garbage collection and at
  interpreter exit; it asks, then terminates, then kills, so no process is left behind.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
import weakref
from typing import Any, Callable

from ..errors import LoaderTimeout, WorkerError

log = logging.getLogger("feedgpu.pool")
POLL_S = 0.1
IDLE_S = 0.5   # a worker with no task for this long flushes its buffers (on_exit hook)


def _pack_exception(e: BaseException, wid: int) -> tuple:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        blob = pickle.dumps(e)
        pickle.loads(blob)
    except Exception:
        blob = None
    return (blob, f"{type(e).__name__}: {e}", tb, wid)


def unpack_exception(packed: tuple, context: str) -> BaseException:
    """Rebuild a worker's exception in the main process, its traceback as a note."""
    blob, summary, tb, wid = packed
    exc = pickle.loads(blob) if blob is not None else WorkerError(summary)
    note = f"raised in feedgpu worker {wid} {context}; worker traceback:\n{tb}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10
        exc.args = (f"{exc.args[0] if exc.args else ''}\n{note}", *exc.args[1:])
    return exc


FLUSH = "__feedgpu_flush__"


def _worker_main(wid: int, handler: Callable, tasks, results, init_fn, parent: int, on_exit, barrier) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover
        pass
    if init_fn is not None:
        try:
            init_fn(wid)
        except BaseException as e:
            results.put((None, -1, wid, False, _pack_exception(e, wid)))
            return
    while True:
        try:
            task = tasks.get(timeout=IDLE_S)
        except queue.Empty:
            if os.getppid() != parent:
                return
            if on_exit is not None:  # idle: write what is buffered (e.g. cache rows) now
                try:
                    on_exit()
                except Exception:  # noqa: BLE001
                    log.exception("feedgpu worker %d: flush while idle failed", wid)
            continue
        if task is None:
            if on_exit is not None:
                try:
                    on_exit()
                except Exception:  # noqa: BLE001 - never block shutdown; the parent logs nothing
                    log.exception("feedgpu worker %d: on_exit failed", wid)
            return
        tag, seq = task[0], task[1]
        if tag == FLUSH:  # every worker takes exactly one: the barrier holds it until all have
            try:
                if on_exit is not None:
                    on_exit()
                results.put((FLUSH, seq, wid, True, None))
            except BaseException as e:  # noqa: BLE001
                results.put((FLUSH, seq, wid, False, _pack_exception(e, wid)))
            try:
                barrier.wait(60)
            except Exception:  # noqa: BLE001 - a broken barrier only means a worker died
                pass
            continue
        try:
            results.put((tag, seq, wid, True, handler(task)))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the main process
            results.put((tag, seq, wid, False, _pack_exception(e, wid)))


class _State:
    """What shutdown needs, kept apart from the pool so a finalizer can hold it."""

    def __init__(self, procs, tasks, results):
        self.procs, self.tasks, self.results, self.closed = procs, tasks, results, False

    def close(self, grace_s: float = 1.0) -> None:
        if self.closed:
            return
        self.closed = True
        for _ in self.procs:
            try:
                self.tasks.put(None)
            except (OSError, ValueError):
                break
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            while p.is_alive() and time.monotonic() < deadline:
                try:  # drain so a worker blocked on a full result pipe can see its sentinel
                    self.results.get(timeout=0.02)
                except (queue.Empty, OSError, ValueError, EOFError):
                    pass
                p.join(0.01)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for q in (self.tasks, self.results):
            q.cancel_join_thread()
            q.close()


class ProcessPool:
    """``num_workers`` forked processes running ``handler`` on tasks.

    Args:
        handler: ``handler(task) -> payload``; a task is a tuple whose first two items are a tag
            and a sequence number, echoed back with the result.
        num_workers: processes to start (>= 1).
        worker_init_fn: called as ``worker_init_fn(worker_id)`` in each worker before any task.
        on_exit: called in each worker when it is asked to stop, and when it has been idle for
            ``IDLE_S`` seconds (e.g. to write buffered cache rows).
        grace_s: seconds workers get to stop (and flush) before they are terminated, also at
            garbage collection and interpreter exit (default 1).
        name: process name prefix.

    Only the ``fork`` start method is supported: the handler, the source index and the
    shared-memory batch slots are inherited, not pickled.
    """

    def __init__(self, handler: Callable[[tuple], Any], num_workers: int,
                 worker_init_fn: Callable[[int], None] | None = None, on_exit: Callable[[], None] | None = None,
                 name: str = "feedgpu-worker", grace_s: float = 1.0):
        if "fork" not in mp.get_all_start_methods():
            raise WorkerError("feedgpu's process pool needs the 'fork' start method (Linux)")
        import torch.multiprocessing  # noqa: F401  registers tensor reductions for the queues

        ctx = mp.get_context("fork")
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        self._barrier = ctx.Barrier(num_workers)
        self._flushes = 0
        self.procs = []
        parent = os.getpid()
        for wid in range(num_workers):
            p = ctx.Process(target=_worker_main, name=f"{name}-{wid}", daemon=True,
                            args=(wid, handler, self.tasks, self.results, worker_init_fn, parent, on_exit,
                                  self._barrier))
            p.start()
            self.procs.append(p)
        self._state = _State(self.procs, self.tasks, self.results)
        self.grace_s = grace_s
        self._finalizer = weakref.finalize(self, self._state.close, grace_s)
        log.debug("started %d workers: %s", num_workers, [p.pid for p in self.procs])

    @property
    def num_workers(self) -> int:
        return len(self.procs)

    @property
    def closed(self) -> bool:
        return self._state.closed

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def submit(self, task: tuple) -> None:
        self.tasks.put(task)

    def get(self, timeout: float | None = None) -> tuple:
        """Next ``(tag, seq, worker_id, ok, payload)``. Raises :class:`WorkerError` when a worker
        died and :class:`LoaderTimeout` after ``timeout`` seconds (None or 0: wait forever)."""
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            try:
                return self.results.get(timeout=POLL_S)
            except queue.Empty:
                pass
            for wid, p in enumerate(self.procs):
                if not p.is_alive():
                    code = p.exitcode
                    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                    raise WorkerError(f"feedgpu worker {wid} (pid {p.pid}) died unexpectedly ({how})")
            if deadline is not None and time.monotonic() > deadline:
                raise LoaderTimeout(f"no batch from the workers within timeout={timeout} s")

    def flush(self, timeout: float = 60.0) -> list[tuple]:
        """Run ``on_exit`` in every worker (each exactly once) and wait for all of them; returns
        the task results that arrived meanwhile, for the caller to handle."""
        self._flushes += 1
        for _ in self.procs:
            self.submit((FLUSH, self._flushes))
        acks, other = 0, []
        while acks < len(self.procs):
            r = self.get(timeout)
            if r[0] == FLUSH and r[1] == self._flushes:
                if not r[3]:
                    raise unpack_exception(r[4], "while flushing")
                acks += 1
            else:
                other.append(r)
        return other

    def close(self, grace_s: float | None = None) -> None:
        """Ask workers to stop, wait ``grace_s`` seconds (default: the pool's), then terminate
        and kill."""
        if self._finalizer.alive:
            self._finalizer.detach()
            self._state.close(self.grace_s if grace_s is None else grace_s)
