"""Batch buffers' page tables: the first slot is mapped in at once, the rest from a thread."""
from __future__ import annotations

import os

import numpy as np
import psutil
import pytest

from feedgpu.exec.buffers.shm import MADV_POPULATE_WRITE, BatchSlots, populate_soon, shared_file

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


@needs_populate
def test_populate_soon_maps_the_first_bytes_now_and_the_rest_from_a_thread():
    n = 96 * MIB
    fd, mm = shared_file(n, "feedgpu-test", n)
    before = _rss()
    t = populate_soon(mm, n, 8 * MIB)
    assert t is not None and t.daemon
    t.join(30)
    assert not t.is_alive()
    assert _rss() - before >= 90 * MIB        # every page of the 96 MiB is mapped in


@needs_populate
def test_populate_soon_stops_when_the_buffers_go_and_keeps_the_contents():
    n = 64 * MIB
    fd, mm = shared_file(n, "feedgpu-test", n)
    view = np.ndarray((n,), np.uint8, buffer=mm)
    view[::4096] = 7                          # written before: mapping in changes nothing
    before = _rss()
    t = populate_soon(mm, n, 4 * MIB, alive=lambda: False)
    t.join(30)
    grew = _rss() - before
    assert grew < 8 * MIB                     # only the first 4 MiB (the thread stopped at once)
    assert (view[::4096] == 7).all() and view[1::4096].max() == 0
    assert populate_soon(mm, 2 * MIB, 4 * MIB) is None   # all of it mapped now: no thread


def test_batch_slots_hand_out_zeroed_buffers_while_mapping_in():
    slots = BatchSlots(6, 4, (8, 8, 3), "float32")
    seen = set()
    for _ in range(6):
        s = slots.acquire()
        images, labels = slots.arrays(s)
        assert images.shape == (4, 8, 8, 3) and not images.any() and not labels.any()
        seen.add(s)
    assert seen == set(range(6))
    slots.close()


def test_slots_after_the_first_are_allocated_by_a_thread_and_handed_out_once_allocated(monkeypatch):
    """The first slot is allocated when the buffers are made, the others from a thread; a slot
    is handed out only once its memory is there, and one that cannot be had raises
    SharedMemoryError (the slot stays free) instead of a worker dying on it later."""
    import threading

    import feedgpu.exec.buffers.shm as shm
    from feedgpu.errors import SharedMemoryError

    gate = threading.Event()
    real = os.posix_fallocate
    calls = []

    def slow(fd, offset, length):
        calls.append(offset)
        if len(calls) > 1:      # the thread's calls wait for the test
            gate.wait(10)
        return real(fd, offset, length)

    monkeypatch.setattr(shm.os, "posix_fallocate", slow)
    slots = BatchSlots(4, 4, (8, 8, 3), "float32")
    assert slots.acquire() == 0 and slots._ready >= 1          # the first at once
    got = []
    t = threading.Thread(target=lambda: got.append(slots.acquire()))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got                            # slot 1 waits for its memory
    gate.set()
    t.join(10)
    assert got == [1] and slots._ready >= 2
    assert {slots.acquire(), slots.acquire()} == {2, 3}
    slots.close()

    def fails(fd, offset, length):
        if offset:
            raise OSError(12, "Cannot allocate memory")
        return real(fd, offset, length)

    monkeypatch.setattr(shm.os, "posix_fallocate", fails)
    slots = BatchSlots(3, 4, (8, 8, 3), "float32")
    assert slots.acquire() == 0
    with pytest.raises(SharedMemoryError, match="could not map 3 batch buffers.*Cannot allocate memory"):
        slots.acquire()
    assert slots.free == 2                                     # the slot went back
    slots.close()


def test_batch_buffers_larger_than_the_available_memory_are_refused_up_front(monkeypatch):
    import feedgpu.exec.buffers.shm as shm
    from feedgpu.errors import SharedMemoryError

    with pytest.raises(OSError, match="EiB|GiB asked"):
        shm._check_fits(1 << 62)                               # 4 EiB: more than any machine has
    shm._check_fits(1 << 20)

    def short(n):
        raise OSError(12, f"{n / 2**30:.2f} GiB asked, 0.01 GiB available")

    monkeypatch.setattr(shm, "_check_fits", short)
    with pytest.raises(SharedMemoryError, match="could not map 8 batch buffers.*GiB asked, 0.01 GiB available"):
        BatchSlots(8, 256, (224, 224, 3), "float32")


def test_an_allocating_thread_that_stops_early_never_leaves_acquire_waiting(monkeypatch):
    import feedgpu.exec.buffers.shm as shm
    from feedgpu.errors import SharedMemoryError

    real_dup = os.dup
    monkeypatch.setattr(shm.os, "dup", lambda fd: (_ for _ in ()).throw(OSError(24, "Too many open files")))
    slots = BatchSlots(3, 4, (8, 8, 3), "float32")
    monkeypatch.setattr(shm.os, "dup", real_dup)
    assert slots.acquire() == 0
    with pytest.raises(SharedMemoryError, match="Too many open files"):
        slots.acquire()
    slots.close()
