"""Resume across world sizes under a real ``torch.distributed`` process group (gloo, CPU).

Each phase spawns its ranks (``file://`` rendezvous). The loader is built BEFORE
``init_process_group`` from a torch Dataset without ``seed=`` on ranks whose torch RNGs were
seeded differently, as a script that builds its loader first would: iterating after the group
is up must give each rank a disjoint share of one order (rank 0's seed). A state saved by rank 1
on 2 ranks is resumed on 1 rank, and one saved on 1 rank is resumed on 2 (with workers): the
epoch's samples are each delivered exactly once over the two runs. A ``__len__`` that raises on
one rank fails every rank with a ConfigError that names it (not gloo's lost connection).
"""
from __future__ import annotations

import json
import multiprocessing
import traceback
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)
N, BS = 12, 2   # 12 = 2 ranks x 2 batches x 2 + 4, and 1 rank x 3 batches x 2 + 6: no padding anywhere


class Indexed:
    """Sample ``i`` is ``i`` (a map-style torch Dataset by duck typing)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


def _rank_main(rank: int, world: int, rendezvous: str, out: str, take: int | None, state_in: str | None,
               num_workers: int) -> None:
    rec: dict = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist

        from feedgpu import DataLoader

        torch.manual_seed(1000 + rank)   # unseeded loaders would draw different seeds on each rank
        loader = DataLoader(Indexed(), batch_size=BS, shuffle=True, num_workers=num_workers)
        rec["seed_before"] = loader.seed
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        if state_in is not None:
            loader.load_state_dict(json.loads(Path(state_in).read_text()))
        got = []
        for b in loader:
            got.append([int(v) for v in b])
            if take is not None and len(got) == take:
                break
        rec.update(batches=got, seed=loader.seed, state=loader.state_dict(), len=len(loader))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        rec["crash"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rec))


class LenFailsOnRankOne(Indexed):
    """``__len__`` raises ``OSError`` on rank 1 (its data is not mounted there)."""

    def __init__(self, rank: int):
        self.rank = rank

    def __len__(self):
        if self.rank == 1:
            raise OSError("/data/train: no such directory on this node")
        return N


def _len_fails_main(rank: int, world: int, rendezvous: str, out: str, *_) -> None:
    rec: dict = {"rank": rank}
    try:
        import torch.distributed as dist

        from feedgpu import DataLoader

        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        try:
            DataLoader(LenFailsOnRankOne(rank), batch_size=BS)
            rec["error"] = None
        except Exception as e:  # noqa: BLE001 - recorded for the parent
            rec["error"] = [type(e).__name__, str(e), type(e.__cause__).__name__]
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        rec["crash"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rec))


def _phase(base: Path, name: str, world: int, take: int | None, state_in: Path | None = None,
           num_workers: int = 0, target=_rank_main) -> list[dict]:
    out = base / name
    out.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, f"file://{base / (name + '.rdv')}", str(out), take,
                                              None if state_in is None else str(state_in), num_workers))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks hung: {hung}"
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r in recs:
        assert "crash" not in r, r["crash"]
    return recs


def _samples(recs: list[dict]) -> Counter:
    return Counter(v for r in recs for b in r["batches"] for v in b)


def _save(base: Path, rec: dict) -> Path:
    path = base / f"state_rank{rec['rank']}.json"
    path.write_text(json.dumps(rec["state"]))
    return path


def test_two_ranks_to_one_delivers_the_rest_of_the_epoch_once(tmp_path):
    first = _phase(tmp_path, "two", world=2, take=2)
    assert first[0]["seed_before"] != first[1]["seed_before"]   # the ranks' own draws differed
    assert first[0]["seed"] == first[1]["seed"] == first[0]["seed_before"]   # rank 0's seed won
    shares = [set(v for b in r["batches"] for v in b) for r in first]
    assert not shares[0] & shares[1] and len(shares[0]) == len(shares[1]) == 2 * BS
    rest = _phase(tmp_path, "one", world=1, take=None, state_in=_save(tmp_path, first[1]))
    total = _samples(first) + _samples(rest)
    assert total == Counter(range(N)), total


def test_one_rank_to_two_delivers_the_rest_of_the_epoch_once(tmp_path):
    first = _phase(tmp_path, "one", world=1, take=3)
    rest = _phase(tmp_path, "two", world=2, take=None, state_in=_save(tmp_path, first[0]), num_workers=2)
    a, b = (set(v for bb in r["batches"] for v in bb) for r in rest)
    assert not a & b and len(a) == len(b)
    total = _samples(first) + _samples(rest)
    assert total == Counter(range(N)), total
    assert rest[0]["state"]["epoch"] == rest[1]["state"]["epoch"] == 1   # the epoch is complete on both


def test_a_len_that_raises_on_one_rank_fails_every_rank_naming_it(tmp_path):
    recs = _phase(tmp_path, "len", world=2, take=None, target=_len_fails_main)
    for r in recs:
        kind, message, cause = r["error"]
        assert kind == "ConfigError" and "rank 1: OSError: /data/train: no such directory" in message
    assert recs[1]["error"][2] == "OSError" and recs[0]["error"][2] == "NoneType"
