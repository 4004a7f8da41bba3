"""Copy-on-read (feedgpu.exec.memory_watch): a torch Dataset holding millions of Python objects
grows every worker as reading them writes their reference counts; the loader warns once at the
first epoch, a Dataset of numpy arrays does not warn."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch.utils.data as tud

import feedgpu.exec.memory_watch as mw
from feedgpu import DataLoader
from feedgpu.exec.memory_watch import CopyOnReadWarning, CopyOnReadWatch, big_containers

pytestmark = pytest.mark.timeout(300)
MIB = 1 << 20
ITEMS = 2_000_000     # Python ints (32 bytes each in CPython's allocator): ~61 MiB of objects
CHUNK = 100           # items one sample reads


class ListDataset(tud.Dataset):
    """2 M distinct Python ints in a list; sample ``i`` sums the ``i``-th chunk of 100 (slicing
    the list writes each int's reference count)."""

    def __init__(self):
        self.items = list(range(10**7, 10**7 + ITEMS))

    def __len__(self):
        return ITEMS // CHUNK

    def __getitem__(self, i):
        return sum(self.items[i * CHUNK:(i + 1) * CHUNK])


class ArrayDataset(ListDataset):
    """The same values in a numpy array: reading them writes nothing."""

    def __init__(self):
        self.items = np.arange(10**7, 10**7 + ITEMS, dtype=np.int64)

    def __getitem__(self, i):
        return int(self.items[i * CHUNK:(i + 1) * CHUNK].sum())


def _epoch(ds) -> tuple[list, list, DataLoader]:
    dl = DataLoader(ds, batch_size=500, shuffle=True, num_workers=1, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [int(v) for b in dl for v in b]
    return got, [w for w in caught if issubclass(w.category, CopyOnReadWarning)], dl


def test_a_list_of_python_objects_warns_a_numpy_array_does_not(monkeypatch):
    monkeypatch.setattr(mw, "THRESHOLD_BYTES", 32 * MIB)      # injected: the objects are ~61 MiB
    expected = sorted(sum(range(10**7 + i * CHUNK, 10**7 + (i + 1) * CHUNK)) for i in range(ITEMS // CHUNK))
    got, warned, dl = _epoch(ListDataset())
    assert sorted(got) == expected                             # every sample once, right values
    assert len(warned) == 1, [str(w.message) for w in warned]
    msg = str(warned[0].message)
    assert "copy-on-read" in msg and "items (list of 2,000,000)" in msg and "numpy" in msg
    grew = dl._backend.memory_watch.report()["growth_mb"]
    assert grew and max(grew) > 32, grew
    got, warned, dl = _epoch(ArrayDataset())
    assert sorted(got) == expected
    assert warned == []
    assert max(dl._backend.memory_watch.report()["growth_mb"]) < 32


def test_the_watch_reads_three_times_and_warns_once():
    """Injected readings (USS, RSS): a worker at 10 MiB unique of 200 MiB resident when the pool
    starts, 50 MiB half-way, 90 MiB at the end of epoch 0 with RSS unchanged (threshold 64 MiB):
    one warning at the end, none at epoch 1. Memory the worker allocates (RSS grows as much as
    USS) is not copy-on-read, and spawned workers are not watched."""
    readings = {7: iter([(10 * MIB, 200 * MIB), (50 * MIB, 200 * MIB), (90 * MIB, 200 * MIB)])}
    calls = []

    def read(pid):
        calls.append(pid)
        return next(readings[pid])

    class D:
        def __len__(self):
            return 1000

    w = CopyOnReadWatch(D(), threshold_bytes=64 * MIB, read_memory=read)
    w.start([7], epoch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CopyOnReadWarning)
        for b in range(6):                       # up to half-way (batch 5 of 0-9): 40 MiB, under 64
            w.on_batch(0, b, 0, 10, [7])
    assert w.growth == {7: 40 * MIB} and not w.warned
    with pytest.warns(CopyOnReadWarning, match="copied up to 80 MiB each .*83,886 bytes per sample"):
        for b in range(6, 10):
            w.on_batch(0, b, 0, 10, [7])
    assert w.done and w.warned and len(calls) == 3
    w.start([7], epoch=1)
    w.on_batch(1, 9, 0, 10, [7])                 # later epochs are not read
    assert len(calls) == 3
    # allocated, not copied: USS and RSS grow alike (a worker importing a library, say)
    grows = iter([(10 * MIB, 200 * MIB), (180 * MIB, 372 * MIB), (180 * MIB, 372 * MIB)])
    w = CopyOnReadWatch(D(), threshold_bytes=64 * MIB, read_memory=lambda pid: next(grows))
    w.start([7], epoch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CopyOnReadWarning)
        for b in range(10):
            w.on_batch(0, b, 0, 10, [7])
    assert w.growth == {7: 0} and not w.warned
    w = CopyOnReadWatch(D(), read_memory=read, forked=False)
    assert w.done


def test_big_containers_are_named():
    class D:
        def __init__(self):
            self.paths = ["x"] * 20_000
            self.small = [1, 2]
            self.labels = np.zeros(50_000)

    assert big_containers(D()) == ["paths (list of 20,000)"]


def test_bench_names_copy_on_read_and_an_exceeded_budget():
    from feedgpu.bench.report import memory_notes

    summary = {"torch": {"label": "torch DataLoader", "cow_growth_mb_per_worker": 300.0, "uss_mb_per_worker": 340.0},
               "feedgpu": {"label": "feedgpu", "cow_growth_mb_per_worker": 2.0, "uss_mb_per_worker": 60.0,
                           "worker_memory_mb": 48.0}}
    notes = memory_notes(summary, growth_mb=64)
    assert len(notes) == 2
    assert notes[0].startswith("torch DataLoader: a worker copied 300 MB") and "copy-on-read" in notes[0]
    assert notes[1].startswith("feedgpu: USS per worker 60 MB is over its memory budget of 48 MB")
    summary["feedgpu"]["worker_memory_mb"] = 64.0
    summary["torch"]["cow_growth_mb_per_worker"] = 10.0
    assert memory_notes(summary, growth_mb=64) == []
