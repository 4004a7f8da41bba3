"""Batch buffers in shared memory: each slot allocated and mapped in by the process that first
writes into it, and the up-front check that they fit."""
from __future__ import annotations

import os

import numpy as np
import psutil
import pytest

from feedgpu.exec.shm import MADV_POPULATE_WRITE, BatchSlots, shared_file

MIB = 1 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _supported() -> bool:
    fd, mm = shared_file(MIB, "feedgpu-test", MIB)
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, MIB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


needs_populate = pytest.mark.skipif(not _supported(), reason="this kernel has no MADV_POPULATE_WRITE")


def test_batch_slots_hand_out_zeroed_buffers():
    slots = BatchSlots(6, 4, (8, 8, 3), "float32")
    seen = set()
    for _ in range(6):
        s = slots.acquire()
        slots.prepare(s)
        images, labels = slots.arrays(s)
        assert images.shape == (4, 8, 8, 3) and not images.any() and not labels.any()
        seen.add(s)
    assert seen == set(range(6)) and slots.acquire() is None
    slots.close()


@needs_populate
def test_a_slot_takes_memory_only_once_a_process_prepares_it_and_keeps_what_was_written():
    """No slot is allocated ahead (allocating all of them while the first batches are made takes
    the cores those batches need); prepare() allocates and maps in one slot, once per process."""
    slots = BatchSlots(4, 64, (224, 224, 3), "uint8")     # 4 slots of ~9.2 MiB
    before = _rss()
    assert slots.acquire() == 0 and _rss() - before < 2 * MIB   # handing out allocates nothing
    slots.prepare(0)
    grew = _rss() - before
    assert slots.stride - MIB <= grew <= slots.stride + 2 * MIB   # slot 0 only, not the other three
    images, labels = slots.arrays(0)
    images[:] = 7
    slots.prepare(0)                                      # again: nothing happens, nothing is lost
    assert _rss() - before < slots.stride + 2 * MIB
    assert (slots.arrays(0)[0] == 7).all()
    slots.close()


def test_a_slot_whose_memory_cannot_be_had_raises_shared_memory_error_when_prepared(monkeypatch):
    """The memory is allocated before the first write, so a shortage is a clear error in the
    process that prepares the slot (the worker's batch fails with it), not SIGBUS."""
    import feedgpu.exec.shm as shm
    from feedgpu.errors import SharedMemoryError

    real = os.posix_fallocate

    def fails(fd, offset, length):
        if offset:
            raise OSError(12, "Cannot allocate memory")
        return real(fd, offset, length)

    monkeypatch.setattr(shm.os, "posix_fallocate", fails)
    slots = BatchSlots(3, 4, (8, 8, 3), "float32")
    slots.prepare(0)
    with pytest.raises(SharedMemoryError, match="could not map 3 batch buffers.*Cannot allocate memory"):
        slots.prepare(1)
    monkeypatch.setattr(shm.os, "posix_fallocate", real)
    slots.prepare(1)                                      # not recorded as prepared: tried again
    slots.close()


def test_batch_buffers_larger_than_the_available_memory_are_refused_up_front(monkeypatch):
    import feedgpu.exec.shm as shm
    from feedgpu.errors import SharedMemoryError

    with pytest.raises(OSError, match="EiB|GiB asked"):
        shm._check_fits(1 << 62)                               # 4 EiB: more than any machine has
    shm._check_fits(1 << 20)

    def short(n):
        raise OSError(12, f"{n / 2**30:.2f} GiB asked, 0.01 GiB available")

    monkeypatch.setattr(shm, "_check_fits", short)
    with pytest.raises(SharedMemoryError, match="could not map 8 batch buffers.*GiB asked, 0.01 GiB available"):
        BatchSlots(8, 256, (224, 224, 3), "float32")
