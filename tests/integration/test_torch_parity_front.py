"""torch's loader behaviours next to feedgpu's: the iterator's len(), arguments torch refuses,
the too-many-workers warning, running out of file descriptors, an IterDataPipe's shuffle."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.utils.data as tud

from feedgpu import DataLoader

pytestmark = pytest.mark.timeout(180)
LOADERS = [tud.DataLoader, DataLoader]

from test_torch_parity import Items  # noqa: E402  item i: i


class Unsized(tud.Sampler):
    def __iter__(self):
        return iter(range(5))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kw", [dict(batch_size=4), dict(batch_size=4, drop_last=True), dict(batch_size=5, shuffle=True),
                                dict(batch_size=None), dict(batch_sampler=tud.BatchSampler(range(23), 6, False))])
def test_the_iterator_has_torchs_len(kw, num_workers):
    lens = []
    for make in LOADERS:
        it = iter(make(Items(23), num_workers=num_workers, **kw))
        lens.append(len(it))
        next(it)
        assert len(it) == lens[-1]   # torch's counts the epoch, not what is left
    assert lens[0] == lens[1]


def test_the_iterator_of_a_sampler_without_len_raises_typeerror_as_torchs():
    for make in LOADERS:
        with pytest.raises(TypeError, match="has no len"):
            len(iter(make(Items(23), batch_size=2, sampler=Unsized())))


def test_a_resumed_iterator_counts_what_remains():
    loader = DataLoader(Items(23), batch_size=4, shuffle=True, seed=1)
    it = iter(loader)
    next(it), next(it)
    again = DataLoader(Items(23), batch_size=4, shuffle=True, seed=1)
    again.load_state_dict(loader.state_dict())
    rest = iter(again)
    assert len(rest) == len(loader) - 2 == len(list(rest))


def test_batch_size_none_with_drop_last_is_refused_in_torchs_words():
    messages = []
    for make in LOADERS:
        with pytest.raises(ValueError) as e:
            make(Items(23), batch_size=None, drop_last=True)
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_too_many_workers_warn_in_torchs_words():
    n = (torch.multiprocessing.cpu_count() or 1) + 1
    for make in LOADERS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = make(Items(4), batch_size=2, num_workers=n)
            next(iter(loader))   # torch warns when its workers start
        words = [str(w.message) for w in caught if "excessive worker creation" in str(w.message)]
        assert words and "might get DataLoader running slow or even freeze" in words[0], (make, caught)


_OUT_OF_FDS = """
import resource, sys, torch, torch.utils.data as tud
from feedgpu import DataLoader as Ours

class Stream(tud.IterableDataset):
    def __iter__(self):
        return (torch.randn(2, 2) for _ in range(200))

class Items(tud.Dataset):
    def __len__(self):
        return 200
    def __getitem__(self, i):
        return torch.randn(2, 2)

make = Ours if sys.argv[1] == "feedgpu" else tud.DataLoader
ds = Stream() if sys.argv[2] == "iterable" else Items()
keep = []
resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
try:
    for t in make(ds, multiprocessing_context="fork", num_workers=1):
        keep.append(t)   # every batch kept: one descriptor each
    print("no error")
except RuntimeError as e:
    print("RuntimeError", str(e).replace(chr(10), " "))
"""


@pytest.mark.parametrize("kind", ["iterable", "map"])
def test_running_out_of_file_descriptors_raises_torchs_runtimeerror(kind, tmp_path):
    """torch's test_fd_limit_exceeded, with both loaders (each in its own process)."""
    script = tmp_path / "fds.py"
    script.write_text(textwrap.dedent(_OUT_OF_FDS))
    for which in ("torch", "feedgpu"):
        out = subprocess.run([sys.executable, str(script), which, kind], capture_output=True, text=True,
                             timeout=120).stdout
        assert out.startswith("RuntimeError") and "ulimit -n" in out and "set_sharing_strategy" in out, (which, out)


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_an_iterdatapipe_takes_shuffle_as_in_torch(num_workers, persistent):
    """shuffle= reaches the pipe's Shuffler, each pass is seeded from torch's RNG as torch seeds it
    (the same orders, pass after pass, also with persistent workers), and sharding_filter splits
    the pipe over the workers: each sample once per pass."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    runs = []
    for make in LOADERS:
        torch.manual_seed(3)
        loader = make(IterableWrapper(range(20)).shuffle().sharding_filter(), batch_size=None, shuffle=True,
                      num_workers=num_workers, persistent_workers=persistent)
        passes = [[int(x) for x in loader] for _ in range(3)]
        unshuffled = [int(x) for x in make(IterableWrapper(range(20)).shuffle().sharding_filter(), batch_size=None,
                                           shuffle=False, num_workers=num_workers)]
        runs.append((passes, unshuffled))
    (theirs, plain_theirs), (ours, plain_ours) = runs
    assert ours == theirs
    assert all(sorted(p) == list(range(20)) for p in ours) and ours[0] != ours[1]
    assert plain_ours == plain_theirs == list(range(20))   # shuffle=False turns the Shuffler off


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(20))


def _refusals():
    seq = tud.SequentialSampler(range(23))
    batches = tud.BatchSampler(seq, 3, False)
    start = list(torch.multiprocessing.get_all_start_methods())[-1]
    return [
        (Items(), dict(num_workers=-1)), (Items(), dict(timeout=-1)), (Items(), dict(batch_size=None, drop_last=True)),
        (Items(), dict(num_workers=0, multiprocessing_context=start)),
        (Items(), dict(num_workers=1, multiprocessing_context="bad")),
        (Items(), dict(num_workers=1, multiprocessing_context=object())),
        (Items(), dict(batch_size=11, sampler=seq, shuffle=True)),
        (Items(), dict(batch_sampler=batches, sampler=seq, shuffle=True)),
        (Items(), dict(batch_sampler=batches, sampler=seq, shuffle=3)),
        (Items(), dict(batch_size=11, batch_sampler=batches)), (Items(), dict(shuffle=True, batch_sampler=batches)),
        (Items(), dict(drop_last=True, batch_sampler=batches)), (Items(), dict(drop_last=3, batch_sampler=batches)),
        (Stream(), dict(shuffle=True)), (Stream(), dict(shuffle=3)), (Stream(), dict(sampler=seq)),
        (Stream(), dict(sampler=3)), (Stream(), dict(batch_sampler=batches)), (Stream(), dict(batch_sampler=3)),
    ]


@pytest.mark.parametrize("case", range(len(_refusals())))
def test_constructor_refusals_have_torchs_kind_and_words(case):
    """The combinations torch's constructor refuses: the same exception kind and message (the
    first check torch makes decides which message, e.g. ``sampler`` with ``shuffle`` before
    ``batch_sampler``'s exclusions, and a non-bool ``drop_last`` counts as set)."""
    dataset, kw = _refusals()[case]
    errors = []
    for make in LOADERS:
        with pytest.raises((ValueError, TypeError)) as e:
            make(dataset, **kw)
        errors.append(e.value)
    theirs, ours = errors
    assert isinstance(ours, type(theirs)) and str(theirs).split(",")[0] in str(ours), (theirs, ours)


def test_code_reading_torchs_iterator_attribute_finds_none():
    """Code written for torch's loader reads ``loader._iterator`` (None unless torch keeps
    persistent workers' iterator); feedgpu's loader has the attribute, always None."""
    for make in LOADERS:
        loader = make(Items(8), batch_size=4)
        assert loader._iterator is None
        list(loader)
        assert loader._iterator is None
    assert DataLoader(Stream(), batch_size=4)._iterator is None


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_workers_of_a_dropped_unfinished_iterator_exit_as_torchs(kind, persistent):
    """What torch's test_partial_workers and test_iterable_style_dataset check through torch's
    private ``it._workers``, read from the process table instead: an iterator left after a few
    batches, then dropped with its loader, leaves no worker running (torch's and feedgpu's,
    with and without persistent workers), and both loaders gave the same batches first."""
    from conftest import child_pids, wait_gone

    firsts = []
    for make in LOADERS:
        before = child_pids()
        dataset = Items(40) if kind == "map" else Stream()
        loader = make(dataset, batch_size=2, num_workers=2, persistent_workers=persistent)
        it = iter(loader)
        firsts.append([next(it).tolist() for _ in range(4)])
        workers = child_pids() - before
        assert len(workers) >= 2, (make, workers)
        del it, loader
        gc.collect()
        assert not wait_gone(workers, timeout=30.0), (make, persistent)
    theirs, ours = firsts
    if kind == "map":   # an IterableDataset copied into each worker repeats per worker, as in torch
        assert ours == theirs
    else:
        assert sorted(map(tuple, ours)) == sorted(map(tuple, theirs))


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_worker_pids_names_the_running_workers(kind, persistent):
    """``loader.worker_pids()``, the public stand-in for torch's private ``it._workers``: the
    processes started for the pass, for a map-style and an iterable-style dataset alike; none
    once a non-persistent pass is dropped."""
    from conftest import child_pids, wait_gone

    before = child_pids()
    loader = DataLoader(Items(40) if kind == "map" else Stream(), batch_size=2, num_workers=2,
                        persistent_workers=persistent)
    it = iter(loader)
    next(it)
    pids = loader.worker_pids()
    assert len(pids) == 2 and set(pids) == child_pids() - before, (pids, child_pids() - before)
    del it
    gc.collect()
    if persistent:
        assert loader.worker_pids() == pids
    else:
        assert loader.worker_pids() == [] and not wait_gone(pids, timeout=30.0)
    loader.shutdown()
    assert not wait_gone(pids, timeout=30.0)
