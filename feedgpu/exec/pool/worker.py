"""What runs in a pool worker process (see :class:`~feedgpu.exec.pool.process_pool.ProcessPool`).

A worker starts as torch's DataLoader workers do (``torch.set_num_threads(1)``; seeds
``base_seed + worker_id`` for torch and ``random`` and numpy's global RNG as torch derives it;
torch's ``WorkerInfo`` for ``get_worker_info()``), then runs ``on_start`` and
``worker_init_fn(worker_id)``, then takes tasks from its queue and sends each result (or its
exception, packed with the traceback) on its own :class:`~feedgpu.exec.pool.fd_channel.Channel`,
until it gets ``None``, its parent dies, or the main process terminates it. Before each task it
writes how many tasks it has taken into its progress slot (:func:`feedgpu.exec.progress.took`),
so that a death is blamed on the task it was running without a message per task.
"""
from __future__ import annotations

import logging
import pickle
import queue

from ...errors import WorkerError
from .. import progress
from ..contract import Control, Result
from .errors import pack_exception, unsendable
from .lifetime import enter_worker
from .start import seed_worker

log = logging.getLogger("feedgpu.pool")
IDLE_S = 0.5   # a worker with no task for this long runs its on_idle hook (e.g. writes buffered cache rows)


def _run_hook(hook, wid: int, what: str) -> None:
    if hook is None:
        return
    try:
        hook()
    except Exception:  # noqa: BLE001 - never block shutdown or idling on a flush
        log.exception("feedgpu worker %d: %s failed", wid, what)


class WorkerLoad:
    """What a worker needs from the main process: ``(handler, worker_init_fn, on_exit, on_idle,
    on_start, dataset)``. Forked workers get the objects themselves. For spawn and forkserver, they are
    pickled together (one pickle: the dataset a ``WorkerInfo`` names is the handler's own copy)
    while the pool starts the worker, so file descriptors in them are passed to it; the worker
    unpickles them in :func:`worker_main`, where a failure can be reported to the main process."""

    def __init__(self, objs: tuple, pickled: bool):
        self.objs, self.pickled, self.blob = objs, pickled, None

    def __reduce__(self):
        if not self.pickled:  # pragma: no cover - fork never pickles
            return (WorkerLoad, (self.objs, False))
        from multiprocessing.reduction import ForkingPickler

        return (WorkerLoad._from_blob, (bytes(ForkingPickler.dumps(self.objs)),))

    @staticmethod
    def _from_blob(blob: bytes) -> "WorkerLoad":
        load = WorkerLoad((), True)
        load.blob = blob
        return load

    def load(self) -> tuple:
        if self.blob is not None:
            self.objs, self.blob = pickle.loads(self.blob), None
        return self.objs


def worker_main(wid: int, load: WorkerLoad, tasks, conn, parent: int, board, seeding: tuple | None,
                 method: str) -> None:
    board.attach(wid)   # first: the main process sees this worker has started
    orphaned = enter_worker(parent)
    try:
        handler, init_fn, on_exit, on_idle, on_start, dataset = load.load()
    except BaseException as e:  # noqa: BLE001 - say why instead of dying with a bare exit code
        err = WorkerError(f"a feedgpu worker started with {method!r} could not unpickle what it runs (the "
                          f"dataset or pipeline, worker_init_fn, collate_fn): {type(e).__name__}: {e}. With "
                          "spawn and forkserver these must be importable by the new process: defined at the top "
                          "level of a module (not in a function, a lambda, or an interactive __main__)")
        conn.send(Result(Control.START_FAILED, -1, wid, False, pack_exception(err, wid)))
        return
    try:
        if seeding is not None:
            seed_worker(wid, seeding[0], seeding[1], dataset)
        if on_start is not None:
            on_start()
        if init_fn is not None:
            init_fn(wid)
    except BaseException as e:
        conn.send(Result(Control.START_FAILED, -1, wid, False, pack_exception(e, wid)))
        return

    taken = 0   # items taken from the queue, written to the board: a death is blamed on the last one
    while True:
        try:
            task = tasks.get(timeout=IDLE_S)
        except queue.Empty:
            if orphaned():
                return
            _run_hook(on_idle, wid, "on_idle")  # write what is buffered (e.g. cache rows) now
            continue
        taken += 1
        progress.took(taken)
        if task is None:
            _run_hook(on_exit, wid, "on_exit")
            return
        tag, seq = task[0], task[1]
        if tag is Control.FLUSH:
            try:
                if on_exit is not None:
                    on_exit()
                conn.send(Result(Control.FLUSH, seq, wid, True, None))
            except BaseException as e:  # noqa: BLE001
                conn.send(Result(Control.FLUSH, seq, wid, False, pack_exception(e, wid)))
            continue
        try:
            result = Result(tag, seq, wid, True, handler(task))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the main process
            result = Result(tag, seq, wid, False, pack_exception(e, wid))
        try:
            conn.send(result)
        except Exception as e:  # noqa: BLE001 - the result cannot travel: say why instead of dying
            conn.send(Result(tag, seq, wid, False, pack_exception(unsendable(e), wid)))
