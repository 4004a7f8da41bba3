"""The pool's result channel: tensors arrive as torch's reductions share them (same values, in
shared memory, views of one storage still sharing it), their descriptors carried with the
message instead of fetched from the worker's resource sharer; no descriptor leaks; a sender
that dies mid-message and a receiver out of descriptors raise instead of hanging."""
from __future__ import annotations

import multiprocessing as mp
import os
import resource
import struct

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401  registers torch's reductions

from feedgpu import WorkerError
from feedgpu.exec.pool.fd_channel import MAX_FDS, Channel

pytestmark = pytest.mark.timeout(60)
ctx = mp.get_context("fork")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _payload() -> dict:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    shared = torch.arange(6, dtype=torch.int64).share_memory_()
    return {"plain": base, "shared": shared, "views": (base[0], base[2]), "empty": torch.empty(0, 5),
            "array": np.arange(4, dtype=np.uint8), "text": "a sample", "many": [torch.full((2,), float(i))
                                                                              for i in range(MAX_FDS + 6)]}


def _send_payload(end: Channel) -> None:
    from multiprocessing import resource_sharer

    end.send(_payload())
    # the descriptors came with the message: the worker's resource sharer (torch's DupFd path)
    # served only the storages past MAX_FDS
    end.send(resource_sharer._resource_sharer._address is not None)
    end.recv()   # torch's DupFd path needs this process until the receiver has fetched them
    end.close()


def test_tensors_arrive_as_torch_shares_them():
    mine, theirs = Channel.pair()
    p = ctx.Process(target=_send_payload, args=(theirs,))
    p.start()
    theirs.close()
    try:
        before = open_fds()
        got = mine.recv()
        used_sharer = mine.recv()
        mine.send("done")
    finally:
        p.join(10)
        mine.close()
    want = _payload()
    for key in ("plain", "shared", "empty"):
        assert torch.equal(got[key], want[key]) and got[key].dtype == want[key].dtype
        assert got[key].is_shared() or got[key].numel() == 0   # as through torch's queues
    assert [v.tolist() for v in got["views"]] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    got["views"][0][0] = 100.0   # two views of one storage still share it, as with torch
    assert got["views"][1].untyped_storage().data_ptr() == got["views"][0].untyped_storage().data_ptr()
    assert got["array"].tolist() == [0, 1, 2, 3] and got["text"] == "a sample"
    assert [t.tolist() for t in got["many"]] == [[float(i)] * 2 for i in range(MAX_FDS + 6)]
    assert used_sharer  # the last 6 took torch's own path: it still works alongside
    del got
    assert open_fds() <= before  # every descriptor received was closed once mapped


def _send_without_resource_sharer(end: Channel) -> None:
    from multiprocessing import resource_sharer

    end.send([torch.ones(3).share_memory_(), torch.zeros(2, dtype=torch.int64)])
    end.send(resource_sharer._resource_sharer._address is None)
    end.close()


def test_a_batch_needs_no_connection_back_to_the_worker():
    mine, theirs = Channel.pair()
    p = ctx.Process(target=_send_without_resource_sharer, args=(theirs,))
    p.start()
    theirs.close()
    try:
        images, labels = mine.recv()
        assert mine.recv() is True   # torch's reductions would have started the worker's sharer
    finally:
        p.join(10)
        mine.close()
    assert images.tolist() == [1.0, 1.0, 1.0] and labels.tolist() == [0, 0]


def _die_mid_message(end: Channel) -> None:
    end.sock.sendall(struct.pack("<QI", 1000, 0) + b"x" * 10)
    os._exit(0)


def test_a_sender_dying_mid_message_reads_as_eof():
    mine, theirs = Channel.pair()
    p = ctx.Process(target=_die_mid_message, args=(theirs,))
    p.start()
    theirs.close()
    try:
        with pytest.raises(EOFError, match="middle of a message"):
            mine.recv()
        with pytest.raises(EOFError):
            mine.recv()
    finally:
        p.join(10)
        mine.close()


def _receive_with_few_descriptors(end: Channel, report: Channel) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 3, hard))
    try:
        end.recv()
        report.send("received")
    except WorkerError as e:
        report.send(str(e))
    except BaseException as e:  # noqa: BLE001
        report.send(f"{type(e).__name__}: {e}")


def test_out_of_descriptors_raises_a_clear_error():
    rx, tx = Channel.pair()
    rep_rx, rep_tx = Channel.pair()
    p = ctx.Process(target=_receive_with_few_descriptors, args=(rx, rep_tx))
    p.start()
    rx.close()
    rep_tx.close()
    try:
        tx.send([torch.full((3,), float(i)).share_memory_() for i in range(20)])
        assert rep_rx.poll(20)
        msg = rep_rx.recv()
    finally:
        p.join(10)
        tx.close()
        rep_rx.close()
    assert "Too many open files" in msg and "ulimit -n" in msg and "set_sharing_strategy" in msg, msg
