"""A ``DistributedSampler`` given as ``sampler``: feedgpu.DataLoader next to torch's loader.

torch's loader iterates the sampler: each rank reads ``indices[rank:total_size:num_replicas]`` of
the sampler's padded (or cut) permutation, drawn from ``seed + epoch``, whatever the process's own
torch RNG holds, with or without a process group; the loader's ``drop_last`` then drops each rank's
own incomplete batch. feedgpu's loader must give the same rows in the same order on every rank.

Ranks are simulated in one process (``num_replicas=4, rank=r``, each rank's torch RNG seeded
differently, as separate processes would have it), then run as 4 real processes without a process
group and as 4 processes of a gloo group. Resume across world sizes and the conservation rule over
random datasets, world sizes, sampler kinds, ``drop_last`` and worker counts close the file.
"""
from __future__ import annotations

import itertools
import json
import multiprocessing
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from feedgpu import DataLoader, StateError

pytestmark = pytest.mark.timeout(240)
N, WORLD, BS = 103, 4, 5
#: (sampler drop_last, loader drop_last, num_workers, seeded)
COMBOS = list(itertools.product([False, True], [False, True], [0, 2], [False, True]))
EPOCHS = (0, 1)
#: the combinations real processes run (every sampler/loader drop_last without workers, and with 2
#: workers once per phase): 4 ranks of 2 loaders each on a shared machine
PROCESS_COMBOS = [c for c in COMBOS if c[2] == 0] + [(False, True, 2, False)]


class Items(tud.Dataset):
    """Item i: i (an int), so batches say which samples they hold."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _batches(loader) -> list[list[int]]:
    return [b.tolist() for b in loader]


def _rank_run(make, rank: int, world: int | None, sampler_drop_last: bool, drop_last: bool, num_workers: int,
              seeded: bool, n: int = N, epochs=EPOCHS) -> dict:
    """One rank's batches per epoch with ``make`` (a loader class), as a training script writes it:
    the process's torch RNG seeded per rank (``seeded=False``: differently on every rank, as
    unseeded processes are) and the sampler's seed given only when ``seeded``. ``world=None``:
    the sampler reads rank and world size from the process group."""
    torch.manual_seed(7 if seeded else 1000 + rank)
    ds = Items(n)
    kw = {"seed": 7} if seeded else {}
    if world is not None:
        kw.update(num_replicas=world, rank=rank)
    s = tud.DistributedSampler(ds, shuffle=True, drop_last=sampler_drop_last, **kw)
    loader = make(ds, batch_size=BS, sampler=s, drop_last=drop_last, num_workers=num_workers)
    out = {"len": len(loader), "epochs": []}
    for e in epochs:
        s.set_epoch(e)
        out["epochs"].append(_batches(loader))
    return out


def _check_split(per_rank: list[dict], sampler_drop_last: bool, drop_last: bool) -> None:
    """torch's split of N = 103 over 4 ranks with batches of 5: no sample on two ranks except the
    sampler's one padding repeat; 25 or 26 rows per rank."""
    for e in range(len(EPOCHS)):
        rows = [v for r in per_rank for b in r["epochs"][e] for v in b]
        counts = Counter(rows)
        if sampler_drop_last:
            assert len(rows) == len(counts) == 100   # 103 cut to 100, then 25 per rank (5 full batches)
        elif drop_last:
            assert len(rows) == 100 and len(counts) >= 99   # 26 per rank, each drops its incomplete batch
        else:
            assert len(rows) == 104 and len(counts) == 103   # padded by one repeat, 26 per rank


@pytest.mark.parametrize("sampler_drop_last,drop_last,num_workers,seeded", COMBOS)
def test_a_distributed_sampler_without_a_group_gives_torchs_rows_on_every_rank(sampler_drop_last, drop_last,
                                                                                num_workers, seeded):
    ours, theirs = [], []
    for r in range(WORLD):
        ours.append(_rank_run(DataLoader, r, WORLD, sampler_drop_last, drop_last, num_workers, seeded))
        theirs.append(_rank_run(tud.DataLoader, r, WORLD, sampler_drop_last, drop_last, num_workers, seeded))
        assert ours[r] == theirs[r], f"rank {r}"
    _check_split(ours, sampler_drop_last, drop_last)
    assert ours[0]["epochs"][0] != ours[0]["epochs"][1]   # set_epoch reshuffles


def test_without_set_epoch_every_epoch_repeats_the_samplers_order_as_in_torch():
    runs = []
    for make in (tud.DataLoader, DataLoader):
        s = tud.DistributedSampler(Items(23), num_replicas=2, rank=1, seed=3)
        loader = make(Items(23), batch_size=4, sampler=s)
        runs.append([_batches(loader) for _ in range(3)])
    assert runs[0] == runs[1] and runs[1][0] == runs[1][2]


def test_the_loaders_set_epoch_sets_the_samplers_epoch():
    s = tud.DistributedSampler(Items(23), num_replicas=2, rank=0, seed=3)
    loader = DataLoader(Items(23), batch_size=4, sampler=s)
    loader.set_epoch(4)
    assert s.epoch == 4
    s4 = tud.DistributedSampler(Items(23), num_replicas=2, rank=0, seed=3)
    s4.set_epoch(4)
    assert _batches(loader) == _batches(tud.DataLoader(Items(23), batch_size=4, sampler=s4))


def test_a_sampler_for_another_dataset_size_and_rank_arguments_are_refused():
    from feedgpu import ConfigError

    s = tud.DistributedSampler(Items(50), num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match="another size"):
        len(DataLoader(Items(23), batch_size=4, sampler=s))
    with pytest.raises(ConfigError, match="shard in the sampler"):
        DataLoader(Items(23), batch_size=4, sampler=tud.DistributedSampler(Items(23), num_replicas=2, rank=0),
                   rank=0, world_size=2)


# -- torch's test_duplicating_data_with_drop_last ------------------------------------------------
@pytest.mark.parametrize("kind", ["DistributedSampler", "feedgpu"])
def test_drop_last_keeps_distinct_rows_on_every_rank(kind):
    """9 samples, 4 ranks, batches of 2, the loader's drop_last: 8 distinct rows, as torch gives
    them, whether the split is the sampler's or feedgpu's own order."""
    rows = []
    for r in range(4):
        if kind == "feedgpu":
            loader = DataLoader(Items(9), batch_size=2, drop_last=True, shuffle=True, seed=1, rank=r, world_size=4)
        else:
            loader = DataLoader(Items(9), batch_size=2, drop_last=True,
                                sampler=tud.DistributedSampler(Items(9), num_replicas=4, rank=r))
        rows += [v for b in _batches(loader) for v in b]
    assert len(rows) == len(set(rows)) == 8


# -- real processes: no process group, then a gloo group -------------------------------------------
def _process_main(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    rec: dict = {"rank": rank, "no_group": [], "gloo": []}
    try:
        for combo in PROCESS_COMBOS:   # each process alone: no process group, the sampler names the rank
            rec["no_group"].append([_rank_run(make, rank, world, *combo) for make in (DataLoader, tud.DataLoader)])
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        for combo in PROCESS_COMBOS:   # DistributedSampler(ds): rank and world size from the group
            rec["gloo"].append([_rank_run(make, rank, None, *combo) for make in (DataLoader, tud.DataLoader)])
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - recorded for the parent's assertions
        rec["crash"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rec))


@pytest.fixture(scope="module")
def processes(tmp_path_factory) -> list[dict]:
    base = tmp_path_factory.mktemp("ranks")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_process_main, args=(r, WORLD, f"file://{base / 'rdv'}", str(base)))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks hung: {alive}"
    recs = [json.loads((base / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in recs:
        assert "crash" not in r, r["crash"]
    return recs


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", ["no_group", "gloo"])
def test_four_processes_read_torchs_split(processes, phase):
    for i, (sampler_drop_last, drop_last, _, _) in enumerate(PROCESS_COMBOS):
        ours = [rec[phase][i][0] for rec in processes]
        theirs = [rec[phase][i][1] for rec in processes]
        assert ours == theirs, f"{phase}: {PROCESS_COMBOS[i]}"
        _check_split(ours, sampler_drop_last, drop_last)


# -- resume --------------------------------------------------------------------------------------
def _sampler_loader(n, world, rank, sampler_drop_last=False, drop_last=False, seed=5, num_workers=0):
    s = tud.DistributedSampler(Items(n), num_replicas=world, rank=rank, seed=seed, drop_last=sampler_drop_last)
    return s, DataLoader(Items(n), batch_size=BS, sampler=s, drop_last=drop_last, num_workers=num_workers)


def _torch_rows(n, world, rank, epoch, sampler_drop_last=False, drop_last=False, seed=5) -> list[list[int]]:
    s = tud.DistributedSampler(Items(n), num_replicas=world, rank=rank, seed=seed, drop_last=sampler_drop_last)
    s.set_epoch(epoch)
    return _batches(tud.DataLoader(Items(n), batch_size=BS, sampler=s, drop_last=drop_last))


@pytest.mark.parametrize("sampler_drop_last,drop_last", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("world_after", [4, 3, 2, 5])
def test_resume_mid_epoch_on_the_same_or_another_world_size(sampler_drop_last, drop_last, world_after):
    """4 ranks read 2 batches of epoch 1 and save; the run resumes on ``world_after`` ranks, each
    loading rank 0's state. Same world size: each rank gets exactly the rest of torch's batches.
    Another: the rest of the epoch's permutation split over the new ranks (no sample of the first
    part again but the sampler's padding, every sample once but for its cut); the next epoch is
    torch's split on the new world size."""
    n, first, state = 61, [], None
    for r in range(WORLD):
        s, loader = _sampler_loader(n, WORLD, r, sampler_drop_last, drop_last, num_workers=2 if r == 1 else 0)
        s.set_epoch(1)
        it = iter(loader)
        first += [next(it).tolist() for _ in range(2)]
        assert first[-2:] == _torch_rows(n, WORLD, r, 1, sampler_drop_last, drop_last)[:2]
        state = loader.state_dict() if r == 0 else state
        del it
    rest, nxt = [], []
    for r in range(world_after):
        s, loader = _sampler_loader(n, world_after, r, sampler_drop_last, drop_last, num_workers=2 if r == 0 else 0)
        loader.load_state_dict(state)
        s.set_epoch(1)
        mine = _batches(loader)
        if world_after == WORLD:
            assert mine == _torch_rows(n, WORLD, r, 1, sampler_drop_last, drop_last)[2:], f"rank {r}"
        rest += mine
        s.set_epoch(2)
        nxt.append(_batches(loader))
        assert nxt[-1] == _torch_rows(n, world_after, r, 2, sampler_drop_last, drop_last)
    before = Counter(v for b in first for v in b)
    after = Counter(v for b in rest for v in b)
    m = n - 2 * WORLD * BS                  # what remained of the permutation
    per_rank = m // world_after if sampler_drop_last else -(-m // world_after)
    padding = max(0, per_rank * world_after - m)   # the sampler's rule: the head of the permutation again
    kept = (per_rank // BS) * BS if drop_last else per_rank
    assert sum(after.values()) == kept * world_after
    repeats = sum(after.values()) - len(set(after) - set(before))   # rows read before, or twice
    if not sampler_drop_last and not drop_last:   # all of it, plus exactly the padding
        assert set(before) | set(after) == set(range(n)) and repeats == padding
    else:
        assert repeats <= padding

def test_a_state_of_another_split_is_refused():
    s, loader = _sampler_loader(40, 2, 0, seed=5)
    next(iter(loader))
    state = loader.state_dict()
    _, other_seed = _sampler_loader(40, 2, 0, seed=6)
    with pytest.raises(StateError, match="split_seed"):
        other_seed.load_state_dict(state)
    own = DataLoader(Items(40), batch_size=BS, shuffle=True, seed=5, rank=0, world_size=2)
    with pytest.raises(StateError, match="split"):
        own.load_state_dict(state)


# -- the conservation rule, against torch, over random settings -------------------------------------
def _delivered(make, n, world, kind, bs, sampler_drop_last, drop_last, num_workers, seed) -> list[list[int]]:
    """Every rank's rows of epoch 1 with loader class ``make`` (None: feedgpu's own order)."""
    out = []
    for r in range(world):
        if kind == "feedgpu":
            loader = DataLoader(Items(n), batch_size=bs, shuffle=True, seed=seed, rank=r, world_size=world,
                                drop_last=drop_last, num_workers=num_workers)
            loader.set_epoch(1)
        elif kind == "distributed":
            s = tud.DistributedSampler(Items(n), num_replicas=world, rank=r, shuffle=bool(seed % 2), seed=seed,
                                       drop_last=sampler_drop_last)
            s.set_epoch(1)
            loader = make(Items(n), batch_size=bs, sampler=s, drop_last=drop_last, num_workers=num_workers)
        else:   # one process's own sampler: a seeded RandomSampler, a SequentialSampler
            g = torch.Generator().manual_seed(seed)
            s = tud.RandomSampler(Items(n), generator=g) if kind == "random" else tud.SequentialSampler(Items(n))
            loader = make(Items(n), batch_size=bs, sampler=s, drop_last=drop_last, num_workers=num_workers)
        out.append([v for b in _batches(loader) for v in b])
    return out


def _examples(k: int = 40):
    rng = np.random.default_rng(44)
    for _ in range(k):
        world = int(rng.integers(1, 6))
        kind = str(rng.choice(["distributed", "feedgpu", "random", "sequential"] if world == 1
                              else ["distributed", "feedgpu"]))
        yield (int(rng.integers(1, 40)), world, kind, int(rng.integers(1, 6)), bool(rng.integers(2)),
               bool(rng.integers(2)), int(rng.choice([0, 0, 0, 2])), int(rng.integers(0, 1000)))


@pytest.mark.parametrize("n,world,kind,bs,sampler_drop_last,drop_last,num_workers,seed", list(_examples()))
def test_delivered_indices_are_torchs_multiset(n, world, kind, bs, sampler_drop_last, drop_last, num_workers, seed):
    if kind == "feedgpu":   # feedgpu's own order: torch has none; its documented rule, checked here
        if drop_last and n < world * bs:
            pytest.skip("drop_last leaves no full batch: refused with ConfigError (tested in test_sampling)")
        rows = _delivered(None, n, world, kind, bs, sampler_drop_last, drop_last, num_workers, seed)
        counts = Counter(v for r in rows for v in r)
        assert len({len(r) for r in rows}) == 1   # every rank the same number of rows
        if drop_last:   # whole batches on every rank, never a repeat
            assert sum(counts.values()) == len(counts) == (n // (world * bs)) * world * bs
        else:           # every sample, plus the padding: ceil(n / world) per rank
            assert set(counts) == set(range(n)) and sum(counts.values()) == -(-n // world) * world
        return
    ours = _delivered(DataLoader, n, world, kind, bs, sampler_drop_last, drop_last, num_workers, seed)
    theirs = _delivered(tud.DataLoader, n, world, kind, bs, sampler_drop_last, drop_last, 0, seed)
    assert Counter(v for r in ours for v in r) == Counter(v for r in theirs for v in r)
    assert ours == theirs   # and, rank by rank, the same order


class TinyImages(tud.Dataset):
    """Sample i: an 8x8 image filled with i, label i."""

    def __len__(self):
        return 23

    def __getitem__(self, i):
        return np.full((8, 8, 3), i, np.uint8), i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pipeline_reads_the_samplers_split(num_workers):
    from feedgpu import Pipeline
    from feedgpu.stages import Decode, ResizeCenterCrop

    pipe = Pipeline(TinyImages(), [Decode(), ResizeCenterCrop(8, 8)], batch_size=4, num_workers=0, device="cpu", seed=3)
    for r in range(3):
        s = tud.DistributedSampler(pipe, num_replicas=3, rank=r, seed=1)
        s.set_epoch(2)
        loader = DataLoader(pipe, sampler=s, batch_size=4, num_workers=num_workers)
        labels = [int(k) for b in loader for k in b.labels]
        assert labels == list(iter(s)) and len(loader) == 2


def test_explicit_ranks_of_a_shuffled_dataset_need_one_seed():
    """rank=/world_size= given to the loader shard feedgpu's shuffled order with no exchange
    between the ranks: a seed drawn from each process's torch RNG (seeded differently per rank,
    as separately started processes may be) would give overlapping shards, so it is refused;
    seed= (or a generator seeded alike) makes the ranks cover the data once."""
    from feedgpu.errors import ConfigError

    ds = Items(30)
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="give seed="):
        DataLoader(ds, batch_size=5, shuffle=True, rank=0, world_size=2)
    seen = []
    for rank in range(2):
        torch.manual_seed(rank)   # each process's own RNG
        seen += [int(i) for b in DataLoader(ds, batch_size=5, shuffle=True, rank=rank, world_size=2, seed=7)
                 for i in b]
        seen += [int(i) for b in DataLoader(ds, batch_size=5, shuffle=True, rank=rank, world_size=2,
                                            generator=torch.Generator().manual_seed(3)) for i in b]
    assert sorted(seen) == sorted(list(range(30)) * 2)
    # unshuffled, the seed plays no part: no refusal
    assert len(list(DataLoader(ds, batch_size=5, rank=1, world_size=2))) == 3
