"""Shard-aware shuffle (feedgpu.order.shard_shuffle): conservation, the open-shard bound, what it does to
randomness, rank sharding and resume, and the pipeline option ``shuffle: shards``."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from feedgpu import ConfigError, DataLoader, Pipeline, StateError
from feedgpu.config import validate
from feedgpu.loader.state import read_state
from feedgpu.order.sharded import ShardedOrder
from feedgpu.order.shard_shuffle import max_open, open_shards, same_shard_neighbours, shard_order
from feedgpu.stages import Decode, ResizeCenterCrop

pytestmark = pytest.mark.timeout(120)


def equal_shards(shards: int, size: int) -> np.ndarray:
    return np.repeat(np.arange(shards, dtype=np.int32), size)


def test_every_sample_once_and_a_pure_function_of_seed_and_epoch():
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 60, size=40)          # uneven, some shards empty
    shard_of = np.repeat(np.arange(40), sizes)
    a = shard_order(shard_of, seed=7, epoch=1, window=4)
    assert a.dtype == np.int64 and np.array_equal(np.sort(a), np.arange(len(shard_of)))
    assert np.array_equal(a, shard_order(shard_of, seed=7, epoch=1, window=4))
    assert not np.array_equal(a, shard_order(shard_of, seed=7, epoch=2, window=4))
    assert not np.array_equal(a, shard_order(shard_of, seed=8, epoch=1, window=4))
    assert not np.array_equal(a, shard_order(shard_of, seed=7, epoch=1, window=5))


def test_samples_of_a_shard_need_not_be_contiguous():
    """A source may number its samples in any order: shard ids are grouped first."""
    shard_of = np.tile(np.arange(10), 30)          # sample i is in shard i % 10
    order = shard_order(shard_of, seed=0, epoch=0, window=3)
    assert np.array_equal(np.sort(order), np.arange(300))
    assert max_open(order, shard_of) <= 3


@pytest.mark.parametrize("window", [1, 2, 4, 8, 16])
def test_at_most_window_shards_are_open_with_equal_shards(window):
    shard_of = equal_shards(100, 50)
    for epoch in range(3):
        order = shard_order(shard_of, seed=1, epoch=epoch, window=window)
        assert max_open(order, shard_of) <= window
        # and the window is used: most of the epoch has that many shards open
        assert np.median(open_shards(order, shard_of)) >= window - 1


@pytest.mark.parametrize("window", [2, 3, 8])
def test_at_most_window_shards_are_open_whatever_their_sizes(window):
    rng = np.random.default_rng(window)
    sizes = np.concatenate([rng.integers(1, 5, size=30), rng.integers(200, 400, size=10), [1, 1, 1, 900]])
    shard_of = np.repeat(np.arange(len(sizes)), rng.permutation(sizes))
    for epoch in range(5):
        assert max_open(shard_order(shard_of, seed=0, epoch=epoch, window=window), shard_of) <= window


def test_window_one_reads_one_shard_at_a_time_in_random_order():
    shard_of = equal_shards(20, 30)
    order = shard_order(shard_of, seed=0, epoch=0, window=1)
    runs = shard_of[order]
    assert (np.diff(runs) != 0).sum() == 19, "each shard is read in one run"
    firsts = order.reshape(20, 30)
    assert not all((np.diff(r) == 1).all() for r in firsts), "samples of a shard are shuffled"


def test_neighbours_come_from_the_same_shard_about_once_in_window():
    """The documented statistic: consecutive samples share a shard with probability ~1/window
    (a plain shuffle: ~1/shards); measured over 200k samples, bound at 1.3/window."""
    shard_of = equal_shards(400, 500)
    for window in (4, 8, 32):
        order = shard_order(shard_of, seed=5, epoch=0, window=window)
        frac = same_shard_neighbours(order, shard_of)
        assert 0.7 / window <= frac <= 1.3 / window, (window, frac)
    plain = np.random.default_rng(0).permutation(len(shard_of))
    assert same_shard_neighbours(plain, shard_of) < 3 / 400


def test_a_samples_place_in_its_shard_says_nothing_about_its_place_in_the_epoch():
    """Within the window the mixing is uniform: the first and the last samples of a shard are
    read equally early (mean rank within the shard, 0.5 for both; bound 0.05)."""
    size = 100
    shard_of = equal_shards(300, size)
    order = shard_order(shard_of, seed=2, epoch=0, window=8)
    rank_in_epoch = np.empty(len(order), np.int64)
    rank_in_epoch[order] = np.arange(len(order))
    by_shard = rank_in_epoch.reshape(300, size)                # row: one shard, in index order
    ranks = by_shard.argsort(axis=1).argsort(axis=1) / (size - 1)   # 0 = read first of its shard
    head, tail = ranks[:, :10].mean(), ranks[:, -10:].mean()
    assert abs(head - 0.5) < 0.05 and abs(tail - 0.5) < 0.05, (head, tail)


def test_a_window_holding_every_shard_is_the_plain_shuffle():
    shard_of = equal_shards(5, 20)
    plain = ShardedOrder(100, 10, seed=3).epoch_order(4)
    assert np.array_equal(shard_order(shard_of, seed=3, epoch=4, window=5), plain)
    assert np.array_equal(shard_order(np.zeros(100, np.int32), seed=3, epoch=4, window=1), plain)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_window(bad):
    with pytest.raises(ConfigError, match="shard_window"):
        shard_order(equal_shards(3, 3), seed=0, epoch=0, window=bad)


# -- through ShardedOrder: ranks, padding, resume ---------------------------------------------------
def _order(n_shards=37, size=23, **kw):
    shard_of = equal_shards(n_shards, size)
    opts = dict(seed=11, shard_window=4, shard_of=shard_of)
    opts.update(kw)
    return shard_of, lambda batch_size, **k: ShardedOrder(len(shard_of), batch_size, **{**opts, **k})


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranks_get_equal_batches_and_cover_every_sample_once(world):
    shard_of, make = _order()
    n = len(shard_of)
    orders = [make(16, rank=r, world_size=world) for r in range(world)]
    assert len({len(o) for o in orders}) == 1
    got = Counter(i for o in orders for i in o.shard(2).tolist())
    assert set(got) == set(range(n))
    assert sum(got.values()) - n == (-n) % world, "only the documented padding repeats"
    # each rank reads from the same few open shards as the global order (the padding, the head
    # of the epoch order repeated at the end, reopens a first shard for the last sample)
    for o in orders:
        assert max_open(o.shard(2)[:n // world], shard_of) <= 4


@pytest.mark.parametrize("saved_world, resumed_world", [(2, 3), (3, 1), (4, 4)])
def test_resume_from_a_global_position_on_another_world_size(saved_world, resumed_world):
    shard_of, make = _order()
    n = len(shard_of)
    before = [make(8, rank=r, world_size=saved_world) for r in range(saved_world)]
    k = 5                                                     # batches each rank took
    taken = [i for o in before for b in range(k) for i in o.batch(1, b).tolist()]
    pos = before[0].position(k)
    after = [make(8, rank=r, world_size=resumed_world) for r in range(resumed_world)]
    rest = [i for o in after for i in o.view(1, pos).indices.tolist()]
    assert sorted(set(taken) | set(rest)) == list(range(n))
    padding = (-(n - pos)) % resumed_world
    assert len(rest) - (n - pos) == padding
    head = set(after[0].epoch_order(1)[:padding].tolist())
    assert set(taken) & set(rest) <= head, "nothing read twice but the padding (the epoch order's head)"
    if saved_world == resumed_world:
        assert after[0].view(1, pos).indices.tolist() == before[0].shard(1)[k * 8:].tolist()


def test_the_order_settings_name_the_window_and_a_plain_state_is_refused():
    shard_of, make = _order()
    shards = make(8)
    plain = ShardedOrder(len(shard_of), 8, seed=11)
    assert shards.config()["shard_window"] == 4 and "shard_window" not in plain.config()
    state = {"format": "feedgpu.loader/2", "fingerprint": "f", "epoch": 0, "samples_seen": 16,
             "batches_seen": 2, "seed": 11, "world_size": 1, "sampler": plain.config()}
    with pytest.raises(StateError, match="shard_window"):
        read_state(state, "f", shards.config(), sharded=True)
    assert read_state(dict(state, sampler=shards.config()), "f", shards.config(), sharded=True)[1] == 16


def test_no_shuffle_ignores_the_window():
    shard_of, make = _order()
    assert make(8, shuffle=False).epoch_order(0).tolist() == list(range(len(shard_of)))


# -- sources and the pipeline option ---------------------------------------------------------------
def test_sources_say_which_shard_each_sample_is_in(sources):
    tar, pq_, folder = sources["tar"], sources["parquet"], sources["folder"]
    assert np.array_equal(tar.shard_of(), tar.shard_ids) and tar.shard_names() == tar.shards
    assert tar.shard_sizes().sum() == len(tar) and len(tar.shard_sizes()) == 3
    assert np.array_equal(pq_.shard_of(), pq_.file_ids) and pq_.shard_names() == pq_.files
    assert pq_.shard_sizes().tolist() == [int((pq_.file_ids == f).sum()) for f in range(3)]
    assert folder.shard_sizes().tolist() == [len(folder)] and not folder.shard_of().any()


def _tar_pipe(tar_ds, **kw):
    return Pipeline({"format": "tar", "path": str(tar_ds)}, [Decode(), ResizeCenterCrop(40, 32)],
                    batch_size=10, num_workers=0, device="cpu", seed=4, **kw)


def test_loader_reads_in_the_shard_aware_order_and_resumes(tar_ds):
    pipe = _tar_pipe(tar_ds, shuffle="shards", shard_window=2)
    assert pipe.shuffle is True and pipe.shard_window == 2
    loader = DataLoader(pipe)
    loader.set_epoch(3)
    src = pipe.source
    expected = shard_order(src.shard_of(), seed=4, epoch=3, window=2)
    assert max_open(expected, src.shard_of()) <= 2
    it = iter(loader)
    head = [next(it).labels.clone() for _ in range(4)]
    state = loader.state_dict()
    assert state["sampler"]["shard_window"] == 2
    loader.shutdown()
    del it
    again = DataLoader(_tar_pipe(tar_ds, shuffle="shards", shard_window=2))
    again.load_state_dict(state)
    tail = [b.labels.clone() for b in again]
    labels = torch.cat(head + tail)
    assert labels.tolist() == src.labels[expected].tolist(), "the documented order, resumed exactly"
    with pytest.raises(StateError, match="shard_window"):
        DataLoader(_tar_pipe(tar_ds)).load_state_dict(state)


def test_shuffle_false_and_sampler_views(tar_ds):
    pipe = _tar_pipe(tar_ds, shuffle="shards", shard_window=2)
    assert DataLoader(pipe, shuffle=False)._backend.order().epoch_order(0).tolist() == list(range(len(pipe.source)))
    loader = DataLoader(pipe)
    loader.set_epoch(1)
    assert list(loader.sampler) == shard_order(pipe.source.shard_of(), 4, 1, 2).tolist()


def test_the_sampler_keeps_the_shard_aware_order_once_the_loader_is_gone(tar_ds):
    """accelerate's prepare() keeps loader.batch_sampler and drops the loader."""
    import gc

    pipe = _tar_pipe(tar_ds, shuffle="shards", shard_window=2)
    loader = DataLoader(pipe)
    sampler = loader.sampler
    sampler.set_epoch(2)
    del loader
    gc.collect()
    assert sampler._loader() is None
    assert list(sampler) == shard_order(pipe.source.shard_of(), 4, 2, 2).tolist()


def test_yaml_option(tar_ds):
    base = {"source": {"format": "tar", "path": str(tar_ds)}, "output": {"dtype": "uint8", "layout": "NHWC"},
            "stages": [{"op": "decode"}, {"op": "resize_center_crop", "resize": 40, "crop": 32}]}
    c = validate({**base, "loader": {"shuffle": "shards", "shard_window": 3}})
    assert c.loader.shuffle == "shards" and c.loader.shard_window == 3
    pipe = Pipeline.from_config({**base, "loader": {"shuffle": "shards", "shard_window": 3}})
    assert pipe.shard_window == 3 and "shards (window 3)" in pipe.explain()
    assert Pipeline.from_config(base).shard_window is None
    with pytest.raises(ConfigError, match="shard_window"):
        validate({**base, "loader": {"shuffle": "shards", "shard_window": 0}})
    with pytest.raises(ConfigError, match="loader.shuffle"):
        validate({**base, "loader": {"shuffle": "blocks"}})
    with pytest.raises(ConfigError, match=r"loader.shuffle: .* 'shards' \(got 'blocks'\)"):
        _tar_pipe(tar_ds, shuffle="blocks")
