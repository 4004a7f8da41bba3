"""Running out of file descriptors while batches travel from the workers, reported as torch
reports it.

With torch's ``file_descriptor`` sharing strategy (Linux's default) every shared-memory storage a
batch holds costs the main process one descriptor for as long as the tensor lives, so a training
loop that keeps batches (or many small tensors per batch) meets the ``RLIMIT_NOFILE`` limit.
Wherever a batch cannot be received or sent because of it, the loader raises
:class:`~feedgpu.errors.TooManyOpenFiles` (a ``RuntimeError``), whose message names the two ways
out torch names: a higher ``ulimit -n``, or the ``file_system`` sharing strategy.
"""
from __future__ import annotations

import errno
import os

from ...errors import TooManyOpenFiles

#: descriptors that must still be free for the process not to count as out of them
MARGIN = 10
MESSAGE = ("Too many open files: communication with the workers is no longer possible. Please increase the "
           "limit using `ulimit -n` in the shell or change the sharing strategy by calling "
           "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code")


def out_of_descriptors(e: BaseException | None = None) -> bool:
    """True when ``e`` is an ``EMFILE``/``ENFILE`` error, or this process cannot open
    :data:`MARGIN` more descriptors (errors raised deep in torch's unpickling do not carry
    ``errno``)."""
    if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
        return True
    fds: list[int] = []
    try:
        for _ in range(MARGIN):
            fds.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as err:
        return err.errno in (errno.EMFILE, errno.ENFILE)
    finally:
        for fd in fds:
            os.close(fd)
    return False


def error(e: BaseException) -> TooManyOpenFiles:
    """The :class:`TooManyOpenFiles` to raise for ``e``."""
    return TooManyOpenFiles(f"{MESSAGE} ({type(e).__name__}: {e})")


def raise_if_out(e: BaseException) -> None:
    """Raise :class:`TooManyOpenFiles` from ``e`` when descriptors ran out, else return."""
    if out_of_descriptors(e):
        raise error(e) from e
