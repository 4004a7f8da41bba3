"""The cache as a step of the plan, end to end: a hit delivers exactly the bytes of a miss (and of
no cache at all), for pipelines that end at the cut and for ones with random stages after it;
a hit converts to PIL only where a stage needs it; every publication goes through the entry's
flush policy. Pipelines resize to 64 px before the cut, so entries stay small."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import N_IMAGES
from feedgpu import DataLoader, Pipeline
from feedgpu.exec import cache_step, pixels
from feedgpu.stages import Decode, HorizontalFlip, Normalize, RandomResizedCrop, Resize, ResizeCenterCrop
from feedgpu.testing import check_cache_agrees

pytestmark = pytest.mark.timeout(180)

BATCH = 16

PIPELINES = {
    # the cut is the last sample stage: a hit goes from the cache straight into the batch
    "ends_at_cut_uint8": lambda: [Decode(), ResizeCenterCrop(64, 48)],
    "ends_at_cut_normalize": lambda: [Decode(), ResizeCenterCrop(64, 48), Normalize()],
    # random stages after the cut: a PIL-only crop, then a flip that takes arrays
    "random_after": lambda: [Decode(), Resize(64), RandomResizedCrop(48), HorizontalFlip(), Normalize()],
    # only an array-taking random stage after the cut
    "flip_after": lambda: [Decode(), ResizeCenterCrop(64, 48), HorizontalFlip(), Normalize(layout="NHWC")],
}


def loader(src, stages, cache=None, nw: int = 0, **kw) -> DataLoader:
    opts = dict(batch_size=BATCH, num_workers=nw, seed=3, device="cpu", drop_last=False, shuffle=True,
                persistent_workers=False, cache=cache)
    opts.update(kw)
    return DataLoader(Pipeline(src, stages, **opts))


def epochs(ld: DataLoader, n: int) -> tuple[list, list[dict]]:
    out, stats = [], []
    for _ in range(n):
        out.append([(b.images.clone(), b.labels.clone()) for b in ld])
        stats.append(ld.stats())
    return out, stats


def same_bytes(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x[0].dtype == y[0].dtype and torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                    for x, y in zip(a, b))


def decoded(stats: list[dict]) -> list[float]:
    totals = [s["stage_s"].get("decode", 0.0) for s in stats]
    return [t - (totals[i - 1] if i else 0.0) for i, t in enumerate(totals)]


@pytest.fixture(scope="module")
def src(sources):
    return sources["folder"]


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("name", list(PIPELINES))
def test_a_hit_delivers_exactly_the_bytes_of_a_miss_and_of_no_cache(src, name, nw, tmp_path, no_leaked_workers):
    ref, _ = epochs(loader(src, PIPELINES[name]()), 2)
    ld = loader(src, PIPELINES[name](), {"dir": str(tmp_path / "c")}, nw=nw)
    got, st = epochs(ld, 2)          # epoch 1: every sample a miss (fills); epoch 2: every sample a hit
    ld.shutdown()
    assert st[0]["cache"]["cached"] == N_IMAGES and decoded(st)[1] == 0.0
    assert same_bytes(got[0], ref[0]) and same_bytes(got[1], ref[1])
    # a new loader, epoch 2 again: hits in a fresh process give the same bytes as the filling run's
    again = loader(src, PIPELINES[name](), {"dir": str(tmp_path / "c")}, nw=nw)
    again.set_epoch(1)
    hit, st2 = epochs(again, 1)
    again.shutdown()
    assert decoded(st2) == [0.0] and same_bytes(hit[0], ref[1])


@pytest.mark.parametrize("name, miss, hit", [
    ("ends_at_cut_normalize", (0, 1), (0, 0)),   # (PIL images made, arrays packed) per sample
    ("ends_at_cut_uint8", (0, 1), (0, 0)),
    ("flip_after", (0, 1), (0, 0)),
    ("random_after", (0, 2), (1, 1)),            # miss: the stored 64 px image, the 48 px batch row
])
def test_a_hit_converts_only_where_a_stage_needs_pil(src, name, miss, hit, tmp_path, monkeypatch):
    counts = {"image": 0, "array": 0}
    to_image, to_array = pixels.rgb_image, pixels.rgb_array

    def counted_image(a):
        counts["image"] += 1
        return to_image(a)

    def counted_array(img):
        counts["array"] += 1
        return to_array(img)

    monkeypatch.setattr(pixels, "rgb_image", counted_image)
    monkeypatch.setattr(pixels, "rgb_array", counted_array)
    monkeypatch.setattr(cache_step, "rgb_array", counted_array)
    ld = loader(src, PIPELINES[name](), {"dir": str(tmp_path / "c")})
    seen = []
    for _ in range(2):
        for _ in ld:
            pass
        seen.append((counts["image"] / N_IMAGES, counts["array"] / N_IMAGES))
        counts.update(image=0, array=0)
    ld.shutdown()
    assert seen == [miss, hit]


def test_every_publication_goes_through_the_flush_policy(src, tmp_path):
    ld = loader(src, PIPELINES["random_after"](), {"dir": str(tmp_path / "c"), "part_bytes": 120_000})
    _, st = epochs(ld, 2)
    entry = ld._backend.work.cache_entry()
    published = dict(entry.policy.published)
    manifest = json.loads((entry.dir / "manifest.json").read_text())
    ld.shutdown()
    assert published.get("part full", 0) >= 2
    assert set(published) <= {"part full", "pause"}          # inline: parts fill, then the epoch ends
    assert sum(published.values()) == len(manifest["parts"])
    assert decoded(st)[1] == 0.0


def test_explain_shows_the_cache_as_a_step_at_its_cut(src, tmp_path):
    p = Pipeline(src, PIPELINES["random_after"](), cache={"dir": str(tmp_path / "c"), "compression": "zstd:1"},
                 device="cpu")
    lines = [ln.split()[0] for ln in p.explain("cpu").splitlines()[3:10]]
    assert lines == ["source", "decode", "resize", "[cache]", "random_resized_crop", "horizontal_flip", "normalize"]
    row = next(ln for ln in p.explain("cpu").splitlines() if ln.strip().startswith("[cache]"))
    assert "stored after resize" in row and "uint8 HWC [?, ?, 3]" in row
    assert p.plan("cpu").cache_cut.stores.shape == (None, None, 3)


class UpsideDownOnArrays(HorizontalFlip):
    """Claims ``takes_arrays`` but mirrors an array top to bottom: a broken contract."""

    def apply(self, img, rng):
        if isinstance(img, np.ndarray):
            return img[::-1]
        return super().apply(img, rng)


def test_check_cache_agrees_passes_a_good_pipeline_and_catches_a_stage_that_breaks_takes_arrays(src, tmp_path):
    good = Pipeline(src, PIPELINES["random_after"](), batch_size=BATCH, seed=1, device="cpu")
    assert check_cache_agrees(good, tmp_path / "good") == {"epochs": 2, "batches": -(-N_IMAGES // BATCH),
                                                           "cached": N_IMAGES}
    bad = Pipeline(src, [Decode(), ResizeCenterCrop(64, 48), UpsideDownOnArrays(p=1.0)], batch_size=BATCH, seed=1,
                   device="cpu")
    with pytest.raises(AssertionError, match=r"cache filled, epoch 0 \(misses\): batch 0 pixels differ"):
        check_cache_agrees(bad, tmp_path / "bad")
