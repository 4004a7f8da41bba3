"""The sampler: a pure function of (seed, epoch, rank, world_size)."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from feedgpu import ConfigError
from feedgpu.order.sharded import ShardedOrder


def _epoch_batches(order: ShardedOrder, epoch: int) -> list[list[int]]:
    return [order.batch(epoch, b).tolist() for b in range(len(order))]


def test_shuffle_changes_per_epoch_and_repeats_for_the_same_seed():
    a = ShardedOrder(100, 10, seed=7)
    b = ShardedOrder(100, 10, seed=7)
    c = ShardedOrder(100, 10, seed=8)
    e0, e1 = a.epoch_order(0), a.epoch_order(1)
    assert sorted(e0.tolist()) == list(range(100))
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(e0, np.arange(100))
    np.testing.assert_array_equal(e1, b.epoch_order(1))
    assert _epoch_batches(a, 3) == _epoch_batches(b, 3)
    assert not np.array_equal(e0, c.epoch_order(0))
    assert e0.dtype == np.int64


def test_no_shuffle_keeps_index_order():
    o = ShardedOrder(10, 4, shuffle=False)
    assert _epoch_batches(o, 0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert _epoch_batches(o, 5) == _epoch_batches(o, 0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 10, 13, 17, 24])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_get_equal_batches_and_cover_every_sample(world_size, n, shuffle):
    bs = 3
    orders = [ShardedOrder(n, bs, shuffle=shuffle, seed=1, rank=r, world_size=world_size) for r in range(world_size)]
    per_rank = math.ceil(n / world_size)
    for epoch in (0, 1):
        shards = [o.shard(epoch) for o in orders]
        assert {len(o) for o in orders} == {math.ceil(per_rank / bs)}
        assert {len(s) for s in shards} == {per_rank}
        # batch sizes are the same on every rank, batch by batch
        sizes = [[len(o.batch(epoch, b)) for b in range(len(o))] for o in orders]
        assert all(s == sizes[0] for s in sizes)
        assert sum(sizes[0]) == per_rank
        counts = Counter(np.concatenate(shards).tolist())
        assert set(counts) == set(range(n)), "every sample is read once per epoch"
        dup = sum(c - 1 for c in counts.values())
        assert dup == per_rank * world_size - n <= world_size - 1
        # padding repeats the head of the epoch's order (cyclically when n < world_size)
        order = orders[0].epoch_order(epoch).tolist()
        assert counts == Counter(order + (order * world_size)[:dup])
        if n >= world_size:
            assert max(counts.values()) <= 2


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [13, 24, 50])
def test_drop_last_keeps_only_full_batches(world_size, n):
    bs = 3
    if n < world_size * bs:
        pytest.skip("no full batch")
    orders = [ShardedOrder(n, bs, seed=3, rank=r, world_size=world_size, drop_last=True) for r in range(world_size)]
    nb = n // (world_size * bs)
    used = []
    for o in orders:
        assert len(o) == nb
        batches = _epoch_batches(o, 2)
        assert all(len(b) == bs for b in batches)
        used += [i for b in batches for i in b]
    assert len(used) == len(set(used)) == nb * bs * world_size  # no padding duplicates
    assert set(used) == set(orders[0].epoch_order(2)[:nb * bs * world_size].tolist())


def test_drop_last_leaving_nothing_is_an_error():
    with pytest.raises(ConfigError, match="leaves no full batch"):
        ShardedOrder(5, 3, world_size=2, drop_last=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 0, "batch_size": 2}, "no samples"),
    ({"n": 5, "batch_size": 0}, "batch_size"),
    ({"n": 5, "batch_size": 2, "rank": 2, "world_size": 2}, "rank 2"),
    ({"n": 5, "batch_size": 2, "rank": -1, "world_size": 2}, "rank -1"),
    ({"n": 5, "batch_size": 2, "rank": 0, "world_size": 0}, "world_size=0"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ShardedOrder(**kwargs)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [10, 13, 17])
def test_unshuffled_shards_match_torch_distributed_sampler(world_size, n):
    for r in range(world_size):
        ours = ShardedOrder(n, 4, shuffle=False, rank=r, world_size=world_size).shard(0).tolist()
        theirs = list(DistributedSampler(range(n), num_replicas=world_size, rank=r, shuffle=False))
        assert ours == theirs


def test_resume_is_a_pure_function():
    """A new sampler with the same config gives the same batches: resume needs no cursor."""
    a = ShardedOrder(50, 8, seed=11, rank=1, world_size=3)
    before = _epoch_batches(a, 4)
    b = ShardedOrder(**a.config())
    assert [b.batch(4, k).tolist() for k in range(2, len(b))] == before[2:]


def test_batch_index_out_of_range():
    o = ShardedOrder(10, 4)
    with pytest.raises(IndexError):
        o.batch(0, 3)
    with pytest.raises(IndexError):
        o.batch(0, -1)


def test_spares_are_deterministic_and_come_from_the_shard():
    o = ShardedOrder(40, 4, seed=5, rank=1, world_size=2)
    s = o.spares(2, 3, 16)
    assert len(s) == 16
    assert set(s.tolist()) <= set(o.shard(2).tolist())
    np.testing.assert_array_equal(s, ShardedOrder(40, 4, seed=5, rank=1, world_size=2).spares(2, 3, 16))
    assert not np.array_equal(s, o.spares(2, 4, 16))


def test_permutation_is_uniform_enough():
    """Each index lands in each position about equally often over many epochs (a real shuffle)."""
    n, epochs = 8, 4000
    o = ShardedOrder(n, 8, seed=0)
    pos = np.zeros((n, n))
    for e in range(epochs):
        pos[o.epoch_order(e), np.arange(n)] += 1
    expected = epochs / n
    assert np.abs(pos - expected).max() < 5 * math.sqrt(expected)
    torch.manual_seed(0)  # nothing global is used: torch's RNG state does not matter
    assert o.epoch_order(3).tolist() == ShardedOrder(n, 8, seed=0).epoch_order(3).tolist()


def test_negative_seeds_work():
    """Any Python int is a seed (as for torch.manual_seed and the stages' sample_rng)."""
    o = ShardedOrder(20, 4, seed=-1)
    order = o.epoch_order(0).tolist()
    assert sorted(order) == list(range(20)) and order != list(range(20))
    assert order == ShardedOrder(20, 4, seed=-1).epoch_order(0).tolist()
    assert order != ShardedOrder(20, 4, seed=1).epoch_order(0).tolist()
    assert set(o.spares(0, 1, 8).tolist()) <= set(range(20))


def test_a_resumed_view_draws_the_epoch_order_once_and_the_same_spares(monkeypatch):
    """A view from a saved position takes its spares from the same epoch order it sliced (one
    permutation of ``n``, not two); the spares equal those of the view from the epoch's start."""
    from feedgpu.order.sharded import ShardedOrder

    calls = []
    real = ShardedOrder.epoch_order
    monkeypatch.setattr(ShardedOrder, "epoch_order", lambda self, e: calls.append(e) or real(self, e))
    whole = ShardedOrder(10_001, 16, shuffle=True, seed=3, rank=1, world_size=2).view(2, 0)
    resumed = ShardedOrder(10_001, 16, shuffle=True, seed=3, rank=1, world_size=2).view(2, 4_000)
    b = resumed.first + 3
    assert resumed.spares(b, 5).tolist() == whole.spares(b, 5).tolist()
    assert resumed.batch(b).tolist() == whole.batch(b).tolist()
    assert calls == [2, 2]
