"""A user's sampler and batch_sampler, run with torch.utils.data.DataLoader and feedgpu.DataLoader.

torch runs an epoch until the sampler is exhausted: its ``len()`` only answers ``len(loader)``,
and it need not have one (a generator, an infinite sampler as detectron2's). The keys it yields
reach the dataset as given (a map-style dataset may take string keys).
"""
from __future__ import annotations

import itertools

import pytest
import torch.utils.data as tud

from feedgpu import DataLoader

pytestmark = pytest.mark.timeout(120)
LOADERS = [tud.DataLoader, DataLoader]


from test_torch_parity import Items  # noqa: E402  item i: i


class Lying(tud.Sampler):
    """Yields ``range(k)`` but says its length is ``claimed``."""

    def __init__(self, k: int, claimed: int):
        self.k, self.claimed = k, claimed

    def __iter__(self):
        return iter(range(self.k))

    def __len__(self):
        return self.claimed


class Endless(tud.Sampler):
    """0, 1, ..., n-1, 0, 1, ... forever, without ``__len__`` (an iteration-based training sampler)."""

    def __init__(self, n: int = 23):
        self.n = n

    def __iter__(self):
        return (i % self.n for i in itertools.count())


class Unsized(tud.Sampler):
    """A re-iterable sampler without ``__len__``: the keys given, every epoch."""

    def __init__(self, keys):
        self.keys = list(keys)

    def __iter__(self):
        return iter(self.keys)


def _lists(loader) -> list:
    return [b.tolist() if hasattr(b, "tolist") else b for b in loader]


def _both(fn):
    theirs, ours = (fn(make) for make in LOADERS)
    assert ours == theirs
    return ours


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_generator_as_sampler_or_batch_sampler(num_workers):
    got = _both(lambda make: _lists(make(Items(), batch_size=2, sampler=(i for i in [5, 4, 3]),
                                         num_workers=num_workers)))
    assert got == [[5, 4], [3]]
    got = _both(lambda make: _lists(make(Items(), batch_sampler=([i, i + 1] for i in range(0, 6, 2)),
                                         num_workers=num_workers)))
    assert got == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_endless_sampler_runs_until_the_loop_stops(num_workers):
    def first_nine(make):
        return [b.tolist() for b in itertools.islice(make(Items(), batch_size=4, sampler=Endless(),
                                                           num_workers=num_workers), 9)]

    got = _both(first_nine)
    assert got[5] == [20, 21, 22, 0] and len(got) == 9
    for make in LOADERS:
        with pytest.raises(TypeError):
            len(make(Items(), batch_size=4, sampler=Endless()))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("k, claimed", [(5, 9), (9, 5)])
def test_the_epoch_is_what_the_sampler_yields_not_its_len(num_workers, k, claimed):
    got = _both(lambda make: _lists(make(Items(), batch_size=2, sampler=Lying(k, claimed),
                                         num_workers=num_workers)))
    assert [i for b in got for i in b] == list(range(k))
    got = _both(lambda make: _lists(make(Items(), batch_sampler=tud.BatchSampler(Lying(k, claimed), 2, False),
                                         num_workers=num_workers)))
    assert [i for b in got for i in b] == list(range(k))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_keys_reach_the_dataset_as_the_sampler_gives_them(num_workers):
    class Keyed(tud.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, key):
            return f"{type(key).__name__}:{key}"

    got = _both(lambda make: _lists(make(Keyed(), batch_size=2, sampler=["a", "b", "c"], num_workers=num_workers)))
    assert got == [["str:a", "str:b"], ["str:c"]]
    got = _both(lambda make: _lists(make(Keyed(), batch_size=2, sampler=[1.5, 2.0], num_workers=num_workers)))
    assert got == [["float:1.5", "float:2.0"]]
    got = _both(lambda make: _lists(make(Keyed(), batch_size=2, sampler=[2, 0], num_workers=num_workers)))
    assert got == [["int:2", "int:0"]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_without_len_resumes_and_its_epoch_ends_where_it_ends(num_workers):
    keys = [7, 3, 9, 1, 0, 12, 5]

    def make():
        return DataLoader(Items(), batch_size=2, sampler=Unsized(keys), num_workers=num_workers)

    full = _lists(make())
    assert full == [[7, 3], [9, 1], [0, 12], [5]]
    for k in range(len(full) + 1):
        first = make()
        it = iter(first)
        seen = [next(it).tolist() for _ in range(k)]
        state = first.state_dict()
        del it
        resumed = make()
        resumed.load_state_dict(state)
        rest = _lists(resumed)
        if seen + rest != full:
            # the end was already known (workers read the sampler ahead): the state is the next epoch's start
            assert k == len(full) and rest == full and state["epoch"] == 1, (k, rest)
    done = make()
    assert _lists(done) == full
    assert done.state_dict()["epoch"] == 1 and done.state_dict()["num_batches"] is None


class OwnDistributed(tud.DistributedSampler):
    """A DistributedSampler subclass (a user's own): iterated as given, not read as sharding."""


def _own(seed: int = 0) -> OwnDistributed:
    return OwnDistributed(Items(12), num_replicas=1, rank=0, shuffle=True, seed=seed)


def test_the_sampler_keeps_the_epoch_its_owner_sets():
    """The loader must not reset a user's set_epoch: resuming training at epoch 5, or leaving each
    epoch early (Lightning's limit_train_batches), must still change the order every epoch."""
    def from_epoch_five(make):
        s = _own()
        loader = make(Items(12), batch_size=4, sampler=s)
        out = []
        for e in (5, 6):
            s.set_epoch(e)
            out.append(_lists(loader))
        return out

    five, six = _both(from_epoch_five)
    assert five != six

    def first_batch_each_epoch(make):
        s = _own()
        loader = make(Items(12), batch_size=4, sampler=s)
        out = []
        for e in range(3):
            s.set_epoch(e)
            out.append(next(iter(loader)).tolist())
        return out

    assert len(set(map(tuple, _both(first_batch_each_epoch)))) == 3


def test_a_user_samplers_epoch_is_the_states_and_a_resume_replays_it():
    s = _own()
    s.set_epoch(5)
    loader = DataLoader(Items(12), batch_size=4, sampler=s)
    expected = _lists(loader)
    it = iter(loader)
    first = next(it).tolist()
    state = loader.state_dict()
    del it
    assert state["epoch"] == 5
    resumed = DataLoader(Items(12), batch_size=4, sampler=_own())   # a fresh sampler, at epoch 0
    resumed.load_state_dict(state)
    assert [first] + _lists(resumed) == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_second_iterator_stops_the_first_loudly(num_workers):
    """torch runs two iterators of one loader side by side; feedgpu runs one iteration at a time
    (the loader's position is its state): the older iterator's next() raises, never a silent end."""
    from feedgpu import IteratorSuperseded

    theirs = tud.DataLoader(Items(10), batch_size=3, num_workers=num_workers)
    a, b = iter(theirs), iter(theirs)
    assert next(a).tolist() == next(b).tolist() == [0, 1, 2]
    ours = DataLoader(Items(10), batch_size=3, num_workers=num_workers)
    a = iter(ours)
    assert next(a).tolist() == [0, 1, 2]
    b = iter(ours)
    with pytest.raises(IteratorSuperseded, match="stopped at batch 1 of epoch 0 by a newer iter"):
        next(a)
    assert isinstance(IteratorSuperseded("x"), RuntimeError)
    assert _lists(b) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    done = iter(ours)   # a finished iterator is not superseded: it just ends
    assert len(list(done)) == 4
    iter(ours)
    assert list(done) == []


class UnsizedDataset(tud.Dataset):
    """A map-style dataset without ``__len__`` (optional in torch): key k gives k * 10."""

    def __getitem__(self, k):
        return k * 10


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_without_len_works_with_a_sampler(num_workers):
    got = _both(lambda make: _lists(make(UnsizedDataset(), batch_size=2, sampler=[3, 1, 4],
                                         num_workers=num_workers)))
    assert got == [[30, 10], [40]]
    got = _both(lambda make: _lists(make(UnsizedDataset(), batch_sampler=[[2], [0, 1]], num_workers=num_workers)))
    assert got == [[20], [0, 10]]
    loader = DataLoader(UnsizedDataset(), batch_size=2, sampler=[3, 1, 4], num_workers=num_workers)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    resumed = DataLoader(UnsizedDataset(), batch_size=2, sampler=[3, 1, 4], num_workers=num_workers)
    resumed.load_state_dict(state)
    assert _lists(resumed) == [[40]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pipelines_sampler_indices_are_checked_as_a_sequence_checks_them(folder_ds, num_workers):
    """A Pipeline is the dataset: an index out of range fails its batch with IndexError (the next
    batch comes), a negative one is the sample it names from the end (before: index -1 read a key
    of the folder's root and counted it as an unreadable skip), a float is a TypeError (before: 0.5
    read sample 0)."""
    from feedgpu import Pipeline
    from feedgpu.stages import Decode, ResizeCenterCrop

    def loader(sampler):
        return DataLoader(Pipeline({"format": "folder", "path": str(folder_ds)}, [Decode(), ResizeCenterCrop(8, 8)],
                                   batch_size=2, shuffle=False, num_workers=num_workers, device="cpu"),
                          sampler=sampler)

    everything = [int(v) for b in loader(None) for v in b.labels]
    n = len(everything)
    it = iter(loader([0, n + 3, 1, 2]))
    with pytest.raises(IndexError, match=f"index {n + 3} from the sampler is out of range"):
        next(it)
    assert next(it).labels.tolist() == everything[1:3]
    assert [b.labels.tolist() for b in loader([-1, 0])] == [[everything[-1], everything[0]]]
    wrapped, direct = next(iter(loader([-1]))), next(iter(loader([n - 1])))
    assert wrapped.images.tolist() == direct.images.tolist()   # the same sample, the same draws
    with pytest.raises(IndexError):
        list(loader([-n - 1]))
    with pytest.raises(TypeError, match="pipeline indices must be integers, got 0.5"):
        list(loader([0.5, 1]))
