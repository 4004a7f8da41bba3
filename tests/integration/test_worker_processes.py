"""WorkerProcesses, the process core of both worker pools (the map-style ProcessPool and an
IterableDataset's WorkerSet): a close that never hangs (stop message, grace, terminate, kill),
a stuck fork killed and given up after MAX_STUCK forks, deaths worded as torch words them, and
nothing done by a forked copy of the core."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from conftest import wait_gone
from feedgpu import WorkerError
from feedgpu.exec.pool.processes import MAX_STUCK, WorkerProcesses

pytestmark = pytest.mark.timeout(120)


class Member:
    """A worker with a pipe: ``ask_stop`` sends "stop" on it."""

    def __init__(self, wid, proc, conn):
        self.wid, self.proc, self.conn = wid, proc, conn
        self.stop_sent = self.dropped = False

    def ask_stop(self):
        self.stop_sent = True
        self.conn.send("stop")

    def drain(self, seconds):
        self.proc.join(seconds)

    def drop(self):
        self.dropped = True
        self.conn.close()


def obeys(conn):
    conn.recv()   # exits at its stop message


def ignores_everything(conn):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send("up")
    time.sleep(3600)


def sleeps(conn):
    time.sleep(3600)


def start(core, wid, target):
    mine, theirs = mp.get_context("fork").Pipe()
    m = core.start(wid, target, (theirs,), f"test-{wid}", lambda p: Member(wid, p, mine))
    theirs.close()
    return m


def test_close_stops_obeying_workers_and_kills_one_that_ignores_stop_and_terminate():
    core = WorkerProcesses("fork", "test", fork_start_s=60.0, grace_s=0.5)
    good, bad = start(core, 0, obeys), start(core, 1, ignores_everything)
    assert bad.conn.recv() == "up"   # its SIGTERM is ignored from here on
    t0 = time.monotonic()
    core.close()
    assert time.monotonic() - t0 < 30, "close must not hang on a worker that ignores everything"
    assert good.stop_sent and good.proc.exitcode == 0
    assert bad.proc.exitcode == -signal.SIGKILL
    assert good.dropped and bad.dropped and core.closed and core.members == {}
    core.close()   # once


def test_a_fork_that_never_starts_is_killed_then_given_up_after_max_stuck():
    core = WorkerProcesses("fork", "test", fork_start_s=0.3)
    try:
        for n in range(1, MAX_STUCK + 1):
            m = start(core, 0, sleeps)
            assert core.watched(0)
            assert core.overdue() == []   # not yet 0.3 s
            time.sleep(0.5)
            if n < MAX_STUCK:
                assert core.overdue() == [0]
                assert m.proc.exitcode == -signal.SIGKILL and core.was_stuck(m)
                assert "run nothing 0.3 s after its fork" in core.death(m, torch_words=False)
                core.remove(m)
            else:
                with pytest.raises(WorkerError, match=f"test worker 0 .*run nothing 0.3 s after its fork.*"
                                                      f"{MAX_STUCK} forks of it never started"):
                    core.overdue()
    finally:
        core.close()


def test_a_worker_that_said_it_started_is_not_watched():
    core = WorkerProcesses("fork", "test", fork_start_s=0.2)
    try:
        m = start(core, 0, sleeps)
        core.settled(0)
        time.sleep(0.4)
        assert core.overdue() == [] and m.proc.exitcode is None
        n = start(core, 1, sleeps)
        time.sleep(0.4)
        assert core.overdue(started=lambda wid: True) == [] and n.proc.exitcode is None
    finally:
        core.close()


def test_spawned_workers_are_not_watched():
    core = WorkerProcesses("spawn", "test", fork_start_s=0.0)
    mine, _theirs = mp.get_context("spawn").Pipe()
    try:
        m = core.start(0, time.sleep, (3600,), "test-0", lambda p: Member(0, p, mine))
        assert not core.watched(0) and core.overdue() == [] and m.proc.exitcode is None
    finally:
        core.close()


def test_a_death_is_worded_as_torch_words_it_then_names_the_worker_and_its_kind():
    core = WorkerProcesses("fork", "IterableDataset", fork_start_s=60.0)
    try:
        m = start(core, 3, sleeps)
        os.kill(m.proc.pid, signal.SIGKILL)
        m.proc.join(30)
        assert core.ended() == [3]
        pid = m.proc.pid
        assert core.death(m).startswith(f"DataLoader worker (pid {pid}) is killed by signal: "
                                        f"{signal.strsignal(signal.SIGKILL)}. IterableDataset worker 3 (pid {pid}) "
                                        "died unexpectedly (signal SIGKILL: killed from outside")
        e = start(core, 4, exits_3)
        e.proc.join(30)
        assert core.death(e).startswith(f"DataLoader worker (pid {e.proc.pid}) exited unexpectedly with exit code 3. "
                                        "Details are lost due to multiprocessing.")
    finally:
        core.close()


def exits_3(conn):
    os._exit(3)


def closes_the_inherited_core(core):
    core.close()   # a forked copy: must do nothing to the parent's workers


def test_a_forked_copy_of_the_core_closes_nothing():
    core = WorkerProcesses("fork", "test", fork_start_s=60.0)
    try:
        m = start(core, 0, sleeps)
        child = mp.get_context("fork").Process(target=closes_the_inherited_core, args=(core,))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        time.sleep(0.2)
        assert m.proc.exitcode is None and not core.closed
    finally:
        core.close()
    assert wait_gone([m.proc.pid]) == []
