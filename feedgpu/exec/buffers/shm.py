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

from .recycled import RecycledBuffers


#: ``madvise`` advice (Linux 5.14, include/uapi/asm-generic/mman-common.h); Python's mmap module
#: lacks the constant before 3.13.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PAGE = mmap.ALLOCATIONGRANULARITY


def shared_file(nbytes: int, name: str, allocate: int = 0) -> tuple[int, mmap.mmap]:
    """``(fd, mapping)``: a shared-memory file of ``nbytes`` (``memfd_create``) mapped
    ``MAP_SHARED``, its first ``allocate`` bytes allocated now (``posix_fallocate``: zeroed pages,
    so that a worker's first write costs a minor fault, and a shortage raises ``OSError`` here
    rather than ``SIGBUS`` in a worker). ``fd`` is -1 where ``memfd_create`` is missing: an
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


def close_fd(fd: int) -> None:
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


def madvise_populate(mm: mmap.mmap, length: int) -> None:
    """Map the first ``length`` bytes of ``mm`` into this process's page tables now, in one call
    (``MADV_POPULATE_WRITE``, Linux >= 5.14), instead of one page fault per 4 KiB page later. A
    no-op where the kernel does not have it."""
    if length <= 0:
        return
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, length)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            raise


#: Bytes mapped in per call by :func:`populate_soon`'s thread (``madvise`` holds the GIL).
POPULATE_CHUNK = 8 << 20


def populate_soon(mm: mmap.mmap, length: int, now: int, alive=lambda: True) -> threading.Thread | None:
    """Map the first ``now`` bytes of ``mm`` in at once (:func:`madvise_populate`) and the rest of
    the first ``length`` from a daemon thread, ``POPULATE_CHUNK`` bytes per call, while
    ``alive()`` holds, so that the first batch does not wait for the whole buffer's page
    tables. Mapping a page in never changes its contents, so the thread may run while workers
    write into the slots. Returns the thread (None when nothing is left for it)."""
    now = min(now, length)
    madvise_populate(mm, now)
    if length <= now:
        return None

    t = threading.Thread(target=_populate_range, args=(mm, now, length, alive), name="feedgpu-populate",
                         daemon=True)
    t.start()
    return t


def _populate_range(mm: mmap.mmap, start: int, end: int, alive) -> None:
    """Map bytes ``start:end`` of ``mm`` in, ``POPULATE_CHUNK`` bytes per call, while ``alive()``
    holds (a thread's work: :func:`populate_soon`, :func:`_allocate_rest`)."""
    for begin in range(start, end, POPULATE_CHUNK):
        if not alive():
            return
        try:
            mm.madvise(MADV_POPULATE_WRITE, begin, min(POPULATE_CHUNK, end - begin))
        except (OSError, ValueError):   # no MADV_POPULATE_WRITE here, or the mapping was closed
            return


def _alive(slots) -> callable:
    """``() -> bool``: ``slots`` still exists and is not closed (held weakly: a thread mapping
    its pages in does not keep it alive)."""
    ref = weakref.ref(slots)
    return lambda: (s := ref()) is not None and s._mm is not None


def _check_fits(nbytes: int) -> None:
    """``OSError`` (ENOMEM) when ``nbytes`` is more than the memory the machine has available."""
    try:
        import psutil

        available = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001 - no reading: the allocation itself will tell
        return
    if nbytes > available:
        raise OSError(errno.ENOMEM, f"{nbytes / 2**30:,.2f} GiB asked, {available / 2**30:,.2f} GiB available")


def _allocate_rest(ref) -> None:
    """The allocating thread of a :class:`BatchSlots` (held weakly): each pre-allocated slot after
    the first in turn (``posix_fallocate``, which releases the GIL), then this process's page
    tables for them (:func:`populate_soon`'s work, from this thread). Whatever stops it before
    every slot is allocated is recorded, so no :meth:`BatchSlots.acquire` waits for ever."""
    try:
        _allocate(ref)
    except BaseException as e:  # noqa: BLE001 - out of descriptors, or a bug: acquire() raises it
        s = ref()
        if s is not None:
            s._allocated(s._ready, e if isinstance(e, OSError) else OSError(errno.EIO, repr(e)))


def _allocate(ref) -> None:
    s = ref()
    if s is None or s._mm is None:
        return
    fd, stride, total = os.dup(s._fd), s.stride, s.populated   # its own descriptor: never a reused number
    start = s._ready
    del s
    try:
        for k in range(start, total):
            s = ref()
            if s is None or s._mm is None:
                return
            try:
                os.posix_fallocate(fd, k * stride, stride)
            except OSError as e:
                s._allocated(k, e)
                return
            s._allocated(k + 1)
            del s
    finally:
        os.close(fd)
    s = ref()
    if s is None or s._mm is None:
        return
    mm, alive = s._mm, _alive(s)
    del s
    _populate_range(mm, stride, total * stride, alive)


class BatchSlots(RecycledBuffers):
    """``count`` buffers, each holding ``images`` (``batch_size`` x ``sample_shape``, ``dtype``)
    followed by ``labels`` (int64, ``batch_size``). The first ``populate`` (default: all) are
    allocated now and handed out first; the others take memory only when first written (the
    balancer's spare buffers for a larger pool).

    Picklable for a worker started with ``spawn`` or ``forkserver`` while the pool starts it (the
    shared file's descriptor is passed, see :func:`share_fd`); the copy maps the same memory.
    A slot handed out returns when its tensors are gone (:class:`RecycledBuffers`; keys are slot
    numbers, ``held`` counts the slots the consumer holds).

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
        # Allocating the pages zero-fills them once: a worker's first write to a page then
        # costs a minor fault, not a fault plus zeroing. The first slot is allocated here, the
        # others from a thread while the first batch is made (a slot is handed out only once it
        # is allocated); that they fit in memory is checked here, so a shortage is a clear
        # error, not a worker killed later. Persistent workers take their faults once per run.
        populate = count if populate is None else min(count, populate)
        super().__init__()
        self.populated = populate
        try:
            _check_fits(populate * self.stride)
            self._fd, self._mm = shared_file(max(1, count * self.stride), "feedgpu-batches",
                                             min(populate, 1) * self.stride)
        except OSError as e:
            raise self._no_memory(e) from None
        self._closer = weakref.finalize(self, close_fd, self._fd)
        self._free = list(range(count))[::-1]   # pop() takes the pre-allocated ones first
        self._ready = populate if self._fd < 0 else min(populate, 1)   # slots allocated so far
        self._alloc_error: OSError | None = None
        self._alloc_cond = threading.Condition(threading.Lock())
        madvise_populate(self._mm, min(populate, 1) * self.stride)   # this process reads them
        if populate > 1 and self._fd >= 0:
            threading.Thread(target=_allocate_rest, args=(weakref.ref(self),), name="feedgpu-allocate",
                             daemon=True).start()

    def _no_memory(self, e: OSError):
        from ...errors import SharedMemoryError

        return SharedMemoryError(
            f"could not map {self.count} batch buffers of {self.nbytes / 2**20:,.0f} MiB "
            f"({self.count * self.nbytes / 2**30:,.2f} GiB) of shared memory: {e}. Lower batch_size, "
            "prefetch_factor or num_workers, or deliver uint8/float16 (output.dtype)")

    def _allocated(self, k: int, error: OSError | None = None) -> None:
        with self._alloc_cond:
            if error is not None:
                self._alloc_error = error
            else:
                self._ready = k
            self._alloc_cond.notify_all()

    def _wait_allocated(self, slot: int) -> None:
        """Block until ``slot`` is allocated; :class:`SharedMemoryError` when it cannot be."""
        with self._alloc_cond:
            while slot >= self._ready and self._alloc_error is None:
                self._alloc_cond.wait(1.0)
            if slot >= self._ready:
                raise self._no_memory(self._alloc_error)

    def __getstate__(self) -> dict:
        if self._mm is None:
            raise ValueError("these batch buffers are closed")
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_fd", "_mm", "_free", "_lock", "_closer", "_alloc_cond", "_alloc_error")}
        state["_shared"] = share_fd(self._fd)
        return state

    def __setstate__(self, state: dict) -> None:
        shared = state.pop("_shared")
        self.__dict__.update(state)
        self._fd, self._mm = attach_fd(shared, max(1, self.count * self.stride))
        self._closer = weakref.finalize(self, close_fd, self._fd)
        self._free, self._lock, self.held = [], threading.Lock(), 0   # a worker hands out nothing
        self._alloc_error, self._alloc_cond = None, threading.Condition(threading.Lock())

    def map_in(self) -> None:
        """In a worker: map the pre-allocated buffers into this process's page tables
        (``MADV_POPULATE_WRITE``, Linux >= 5.14) instead of one page fault per 4 KiB page during
        its first batches: the first slot now, the others from a thread while the worker runs
        its first tasks (:func:`populate_soon`). A no-op where the kernel does not have it."""
        populate_soon(self._mm, self.populated * self.stride, self.stride, _alive(self))

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
        """A free slot (pre-allocated ones first, each once allocated), None when none is free.
        Raises :class:`SharedMemoryError` when a slot's memory could not be allocated."""
        slot = self._pop_free()
        if slot is not None and self._ready <= slot < self.populated:
            try:
                self._wait_allocated(slot)
            except BaseException:
                self.release(slot)
                raise
        return slot

    def hand_out(self, slot: int, rows: int):
        """Tensors ``(images[:rows], labels[:rows])`` over the slot; the slot is released when
        both (and every view of them) are gone."""
        import torch

        images, labels = self.arrays(slot)
        images, labels = images[:rows], labels[:rows]
        self.return_when_gone(slot, (images, labels))
        return torch.from_numpy(images), torch.from_numpy(labels)

    def copy_out(self, slot: int, rows: int):
        """Owned tensor copies of a slot's rows; the slot is released at once."""
        import torch

        images, labels = self.arrays(slot)
        out = torch.from_numpy(images[:rows].copy()), torch.from_numpy(labels[:rows].copy())
        self.release(slot)
        return out

    def deliver(self, slot: int, rows: int, keep_views: int):
        """:meth:`hand_out` while fewer than ``keep_views`` slots are held by the consumer, else
        :meth:`copy_out` (a consumer holding many batches must not starve the pool of slots)."""
        if self.held < keep_views:
            return self.hand_out(slot, rows)
        return self.copy_out(slot, rows)

    def close(self) -> None:
        # Never mmap.close(): numpy views hold the mapping as their base without a buffer
        # export, so closing would unmap memory a tensor still reads. The mapping is unmapped
        # when its last reference (ours or a view's) goes; the file's memory goes with the last
        # mapping and descriptor (a worker's included).
        self._mm = None
        self._free = []
        self._closer()
        self._fd = -1
