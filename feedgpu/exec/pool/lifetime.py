"""A worker process's life around its work, the same for the map-style pool's workers and an
``IterableDataset``'s: its first steps (:func:`enter_worker`), its exit when the main process is
gone (even in the middle of a task or a batch), and the end of processes that do not stop when
asked."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

ORPHAN_POLL_S = 1.0   # how often a worker checks that its main process lives
KILL_WAIT_S = 1.0     # seconds a terminated (then killed) process gets to go


def enter_worker(main_pid: int) -> Callable[[], bool]:
    """A worker process's first steps, the same in both pools: Ctrl-C is left to the main process
    ``main_pid`` (which stops its workers), the worker exits by itself once that process is gone
    (:func:`watch_parent`), and torch runs on one thread with its tensor reductions registered
    (tensors travel in shared memory), as in torch's DataLoader workers. Returns the worker's
    orphan check (:func:`orphan_check`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    orphaned = orphan_check(main_pid)
    watch_parent(orphaned)
    try:
        import torch
        import torch.multiprocessing  # noqa: F401  registers the tensor reductions

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover - feedgpu imports without torch only in tools
        pass
    return orphaned


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a recycled pid of another user
        return True
    return True


def orphan_check(main_pid: int) -> Callable[[], bool]:
    """In a worker, as it starts: a check that is True once the main process ``main_pid`` is gone.
    The worker's parent is the main process (fork, spawn) or the fork server (forkserver), which
    exits with the main process; the worker is orphaned when its parent changes or, under a fork
    server, when ``main_pid`` no longer lives."""
    first_parent = os.getppid()

    def orphaned() -> bool:
        return os.getppid() != first_parent or (first_parent != main_pid and not pid_alive(main_pid))

    return orphaned


def watch_parent(orphaned: Callable[[], bool]) -> None:
    """Exit this worker when ``orphaned()`` says its main process is gone, even in the middle of a
    task (a sample that waits on a network retry chain, a stage or a dataset that hangs): a daemon
    thread polls every ``ORPHAN_POLL_S`` seconds. Results have nowhere to go, so nothing is lost by
    not finishing."""
    def watch():
        while True:
            time.sleep(ORPHAN_POLL_S)
            if orphaned():
                os._exit(0)

    threading.Thread(target=watch, name="feedgpu-orphan-watch", daemon=True).start()


def end_processes(procs) -> None:
    """Terminate each of ``procs`` (multiprocessing processes) still alive, then kill those that
    outlive ``KILL_WAIT_S`` seconds."""
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(KILL_WAIT_S)
        if p.is_alive():
            p.kill()
            p.join(KILL_WAIT_S)
