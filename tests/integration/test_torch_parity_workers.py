"""Worker processes as torch's DataLoader runs them: start methods, get_worker_info(), seeding,
error wording, exit without hanging. Each behaviour runs with ``torch.utils.data.DataLoader``
and with ``feedgpu.DataLoader`` and the two are compared.

Datasets and worker_init_fns live at the top of this module: spawned and forkserver workers
import them (pytest put this directory on ``sys.path``, which spawn passes on)."""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from conftest import REPO, batches_equal, child_pids, clone_all, wait_gone
from feedgpu import ConfigError, DataLoader, LoaderTimeout, Pipeline, WorkerError
from feedgpu.exec.contract import Control
from feedgpu.exec.pool.errors import unpack_exception
from feedgpu.exec.pool.process_pool import ProcessPool
from feedgpu.stages import Decode, HorizontalFlip, RandomResizedCrop

pytestmark = pytest.mark.timeout(240)

def _helper(pid: int) -> bool:
    """multiprocessing's own long-lived helpers (the forkserver, spawn's resource tracker): one
    per main process, started with the first spawn or forkserver worker, torch's included."""
    import psutil

    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return "resource_tracker" in cmd or "forkserver" in cmd


@pytest.fixture
def no_leaked_workers():
    """Fails the test when it leaves worker processes behind (multiprocessing's helpers aside)."""
    before = child_pids()
    yield
    left = [p for p in wait_gone(child_pids() - before, timeout=10.0) if not _helper(p)]
    assert not left, f"worker processes left behind: {left}"


#: set in the main process by the tests; forked workers inherit it, spawned ones import the default
MARK = {"set_in_parent": False}


class Probe(tud.Dataset):
    """Item i: what the worker that loads it sees (worker info, how it was started, RNG draws)."""

    def __init__(self, n: int = 24):
        self.n, self.main_pid, self.tag, self.init = n, os.getpid(), "main", ""

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = tud.get_worker_info()
        return {"i": i, "wid": -1 if info is None else info.id, "nw": -1 if info is None else info.num_workers,
                "seed": -1 if info is None else info.seed, "tag": self.tag, "init": self.init,
                "same_dataset": info is not None and info.dataset is self,
                "inherited": MARK["set_in_parent"], "child_of_main": os.getppid() == self.main_pid,
                "torch": torch.rand(()).item(), "numpy": float(np.random.rand()), "random": random.random()}


def record_init(worker_id):
    """What torch's documentation does in a worker_init_fn: look at get_worker_info() and change
    the worker's copy of the dataset; here it records the worker's seeds."""
    info = tud.get_worker_info()
    ds = info.dataset
    ds.tag = f"w{worker_id}"
    ds.init = repr((worker_id, torch.initial_seed(), info.id, info.num_workers, info.seed,
                    np.random.get_state()[1][:4].tolist(), random.getrandbits(32)))


def reseed_init(worker_id):
    """A worker_init_fn that seeds every RNG itself (as seed_everything-style helpers do)."""
    torch.manual_seed(1000 + worker_id)
    np.random.seed(2000 + worker_id)
    random.seed(3000 + worker_id)


def lightning_style_init(worker_id):
    """Lightning's pl_worker_init_function derives the base seed back from torch.initial_seed()."""
    base = torch.initial_seed() - worker_id
    np.random.SeedSequence([base, worker_id, 0])  # raises ValueError on a negative base seed
    assert base >= 0


def run_both(make, **kw):
    """Every batch of ``make()`` loaded by torch's DataLoader and by feedgpu's, with ``kw``."""
    theirs = list(tud.DataLoader(make(), **kw))
    ours = list(DataLoader(make(), seed=0, **kw))
    return theirs, ours


def flat(batches, key):
    out = []
    for b in batches:
        v = b[key]
        out += v.tolist() if isinstance(v, torch.Tensor) else list(v)
    return out


def per_worker(batches, key):
    """``{worker id: [values of key, in delivery order]}``."""
    out: dict = {}
    for w, v in zip(flat(batches, "wid"), flat(batches, key)):
        out.setdefault(w, []).append(v)
    return out


# -- start methods -----------------------------------------------------------------------------------
CONTEXTS = [None, "fork", "spawn", "forkserver", "spawn-object"]


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_start_methods_deliver_what_torch_delivers(ctx, no_leaked_workers):
    context = mp.get_context("spawn") if ctx == "spawn-object" else ctx
    MARK["set_in_parent"] = True
    try:
        theirs, ours = run_both(lambda: Probe(16), batch_size=4, num_workers=2, multiprocessing_context=context)
    finally:
        MARK["set_in_parent"] = False
    assert flat(ours, "i") == flat(theirs, "i") == list(range(16))
    for key in ("inherited", "child_of_main", "same_dataset", "nw"):
        assert set(flat(ours, key)) == set(flat(theirs, key)), key
    forked = ctx in (None, "fork")  # None: fork, as torch's default on this platform
    assert set(flat(ours, "inherited")) == {forked}
    assert set(flat(ours, "child_of_main")) == {ctx != "forkserver"}
    assert set(flat(ours, "same_dataset")) == {True}


GLOBAL_METHOD_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, sys
    sys.path[:0] = [{repo!r}, {tests!r}, {conftest!r}]
    import torch.utils.data as tud
    from feedgpu import DataLoader
    from test_torch_parity_workers import MARK, Probe

    if __name__ == "__main__":
        mp.set_start_method("spawn")
        MARK["set_in_parent"] = True
        for cls in (tud.DataLoader, DataLoader):
            seen = set()
            for b in cls(Probe(4), batch_size=2, num_workers=1):
                seen |= set(b["inherited"].tolist())
            print(cls.__module__, sorted(seen))
""")


def test_the_default_context_follows_set_start_method_as_torchs(tmp_path):
    """multiprocessing_context=None: torch uses multiprocessing's default context, so a start
    method the program set applies to both (feedgpu forks only when none was set)."""
    script = tmp_path / "global_method.py"
    script.write_text(GLOBAL_METHOD_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests" / "integration"), conftest=str(REPO / "tests")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["torch.utils.data.dataloader [False]", "feedgpu.loader.front [False]"]


def test_multiprocessing_context_is_checked_as_torch_checks_it():
    for bad, error in (("thread", ValueError), (3, TypeError)):
        with pytest.raises(error) as theirs:
            tud.DataLoader(Probe(4), num_workers=1, multiprocessing_context=bad)
        with pytest.raises(error) as ours:
            DataLoader(Probe(4), num_workers=1, multiprocessing_context=bad)
        assert str(ours.value) == str(theirs.value)
    ctx = mp.get_context("forkserver")
    assert tud.DataLoader(Probe(4), num_workers=1, multiprocessing_context="forkserver").multiprocessing_context is ctx
    assert DataLoader(Probe(4), num_workers=1, multiprocessing_context="forkserver").multiprocessing_context is ctx


def pipeline(src, **kw) -> Pipeline:
    opts = dict(batch_size=8, num_workers=2, shuffle=True, seed=1, device="cpu")
    opts.update(kw)
    return Pipeline(src, [Decode(), RandomResizedCrop(32), HorizontalFlip()], **opts)


@pytest.fixture(scope="module")
def src(sources):
    return sources["folder"]


def _in_slots(loader, tensor) -> bool:
    slots = loader._backend.work.slots
    base = np.frombuffer(slots._mm, np.uint8).ctypes.data
    return base <= tensor.data_ptr() < base + len(slots) * slots.stride


def test_pipeline_under_spawn_uses_shared_memory_and_survives_a_killed_worker(src, no_leaked_workers):
    """The pipeline is pickled to spawned workers; its batches still come back in the shared
    buffers (the tensors view them), a SIGKILLed worker's replacement (spawned too) maps them
    again, and every batch equals the one the main process computes alone."""
    expected = clone_all(DataLoader(pipeline(src, num_workers=0)))
    loader = DataLoader(pipeline(src), multiprocessing_context="spawn", timeout=120)
    it = iter(loader)
    first = next(it)
    assert _in_slots(loader, first.images) and _in_slots(loader, first.labels)
    assert loader._backend.pool.method == "spawn"
    got = [type(first)(first.images.clone(), first.labels.clone())]
    del first
    pids = loader.worker_pids()
    os.kill(pids[0], signal.SIGKILL)
    got += clone_all(it)
    assert batches_equal(got, expected)
    assert loader._backend.pool.respawns == 1 and pids[0] not in loader.worker_pids()
    loader.shutdown()


def test_pipeline_with_worker_init_fn_under_forkserver_matches_fork(src, no_leaked_workers):
    fork = clone_all(DataLoader(pipeline(src, shuffle=False), worker_init_fn=reseed_init))
    forkserver = clone_all(DataLoader(pipeline(src, shuffle=False), worker_init_fn=reseed_init,
                                      multiprocessing_context="forkserver", timeout=120))
    assert batches_equal(fork, forkserver)


def test_a_cached_pipeline_under_spawn_is_refused_clearly(src, tmp_path, no_leaked_workers):
    """The cache entry holds a lock and open files that a spawned process cannot take over."""
    loader = DataLoader(pipeline(src, shuffle=False), cache=str(tmp_path), multiprocessing_context="spawn")
    with pytest.raises(ConfigError, match="cache runs in forked workers only.*multiprocessing_context='fork'"):
        next(iter(loader))
    loader.shutdown()


# -- get_worker_info and seeds -----------------------------------------------------------------------
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
@pytest.mark.parametrize("rng", ["generator", "global"])
def test_worker_seeds_and_worker_info_equal_torchs(ctx, rng, no_leaked_workers):
    """Same generator (or global seed): every worker gets the seed torch's would, the same numpy
    and random state, and the same WorkerInfo, seen from worker_init_fn and from __getitem__."""
    def load(cls):
        if rng == "global":
            torch.manual_seed(7)
            g = None
        else:
            g = torch.Generator().manual_seed(123)
        kw = dict(seed=0) if cls is DataLoader else {}
        return list(cls(Probe(16), batch_size=2, num_workers=2, generator=g, worker_init_fn=record_init,
                        multiprocessing_context=ctx, **kw))

    theirs, ours = load(tud.DataLoader), load(DataLoader)
    mine = dict(zip(flat(ours, "wid"), flat(ours, "init")))
    assert mine == dict(zip(flat(theirs, "wid"), flat(theirs, "init")))
    assert sorted(mine) == [0, 1]
    assert set(flat(ours, "tag")) == {"w0", "w1"}  # the dataset worker_init_fn changed is the one loading
    seeds = dict(zip(flat(ours, "wid"), flat(ours, "seed")))
    assert seeds[1] == seeds[0] + 1 and 0 <= seeds[0] < 2**63 - 1
    assert flat(ours, "nw") == [2] * 16
    for w, init in mine.items():  # torch.initial_seed() in worker_init_fn is the WorkerInfo's seed
        wid, initial, info_id, nw, info_seed = eval(init)[:5]
        assert wid == info_id == w and initial == info_seed == seeds[w] and nw == 2


def test_get_worker_info_is_none_outside_workers():
    theirs, ours = run_both(lambda: Probe(4), batch_size=2, num_workers=0)
    assert flat(ours, "wid") == flat(theirs, "wid") == [-1] * 4
    assert tud.get_worker_info() is None


@pytest.mark.parametrize("init", [None, reseed_init])
def test_random_draws_equal_torchs_with_one_worker(init, no_leaked_workers):
    """One worker loads every batch in order in both loaders: same seeds, same draws. A seed
    worker_init_fn sets holds for the whole epoch (not reset per batch)."""
    g = [torch.Generator().manual_seed(5) for _ in range(2)]
    theirs = list(tud.DataLoader(Probe(20), batch_size=4, num_workers=1, generator=g[0], worker_init_fn=init))
    ours = list(DataLoader(Probe(20), batch_size=4, num_workers=1, generator=g[1], worker_init_fn=init, seed=0))
    for key in ("torch", "numpy", "random"):
        assert flat(ours, key) == flat(theirs, key), key
    assert len(set(flat(ours, "torch"))) == 20


def test_a_seed_set_in_worker_init_fn_holds_for_every_batch(no_leaked_workers):
    """Two workers: whichever batches a worker loads, its draws continue the stream its
    worker_init_fn seeded, in both loaders."""
    theirs, ours = run_both(lambda: Probe(24), batch_size=3, num_workers=2, worker_init_fn=reseed_init)
    for batches in (theirs, ours):
        for w, draws in per_worker(batches, "torch").items():
            expected = torch.rand(len(draws), generator=torch.Generator().manual_seed(1000 + w)).tolist()
            assert draws == pytest.approx(expected, abs=0), w


def test_lightning_style_worker_init_runs_and_seeds_collate(no_leaked_workers):
    for cls in (tud.DataLoader, DataLoader):
        batches = list(cls(Probe(8), batch_size=4, num_workers=2, worker_init_fn=lightning_style_init))
        seeds = torch.cat([b["seed"] for b in batches])  # int64: collatable
        assert seeds.dtype == torch.int64 and bool((seeds >= 0).all())


def test_worker_seeds_stay_below_2_63():
    pool = ProcessPool(_square, 2, base_seed=2**63 - 1)
    try:
        assert pool.base_seed + 1023 <= 2**63 - 1
    finally:
        pool.close()


# -- errors ------------------------------------------------------------------------------------------
class KillsItsWorker(tud.Dataset):
    """Item 5 SIGKILLs the worker that loads it (as the out-of-memory killer would)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 5 and tud.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


TORCH_DEATH = re.compile(r"^DataLoader worker \(pid(\(s\))? (\d+)\) "
                         r"(is killed by signal: Killed\.|exited unexpectedly)")


def test_a_killed_worker_is_reported_in_torchs_words(no_leaked_workers):
    """torch stops at the first death; feedgpu replaces the worker and gives up when the same
    batch kills a second one. Both messages begin as torch's, naming a worker pid."""
    # torch's side in a child process: torch's loader reports deaths from a SIGCHLD handler it
    # installs for good, which can fire outside pytest.raises on a busy machine
    script = textwrap.dedent("""
        import os, signal, torch.utils.data as tud
        class KillsItsWorker(tud.Dataset):
            def __len__(self):
                return 16
            def __getitem__(self, i):
                if i == 5 and tud.get_worker_info() is not None:
                    os.kill(os.getpid(), signal.SIGKILL)
                return i
        try:
            list(tud.DataLoader(KillsItsWorker(), batch_size=2, num_workers=2, timeout=60))
        except RuntimeError as e:
            print(str(e).splitlines()[0])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    theirs = out.stdout.strip()
    with pytest.raises(RuntimeError) as info:
        list(DataLoader(KillsItsWorker(), batch_size=2, num_workers=2, timeout=60))
    ours = str(info.value)
    assert TORCH_DEATH.match(theirs), theirs
    m = TORCH_DEATH.match(ours)
    assert m and m.group(3) == "is killed by signal: Killed." and "task 2 has now killed 2 workers" in ours, ours
    assert ours.startswith(f"DataLoader worker (pid {m.group(2)}) is killed by signal: {signal.strsignal(9)}. ")


class Slow(tud.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        time.sleep(5)
        return i


def test_a_timeout_is_reported_in_torchs_words(no_leaked_workers):
    messages = []
    for cls in (tud.DataLoader, DataLoader):
        with pytest.raises(RuntimeError) as info:
            next(iter(cls(Slow(), batch_size=1, num_workers=1, timeout=1)))
        messages.append(str(info.value))
    assert messages[0] == "DataLoader timed out after 1 seconds"
    assert messages[1].startswith(messages[0] + ". ") and "Slow[0]" in messages[1]
    assert isinstance(info.value, LoaderTimeout)


class FailsOnSix(tud.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == 6:
            raise KeyError(f"no record {i}")
        return i


def test_the_pool_goes_on_after_a_task_raises(no_leaked_workers):
    """The pool side of torch's continuation: a handler's exception is one result; the same
    workers run the tasks after it."""
    pool = ProcessPool(_fails_on_three, 2)
    try:
        pids = pool.pids()
        for i in range(8):
            pool.submit(("t", i, 0.0))
        got = {}
        while len(got) < 8:
            tag, seq, _, ok, payload = pool.get(60)
            got[seq] = payload if ok else unpack_exception(payload, f"in task {seq}")
        assert isinstance(got[3], KeyError) and [got[i][0] for i in range(8) if i != 3] == [0, 1, 4, 16, 25, 36, 49]
        pool.submit(("t", 8, 0.0))
        assert pool.get(60)[4][0] == 64
        assert pool.pids() == pids and pool.respawns == 0
    finally:
        pool.close()


def test_next_after_a_failed_batch_gives_the_next_batch_as_torch(no_leaked_workers):
    results = []
    for cls in (tud.DataLoader, DataLoader):
        it = iter(cls(FailsOnSix(), batch_size=2, num_workers=2))
        got = []
        for _ in range(6):
            try:
                got.append(next(it).tolist())
            except KeyError:
                got.append("KeyError")
        results.append(got)
        del it   # stops its workers now (the fixture checks none is left); torch's iterator sits in
        gc.collect()   # a reference cycle with the exception it raised, so only the collector frees it
    assert results[0] == [[0, 1], [2, 3], [4, 5], "KeyError", [8, 9], [10, 11]]
    assert results[1] == results[0]


def _square(task):
    time.sleep(task[2])
    return (task[1] ** 2, os.getpid())


def _fails_on_three(task):
    if task[1] == 3:
        raise KeyError("task three")
    return _square(task)


class _BreaksInTheChild:
    """Pickles in the main process; unpickling it in a spawned worker raises."""

    def __reduce__(self):
        return (_refuse, ())

    def __call__(self, task):  # pragma: no cover - never runs
        return task


def _refuse():
    raise ImportError("cannot import the dataset's module here")


def test_spawned_pool_grows_shrinks_and_replaces_workers(no_leaked_workers):
    pool = ProcessPool(_square, 1, context="spawn", base_seed=0)
    try:
        for i in range(6):
            pool.submit(("t", i, 0.05))
        pool.resize(2)
        for i in range(6, 12):
            pool.submit(("t", i, 0.05))
        os.kill(pool.pids()[0], signal.SIGKILL)
        got = {}
        while len(got) < 12:
            tag, seq, _, ok, payload = pool.get(120)
            assert ok and seq not in got
            got[seq] = payload[0]
        assert got == {i: i * i for i in range(12)} and pool.respawns == 1
        pool.resize(1)
        assert pool.num_workers == 1
    finally:
        pool.close()


def test_what_a_spawned_worker_cannot_unpickle_is_named(no_leaked_workers):
    pool = ProcessPool(_BreaksInTheChild(), 1, context="spawn")
    try:
        tag, _, _, ok, payload = pool.get(120)
        assert tag is Control.START_FAILED and not ok
        e = unpack_exception(payload, "while starting")
        assert isinstance(e, WorkerError)
        assert re.search(r"started with 'spawn' could not unpickle .*ImportError: cannot import the dataset", str(e))
    finally:
        pool.close()


# -- exit ----------------------------------------------------------------------------------------------
HANG_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, sys
    sys.path.insert(0, {repo!r})
    import torch.utils.data as tud
    from feedgpu import DataLoader

    class Big(tud.Dataset):
        def __len__(self):
            return 10 ** 6

        def __getitem__(self, i):
            if FAIL_IN_WORKER and i == 250_000:
                raise KeyError("record 250000 is broken")
            return i

    FAIL_IN_WORKER = sys.argv[3] == "worker"

    def run(ctx):
        # batches of 100,000 indices (800 kB per task): more than a pipe holds, so the task
        # queue's feeder thread is writing when the error comes
        loader = DataLoader(Big(), batch_size=100_000, num_workers=2, multiprocessing_context=ctx)
        it = iter(loader)
        next(it)
        if FAIL_IN_WORKER:
            for _ in it:
                pass
        raise RuntimeError("the training step failed mid-epoch")

    if __name__ == "__main__":
        where, ctx = sys.argv[1], sys.argv[2]
        if where == "main":
            run(ctx)
        p = mp.get_context(where).Process(target=run, args=(ctx,))
        p.start()
        p.join()
        sys.exit(p.exitcode)
""")


@pytest.mark.parametrize("where, ctx, fail", [
    ("main", "fork", "main"),
    ("main", "spawn", "worker"),
    ("fork", "fork", "main"),
    ("fork", "spawn", "worker"),
    ("spawn", "fork", "main"),
    ("spawn", "spawn", "main"),
])
def test_no_process_hangs_at_exit_after_an_error_mid_epoch(tmp_path, where, ctx, fail):
    """The loader runs in the main process or in a multiprocessing child (as under
    torch.multiprocessing.spawn), its workers forked or spawned; an error mid-epoch ends it."""
    script = tmp_path / "fails_mid_epoch.py"
    script.write_text(HANG_SCRIPT.format(repo=str(REPO)))
    try:
        proc = subprocess.run([sys.executable, str(script), where, ctx, fail], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit: {e.stderr}")
    assert proc.returncode == 1, proc.stderr
    assert ("record 250000 is broken" if fail == "worker" else "the training step failed") in proc.stderr
