"""ProcessPool: growing, shrinking and replacing workers while tasks are in flight loses and
repeats nothing."""
from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import sticks_once, wait_gone
from feedgpu import LoaderTimeout, WorkerError
from feedgpu.exec.pool.process_pool import ProcessPool

pytestmark = pytest.mark.timeout(60)


def square(task):
    time.sleep(task[2])
    return (task[1] ** 2, os.getpid())


def collect(pool, n):
    out = {}
    while len(out) < n:
        tag, seq, wid, ok, payload = pool.get(30)
        assert ok and tag == "t"
        assert seq not in out, f"task {seq} delivered twice"
        out[seq] = payload
    return out


def test_grow_and_shrink_while_tasks_are_in_flight():
    pool = ProcessPool(square, 1)
    try:
        for i in range(10):
            pool.submit(("t", i, 0.01))
        pool.resize(3)
        assert pool.num_workers == 3
        for i in range(10, 40):  # queued tasks stay where they are; new ones go to the least loaded
            pool.submit(("t", i, 0.01))
        first = collect(pool, 20)
        pool.resize(1)
        assert pool.num_workers == 1
        rest = collect(pool, 20)
        got = {**first, **rest}
        assert sorted(got) == list(range(40))
        assert all(v[0] == k * k for k, v in got.items())
        assert len({pid for _, pid in got.values()}) == 3  # the added workers took tasks
        with pytest.raises(LoaderTimeout):  # meanwhile the retired workers finish and are reaped
            pool.get(1.0)
        assert len(pool._workers) == 1 and pool.retired == 2 and pool.respawns == 0
    finally:
        pids = pool.pids()
        pool.close()
    assert not wait_gone(pids)


def test_a_parked_worker_finishes_its_tasks_takes_none_and_comes_back_warm():
    """resize(n, park_s): the surplus worker stops taking tasks but stays alive, so a grow
    within park_s takes the same process back instead of starting one; then it is retired."""
    pool = ProcessPool(square, 2)
    try:
        first_pids = pool.pids()
        for i in range(8):
            pool.submit(("t", i, 0.05))
        pool.resize(1, park_s=30)
        assert pool.num_workers == 1 and len(pool.pids()) == 1
        parked = next(w for w in pool._workers.values() if w.parked_until is not None)
        assert parked.proc.pid not in pool.pids() and parked.proc.is_alive()
        for i in range(8, 16):                 # new tasks go to the worker still taking them
            pool.submit(("t", i, 0.01))
        got = collect(pool, 16)
        assert sorted(got) == list(range(16)) and all(v[0] == k * k for k, v in got.items())
        assert {got[i][1] for i in range(8, 16)} == set(pool.pids())
        pool.resize(2)                          # taken back: no process started
        assert sorted(pool.pids()) == sorted(first_pids) and pool.retired == 0
        pool.resize(1, park_s=0.2)
        time.sleep(0.3)
        pool.submit(("t", 16, 0.0))             # a submit retires the parked worker whose time is up
        assert collect(pool, 1)[16][0] == 256
        assert pool.retired == 1
        gone = [p for p in first_pids if p not in pool.pids()]
        pool.resize(2, park_s=30)
        assert len(set(pool.pids()) - set(first_pids)) == 1   # a new process: the old one was retired
        pool.resize(1, park_s=30)
        assert pool.retire_parked() == 1 and pool.retired == 2
        with pytest.raises(LoaderTimeout):     # meanwhile the retired workers finish and are reaped
            pool.get(1.0)
        assert len(pool._workers) == 1
    finally:
        pids = pool.pids()
        pool.close()
    assert not wait_gone(pids + gone)


def test_killed_worker_is_replaced_and_its_tasks_redone():
    pool = ProcessPool(square, 2)
    try:
        for i in range(10):
            pool.submit(("t", i, 0.2))
        victim = pool.pids()[0]
        time.sleep(0.1)
        os.kill(victim, signal.SIGKILL)
        got = collect(pool, 10)
        assert sorted(got) == list(range(10))
        assert victim not in {pid for _, pid in got.values()} or pool.respawns == 1
        assert pool.respawns == 1 and victim not in pool.pids() and pool.num_workers == 2
    finally:
        pool.close()


def test_respawn_off_raises_at_first_death():
    pool = ProcessPool(square, 2, respawn=False)
    try:
        pool.submit(("t", 0, 5.0))
        os.kill(pool.pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"died unexpectedly \(signal SIGKILL: .*out-of-memory"):
            pool.get(30)
    finally:
        pool.close()


def test_a_forked_worker_that_never_starts_is_killed_and_replaced(tmp_path, monkeypatch, caplog):
    import feedgpu.exec.pool.process_pool as pp

    monkeypatch.setattr(pp, "worker_main", sticks_once(str(tmp_path / "stuck"), pp.worker_main))
    pool = ProcessPool(square, 2, fork_start_s=2.0)
    try:
        stuck = pool.pids()[0]
        for i in range(6):
            pool.submit(("t", i, 0.01))
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="feedgpu.pool"):
            got = collect(pool, 6)
        assert sorted(got) == list(range(6)) and all(v[0] == k * k for k, v in got.items())
        assert stuck not in {pid for _, pid in got.values()}
        assert pool.respawns == 1 and stuck not in pool.pids() and pool.num_workers == 2
        assert time.monotonic() - t0 < 25
        assert any(f"pid {stuck}" in r.message and "run nothing 2 s after its fork" in r.message
                   and "gh-112275" in r.message for r in caplog.records), [r.message for r in caplog.records]
    finally:
        pids = pool.pids()
        pool.close()
    assert not wait_gone(pids + [stuck])


def test_a_stuck_fork_without_respawn_raises_instead_of_hanging(tmp_path, monkeypatch):
    import feedgpu.exec.pool.process_pool as pp

    monkeypatch.setattr(pp, "worker_main", sticks_once(str(tmp_path / "stuck"), pp.worker_main))
    pool = ProcessPool(square, 1, respawn=False, fork_start_s=1.0)
    try:
        pool.submit(("t", 0, 0.0))
        with pytest.raises(WorkerError, match=r"run nothing 1 s after its fork, so it was killed"):
            pool.get(20)
    finally:
        pool.close()


def test_resize_below_one_is_refused():
    pool = ProcessPool(square, 1)
    try:
        with pytest.raises(WorkerError, match="at least one worker"):
            pool.resize(0)
    finally:
        pool.close()
