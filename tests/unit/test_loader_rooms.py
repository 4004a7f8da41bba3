"""The loader's rooms (feedgpu.loader, feedgpu.order): torch's keywords resolved once in the
settings class, the position record, one backend per kind of dataset, the listeners of a pass and
the one spare-sample draw."""
from __future__ import annotations

import numpy as np
import pytest
import torch.utils.data as tud

from feedgpu import ConfigError, DataLoader
from feedgpu.errors import ArgumentTypeError
from feedgpu.loader.iterable import IterableBackend
from feedgpu.loader.kinds import DatasetBackend
from feedgpu.loader.listeners import BalancerListener, Counters, SkipBudgetListener
from feedgpu.loader.state import Position
from feedgpu.order.sharded import ShardedOrder
from feedgpu.order.sharded import draw_spares
from feedgpu.order.user import UserOrder
from feedgpu.settings import TORCH_DEFAULTS, LoaderSettings


class Items(tud.Dataset):
    def __init__(self, n: int = 10):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(5))


def test_torch_defaults_apply_to_a_torch_dataset_and_the_given_keywords_override_them():
    s = LoaderSettings.from_torch({}, TORCH_DEFAULTS)
    assert (s.batch_size, s.shuffle, s.drop_last, s.num_workers, s.prefetch_factor, s.persistent_workers,
            s.timeout) == (1, False, False, 0, 2, False, 0.0)
    s = LoaderSettings.from_torch({"batch_size": 8, "num_workers": 2, "shuffle": 1, "timeout": 3}, TORCH_DEFAULTS)
    assert (s.batch_size, s.num_workers, s.shuffle, s.timeout) == (8, 2, True, 3.0)


def test_a_pipelines_persistent_workers_apply_only_with_workers():
    base = LoaderSettings(persistent_workers=True)
    assert LoaderSettings.from_torch({"num_workers": 2}, base).persistent_workers is True
    assert LoaderSettings.from_torch({"num_workers": 0}, base).persistent_workers is False
    assert LoaderSettings.from_torch({"num_workers": 0}, base, remote=True).persistent_workers is True


@pytest.mark.parametrize("given,kind,words", [
    ({"batch_size": 0}, ConfigError, "batch_size should be a positive integer value, but got batch_size=0"),
    ({"drop_last": "yes"}, ConfigError, "drop_last should be a boolean value"),
    ({"num_workers": 1.5}, ArgumentTypeError, "num_workers must be an int"),
    ({"num_workers": -1}, ConfigError, "num_workers option should be non-negative"),
    ({"prefetch_factor": 2}, ConfigError, "prefetch_factor option could only be specified in multiprocessing"),
    ({"persistent_workers": True}, ConfigError, "persistent_workers option needs num_workers > 0"),
    ({"num_workers": 1, "prefetch_factor": 0}, ConfigError, "prefetch_factor=0 asks the workers for no batch"),
    ({"timeout": "1"}, ArgumentTypeError, "timeout must be a number of seconds"),
    ({"timeout": -1}, ConfigError, "timeout option should be non-negative"),
])
def test_the_settings_class_refuses_in_torchs_words_and_kinds(given, kind, words):
    with pytest.raises(kind, match=words):
        LoaderSettings.from_torch(given, TORCH_DEFAULTS)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ConfigError, ValueError)


def test_the_position_commits_completes_and_seeks():
    p = Position()
    p.begin(3, 0)
    p.commit(3, 8, rows=4)
    p.commit(3, 16, rows=4)
    assert (p.epoch, p.start, p.rows_seen, p.batches_seen, p.next_epoch) == (3, 16, 8, 2, 0)
    p.complete(3)
    assert (p.epoch, p.start, p.rows_seen, p.batches_seen, p.next_epoch) == (4, 0, 0, 0, 4)
    p.seek(7, 12)   # set_epoch: the counts are kept
    p.commit(7, 16, rows=4)
    assert (p.epoch, p.start, p.batches_seen, p.next_epoch) == (7, 16, 1, 7)
    p.seek(2, 5, rows=20, batches=5)   # load_state_dict
    assert (p.epoch, p.start, p.rows_seen, p.batches_seen) == (2, 5, 20, 5)


def test_the_loader_picks_one_backend_per_kind_of_dataset_and_delegates():
    mapped = DataLoader(Items(10), batch_size=4)
    assert isinstance(mapped._backend, DatasetBackend) and len(mapped) == 3
    assert [b.tolist() for b in mapped] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert mapped.state_dict()["epoch"] == 1 and mapped._backend.position.next_epoch == 1
    streamed = DataLoader(Stream(), batch_size=2)
    assert isinstance(streamed._backend, IterableBackend)
    assert [b.tolist() for b in streamed] == [[0, 1], [2, 3], [4]]
    assert streamed.worker_pids() == [] and "IterableDataset" in streamed.explain()


def test_the_live_values_of_the_backend_are_the_loaders_attributes():
    loader = DataLoader(Items(10), batch_size=4, num_workers=1, seed=3)
    assert vars(loader)["num_workers"] == 1 and vars(loader)["prefetch_factor"] == 2 and vars(loader)["seed"] == 3
    loader._backend.set_live(2, 3)
    assert (loader.num_workers, loader.prefetch_factor) == (2, 3)
    loader.worker_init_fn = print   # assigned after construction (as Lightning does): the next pass uses it
    assert loader._backend.worker_init_fn is print


def test_a_pass_subscribes_counters_skip_budget_and_only_what_it_runs():
    loader = DataLoader(Items(10), batch_size=4)
    it = iter(loader)
    kinds = [type(x) for x in it.listeners]
    assert kinds[:2] == [Counters, SkipBudgetListener] and BalancerListener not in kinds
    list(it)
    assert loader.stats()["batches"] == 3


def test_the_sharded_spares_are_the_seeded_draw_of_before():
    order = ShardedOrder(50, 4, shuffle=True, seed=-7, rank=1, world_size=2)
    view = order.view(2)
    got = view.spares(3, 6)
    pos = 3 * 2 * 4
    rng = np.random.default_rng([-7 & 0xFFFFFFFFFFFFFFFF, 2, 1, pos, 1])   # the draw the sharded path always used
    assert got.tolist() == view.indices[rng.choice(len(view.indices), size=6, replace=False)].tolist()


def test_a_user_samplers_spares_come_from_the_same_draw_distinct_first():
    order = UserOrder(5, list(range(5)), None, 2, False, seed=11)
    got = order.view(1).spares(2, 8)
    assert got.tolist() == draw_spares(11, 1, 0, 2, 8, 5).tolist()
    assert sorted(got[:5].tolist()) == [0, 1, 2, 3, 4] and all(0 <= x < 5 for x in got)


def test_both_orders_answer_the_order_protocol():
    sharded = ShardedOrder(10, 4, shuffle=False)
    user = UserOrder(10, list(range(10)), None, 4, False, seed=0)
    assert (sharded.seekable, sharded.known_len(), sharded.end()) == (True, 3, 10)
    assert (user.seekable, user.known_len(), user.end()) == (False, 3, 3)
