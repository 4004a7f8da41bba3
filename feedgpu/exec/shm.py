"""Batch buffers in shared memory, handed to the training loop without a copy.

The buffers of a :class:`BatchSlots` are one shared-memory file (``memfd_create``: not a file in
``/dev/shm``, so limited by RAM and the container's memory limit, not by Docker's 64 MB
``/dev/shm``, and with no name to leak), mapped once in the main process. Forked workers inherit
the mapping; a worker started with ``spawn`` or ``forkserver`` gets the file descriptor itself,
passed by multiprocessing when the pool pickles the work for it (:func:`share_fd`), and maps it
(:meth:`BatchSlots.__setstate__`): the batch bytes never travel through a pipe. Workers write into
a slot and the main process reads it with no pickling.

A slot handed to the consumer returns to the free list when the last tensor viewing it is
garbage-collected: ``torch.from_numpy`` keeps the numpy array it wraps alive for as long as any
tensor shares its storage, and a ``weakref.finalize`` on that array releases the slot. The mapping
itself goes when the last view of any slot, and the :class:`BatchSlots`, are gone.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
import weakref

import numpy as np


#: ``madvise`` advice (Linux 5.14, include/uapi/asm-generic/mman-common.h); Python's mmap module
#: lacks the constant before 3.13.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PAGE = mmap.ALLOCATIONGRANULARITY


def shared_file(nbytes: int, name: str, allocate: int = 0) -> tuple[int, mmap.mmap]:
    """``(fd, mapping)``: a shared-memory file of ``nbytes`` (``memfd_create``) mapped
    ``MAP_SHARED``, its first ``allocate`` bytes allocated now (``posix_fallocate``: zeroed pages,
    so that a first write costs a minor fault, and a shortage raises ``OSError`` here rather
    than ``SIGBUS`` at a write). ``fd`` is -1 where ``memfd_create`` is missing: an
    anonymous mapping, which forked workers inherit but spawned ones cannot get.

    Raises ``OSError`` when the memory cannot be had."""
    if not hasattr(os, "memfd_create"):  # pragma: no cover - not Linux
        return -1, mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)  # spawn and forkserver pass it explicitly
    try:
        os.ftruncate(fd, nbytes)
        if allocate:
            os.posix_fallocate(fd, 0, min(allocate, nbytes))
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def _close_fd(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def share_fd(fd: int):
    """A picklable stand-in for ``fd`` (multiprocessing's ``DupFd``): while the pool starts a
    spawn or forkserver worker it is the descriptor passed to that child; ``.detach()`` in the
    child returns the child's descriptor."""
    if fd < 0:
        raise TypeError("these shared buffers are an anonymous mapping (no memfd_create here): only forked "
                        "workers can use them; use multiprocessing_context='fork'")
    from multiprocessing.reduction import DupFd

    return DupFd(fd)


def attach_fd(shared, nbytes: int) -> tuple[int, mmap.mmap]:
    """In a child: ``(fd, mapping)`` of what :func:`share_fd` passed."""
    fd = shared.detach()
    return fd, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)


def madvise_populate(mm: mmap.mmap, length: int, start: int = 0) -> None:
    """Map bytes ``start:start + length`` of ``mm`` into this process's page tables now, in one
    call (``MADV_POPULATE_WRITE``, Linux >= 5.14), instead of one page fault per 4 KiB page later.
    A no-op where the kernel does not have it."""
    if length <= 0:
        return
    try:
        mm.madvise(MADV_POPULATE_WRITE, start, length)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            raise


def _check_fits(nbytes: int) -> None:
    """``OSError`` (ENOMEM) when ``nbytes`` is more than the memory the machine has available."""
    try:
        import psutil

        available = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001 - no reading: the allocation itself will tell
        return
    if nbytes > available:
        raise OSError(errno.ENOMEM, f"{nbytes / 2**30:,.2f} GiB asked, {available / 2**30:,.2f} GiB available")


class BatchSlots:
    """``count`` buffers, each holding ``images`` (``batch_size`` x ``sample_shape``, ``dtype``)
    followed by ``labels`` (int64, ``batch_size``). ``populate`` (default: all) is how many are
    expected in use: that they fit in the memory available is checked here; the others are the
    balancer's spare buffers for a larger pool.

    A slot's memory is allocated by the first process that writes into it, :meth:`prepare` (the
    worker that fills it, before its first sample), not ahead: allocating and mapping in every
    slot while the first batches are made takes the cores those batches need.

    Picklable for a worker started with ``spawn`` or ``forkserver`` while the pool starts it (the
    shared file's descriptor is passed, see :func:`share_fd`); the copy maps the same memory.

    Raises :class:`~feedgpu.errors.SharedMemoryError` when the buffers cannot be had."""

    def __init__(self, count: int, batch_size: int, sample_shape: tuple, dtype: str, populate: int | None = None):
        self.batch_size = batch_size
        self.shape = (batch_size, *sample_shape)
        self.dtype = np.dtype(dtype)
        self.image_bytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.label_offset = (self.image_bytes + 63) // 64 * 64
        self.nbytes = self.label_offset + 8 * batch_size
        self.stride = (self.nbytes + PAGE - 1) // PAGE * PAGE   # each slot starts on a page
        self.count = count
        populate = count if populate is None else min(count, populate)
        self.populated = populate
        try:
            _check_fits(populate * self.stride)   # a shortage is a clear error now, not a worker killed later
            self._fd, self._mm = shared_file(max(1, count * self.stride), "feedgpu-batches")
        except OSError as e:
            raise self._no_memory(e) from None
        self._closer = weakref.finalize(self, _close_fd, self._fd)
        self._free = list(range(count))[::-1]   # pop() takes the lowest first
        self._lock = threading.Lock()
        self.held = 0       # slots the consumer still holds
        self._prepared: set[int] = set()   # slots this process has allocated and mapped in

    def _no_memory(self, e: OSError):
        from ..errors import SharedMemoryError

        return SharedMemoryError(
            f"could not map {self.count} batch buffers of {self.nbytes / 2**20:,.0f} MiB "
            f"({self.count * self.nbytes / 2**30:,.2f} GiB) of shared memory: {e}. Lower batch_size, "
            "prefetch_factor or num_workers, or deliver uint8/float16 (output.dtype)")

    def __getstate__(self) -> dict:
        if self._mm is None:
            raise ValueError("these batch buffers are closed")
        state = {k: v for k, v in self.__dict__.items() if k not in ("_fd", "_mm", "_free", "_lock", "_closer")}
        state["_shared"] = share_fd(self._fd)
        return state

    def __setstate__(self, state: dict) -> None:
        shared = state.pop("_shared")
        self.__dict__.update(state)
        self._fd, self._mm = attach_fd(shared, max(1, self.count * self.stride))
        self._closer = weakref.finalize(self, _close_fd, self._fd)
        self._free, self._lock, self.held = [], threading.Lock(), 0   # a worker hands out nothing
        self._prepared = set()

    def map_in(self) -> None:
        """In a worker as it starts: no slot is mapped into its page tables yet (a forked child
        does not inherit the parent's for a shared mapping); :meth:`prepare` maps each in when
        the worker first writes into it."""
        self._prepared = set()

    def prepare(self, slot: int) -> None:
        """Before this process's first write into ``slot``: allocate its pages, zeroed, unless
        another process already has (``posix_fallocate``, so that a shortage raises here rather
        than ``SIGBUS`` at a write), and map them into this process's page tables in one call
        (:func:`madvise_populate`: a write then costs no page fault). Once per slot and process.

        Raises :class:`~feedgpu.errors.SharedMemoryError` when the memory cannot be had."""
        if slot in self._prepared:
            return
        if not 0 <= slot < self.count:
            raise IndexError(f"batch slot {slot} of {self.count}")
        try:
            if self._fd >= 0:
                os.posix_fallocate(self._fd, slot * self.stride, self.stride)
            madvise_populate(self._mm, self.stride, slot * self.stride)
        except OSError as e:
            raise self._no_memory(e) from None
        self._prepared.add(slot)

    def __len__(self) -> int:
        return self.count

    def arrays(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Fresh numpy views (images, labels) of a slot."""
        if not 0 <= slot < self.count:
            raise IndexError(f"batch slot {slot} of {self.count}")
        base = slot * self.stride
        images = np.ndarray(self.shape, self.dtype, buffer=self._mm, offset=base)
        labels = np.ndarray((self.batch_size,), np.int64, buffer=self._mm, offset=base + self.label_offset)
        return images, labels

    def acquire(self) -> int | None:
        """A free slot (the lowest numbers first), None when none is free."""
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    def hand_out(self, slot: int, rows: int):
        """Tensors ``(images[:rows], labels[:rows])`` over the slot; the slot is released when
        both (and every view of them) are gone."""
        import torch

        images, labels = self.arrays(slot)
        images, labels = images[:rows], labels[:rows]
        remaining = [2]
        lock = self._lock

        def done(_slots=weakref.ref(self)):
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            s = _slots()
            if last and s is not None:
                with lock:
                    s.held -= 1
                s.release(slot)

        with lock:
            self.held += 1
        weakref.finalize(images, done)
        weakref.finalize(labels, done)
        return torch.from_numpy(images), torch.from_numpy(labels)

    def copy_out(self, slot: int, rows: int):
        """Owned tensor copies of a slot's rows; the slot is released at once."""
        import torch

        images, labels = self.arrays(slot)
        out = torch.from_numpy(images[:rows].copy()), torch.from_numpy(labels[:rows].copy())
        self.release(slot)
        return out

    def close(self) -> None:
        # Never mmap.close(): numpy views hold the mapping as their base without a buffer
        # export, so closing would unmap memory a tensor still reads. The mapping is unmapped
        # when its last reference (ours or a view's) goes; the file's memory goes with the last
        # mapping and descriptor (a worker's included).
        self._mm = None
        self._free = []
        self._closer()
        self._fd = -1
