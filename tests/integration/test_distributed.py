"""Several ranks in one gloo process group on the CPU (spawned processes, ``file://`` rendezvous).

Rank and world size come from ``torch.distributed``, as in a real DDP job. One spawn runs every
scenario (each rank writes what it saw to a JSON file); the tests below check those records.
"""
from __future__ import annotations

import json
import multiprocessing
import traceback
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(90)
WORLD = 3
N = 11          # not a multiple of WORLD: padding needed
BS = 2
EPOCHS = 3


class Indexed:
    """A map-style dataset whose sample ``i`` is ``i`` (a torch Dataset by duck typing)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class TinyImages:
    """Sample ``i``: an 8x8 RGB image filled with ``i``, label ``i`` (decoded from an array)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((8, 8, 3), i, np.uint8), i


def _epochs(loader) -> list[list[list[int]]]:
    out = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        out.append([[int(v) for v in (b.labels if hasattr(b, "labels") else b)] for b in loader])
    return out


def _attempt(fn) -> dict:
    try:
        return {"ok": fn()}
    except Exception as e:  # noqa: BLE001 - recorded for the parent's assertions
        return {"error": type(e).__name__, "message": str(e)}


def _rank_main(rank: int, world: int, rendezvous: str, out_dir: str, empty_dir: str, good_dir: str) -> None:
    import torch.distributed as dist
    import torch.utils.data as tud

    from feedgpu import DataLoader, Pipeline
    from feedgpu.stages import Decode, ResizeCenterCrop

    class DS(tud.Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            return self.inner[i]

    rec: dict = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        rec["dataset"] = _attempt(lambda: _epochs(DataLoader(DS(Indexed(N)), batch_size=BS, shuffle=True,
                                                              seed=7, num_workers=0)))
        pipe = Pipeline(DS(TinyImages(N)), [Decode(), ResizeCenterCrop(8, 8)], batch_size=BS, shuffle=True,
                        seed=7, num_workers=0, device="cpu")
        rec["pipeline"] = _attempt(lambda: _epochs(DataLoader(pipe)))
        rec["drop_last"] = _attempt(lambda: _epochs(DataLoader(DS(Indexed(N)), batch_size=BS, shuffle=True,
                                                                seed=7, drop_last=True)))
        rec["uneven"] = _attempt(lambda: len(DataLoader(DS(Indexed(N + rank)), batch_size=BS)))
        rec["empty_dataset"] = _attempt(lambda: len(DataLoader(DS(Indexed(0 if rank == 1 else N)), batch_size=BS)))
        path = empty_dir if rank == 2 else good_dir
        folder = Pipeline({"format": "folder", "path": path}, [Decode(), ResizeCenterCrop(8, 8)], batch_size=BS,
                          num_workers=0, device="cpu")
        rec["no_data"] = _attempt(lambda: len(DataLoader(folder)))
        rec["fewer_samples_than_ranks"] = _attempt(lambda: _epochs(DataLoader(DS(Indexed(2)), batch_size=BS)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        rec["crash"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rec))


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    base = tmp_path_factory.mktemp("dist")
    (base / "empty").mkdir()
    good = base / "good" / "c"
    good.mkdir(parents=True)
    from PIL import Image

    for i in range(4):
        Image.new("RGB", (8, 8), (i, i, i)).save(good / f"{i}.png")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, WORLD, f"file://{base / 'rdv'}", str(base), str(base / "empty"),
                                                   str(base / "good"))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks hung: {alive}"
    recs = [json.loads((base / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in recs:
        assert "crash" not in r, r["crash"]
    return recs


@pytest.mark.parametrize("case", ["dataset", "pipeline"])
def test_equal_batches_each_sample_once_plus_documented_padding(records, case):
    per_rank = [r[case]["ok"] for r in records]
    per_rank_samples = -(-N // WORLD)  # ceil: 4
    for epoch in range(EPOCHS):
        batches = [rk[epoch] for rk in per_rank]
        assert len({len(b) for b in batches}) == 1, "ranks got different numbers of batches"
        assert all(len(b) == -(-per_rank_samples // BS) for b in batches)
        seen = [i for rk in batches for b in rk for i in b]
        assert len(seen) == per_rank_samples * WORLD == N + 1
        assert sorted(set(seen)) == list(range(N))  # every sample at least once
        # the padding repeats the head of the epoch order: WORLD * ceil(N / WORLD) - N = 1 sample
        assert len(seen) - len(set(seen)) == WORLD * per_rank_samples - N


@pytest.mark.parametrize("case", ["dataset", "pipeline"])
def test_order_differs_per_epoch_and_matches_across_kinds(records, case):
    per_rank = [r[case]["ok"] for r in records]
    orders = [[i for rk in per_rank for b in rk[epoch] for i in b] for epoch in range(EPOCHS)]
    assert len({tuple(o) for o in orders}) == EPOCHS
    for rank in range(WORLD):  # rank-wise, not only overall
        assert len({tuple(i for b in per_rank[rank][e] for i in b) for e in range(EPOCHS)}) > 1
    assert [r["dataset"]["ok"] for r in records] == [r["pipeline"]["ok"] for r in records]


def test_drop_last_each_sample_at_most_once(records):
    per_rank = [r["drop_last"]["ok"] for r in records]
    for epoch in range(EPOCHS):
        batches = [rk[epoch] for rk in per_rank]
        assert all(len(b) == N // (WORLD * BS) for b in batches)  # 1 full batch per rank
        seen = [i for rk in batches for b in rk for i in b]
        assert len(seen) == len(set(seen)) == WORLD * BS
        assert all(len(b) == BS for rk in batches for b in rk)


def test_uneven_datasets_fail_on_every_rank_before_training(records):
    for r in records:
        assert r["uneven"]["error"] == "ConfigError"
        assert "rank 0: 11, rank 1: 12, rank 2: 13" in r["uneven"]["message"]


def test_a_rank_with_no_data_fails_on_every_rank_and_is_named(records):
    for r in records:
        assert r["empty_dataset"]["error"] == "ConfigError"
        assert "rank 1: no samples" in r["empty_dataset"]["message"]
        assert r["no_data"]["error"] == "ConfigError"
        assert "rank 2: SourceError" in r["no_data"]["message"] and "no class sub-folders" in r["no_data"]["message"]


def test_fewer_samples_than_ranks_pads_every_rank(records):
    per_rank = [r["fewer_samples_than_ranks"]["ok"] for r in records]
    for epoch in range(EPOCHS):
        assert [len(rk[epoch]) for rk in per_rank] == [1, 1, 1]
        seen = sorted(i for rk in per_rank for b in rk[epoch] for i in b)
        assert set(seen) == {0, 1} and len(seen) == WORLD
