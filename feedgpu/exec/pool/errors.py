"""How the worker pools word what went wrong, the same for the map-style pool and an
``IterableDataset``'s workers: a worker's exception packed for the trip to the main process and
rebuilt there, a batch that could not be sent, and a dead worker's exit and a timeout as torch's
DataLoader words them, each followed by feedgpu's detail."""
from __future__ import annotations

import errno
import pickle
import signal
import traceback

from ...errors import SharedMemoryError, WorkerError


def seconds_text(t) -> str:
    """``t`` seconds as torch prints its ``timeout`` (a whole float as an int, as it was given)."""
    return str(int(t)) if isinstance(t, float) and t.is_integer() else str(t)


def timeout_message(timeout: float, detail: str, as_given: bool = False) -> str:
    """torch's words for no batch within ``timeout`` seconds (``DataLoader timed out after T
    seconds``, T as :func:`seconds_text` prints it, or ``as_given`` when the caller holds the
    value the user gave), then feedgpu's ``detail`` (what each busy worker is doing)."""
    t = str(timeout) if as_given else seconds_text(timeout)
    return f"DataLoader timed out after {t} seconds. No batch from the workers within timeout={timeout} s: {detail}"


def pack_exception(e: BaseException, wid: int) -> tuple:
    """A worker's exception for the trip to the main process: ``(pickled exception or None when
    it does not pickle, type name, message, formatted traceback, worker id, a remote source's
    shard-cache counters at the failure or None)``."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        blob = pickle.dumps(e)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
        blob = None
    return (blob, type(e).__name__, str(e), tb, wid, getattr(e, "feedgpu_network", None))


def unsendable(e: Exception) -> Exception:
    """Why a worker could not send its result back (``e``: what sending raised), as the error the
    main process raises: :class:`~feedgpu.errors.TooManyOpenFiles` when descriptors ran out,
    :class:`~feedgpu.errors.SharedMemoryError` when shared memory did, else
    :class:`~feedgpu.errors.WorkerError` (the batch does not pickle)."""
    from . import fd_limit

    if fd_limit.out_of_descriptors(e):
        return fd_limit.error(e)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM) or "No space left" in str(e):
        return SharedMemoryError(
            f"a worker could not put its batch in shared memory ({type(e).__name__}: {e}). torch shares tensors "
            "through /dev/shm: give the container more (docker --shm-size), use "
            "torch.multiprocessing.set_sharing_strategy('file_system'), or lower batch_size / prefetch_factor")
    return WorkerError(f"a worker could not send its batch back to the main process ({type(e).__name__}: {e}); "
                       "the batch must be picklable")


def unpack_exception(packed: tuple, context: str) -> BaseException:
    """The exception :func:`pack_exception` packed: the same type where it pickles (else
    :class:`~feedgpu.errors.WorkerError` with its type and message), with an exception note in
    torch's words (``Caught X in DataLoader worker process N``), feedgpu's ``context`` (what
    the worker was doing: ``"while assembling batch 1 of epoch 0"``) and the worker's traceback."""
    blob, name, message, tb, wid, network = packed
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - e.g. a class the main process cannot import
            exc = None
    if exc is None:
        exc = WorkerError(f"{name}: {message}")
    if network is not None:   # a remote source's shard-cache counters at the failure
        exc.feedgpu_network = network
    return with_note(exc, f"Caught {name} in DataLoader worker process {wid} (raised in feedgpu worker {wid} "
                          f"{context}).\nOriginal {tb}")


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
    """torch's DataLoader's words for a dead worker: ``DataLoader worker (pid N) is killed by
    signal: <the C library's description>. `` (with torch's shared-memory hint after SIGBUS), or
    ``DataLoader worker (pid N) exited unexpectedly with exit code C. Details are lost due to
    multiprocessing. Rerunning with num_workers=0 may give better error trace.``"""
    if exitcode is not None and exitcode < 0:
        try:
            desc = signal.strsignal(-exitcode)
        except ValueError:  # pragma: no cover
            desc = None
        msg = f"DataLoader worker (pid {pid}) is killed by signal: {desc or f'Unknown signal {-exitcode}'}. "
        if -exitcode == signal.SIGBUS:
            msg += ("It is possible that dataloader's workers are out of shared memory. Please try to raise your "
                    "shared memory limit.")
        return msg
    return (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. Details are lost due to "
            "multiprocessing. Rerunning with num_workers=0 may give better error trace.")


def worker_death(proc, wid: int, kind: str, why: str | None = None) -> str:
    """feedgpu's words for a dead worker, naming it and its ``kind``: ``"IterableDataset worker 0
    (pid N) died unexpectedly (signal SIGKILL: ...)"``. ``why``: how it ended, when not from its
    exit code (a worker killed for never starting)."""
    how = why or exit_text(proc)
    if why is None and how == "signal SIGKILL":
        how += ": killed from outside, often by the kernel's out-of-memory killer (see dmesg)"
    elif why is None and how == "signal SIGBUS":
        how += ": often shared memory running out (the container's memory limit, or /dev/shm for torch tensors)"
    return f"{kind} worker {wid} (pid {proc.pid}) died unexpectedly ({how})"


def death_message(proc, wid: int, kind: str, why: str | None = None) -> str:
    """A dead worker's error message: torch's words (:func:`torch_death`), then feedgpu's
    (:func:`worker_death`)."""
    return f"{torch_death(proc.pid, proc.exitcode).rstrip()} {worker_death(proc, wid, kind, why)}"
