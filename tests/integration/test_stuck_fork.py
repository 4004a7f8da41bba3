"""A forked worker that never starts (a child deadlocked in the interpreter's after-fork handler,
CPython gh-112275 on 3.11 releases without its fix) is killed and forked again, and the epoch
still delivers every sample once, as torch's loader delivers it; never a hang. Both worker
pools: a map-style dataset's and an IterableDataset's. The stuck child is simulated (its target
sleeps before feedgpu's worker code runs) and the start budget injected."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.utils.data as tud

import feedgpu.exec.iterable.pool as iterable_pool
import feedgpu.exec.pool.process_pool as process_pool
from feedgpu import DataLoader, WorkerError

from conftest import child_pids, sticks_once, wait_gone

pytestmark = pytest.mark.timeout(120)
N = 24


class Squares(tud.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([i, i * i])


class Stream(tud.IterableDataset):
    def __iter__(self):
        w = tud.get_worker_info()
        for i in (range(N) if w is None else range(w.id, N, w.num_workers)):
            yield torch.tensor([i, i * i])


def _batches(loader) -> list[list]:
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_an_epoch_with_a_stuck_fork_delivers_what_torch_delivers(kind, tmp_path, monkeypatch, caplog):
    ds = Squares() if kind == "map" else Stream()
    expected = _batches(tud.DataLoader(ds, batch_size=4, num_workers=2))
    if kind == "map":
        monkeypatch.setattr(process_pool, "worker_main", sticks_once(str(tmp_path / "stuck"), process_pool.worker_main))
        monkeypatch.setattr(process_pool, "FORK_START_S", 2.0)
    else:
        monkeypatch.setattr(iterable_pool, "worker_loop", sticks_once(str(tmp_path / "stuck"), iterable_pool.worker_loop))
        monkeypatch.setattr(iterable_pool, "FORK_START_S", 2.0)
    before = child_pids()
    with caplog.at_level(logging.WARNING, logger="feedgpu.pool"):
        got = _batches(DataLoader(ds, batch_size=4, num_workers=2))
    assert (tmp_path / "stuck").exists(), "no worker was stuck: the test tested nothing"
    assert got == expected
    stuck = [r.message for r in caplog.records if "run nothing 2 s after its fork" in r.message]
    assert len(stuck) == 1 and "gh-112275" in stuck[0], [r.message for r in caplog.records]
    assert not wait_gone(child_pids() - before, timeout=10.0)


def test_an_iterable_worker_stuck_at_every_fork_raises_instead_of_hanging(monkeypatch):
    def never(*args):
        import time
        time.sleep(3600)

    monkeypatch.setattr(iterable_pool, "worker_loop", never)
    monkeypatch.setattr(iterable_pool, "FORK_START_S", 0.5)
    before = child_pids()
    with pytest.raises(WorkerError, match=r"IterableDataset worker 0 .*run nothing 0.5 s after its fork.*"
                                          r"3 forks of it never started"):
        list(DataLoader(Stream(), batch_size=4, num_workers=1))
    assert not wait_gone(child_pids() - before, timeout=10.0)
