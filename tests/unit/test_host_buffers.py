"""HostBuffers, the one recycler of host batch buffers (DALI's copies out, the pinned staging of
the device prefetch): a buffer comes back when the tensors viewing it are gone, or once the
copy out of it has completed; it is never handed out while still in use."""
from __future__ import annotations

import gc

import numpy as np

from feedgpu.exec.buffers.host import HostBuffers


class FakeEvent:
    """A CUDA event stand-in: ``done`` says whether the copy it marks has completed."""

    def __init__(self, done: bool = False):
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited, self.done = True, True


def test_a_buffer_copied_from_comes_back_once_its_copy_completed():
    hb = HostBuffers(4, (2, 3), "uint8", count=2)
    a = hb.take()
    assert a.shape == (4, 2, 3) and a.dtype == np.uint8
    ev_a = FakeEvent()
    hb.give_back_after(a, ev_a)
    b = hb.take()
    assert b is not a, "a is still being copied from and the second kept buffer is not made yet"
    ev_b = FakeEvent()
    hb.give_back_after(b, ev_b)
    ev_b.done = True
    assert hb.take() is b and not ev_b.waited, "b's copy completed: b is free, nothing waited"
    hb.give_back_after(b, FakeEvent())
    c = hb.take()     # both kept buffers in a copy: the oldest is waited for, no third is made
    assert c is a and ev_a.waited and hb.fresh == 0


def test_a_buffer_handed_out_comes_back_when_its_tensors_are_gone():
    hb = HostBuffers(4, (3,), "float32", count=1)
    a = hb.take()
    t = hb.hand_out(a, 2)
    assert tuple(t.shape) == (2, 3)
    other = hb.take()
    assert other is not a and hb.fresh == 1, "a is held by the training loop: fresh memory instead"
    del t
    gc.collect()
    assert hb.take() is a


def test_an_untracked_buffer_is_not_taken_back():
    hb = HostBuffers(2, (1,), "int64", count=1)
    hb.take()
    fresh = hb.take()              # over the count: not kept
    hb.give_back_after(fresh, FakeEvent(done=True))
    hb.give_back(fresh)
    assert hb.take() is not fresh and hb.fresh == 2
