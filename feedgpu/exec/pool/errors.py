"""How the worker pool words what went wrong: a worker's exception rebuilt in the main process,
a dead worker's exit as torch's DataLoader words it, a timeout's seconds."""
from __future__ import annotations

import pickle
import signal

from ...errors import WorkerError


def seconds_text(t) -> str:
    """``t`` seconds as torch prints its ``timeout`` (a whole float as an int, as it was given)."""
    return str(int(t)) if isinstance(t, float) and t.is_integer() else str(t)


def unpack_exception(packed: tuple, context: str) -> BaseException:
    """Rebuild a worker's exception in the main process, its traceback as a note."""
    blob, summary, tb, wid, *more = packed
    exc = pickle.loads(blob) if blob is not None else WorkerError(summary)
    if more and more[0] is not None:   # a remote source's shard-cache counters at the failure
        exc.feedgpu_network = more[0]
    return with_note(exc, f"raised in feedgpu worker {wid} {context}; worker traceback:\n{tb}")


def with_note(exc: BaseException, note: str) -> BaseException:
    """``exc`` with ``note`` attached (an exception note; on Python 3.10, appended to its first
    argument)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10
        exc.args = (f"{exc.args[0] if exc.args else ''}\n{note}", *exc.args[1:])
    return exc


def exit_text(proc) -> str:
    """How a finished process ended: ``"signal SIGKILL"`` (by name where Python knows it) or
    ``"exit code N"``."""
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def torch_death(pid: int, exitcode: int | None) -> str:
    """How torch's DataLoader begins the error for a dead worker: ``DataLoader worker (pid N) is
    killed by signal: <the C library's description>. `` or ``DataLoader worker (pid N) exited
    unexpectedly with exit code C. ``"""
    if exitcode is not None and exitcode < 0:
        try:
            desc = signal.strsignal(-exitcode)
        except ValueError:  # pragma: no cover
            desc = None
        return f"DataLoader worker (pid {pid}) is killed by signal: {desc or f'Unknown signal {-exitcode}'}. "
    return f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
