"""RecycledBuffers, the free list under both batch-buffer kinds (shared-memory slots, host
buffers): a buffer handed out comes back only when every array of it, and every tensor or view
over them, is gone, and is counted as held until then."""
from __future__ import annotations

import gc

import numpy as np
import torch

from feedgpu.exec.buffers.host import HostBuffers
from feedgpu.exec.buffers.recycled import RecycledBuffers
from feedgpu.exec.buffers.shm import BatchSlots


def test_a_buffer_returns_when_the_last_of_its_arrays_and_views_is_gone():
    rb = RecycledBuffers()
    images, labels = np.zeros((4, 3), np.float32), np.zeros(4, np.int64)
    rb.return_when_gone("slot-a", (images, labels))
    t_images, t_labels = torch.from_numpy(images), torch.from_numpy(labels)
    del images, labels
    gc.collect()
    assert rb.held == 1 and rb.free == 0            # the tensors keep the arrays alive
    view = t_images[1:]
    del t_images, t_labels
    gc.collect()
    assert rb.held == 1 and rb.free == 0, "a view of the images still reads the buffer"
    del view
    gc.collect()
    assert rb.held == 0 and rb.free == 1 and rb._pop_free() == "slot-a" and rb._pop_free() is None


def test_a_buffer_that_returns_after_its_owner_is_gone_is_dropped():
    rb = RecycledBuffers()
    arr = np.zeros(8)
    rb.return_when_gone(0, (arr,))
    del rb
    gc.collect()
    del arr      # its finalizer runs with no owner left: nothing to return to, nothing raised
    gc.collect()


def test_both_batch_buffer_kinds_are_recycled_buffers():
    slots = BatchSlots(2, 4, (3,), "float32")
    try:
        slot = slots.acquire()
        images, labels = slots.hand_out(slot, 3)
        assert isinstance(slots, RecycledBuffers) and slots.held == 1 and slots.free == 1
        del images, labels
        gc.collect()
        assert slots.held == 0 and slots.free == 2
    finally:
        slots.close()
    hb = HostBuffers(4, (2,), "uint8", count=1)
    arr = hb.take()
    t = hb.hand_out(arr, 2)
    assert isinstance(hb, RecycledBuffers) and hb.held == 1 and hb.free == 0
    del t
    gc.collect()
    assert hb.held == 0 and hb.take() is arr
