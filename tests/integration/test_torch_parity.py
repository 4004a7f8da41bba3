"""feedgpu.DataLoader next to torch.utils.data.DataLoader: each behaviour run with both.

The loader's front (attributes, samplers, len, errors, continuation after an exception) and
its global-position state across world sizes. Worker-side parity (contexts, seeds,
get_worker_info, dead workers) is in tests/integration/test_torch_parity_workers.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from feedgpu import ConfigError, DataLoader, Pipeline, StateError
from feedgpu.stages import Decode, RandomResizedCrop, ResizeCenterCrop

pytestmark = pytest.mark.timeout(120)
LOADERS = [tud.DataLoader, DataLoader]


class Items(tud.Dataset):
    """Item i: i (an int), so batches say which samples they hold."""

    def __init__(self, n: int = 23):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Failing(Items):
    """Item 7 raises, once per epoch's read of it."""

    def __getitem__(self, i):
        if i == 7:
            raise KeyError(f"item {i} is broken")
        return i


def _flat(batches) -> list[int]:
    return [int(x) for b in batches for x in (b.tolist() if hasattr(b, "tolist") else [b])]


# -- what frameworks check ------------------------------------------------------------------
@pytest.mark.parametrize("make", LOADERS)
def test_is_a_torch_dataloader_with_torchs_attributes(make):
    g = torch.Generator().manual_seed(0)
    loader = make(Items(), batch_size=4, shuffle=True, generator=g, num_workers=0)
    assert isinstance(loader, tud.DataLoader)
    assert isinstance(loader.sampler, tud.RandomSampler)
    assert type(loader.batch_sampler) is tud.BatchSampler and loader.batch_sampler.batch_size == 4
    assert loader.generator is g and loader.batch_size == 4 and loader.drop_last is False
    assert loader.multiprocessing_context is None and loader.prefetch_factor is None
    assert isinstance(make(Items(), batch_size=4).sampler, tud.SequentialSampler)
    assert make[int] is not None  # generic, as torch's


def test_the_sampler_view_iterates_the_loaders_order():
    loader = DataLoader(Items(), batch_size=4, shuffle=True, seed=3)
    assert sorted(loader.sampler) == list(range(23)) and len(loader.sampler) == 23
    upcoming = list(loader.sampler)     # the next epoch's order
    assert _flat(loader) == upcoming
    assert list(loader.sampler) != upcoming  # now the epoch after


def test_a_loader_made_again_with_the_sampler_view_orders_its_own_epochs():
    """A framework that re-creates a loader from its attributes passes ``loader.sampler`` back."""
    import gc

    first = DataLoader(Items(), batch_size=4, shuffle=True, seed=3)
    expected = [_flat(first) for _ in range(3)]   # epochs 0, 1, 2 of the first loader
    assert expected[0] != expected[1] != expected[2]
    for keep_first in (True, False):
        original = DataLoader(Items(), batch_size=4, shuffle=True, seed=3)
        again = DataLoader(original.dataset, batch_size=original.batch_size, sampler=original.sampler)
        if not keep_first:
            del original
            gc.collect()
        assert [_flat(again) for _ in range(3)] == expected   # reshuffled each epoch, as the first one
        assert again.seed == 3 and again.shuffle is True and isinstance(again.sampler, tud.RandomSampler)
    other = DataLoader(Items(), batch_size=4, sampler=DataLoader(Items(), shuffle=True, seed=3).sampler)
    assert other.shuffle is False   # another dataset object: the view is a user's sampler, iterated


def test_the_sampler_view_outlives_the_loader_and_follows_set_epoch():
    """accelerate's prepare() keeps loader.batch_sampler and drops the loader."""
    import gc

    loader = DataLoader(Items(), batch_size=4, shuffle=True, seed=3)
    bs = loader.batch_sampler
    loader.sampler.set_epoch(2)
    assert loader._backend.position.epoch == 2  # the loader's epoch follows while it lives
    ref = DataLoader(Items(), batch_size=4, shuffle=True, seed=3)
    ref.set_epoch(2)
    expected = _flat(ref)
    del loader
    gc.collect()
    assert [i for b in bs for i in b] == expected
    bs.sampler.set_epoch(3)
    assert [i for b in bs for i in b] != expected and sorted(i for b in bs for i in b) == list(range(23))


@pytest.mark.parametrize("make", LOADERS)
@pytest.mark.parametrize("attr", ["batch_size", "sampler", "batch_sampler", "drop_last", "dataset",
                                  "persistent_workers"])
def test_assignment_after_construction_raises_value_error(make, attr):
    loader = make(Items(), batch_size=4)
    with pytest.raises(ValueError, match=f"{attr} attribute should not be set after"):
        setattr(loader, attr, getattr(loader, attr))


@pytest.mark.parametrize("make", LOADERS)
def test_len_follows_a_growing_dataset(make):
    ds = Items(10)
    loader = make(ds, batch_size=4)
    assert len(loader) == 3
    ds.n = 21
    assert len(loader) == 6
    assert _flat(loader) == list(range(21))


@pytest.mark.parametrize("kwargs", [dict(), dict(batch_size=None), dict(batch_size=4, collate_fn=list)])
def test_collate_fn_attribute_is_torchs(kwargs):
    # code written for torch's loader reads loader.collate_fn (to wrap it, or to re-create the loader)
    ours, theirs = DataLoader(Items(), **kwargs), tud.DataLoader(Items(), **kwargs)
    assert ours.collate_fn is theirs.collate_fn
    again = DataLoader(Items(), batch_size=ours.batch_size, collate_fn=ours.collate_fn)
    assert [x.tolist() if hasattr(x, "tolist") else x for x in again] == \
        [x.tolist() if hasattr(x, "tolist") else x for x in ours]


def test_batch_sampler_sets_batch_size_and_drop_last_as_torch():
    bs = tud.BatchSampler(tud.SequentialSampler(range(23)), 5, True)
    ours, theirs = DataLoader(Items(), batch_sampler=bs), tud.DataLoader(Items(), batch_sampler=bs)
    assert (ours.batch_size, ours.drop_last) == (theirs.batch_size, theirs.drop_last) == (None, False)
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]


@pytest.mark.parametrize("kwargs", [dict(batch_sampler=tud.BatchSampler(range(23), 5, False), drop_last=True),
                                    dict(num_workers=-1), dict(timeout=-1),
                                    dict(sampler=range(23), shuffle=True)])
def test_invalid_arguments_raise_what_torch_raises(kwargs):
    with pytest.raises(ValueError) as theirs:
        tud.DataLoader(Items(), **kwargs)
    with pytest.raises(ValueError) as ours:
        DataLoader(Items(), **kwargs)
    assert isinstance(ours.value, ConfigError)
    assert str(ours.value).split()[:2] == str(theirs.value).split()[:2]


@pytest.mark.parametrize("kwargs", [dict(timeout="1"), dict(prefetch_factor=-1, num_workers=1), dict(batch_size=0),
                                    dict(batch_size=-1), dict(batch_size="4"), dict(batch_size=2.0),
                                    dict(num_workers=1.5), dict(drop_last="yes"),
                                    dict(multiprocessing_context="nope", num_workers=1),
                                    dict(multiprocessing_context=5, num_workers=1),
                                    dict(multiprocessing_context="spawn", num_workers=0)])
def test_bad_arguments_raise_the_kind_of_error_torch_raises(kwargs):
    def kind(make):
        try:
            list(make(Items(10), **kwargs))
        except TypeError:
            return TypeError
        except ValueError:
            return ValueError
        return None

    assert kind(tud.DataLoader) is not None
    assert kind(DataLoader) is kind(tud.DataLoader)


class _Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.mark.parametrize("kwargs", [dict(batch_size=2.5), dict(batch_size="4"), dict(batch_size=0), dict(drop_last="yes"),
                                    dict(drop_last=0), dict(num_workers="2"), dict(num_workers=-1),
                                    dict(prefetch_factor=-1, num_workers=2), dict(timeout=-1), dict(timeout="x"),
                                    dict(persistent_workers=True), dict(batch_size=None, drop_last=True)])
def test_an_iterable_datasets_bad_arguments_raise_what_torch_raises(kwargs):
    def raised(make):
        try:
            list(make(_Stream(), **kwargs))
        except (TypeError, ValueError) as e:
            return e
        return None

    theirs, ours = raised(tud.DataLoader), raised(DataLoader)
    assert theirs is not None and ours is not None, (theirs, ours)
    assert isinstance(ours, TypeError) == isinstance(theirs, TypeError), (theirs, ours)
    if isinstance(theirs, ValueError):   # torch's words where torch has some (not a bare comparison's TypeError)
        assert str(ours).split()[:3] == str(theirs).split()[:3], (theirs, ours)


def test_a_num_workers_of_the_wrong_type_is_a_type_error_as_in_torch():
    with pytest.raises(TypeError):
        tud.DataLoader(Items(), num_workers="many")
    with pytest.raises(TypeError):
        DataLoader(Items(), num_workers="many")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_without_a_usable_len_is_delivered_as_torch_delivers_it(num_workers):
    def nested(items):
        return torch.nested.nested_tensor([torch.zeros(i % 3 + 1, 2) for i in items]), torch.tensor(items)

    ours = list(DataLoader(Items(10), batch_size=4, collate_fn=nested, num_workers=num_workers))
    theirs = list(tud.DataLoader(Items(10), batch_size=4, collate_fn=nested, num_workers=num_workers))
    assert [b[1].tolist() for b in ours] == [b[1].tolist() for b in theirs]
    assert [b[0].size(0) for b in ours] == [4, 4, 2]


# -- unbatched -------------------------------------------------------------------------------
class BatchFetched(Items):
    """Item i: ``(i, 0)`` read alone, ``(i, len(keys))`` read through ``__getitems__(keys)``, so a
    batch says how it was read."""

    def __getitem__(self, i):
        return (i, 0)

    def __getitems__(self, keys):
        return [(k, len(keys)) for k in keys]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_getitems_is_called_as_torch_calls_it(num_workers):
    """Batched: one ``__getitems__(keys)`` per batch; unbatched (``batch_size=None``): one
    ``__getitem__`` per sample, as torch's fetcher does."""
    for kw in ({"batch_size": 4}, {"batch_size": 4, "drop_last": True}, {"batch_size": None}):
        got = {}
        for make in LOADERS:
            out = []
            for b in make(BatchFetched(10), num_workers=num_workers, **kw):
                keys, tags = (b[0].tolist(), b[1].tolist()) if kw["batch_size"] else ([int(b[0])], [int(b[1])])
                out.append((keys, tags))
            got[make] = out
        assert got[DataLoader] == got[tud.DataLoader], kw
        tags = {t for _, ts in got[DataLoader] for t in ts}
        assert tags == ({0} if kw["batch_size"] is None else ({4, 2} if "drop_last" not in kw else {4})), kw


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unbatched_loading_matches_torch(num_workers):
    class Arrays(Items):
        def __getitem__(self, i):
            return np.full(3, i, np.float32), i

    ours = list(DataLoader(Arrays(7), batch_size=None, num_workers=num_workers))
    theirs = list(tud.DataLoader(Arrays(7), batch_size=None, num_workers=num_workers))
    assert len(ours) == len(theirs) == 7
    assert len(DataLoader(Arrays(7), batch_size=None)) == len(tud.DataLoader(Arrays(7), batch_size=None))
    for (a, i), (b, j) in zip(ours, theirs):
        assert torch.equal(a, b) and type(a) is type(b) and i == j


def test_unbatched_pipeline_is_refused(sources):
    p = Pipeline(sources["folder"], [Decode(), ResizeCenterCrop(32, 32)], num_workers=0, device="cpu")
    with pytest.raises(ConfigError, match="batch_size=None"):
        DataLoader(p, batch_size=None)


# -- an exception, then the next batch ---------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_after_a_batch_raises_the_next_batch_comes_as_in_torch(num_workers):
    def run(make):
        got, errors = [], []
        it = iter(make(Failing(), batch_size=4, num_workers=num_workers))
        while True:
            try:
                got.append(next(it).tolist())
            except StopIteration:
                break
            except KeyError as e:
                errors.append(len(got))
                assert "item 7 is broken" in str(e)
        return got, errors

    ours, theirs = run(DataLoader), run(tud.DataLoader)
    assert ours == theirs
    got, errors = ours
    assert errors == [1]  # batch 1 (items 4-7) raised; the batches after it came
    assert got[:2] == [[0, 1, 2, 3], [8, 9, 10, 11]] and len(got) == 5


def test_a_failed_batch_counts_as_consumed_for_resume():
    loader = DataLoader(Failing(), batch_size=4)
    it = iter(loader)
    next(it)
    with pytest.raises(KeyError):
        next(it)
    again = DataLoader(Failing(), batch_size=4, seed=loader.seed)
    again.load_state_dict(loader.state_dict())
    assert _flat(again) == list(range(8, 23))


# -- sharding read at iteration; a DistributedSampler as frameworks inject it -------------------
def test_a_distributed_sampler_chooses_the_shard_and_the_epoch():
    ds = Items(23)
    seen = []
    for rank in range(2):
        s = tud.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=4, sampler=s, seed=5)
        assert loader.sampler is s
        s.set_epoch(1)
        one = _flat(loader)
        s.set_epoch(2)
        two = _flat(loader)
        assert one != two
        seen.append((one, two))
        assert len(loader) == 3
    for e in range(2):
        both = seen[0][e] + seen[1][e]
        assert len(both) == 24 and set(both) == set(range(23))  # one repeat pads 23 to 2 x 12
    # the shard is the sampler's own, as torch's loader reads it (its seed, not the loader's)
    s = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    s.set_epoch(2)
    assert _flat(tud.DataLoader(ds, batch_size=4, sampler=s)) == seen[1][1]


def test_rebuilding_from_the_attributes_as_lightning_does_keeps_the_settings(sources):
    """Lightning re-creates a loader from its public attributes that match __init__'s
    parameters, with its DistributedSampler (pytorch_lightning.utilities.data)."""
    import inspect

    p = Pipeline(sources["folder"], [Decode(), RandomResizedCrop(32)], batch_size=8, num_workers=0, seed=4,
                 device="cpu")
    for loader in (DataLoader(p, engine="python", max_skipped=3), DataLoader(Items(), batch_size=4, shuffle=True)):
        params = inspect.signature(type(loader).__init__).parameters
        attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
        kwargs = {k: v for k, v in attrs.items() if k in params and params[k].default is not v}
        kwargs.update(sampler=tud.DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=True),
                      shuffle=False, batch_sampler=None)
        again = DataLoader(**kwargs)
        assert again.seed == loader.seed and again.batch_size == loader.batch_size
        assert len(again) == math.ceil(math.ceil(len(loader.dataset) / 2) / loader.batch_size)
        next(iter(again))


# -- state: the global position, any rank, any world size --------------------------------------
def _epoch_from(n, bs, world, state=None, seed=1, shuffle=True, drop_last=False):
    """Every rank's remaining batches of the epoch (each rank loads the same state)."""
    out = []
    for r in range(world):
        loader = DataLoader(Items(n), batch_size=bs, shuffle=shuffle, seed=seed, rank=r, world_size=world,
                            drop_last=drop_last)
        loader.set_epoch(3)
        if state is not None:
            loader.load_state_dict(state)
        out.append([b.tolist() for b in loader])
    return out


def _run_until(n, bs, world, k, seed=1, shuffle=True, drop_last=False):
    """k batches on every rank of ``world``; returns what they took and rank 0's state."""
    taken, state = [], None
    for r in range(world):
        loader = DataLoader(Items(n), batch_size=bs, shuffle=shuffle, seed=seed, rank=r, world_size=world,
                            drop_last=drop_last)
        loader.set_epoch(3)
        it = iter(loader)
        for _ in range(k):
            taken.extend(next(it).tolist())
        if r == 0:
            state = loader.state_dict()
    return taken, state


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3), (3, 2), (2, 2)])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_resume_on_another_world_size_delivers_the_rest_once(before, after, k):
    n, bs = 37, 4
    taken, state = _run_until(n, bs, before, k)
    assert state["samples_seen"] == min(k * before * bs, n)
    rest = [x for rank in _epoch_from(n, bs, after, state) for b in rank for x in b]
    # every sample once, plus at most after - 1 repeats of the documented padding
    assert set(taken) | set(rest) == set(range(n)) and not set(taken) & set(rest[:n - len(taken)])
    assert len(taken) + len(rest) - n < after


def test_resume_on_the_same_world_size_gives_the_batches_that_would_have_come():
    n, bs, world = 37, 4, 2
    whole = _epoch_from(n, bs, world)
    _, state = _run_until(n, bs, world, 2)
    rest = _epoch_from(n, bs, world, state)
    assert [w[2:] for w in whole] == rest


def test_resume_with_drop_last_on_another_world_size_takes_no_sample_twice():
    n, bs = 37, 4
    taken, state = _run_until(n, bs, 2, 2, drop_last=True)
    rest = [x for rank in _epoch_from(n, bs, 3, state, drop_last=True) for b in rank for x in b]
    assert len(set(taken + rest)) == len(taken + rest)
    assert len(rest) == (n - len(taken)) // 12 * 12


def test_resume_at_the_epochs_end_starts_the_next_epoch():
    loader = DataLoader(Items(10), batch_size=4, seed=2, shuffle=True, rank=0, world_size=2)
    list(loader)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["samples_seen"] == 0
    again = DataLoader(Items(10), batch_size=4, seed=2, shuffle=True)
    again.load_state_dict(state)
    ref = DataLoader(Items(10), batch_size=4, seed=2, shuffle=True)
    ref.set_epoch(1)
    assert _flat(again) == _flat(ref)


def test_other_order_settings_are_refused():
    _, state = _run_until(37, 4, 2, 1)
    with pytest.raises(StateError, match="batch_size"):
        DataLoader(Items(37), batch_size=5, shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(StateError, match="another dataset"):
        DataLoader(Items(38), batch_size=4, shuffle=True, seed=1).load_state_dict(state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_memory_pins_like_torch(num_workers):
    class Arrays(Items):
        def __getitem__(self, i):
            return {"x": torch.full((3,), float(i)), "i": i}

    for make in LOADERS:
        batches = list(make(Arrays(9), batch_size=4, num_workers=num_workers, pin_memory=True))
        assert [b["i"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
        assert all(b["x"].is_pinned() and b["i"].is_pinned() for b in batches), make
