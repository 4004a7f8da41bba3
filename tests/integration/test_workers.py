"""Worker processes: errors reach the main process with their traceback; nothing hangs or leaks."""
from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import traceback

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from conftest import REPO, alive, wait_gone
from feedgpu import DataLoader, LoaderTimeout, Pipeline, SharedMemoryError, StageError, WorkerError
from feedgpu.stages import Decode, PythonStage, RandomResizedCrop, ResizeCenterCrop

pytestmark = pytest.mark.timeout(90)


class Painted(tud.Dataset):
    """Item i: an 8x8 image whose pixels all hold i (so a stage can tell which sample it got)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return np.full((8, 8, 3), i, np.uint8), i


def fail_on_seven(img):
    a = np.asarray(img)
    if a[0, 0, 0] == 7:
        raise ValueError("user stage cannot take sample seven")
    return a


def slow(img):
    time.sleep(0.03)
    return img


def very_slow(img):
    time.sleep(3)
    return img


def painted_pipeline(fn, **kw) -> Pipeline:
    opts = dict(batch_size=4, shuffle=False, num_workers=2, device="cpu")
    opts.update(kw)
    return Pipeline(Painted(), [Decode(), ResizeCenterCrop(8, 8), PythonStage(fn, name=fn.__name__)], **opts)


def folder_pipeline(src, fn=None, **kw) -> Pipeline:
    opts = dict(batch_size=8, num_workers=2, device="cpu")
    opts.update(kw)
    stages = [Decode(), RandomResizedCrop(48)] + ([PythonStage(fn)] if fn else [])
    return Pipeline(src, stages, **opts)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_user_stage_error_names_the_sample_and_carries_the_traceback(num_workers, on_error, no_leaked_workers):
    loader = DataLoader(painted_pipeline(fail_on_seven, num_workers=num_workers, on_error=on_error))
    got = []
    with pytest.raises(StageError) as info:
        for batch in loader:
            got.append(batch.labels.tolist())
    assert got in ([], [[0, 1, 2, 3]])  # batch 1 holds sample 7; a bug in a stage is never skipped
    e = info.value
    assert "Painted[7]" in str(e) and "ValueError: user stage cannot take sample seven" in str(e)
    if num_workers:
        notes = "\n".join(getattr(e, "__notes__", []))
        assert "raised in feedgpu worker" in notes and "batch 1 of epoch 0" in notes
        assert "Traceback" in notes and "fail_on_seven" in notes and 'raise ValueError("user stage' in notes
    else:
        assert isinstance(e.__cause__, ValueError)
        assert "fail_on_seven" in "".join(traceback.format_exception(e.__cause__))
    # as torch: the error ends nothing but that batch; persistent workers stay for the next epoch
    assert len(loader.worker_pids()) == num_workers


def slow_zero_fail_seven(img):
    a = np.asarray(img)
    if a[0, 0, 0] == 0:
        time.sleep(1.0)  # batch 0 finishes after batch 1 has failed
    if a[0, 0, 0] == 7:
        raise ValueError("user stage cannot take sample seven")
    return a


def test_a_failed_batch_is_raised_in_order(no_leaked_workers):
    loader = DataLoader(painted_pipeline(slow_zero_fail_seven))
    got = []
    with pytest.raises(StageError, match=r"Painted\[7\]"):
        for batch in loader:
            got.append(batch.labels.tolist())
    assert got == [[0, 1, 2, 3]]


def test_error_in_a_torch_dataset_reaches_the_main_process(no_leaked_workers):
    class Broken(tud.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            if i == 13:
                raise KeyError(f"no record {i}")
            return i

    loader = DataLoader(Broken(), batch_size=4, num_workers=2)
    with pytest.raises(KeyError, match="no record 13") as info:
        list(loader)
    assert any("Traceback" in n and "__getitem__" in n for n in info.value.__notes__)


class Unpicklable(Exception):
    def __init__(self, a, b):  # pickling an instance fails to rebuild it (one arg stored)
        super().__init__(f"{a}-{b}")


class RaisesUnpicklable(tud.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        raise Unpicklable("odd", "error")


def test_unpicklable_worker_error_becomes_worker_error(no_leaked_workers):
    loader = DataLoader(RaisesUnpicklable(), batch_size=2, num_workers=2)
    with pytest.raises(WorkerError, match="Unpicklable: odd-error") as info:
        list(loader)
    assert any("__getitem__" in n for n in info.value.__notes__)


def test_worker_killed_with_sigkill_is_replaced_and_its_batches_redone(src, no_leaked_workers):
    """SIGKILL a worker mid-epoch: a new worker redoes its batches; every batch equals the one
    an undisturbed run delivers (nothing lost, nothing repeated, same order)."""
    expected = [(x.clone(), y.clone()) for x, y in DataLoader(folder_pipeline(src, seed=3), num_workers=0)]
    loader = DataLoader(folder_pipeline(src, slow, seed=3), timeout=60)
    it = iter(loader)
    got = [tuple(t.clone() for t in next(it))]
    pids = loader.worker_pids()
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    got += [(x.clone(), y.clone()) for x, y in it]
    assert len(got) == len(expected)
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(y, ey) and torch.equal(x, ex)
    assert loader._backend.pool is not None and loader._backend.pool.respawns == 1
    assert pids[0] not in loader.worker_pids() and len(loader.worker_pids()) == 2
    loader.shutdown()
    assert not wait_gone(pids)


class CrashesOnFive(tud.Dataset):
    """Item 5 kills the worker that reads it (as a decoder segfault would)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([i])


def test_sample_that_kills_every_worker_raises_worker_error(no_leaked_workers):
    loader = DataLoader(CrashesOnFive(), batch_size=2, num_workers=2, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"signal SIGKILL.*task 2 has now killed 2 workers"):
        list(loader)
    assert time.monotonic() - t0 < 30


def _raising_init(worker_id):
    raise RuntimeError(f"worker_init_fn cannot start worker {worker_id}")


def test_worker_init_fn_error_is_reported(src, no_leaked_workers):
    loader = DataLoader(folder_pipeline(src), worker_init_fn=_raising_init)
    with pytest.raises(Exception) as info:
        list(loader)
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "worker_init_fn cannot start worker" in text


def test_timeout_raises_loader_timeout(no_leaked_workers):
    loader = DataLoader(painted_pipeline(very_slow, batch_size=2), timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(LoaderTimeout, match="timeout=0.5") as info:
        next(iter(loader))
    # the message names the stuck stage and the sample each busy worker is on
    assert re.search(r"worker 0 \(pid \d+\) holds batch\(es\) \[0(, 2)?\] and has been in stage "
                     r"'very_slow' on Painted\[0\] for 0\.\d s", str(info.value)), str(info.value)
    assert "on Painted[2]" in str(info.value)  # worker 1 runs batch 1: samples 2 and 3
    assert time.monotonic() - t0 < 15  # no hang (stopping the busy workers may take their grace period)
    assert isinstance(LoaderTimeout("x"), TimeoutError)


# -- shutdown ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def src(sources):
    return sources["folder"]


def test_workers_stop_after_break_and_del(src, no_leaked_workers):
    loader = DataLoader(folder_pipeline(src, slow))
    for i, _ in enumerate(loader):
        pids = loader.worker_pids()
        if i == 1:
            break
    assert len(pids) == 2
    del loader, _
    assert not wait_gone(pids), "workers still running after break + del"


def test_workers_stop_after_break_when_the_iterator_is_dropped(src, no_leaked_workers):
    """Like torch: leaving the loop frees its iterator, which stops non-persistent workers;
    the loader itself stays usable."""
    loader = DataLoader(folder_pipeline(src, slow, shuffle=False), batch_size=8, persistent_workers=False)
    for i, batch in enumerate(loader):
        pids = loader.worker_pids()
        if i == 1:
            break
    del batch
    assert not wait_gone(pids)
    assert loader.worker_pids() == []
    assert len(list(loader)) == len(loader)


def test_workers_stop_after_keyboard_interrupt_in_the_loop_body(src, no_leaked_workers):
    loader = DataLoader(folder_pipeline(src, slow), persistent_workers=False)
    with pytest.raises(KeyboardInterrupt):
        for i, batch in enumerate(loader):
            pids = loader.worker_pids()
            if i == 2:
                raise KeyboardInterrupt
    del batch
    assert len(pids) == 2
    assert not wait_gone(pids), "workers still running after KeyboardInterrupt"
    assert loader.worker_pids() == []


def test_persistent_workers_by_default_stop_with_the_loader(src, no_leaked_workers):
    """Pipelines keep their workers between epochs by default (like persistent_workers=True):
    after Ctrl-C in the loop body they stay with the loader, and go when the loader goes."""
    loader = DataLoader(folder_pipeline(src, slow))
    with pytest.raises(KeyboardInterrupt):
        for i, batch in enumerate(loader):
            pids = loader.worker_pids()
            if i == 2:
                raise KeyboardInterrupt
    del batch
    assert len(pids) == 2 and all(alive(p) for p in pids)
    assert len(list(loader)) == len(loader)  # still usable, same workers
    assert loader.worker_pids() == pids
    del loader
    gc.collect()
    assert not wait_gone(pids), "workers still running after the loader was dropped"


def test_workers_go_on_after_an_exception_and_stop_with_the_loader(no_leaked_workers):
    loader = DataLoader(painted_pipeline(fail_on_seven))
    it = iter(loader)
    next(it)
    pids = loader.worker_pids()
    with pytest.raises(StageError):
        next(it)
    assert next(it).labels.tolist() == [8, 9, 10, 11]  # as torch: the next batch comes
    assert loader.worker_pids() == pids
    del it, loader
    assert not wait_gone(pids)


def test_workers_stop_at_garbage_collection(src, no_leaked_workers):
    loader = DataLoader(folder_pipeline(src, slow), persistent_workers=True)
    it = iter(loader)
    next(it)
    pids = loader.worker_pids()
    assert len(pids) == 2 and all(alive(p) for p in pids)
    # a reference cycle, so that only the cyclic collector can free them
    it.cycle = loader
    loader.cycle = it
    del loader, it
    gc.collect()
    assert not wait_gone(pids), "workers still running after garbage collection"


def test_shutdown_is_idempotent_and_the_loader_restarts(src, no_leaked_workers):
    loader = DataLoader(folder_pipeline(src), persistent_workers=True)
    next(iter(loader))
    pids = loader.worker_pids()
    loader.shutdown()
    loader.shutdown()
    assert not wait_gone(pids)
    assert len(list(loader)) == len(loader)
    assert set(loader.worker_pids()).isdisjoint(pids)
    loader.shutdown()


def test_workers_exit_when_the_main_process_dies(folder_ds, tmp_path):
    """The main process is SIGKILLed (no cleanup runs): its workers exit by themselves."""
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from feedgpu import DataLoader, FolderSource, Pipeline
        from feedgpu.stages import Decode, RandomResizedCrop
        p = Pipeline(FolderSource({str(folder_ds)!r}), [Decode(), RandomResizedCrop(48)], batch_size=8,
                     num_workers=2, device="cpu")
        loader = DataLoader(p)
        it = iter(loader)
        next(it)
        print(" ".join(map(str, loader.worker_pids())), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    assert not wait_gone(pids, timeout=15), "orphaned workers keep running"


def test_workers_ignore_sigint(src, no_leaked_workers):
    """Ctrl-C reaches the whole process group: workers ignore it and let the main process decide."""
    reference = [b.labels.clone() for b in DataLoader(folder_pipeline(src, shuffle=False, num_workers=0))]
    loader = DataLoader(folder_pipeline(src, slow, shuffle=False), timeout=60)
    it = iter(loader)
    got = [next(it).labels.clone()]
    pids = loader.worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    got += [b.labels.clone() for b in it]
    assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))


def test_ctrl_c_while_waiting_for_a_batch_stops_the_workers():
    """Ctrl-C in the main process while it waits for a batch raises KeyboardInterrupt there at
    once and stops the workers. Run in a fresh interpreter: in the full suite's process, what
    earlier tests leave behind (threads, finalizers that run while the interrupt is due, in which
    Python prints and drops it) made the one SIGINT vanish in clean-clone runs."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        import numpy as np
        import torch.utils.data as tud
        sys.path.insert(0, {str(REPO)!r})
        from feedgpu import DataLoader, Pipeline
        from feedgpu.stages import Decode, PythonStage, ResizeCenterCrop

        class Painted(tud.Dataset):
            def __len__(self):
                return 40
            def __getitem__(self, i):
                return np.full((8, 8, 3), i, np.uint8), i

        def stuck_a_minute(img):   # no batch can be ready when the interrupt comes
            time.sleep(60)
            return img

        p = Pipeline(Painted(), [Decode(), ResizeCenterCrop(8, 8), PythonStage(stuck_a_minute)], batch_size=2,
                     shuffle=False, num_workers=2, device="cpu")
        loader = DataLoader(p)
        it = iter(loader)
        print(" ".join(map(str, loader.worker_pids())), flush=True)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            next(it)
        except KeyboardInterrupt:
            print(f"interrupted after {{time.monotonic() - t0:.2f}} s", flush=True)
            sys.exit(0)
        sys.exit("next() returned instead of raising KeyboardInterrupt")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    pids = [int(p) for p in lines[0].split()]
    assert len(pids) == 2
    waited = float(re.search(r"interrupted after ([0-9.]+) s", lines[-1]).group(1))
    assert waited < 30, "interrupted while waiting, not when a batch came"
    assert not wait_gone(pids, timeout=15)


class NoSpaceOnShm:
    """Pickling it fails as torch's does when /dev/shm is full."""

    def __reduce__(self):
        raise OSError(28, "No space left on device")


class NotPicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle 'generator' object")


def test_full_dev_shm_gives_a_clear_error_not_a_dead_worker(no_leaked_workers):
    loader = DataLoader(Painted(), batch_size=4, num_workers=2, collate_fn=lambda b: NoSpaceOnShm(), timeout=30)
    with pytest.raises(SharedMemoryError, match=r"/dev/shm.*--shm-size"):
        next(iter(loader))
    loader = DataLoader(Painted(), batch_size=4, num_workers=1, collate_fn=lambda b: NotPicklable(), timeout=30)
    with pytest.raises(WorkerError, match="could not send its batch back.*picklable"):
        next(iter(loader))


def test_batch_buffers_that_do_not_fit_give_a_clear_error(src, monkeypatch, no_leaked_workers):
    import feedgpu.exec.buffers.shm as shm

    def no_memory(*a, **kw):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(shm.mmap, "mmap", no_memory)
    with pytest.raises(SharedMemoryError, match=r"could not map 6 batch buffers of .* MiB .*Lower batch_size"):
        next(iter(DataLoader(folder_pipeline(src, num_workers=2))))
