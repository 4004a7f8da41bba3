"""The shard cache's folder locks: eviction skips an entry another thread or process holds the
lock of (checking or serving it), with the same kind of lock the downloads take."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager

from conftest import REPO
from feedgpu.remote.folder import entries, evict, locked, make_room

KEY = "0" * 32


def entry(folder, key=KEY, size=100):
    (folder / f"{key}.data").write_bytes(b"x" * size)
    (folder / f"{key}.json").write_text("{}")


@contextmanager
def held_by_a_thread(lock_path):
    """Another thread holds ``lock_path`` (as a download or a check does) inside the block."""
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with locked(str(lock_path)):
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(10)
        yield
    finally:
        leave.set()
        t.join(10)


def test_an_entry_another_thread_holds_is_not_evicted(tmp_path):
    entry(tmp_path)
    with held_by_a_thread(tmp_path / f"{KEY}.lock"):
        assert evict(str(tmp_path), KEY) is False
        assert (tmp_path / f"{KEY}.data").exists() and (tmp_path / f"{KEY}.json").exists()
    assert evict(str(tmp_path), KEY) is True
    assert not (tmp_path / f"{KEY}.data").exists() and not (tmp_path / f"{KEY}.json").exists()


def test_an_entry_another_process_holds_is_not_evicted_and_its_lock_stays(tmp_path):
    entry(tmp_path)
    code = ("import sys; from feedgpu.remote.folder import locked\n"
            "with locked(sys.argv[1]):\n    print('held', flush=True); sys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"{KEY}.lock")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert p.stdout.readline().strip() == "held"
        assert evict(str(tmp_path), KEY) is False
        assert [e[1:] for e in entries(str(tmp_path))] == [(KEY, 100)]
    finally:
        p.communicate("\n", timeout=30)
    assert evict(str(tmp_path), KEY) is True and entries(str(tmp_path)) == []


def test_eviction_passes_over_a_held_entry_to_the_next_least_recently_used(tmp_path):
    old, new = "a" * 32, "b" * 32
    entry(tmp_path, old)
    entry(tmp_path, new)
    os.utime(tmp_path / f"{old}.json", ns=(1, 1))   # the older entry is held: the newer one goes
    with held_by_a_thread(tmp_path / f"{old}.lock"):
        assert make_room(str(tmp_path), 250, "u", 100, pinned=set()) == 1
        assert [e[1] for e in entries(str(tmp_path))] == [old]


def test_a_held_entry_goes_last_when_the_others_are_not_enough(tmp_path):
    """As a download in a full cache must not fail while another thread looks at an old entry:
    that thread fetches its file again (the source's open retries it)."""
    old, new = "a" * 32, "b" * 32
    entry(tmp_path, old)
    entry(tmp_path, new)
    with held_by_a_thread(tmp_path / f"{new}.lock"):
        assert make_room(str(tmp_path), 200, "u", 100, pinned={old}) == 1   # only the held one can go
        assert [e[1] for e in entries(str(tmp_path))] == [old]
