"""feedgpu.DataLoader: outputs, determinism across worker counts, resume, torch's arguments."""
from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from PIL import Image

from conftest import N_IMAGES, alive, batches_equal, clone_all, wait_gone
from feedgpu import Batch, ConfigError, DataLoader, Pipeline, StateError
from feedgpu.order.sharded import ShardedOrder
from feedgpu.stages import (IMAGENET_MEAN, IMAGENET_STD, Decode, HorizontalFlip, Normalize, RandomResizedCrop,
                            ResizeCenterCrop)

pytestmark = pytest.mark.timeout(120)

LO = (0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
HI = (1 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)


def train(src, size=64, **kw) -> Pipeline:
    opts = dict(batch_size=16, num_workers=2, seed=0, device="cpu")
    opts.update(kw)
    norm = opts.pop("normalize", {})
    stages = [Decode(), RandomResizedCrop(size), HorizontalFlip()]
    if norm is not None:
        stages.append(Normalize(**norm))
    return Pipeline(src, stages, **opts)


def val(src, **kw) -> Pipeline:
    opts = dict(batch_size=16, num_workers=2, shuffle=False, device="cpu")
    opts.update(kw)
    return Pipeline(src, [Decode(), ResizeCenterCrop(72, 64)], **opts)


@pytest.fixture(scope="module")
def src(sources):
    return sources["folder"]


# -- outputs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm, shape, dtype", [
    ({}, (16, 3, 64, 64), torch.float32),
    ({"dtype": "float16"}, (16, 3, 64, 64), torch.float16),
    ({"layout": "NHWC"}, (16, 64, 64, 3), torch.float32),
    (None, (16, 64, 64, 3), torch.uint8),
])
def test_batch_shape_dtype_and_range(src, norm, shape, dtype):
    loader = DataLoader(train(src, normalize=norm, shuffle=False, num_workers=1))
    batch = next(iter(loader))
    assert isinstance(batch, Batch)
    images, labels = batch
    assert tuple(images.shape) == shape and images.dtype == dtype
    assert labels.dtype == torch.int64 and labels.tolist() == src.labels[:16].tolist()
    x = images.double()
    if dtype == torch.uint8:
        assert x.min() < 30 and x.max() > 225
    else:
        chw = x if shape[1] == 3 else x.permute(0, 3, 1, 2)
        per_c = chw.transpose(0, 1).reshape(3, -1)
        tol = 1e-3 if dtype == torch.float16 else 1e-5
        assert (per_c.min(1).values >= torch.tensor(LO) - tol).all()
        assert (per_c.max(1).values <= torch.tensor(HI) + tol).all()
        assert 0.4 < x.std() < 2.0  # real photos, not a constant
    loader.shutdown()


def test_batches_hold_the_stages_output(src):
    """End to end: each row equals decode -> resize+center crop done here, in index order."""
    loader = DataLoader(val(src, num_workers=2))
    got = torch.cat([b.images.clone() for b in loader])
    assert got.shape == (N_IMAGES, 64, 64, 3)
    st = ResizeCenterCrop(72, 64)
    for i in (0, 17, 63, N_IMAGES - 1):
        want = np.asarray(st.apply(Image.open(src.key(i)).convert("RGB")))
        np.testing.assert_array_equal(got[i].numpy(), want)
    norm = DataLoader(Pipeline(src, [Decode(), ResizeCenterCrop(72, 64), Normalize()], batch_size=16,
                               shuffle=False, num_workers=0, device="cpu"))
    x = next(iter(norm)).images
    want = (got[:16].double().permute(0, 3, 1, 2) / 255 - torch.tensor(IMAGENET_MEAN)[:, None, None]) \
        / torch.tensor(IMAGENET_STD)[:, None, None]
    torch.testing.assert_close(x.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
def test_results_do_not_depend_on_worker_count(sources, fmt):
    runs = {nw: clone_all(DataLoader(train(sources[fmt], num_workers=nw))) for nw in (0, 1, 2)}
    assert len(runs[0]) == math.ceil(N_IMAGES / 16)
    assert batches_equal(runs[0], runs[1]) and batches_equal(runs[0], runs[2])
    # the formats hold the same samples in the same order: the same batches come out
    ref = clone_all(DataLoader(train(sources["folder"], num_workers=0)))
    assert batches_equal(runs[0], ref)


def test_shuffle_and_random_stages_change_per_epoch_and_seed(src):
    loader = DataLoader(train(src, num_workers=2))
    e0 = clone_all(loader)
    e1 = clone_all(loader)  # iterating again starts the next epoch
    assert not torch.equal(torch.cat([b.labels for b in e0]), torch.cat([b.labels for b in e1]))
    assert sorted(torch.cat([b.labels for b in e0]).tolist()) == sorted(src.labels.tolist())
    other = DataLoader(train(src, num_workers=2))
    other.set_epoch(1)
    assert batches_equal(clone_all(other), e1)
    reseeded = DataLoader(train(src, num_workers=0), seed=1)
    assert not batches_equal(clone_all(reseeded), e0)


def test_len_follows_the_drop_last_rule(src):
    n = N_IMAGES
    assert len(DataLoader(train(src), batch_size=16)) == math.ceil(n / 16)
    assert len(DataLoader(train(src), batch_size=16, drop_last=True)) == n // 16
    assert len(DataLoader(train(src), batch_size=7, rank=1, world_size=3)) == math.ceil(math.ceil(n / 3) / 7)
    assert len(DataLoader(train(src), batch_size=7, rank=2, world_size=3, drop_last=True)) == n // 21
    loader = DataLoader(train(src, num_workers=0), batch_size=16, drop_last=True)
    sizes = [len(b.labels) for b in loader]
    assert sizes == [16] * (n // 16)
    loader = DataLoader(train(src, num_workers=0), batch_size=16, drop_last=False)
    assert [len(b.labels) for b in loader] == [16] * (n // 16) + [n % 16]


# -- a plain torch Dataset ---------------------------------------------------------------------------
class IndexDataset(tud.Dataset):
    """Item i: (tensor that encodes i and a draw from torch's RNG, i)."""

    def __init__(self, n=50):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item()]), i


def _collect(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


def _same_samples(a, b):
    """Same samples in the same batches (the indices; a torch Dataset's RNG draws follow torch's
    worker seeding, see tests/integration/test_torch_parity_workers.py)."""
    return len(a) == len(b) and all(torch.equal(x1[:, 0], x2[:, 0]) and torch.equal(y1, y2)
                                    for (x1, y1), (x2, y2) in zip(a, b))


def test_torch_dataset_matches_torch_dataloader_without_shuffle():
    ds = IndexDataset(23)
    ours = [(x[:, 0].clone(), y.clone()) for x, y in DataLoader(ds, batch_size=5)]
    theirs = [(x[:, 0].clone(), y.clone()) for x, y in tud.DataLoader(ds, batch_size=5)]
    assert _same(ours, theirs)
    assert [len(y) for _, y in ours] == [5, 5, 5, 5, 3]


def test_torch_dataset_order_does_not_depend_on_worker_count():
    ds = IndexDataset(50)
    runs = [_collect(DataLoader(ds, batch_size=7, shuffle=True, num_workers=nw, seed=3)) for nw in (0, 1, 2)]
    assert _same_samples(runs[0], runs[1]) and _same_samples(runs[0], runs[2])
    idx = torch.cat([y for _, y in runs[0]]).tolist()
    assert sorted(idx) == list(range(50)) and idx != list(range(50))
    for run in runs:  # torch's RNG is seeded once per worker (as torch does), not reset per sample
        draws = torch.cat([x[:, 1] for x, _ in run])
        assert len(set(draws.tolist())) == 50


def test_inline_loading_leaves_the_callers_rng_alone():
    """torch's DataLoader with num_workers=0 advances, but never resets, the training loop's RNG."""
    loader = DataLoader(IndexDataset(20), batch_size=4, seed=0)
    draws = []
    for user_seed in (1, 2):
        torch.manual_seed(user_seed)
        next(iter(loader))
        draws.append(torch.rand(4))  # e.g. a dropout mask in the training step
    assert not torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("nw_before, nw_after", [(0, 2), (2, 1)])
def test_torch_dataset_resume_mid_epoch(nw_before, nw_after):
    ds = IndexDataset(50)
    torch.manual_seed(5)
    first = DataLoader(ds, batch_size=7, shuffle=True, num_workers=nw_before)
    first.set_epoch(1)
    it = iter(first)
    seen = [tuple(t.clone() for t in next(it)) for _ in range(3)]
    state = first.state_dict()
    assert state["epoch"] == 1 and state["batches_seen"] == 3 and state["samples_seen"] == 21
    del it, first
    torch.manual_seed(99)  # a different default seed: the state's seed wins
    again = DataLoader(ds, batch_size=7, shuffle=True, num_workers=nw_after)
    again.load_state_dict(state)
    rest = _collect(again)
    assert len(rest) == len(again) - 3
    reference = DataLoader(ds, batch_size=7, shuffle=True, seed=state["seed"])
    reference.set_epoch(1)
    assert _same_samples(seen + rest, _collect(reference))
    idx = torch.cat([y for _, y in seen + rest]).tolist()
    assert sorted(idx) == list(range(50)), "no sample lost or repeated"
    assert again.state_dict()["epoch"] == 2 and again.state_dict()["batches_seen"] == 0


@pytest.mark.parametrize("nw", [0, 2])
def test_an_iterator_dropped_before_its_first_batch_leaves_the_restored_position(nw):
    # len(iter(loader)) (the batches left, see differences.md) makes an iterator and drops it
    ds = IndexDataset(20)
    first = DataLoader(ds, batch_size=4, shuffle=True, seed=3, num_workers=nw)
    it = iter(first)
    seen = [next(it) for _ in range(2)]
    state = first.state_dict()
    del it, first
    again = DataLoader(ds, batch_size=4, shuffle=True, seed=3, num_workers=nw)
    again.load_state_dict(state)
    assert len(iter(again)) == 3
    unused = iter(again)   # made, superseded by the next one, never asked for a batch
    rest = _collect(again)
    del unused
    assert len(rest) == 3
    idx = torch.cat([y for _, y in seen + rest]).tolist()
    assert sorted(idx) == list(range(20)), "no sample lost or repeated"
    again.load_state_dict(state)
    again.set_epoch(state["epoch"] + 1)   # a choice made since: the next epoch from its start
    assert len(iter(again)) == 5


@pytest.mark.parametrize("fmt", ["folder", "parquet"])
def test_pipeline_resume_mid_epoch(sources, fmt):
    s = sources[fmt]
    full = DataLoader(train(s, num_workers=2))
    full.set_epoch(2)
    reference = clone_all(full)

    first = DataLoader(train(s, num_workers=2))
    first.set_epoch(2)
    it = iter(first)
    head = [Batch(b.images.clone(), b.labels.clone()) for b in (next(it) for _ in range(3))]
    state = first.state_dict()
    assert (state["epoch"], state["batches_seen"], state["samples_seen"]) == (2, 3, 48)
    first.shutdown()
    del it

    again = DataLoader(train(s, num_workers=1))  # another worker count: state is not per worker
    again.load_state_dict(state)
    tail = clone_all(again)
    assert batches_equal(head + tail, reference)
    labels = torch.cat([b.labels for b in head + tail]).tolist()
    assert Counter(labels) == Counter(s.labels.tolist()), "no sample lost or repeated"
    # the next iteration continues with epoch 3, as the uninterrupted run does
    assert batches_equal(clone_all(again), clone_all(full))


def test_resume_at_an_epoch_boundary(src):
    loader = DataLoader(train(src, num_workers=0))
    clone_all(loader)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["batches_seen"] == 0
    nxt = clone_all(loader)
    again = DataLoader(train(src, num_workers=0))
    again.load_state_dict(state)
    assert batches_equal(clone_all(again), nxt)


def test_state_from_another_loader_is_rejected(src, sources):
    state = DataLoader(train(src, num_workers=0)).state_dict()
    with pytest.raises(StateError, match="batch_size"):
        DataLoader(train(src, num_workers=0), batch_size=8).load_state_dict(state)
    with pytest.raises(StateError, match="another dataset"):
        DataLoader(train(sources["tar"], num_workers=0)).load_state_dict(state)
    # another world size is no mismatch: states hold the global position (tests/integration/test_torch_parity.py)
    DataLoader(train(src, num_workers=0), rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(StateError):
        DataLoader(train(src, num_workers=0)).load_state_dict({"epoch": 1})


# -- torch's arguments ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make_kwargs, torch_rejects", [
    (lambda: dict(dataset=IndexDataset(), batch_sampler=tud.BatchSampler(tud.SequentialSampler(range(50)), 4, False),
                  batch_size=4), True),
    (lambda: dict(dataset=IndexDataset(), sampler=tud.SequentialSampler(range(50)), shuffle=True), True),
    (lambda: dict(dataset=IndexDataset(), prefetch_factor=2, num_workers=0), True),
    (lambda: dict(dataset=IndexDataset(), persistent_workers=True, num_workers=0), True),
    (lambda: dict(dataset=IndexDataset(), timeout=-1), True),
    (lambda: dict(dataset=IndexDataset(), num_workers=-1), True),
    (lambda: dict(dataset=IndexDataset(), in_order=False), False),
    (lambda: dict(dataset=IndexDataset(), num_workers="many"), False),
    (lambda: dict(dataset=IndexDataset(), on_error="skip"), False),
])
def test_bad_argument_combinations_raise_config_error(make_kwargs, torch_rejects):
    with pytest.raises(ConfigError):
        DataLoader(**make_kwargs())
    if torch_rejects:  # torch rejects them as well (ConfigError is a ValueError, like torch's)
        with pytest.raises(ValueError):
            tud.DataLoader(**make_kwargs())


def test_collate_fn_with_a_pipeline_is_rejected(src):
    with pytest.raises(ConfigError, match="collate_fn"):
        DataLoader(train(src), collate_fn=tud.default_collate)


def test_fork_context_is_accepted():
    import multiprocessing as mp

    loader = DataLoader(IndexDataset(10), batch_size=5, num_workers=1, multiprocessing_context=mp.get_context("fork"))
    assert sorted(torch.cat([y for _, y in loader]).tolist()) == list(range(10))


def test_custom_sampler_and_batch_sampler(src):
    ds = IndexDataset(30)
    order = list(reversed(range(30)))[::2]
    ours = [y.clone() for _, y in DataLoader(ds, batch_size=4, sampler=order, num_workers=2)]
    theirs = [y for _, y in tud.DataLoader(ds, batch_size=4, sampler=order)]
    assert [t.tolist() for t in ours] == [t.tolist() for t in theirs]
    assert len(DataLoader(ds, batch_size=4, sampler=order)) == len(theirs) == 4

    def batch_sampler():
        return tud.BatchSampler(tud.RandomSampler(range(30), generator=torch.Generator().manual_seed(7)), 6, True)

    ours = [y.tolist() for _, y in DataLoader(ds, batch_sampler=batch_sampler(), num_workers=1)]
    theirs = [y.tolist() for _, y in tud.DataLoader(ds, batch_sampler=batch_sampler())]
    assert ours == theirs and len(ours) == 5

    # a pipeline with a sampler: rows come in the sampler's order
    pick = [5, 100, 3, 42, 42, 0]
    loader = DataLoader(val(src), sampler=pick, batch_size=4)
    labels = torch.cat([b.labels for b in loader]).tolist()
    assert labels == src.labels[pick].tolist()
    assert len(loader) == 2


def test_custom_sampler_resume(src):
    """With a user's sampler, resuming replays it and skips the batches already seen."""
    pick = list(range(0, N_IMAGES, 3))
    full = clone_all(DataLoader(val(src, num_workers=1), sampler=pick))
    first = DataLoader(val(src, num_workers=1), sampler=pick)
    it = iter(first)
    next(it)
    next(it)
    state = first.state_dict()
    first.shutdown()
    again = DataLoader(val(src, num_workers=2), sampler=pick)
    again.load_state_dict(state)
    assert batches_equal(clone_all(again), full[2:])


def _record_init(wid):
    d = os.environ["FEEDGPU_TEST_INIT_DIR"]
    Path(d, f"{wid}-{os.getpid()}").write_text(str(torch.initial_seed()))


@pytest.mark.parametrize("kind", ["pipeline", "dataset"])
def test_worker_init_fn_runs_in_each_worker(src, tmp_path, monkeypatch, kind):
    monkeypatch.setenv("FEEDGPU_TEST_INIT_DIR", str(tmp_path))
    if kind == "pipeline":
        loader = DataLoader(val(src), num_workers=2, worker_init_fn=_record_init)
    else:
        loader = DataLoader(IndexDataset(40), batch_size=4, num_workers=2, worker_init_fn=_record_init)
    it = iter(loader)
    next(it)
    pids = set(loader.worker_pids())
    rest = list(it)
    assert len(rest) == len(loader) - 1
    found = {(int(p.name.split("-")[0]), int(p.name.split("-")[1])) for p in tmp_path.iterdir()}
    assert {w for w, _ in found} == {0, 1}
    assert {pid for _, pid in found} == pids and os.getpid() not in pids


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_sharding_through_the_loader(src, world_size):
    ds = IndexDataset(50)
    seen, lengths = [], set()
    for r in range(world_size):
        loader = DataLoader(ds, batch_size=4, shuffle=True, seed=1, rank=r, world_size=world_size,
                            num_workers=1 if r == 0 else 0)
        batches = _collect(loader)
        lengths.add(len(batches))
        assert len(batches) == len(loader)
        seen += torch.cat([y for _, y in batches]).tolist()
    assert len(lengths) == 1
    per_rank = math.ceil(50 / world_size)
    assert len(seen) == per_rank * world_size and set(seen) == set(range(50))
    # a pipeline: rank r gets the sampler's shard for its rank
    for r in range(world_size):
        loader = DataLoader(train(src, num_workers=0), batch_size=8, rank=r, world_size=world_size)
        labels = torch.cat([b.labels for b in loader]).numpy()
        order = ShardedOrder(N_IMAGES, 8, seed=0, rank=r, world_size=world_size)
        np.testing.assert_array_equal(labels, src.labels[order.shard(0)])


def test_persistent_workers_survive_epochs(src):
    loader = DataLoader(val(src, num_workers=2), persistent_workers=True)
    e0 = clone_all(loader)
    pids = loader.worker_pids()
    assert len(pids) == 2 and all(alive(p) for p in pids)
    e1 = clone_all(loader)
    assert loader.worker_pids() == pids and all(alive(p) for p in pids)
    assert batches_equal(e0, e1)  # unshuffled, deterministic stages
    loader.shutdown()
    assert not wait_gone(pids)
    assert loader.worker_pids() == []


def test_workers_stop_at_epoch_end_without_persistent_workers(src):
    loader = DataLoader(val(src, num_workers=2), persistent_workers=False)
    it = iter(loader)
    next(it)
    pids = loader.worker_pids()
    assert len(pids) == 2
    rest = list(it)
    assert len(rest) == len(loader) - 1
    assert not wait_gone(pids)
    assert loader.worker_pids() == []
    assert batches_equal(clone_all(loader), clone_all(DataLoader(val(src, num_workers=0))))


@pytest.mark.parametrize("kind", ["pipeline", "dataset"])
def test_holding_every_batch_does_not_deadlock_or_corrupt(src, kind):
    if kind == "pipeline":
        def make():
            return DataLoader(train(src, num_workers=2), batch_size=8, timeout=60)
        loader = make()
        held = list(loader)  # 15 batches > buffers in flight
        fresh = clone_all(make())
        assert len(held) == 15 and batches_equal(held, fresh)
        # a numpy view outlives its batch and stays intact while the same loader runs on
        arr = held[0].images.numpy()
        keep = arr.copy()
        del held
        for _ in range(2):
            assert len(clone_all(loader)) == 15
        np.testing.assert_array_equal(arr, keep)
    else:
        def make():
            return DataLoader(IndexDataset(60), batch_size=4, num_workers=2, shuffle=True, seed=2, timeout=60)
        held = list(make())
        assert len(held) == 15 and _same_samples(held, _collect(make()))


def test_stats_count_batches_and_samples(src):
    loader = DataLoader(val(src, num_workers=2))
    clone_all(loader)
    st = loader.stats()
    assert st["batches"] == len(loader) and st["samples"] == N_IMAGES
    assert st["skipped_total"] == 0 and st["skipped"] == {}
    assert {"read", "decode", "resize_center_crop"} <= set(st["stage_s"])
    assert all(v >= 0 for v in st["stage_s"].values()) and st["stage_s"]["decode"] > 0


def test_pin_memory_without_cuda_warns(src):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pin_memory works")
    with pytest.warns(UserWarning, match="pin_memory"):
        DataLoader(IndexDataset(4), pin_memory=True)


def test_pipeline_defaults_come_from_the_pipeline(src):
    p = Pipeline(src, [Decode(), ResizeCenterCrop(72, 64)], batch_size=12, shuffle=False, drop_last=True,
                 num_workers=1, prefetch_factor=3, seed=9, timeout=30, device="cpu")
    loader = DataLoader(p)
    assert (loader.batch_size, loader.shuffle, loader.drop_last, loader.num_workers, loader.prefetch_factor,
            loader.seed, loader.timeout) == (12, False, True, 1, 3, 9, 30.0)
    assert len(loader) == N_IMAGES // 12
    over = DataLoader(p, batch_size=5, shuffle=True, drop_last=False, num_workers=0, seed=1)
    assert (over.batch_size, over.shuffle, over.drop_last, over.num_workers, over.seed) == (5, True, False, 0, 1)


def test_restore_at_every_step_gives_the_batch_that_would_have_come(src):
    """grain's check: save after every batch, restore into a fresh loader, compare the next batch."""
    def make():
        return DataLoader(train(src, num_workers=0), batch_size=16)

    loader = make()
    loader.set_epoch(1)
    states, reference = [], []
    it = iter(loader)
    for _ in range(len(loader)):
        states.append(loader.state_dict())
        b = next(it)
        reference.append(Batch(b.images.clone(), b.labels.clone()))
    for k, state in enumerate(states):
        again = make()
        again.load_state_dict(state)
        nxt = next(iter(again))
        assert torch.equal(nxt.images, reference[k].images) and torch.equal(nxt.labels, reference[k].labels), k


def test_generator_gives_the_seed_like_torch():
    ds = IndexDataset(30)

    def order(gen_seed):
        loader = DataLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(gen_seed))
        return torch.cat([y for _, y in loader]).tolist()

    assert order(1) == order(1)
    assert order(1) != order(2)
    assert sorted(order(3)) == list(range(30))


def test_dict_samples_collate_like_torch():
    class Records(tud.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"x": np.full(3, i, np.float32), "y": i, "name": f"r{i}"}

    ours = list(DataLoader(Records(), batch_size=4, num_workers=2))
    theirs = list(tud.DataLoader(Records(), batch_size=4))
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert set(a) == {"x", "y", "name"}
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"]) and a["name"] == b["name"]


def test_loaded_state_is_reported_back(src):
    first = DataLoader(train(src, num_workers=0))
    it = iter(first)
    next(it)
    next(it)
    state = first.state_dict()
    again = DataLoader(train(src, num_workers=0))
    again.load_state_dict(state)
    assert again.state_dict() == state
    assert state["num_batches"] == len(first) and state["seed"] == 0


def test_a_state_follows_the_records_not_their_bytes(tmp_path):
    """A loader state records which samples, in which order, with which labels: a file rewritten
    with other bytes keeps the state loadable (no stat of every file to load it); a file added
    makes it another dataset."""
    import shutil

    photos = sorted((Path(__file__).resolve().parents[3] / "shared" / "data" / "photos").glob("*.jpg"))[:6]
    for i, p in enumerate(photos):
        (tmp_path / f"c{i % 2}").mkdir(exist_ok=True)
        shutil.copy(p, tmp_path / f"c{i % 2}" / f"{i}.jpg")

    def make():
        return DataLoader(Pipeline({"format": "folder", "path": str(tmp_path), "index_dir": False},
                                   [Decode(), ResizeCenterCrop(16, 16)], batch_size=2, num_workers=0, device="cpu"))

    first = make()
    it = iter(first)
    next(it)
    state = first.state_dict()
    shutil.copy(photos[5], tmp_path / "c0" / "0.jpg")   # other bytes, same name
    again = make()
    again.load_state_dict(state)
    assert again.state_dict()["samples_seen"] == 2
    shutil.copy(photos[0], tmp_path / "c1" / "9.jpg")   # one record more
    with pytest.raises(StateError, match="another dataset"):
        make().load_state_dict(state)
