"""The skip budget (``max_skipped``): per epoch and rank, checked in the main process."""
from __future__ import annotations

import io
import warnings

import pytest
import torch
from PIL import Image

from conftest import CASES, PHOTOS
from feedgpu import ConfigError, DataLoader, Pipeline, SkipBudgetExceeded, SkippedSampleWarning
from feedgpu.loader.skips import SkipBudget, check_max_skipped, skip_limit
from feedgpu.stages import Decode, ResizeCenterCrop

pytestmark = pytest.mark.timeout(120)


def _tiny_jpeg() -> bytes:
    img = Image.open(sorted(PHOTOS.glob("*.jpg"))[0]).convert("RGB").resize((40, 30))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


GOOD = _tiny_jpeg()
HTML = (CASES / "html_named.jpg").read_bytes()
TRUNC = (CASES / "truncated_half.jpg").read_bytes()


class Mixed(torch.utils.data.Dataset):
    """``n`` tiny JPEGs; ``bad`` maps index -> bytes of a bad sample. Label = index."""

    def __init__(self, n: int, bad: dict[int, bytes]):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.bad.get(i, GOOD), i


def pipe(ds, **kw):
    kw.setdefault("num_workers", 0)
    return Pipeline(ds, [Decode(), ResizeCenterCrop(32, 32)], batch_size=10, shuffle=False, device="cpu", **kw)


def run(loader):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSampleWarning)
        return [b.labels.clone() for b in loader]


def test_limit_rules():
    assert skip_limit(0.01, 200) == 2 and skip_limit(0.01, 199) == 1 and skip_limit(0.01, 99) == 0
    assert skip_limit(0.5, 7) == 3 and skip_limit(1.0, 7) == 7 and skip_limit(0.0, 10**6) == 0
    assert skip_limit(3, 10) == 3 and skip_limit(None, 10) is None
    for bad in (True, False, -1, 1.5, -0.1, "1%"):
        with pytest.raises(ConfigError, match="max_skipped"):
            check_max_skipped(bad)


@pytest.mark.parametrize("workers", [0, 2])
def test_default_budget_is_one_percent_of_the_epoch(workers, no_leaked_workers):
    ok = DataLoader(pipe(Mixed(200, {5: HTML, 150: TRUNC}), num_workers=workers), timeout=60)
    labels = torch.cat(run(ok))
    assert len(labels) == 200
    s = ok.stats()
    assert s["skipped"] == {"not an image": 1, "truncated": 1} and s["skipped_total"] == 2
    ok.shutdown()

    over = DataLoader(pipe(Mixed(200, {5: HTML, 150: TRUNC, 177: HTML}), num_workers=workers), timeout=60)
    got = []
    with pytest.raises(SkipBudgetExceeded) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedSampleWarning)
            for b in over:
                got.append(b.labels.clone())
    e = info.value
    assert e.limit == 2 and e.counts == {"not an image": 2, "truncated": 1}
    assert e.keys == [("Mixed[5]", "not an image"), ("Mixed[150]", "truncated"), ("Mixed[177]", "not an image")]
    assert all(k in str(e) for k, _ in e.keys)
    msg = str(e)
    assert "3 samples skipped in epoch 0" in msg and "not an image: 2" in msg and "truncated: 1" in msg
    assert "0.01 of 200 samples = 2" in msg
    assert len(got) == 17  # batches 0..16 delivered; batch 17 holds the third bad sample
    assert over.worker_pids() == []


def test_keys_in_the_error_name_the_samples():
    over = DataLoader(pipe(Mixed(50, {3: HTML, 7: TRUNC}), max_skipped=1), timeout=60)
    with pytest.raises(SkipBudgetExceeded) as info:
        run(over)
    assert info.value.keys == [("Mixed[3]", "not an image"), ("Mixed[7]", "truncated")]
    assert "Mixed[3] (not an image)" in str(info.value) and "Mixed[7] (truncated)" in str(info.value)
    assert info.value.limit == 1


def test_absolute_count_and_none():
    bad = {i: HTML for i in range(0, 50, 10)}  # 5 bad, one per batch; a spare may hit one too
    free = DataLoader(pipe(Mixed(50, bad), max_skipped=None))
    assert sorted(torch.cat(run(free)).tolist()) != []
    t = free.stats()["skipped_total"]
    assert t >= 5 and free.stats()["skipped"] == {"not an image": t}
    assert len(torch.cat(run(DataLoader(pipe(Mixed(50, bad), max_skipped=t))))) == 50
    with pytest.raises(SkipBudgetExceeded, match=f"max_skipped={t - 1}\\)"):
        run(DataLoader(pipe(Mixed(50, bad), max_skipped=t - 1)))
    # the loader's argument overrides the pipeline's
    assert len(torch.cat(run(DataLoader(pipe(Mixed(50, bad), max_skipped=0), max_skipped=0.5)))) == 50
    with pytest.raises(SkipBudgetExceeded):
        run(DataLoader(pipe(Mixed(50, bad)), max_skipped=0))


def test_budget_is_per_epoch_and_reported_in_stats():
    loader = DataLoader(pipe(Mixed(100, {42: HTML}), max_skipped=1))
    assert loader.stats()["skip_budget"] is None  # before the first iteration
    for epoch in range(3):
        it = iter(loader)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedSampleWarning)
            for b, _ in zip(it, range(5)):
                pass
            sb = loader.stats()["skip_budget"]
            assert sb == {"max_skipped": 1, "limit": 1, "epoch": epoch, "skipped": 1,
                          "by_reason": {"not an image": 1}}
            for _ in it:
                pass
    s = loader.stats()
    assert s["skipped"] == {"not an image": 3} and s["skip_budget"]["epoch"] == 2


def test_budget_counts_this_ranks_samples():
    # 200 samples over 2 ranks: 100 per rank -> 1 % allows 1 skip per rank
    bad = {0: HTML, 2: HTML}  # shuffle=False: even indices go to rank 0
    with pytest.raises(SkipBudgetExceeded, match="0.01 of 100 samples = 1"):
        run(DataLoader(pipe(Mixed(200, bad)), rank=0, world_size=2))
    assert len(torch.cat(run(DataLoader(pipe(Mixed(200, bad)), rank=1, world_size=2)))) == 100


def test_yaml_key_and_errors(tmp_path):
    base = {"source": {"format": "folder", "path": str(tmp_path)}, "stages": [{"op": "decode"}, {"op": "resize_center_crop", "resize": 32, "crop": 32}],
            "output": {"dtype": "uint8", "layout": "NHWC"}}
    assert Pipeline.from_config(base).max_skipped == 0.01
    for v in (0, 25, 0.5, None):
        assert Pipeline.from_config({**base, "loader": {"max_skipped": v}}).max_skipped == v
    for v in (1.5, -3, True, "5%"):
        with pytest.raises(ConfigError, match=r"loader\.max_skipped"):
            Pipeline.from_config({**base, "loader": {"max_skipped": v}})


def test_the_loaders_max_skipped_is_the_budget_in_force_and_makes_the_same_loader_again():
    # frameworks (Lightning) re-create a loader from its attributes: a budget not given must come
    # back as the pipeline's, not as None (no limit)
    p = pipe(Mixed(10, {}))
    assert DataLoader(p).max_skipped == 0.01
    assert DataLoader(p, max_skipped=3).max_skipped == 3
    assert DataLoader(p, max_skipped=None).max_skipped is None
    again = DataLoader(p, max_skipped=DataLoader(p).max_skipped)
    assert again.max_skipped == 0.01
    assert DataLoader(torch.utils.data.TensorDataset(torch.zeros(4))).max_skipped is None
    with pytest.raises(ValueError, match="max_skipped attribute should not be set"):
        again.max_skipped = None   # the budget in force would no longer be what it says


def test_max_skipped_is_for_pipelines_only():
    with pytest.raises(ConfigError, match="max_skipped"):
        DataLoader(torch.utils.data.TensorDataset(torch.zeros(4)), max_skipped=0.1)
    with pytest.raises(ConfigError, match="max_skipped"):
        DataLoader(pipe(Mixed(10, {})), max_skipped=2.0)


def test_skip_budget_exceeded_pickles_with_its_fields():
    import pickle

    b = SkipBudget(0, 10)
    with pytest.raises(SkipBudgetExceeded) as info:
        b.add([("a.jpg", "empty", "")])
    e = pickle.loads(pickle.dumps(info.value))
    assert (e.counts, e.keys, e.limit) == ({"empty": 1}, [("a.jpg", "empty")], 0)


def test_a_bad_sample_drawn_again_as_a_spare_is_counted_once_per_epoch(cases_datasets):
    """Without shuffling, a batch's spares are the samples after it: a bad sample replacing
    another bad one is met twice in one epoch. It is one bad sample: skipped once, counted once
    in the stats and in the skip budget, one warning."""
    import collections
    import warnings

    from conftest import open_format
    from feedgpu import DataLoader, Pipeline
    from feedgpu.stages import Decode, RandomResizedCrop

    src = open_format("folder", cases_datasets["folder"])

    def loader(max_skipped):
        return DataLoader(Pipeline(src, [Decode(), RandomResizedCrop(32)], batch_size=8, shuffle=False, seed=0,
                                   num_workers=0, max_skipped=max_skipped, device="cpu"))

    probe = loader(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        list(probe)
    at_index = {k for k, _ in src.rejected}   # left out while indexing: counted, not in the budget
    bad = len({k for k, _ in probe.stats()["skipped_keys"]} - at_index)
    assert bad >= 3
    exact = loader(bad)     # a budget of exactly the bad samples: passes only if each counts once
    for epoch in range(2):
        exact.set_epoch(epoch)
        before = len(exact.stats()["skipped_keys"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = sum(len(b.labels) for b in exact)
        keys = [k for k, _ in exact.stats()["skipped_keys"][before:]]
        skips = [str(w.message) for w in caught if "skipped" in str(w.message)]
        assert not [k for k, n in collections.Counter(keys).items() if n > 1], keys
        assert len(skips) == len(keys) == bad
        assert rows == len(src)   # every row refilled by a good spare
