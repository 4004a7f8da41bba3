"""Batch buffers' page tables: the first slot is mapped in at once, the rest from a thread."""
from __future__ import annotations

import os

import numpy as np
import psutil
import pytest

from feedgpu.exec.shm import MADV_POPULATE_WRITE, BatchSlots, populate_soon, shared_file

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
