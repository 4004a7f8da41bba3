"""feedgpu.testing: the shipped checks pass on a sound pipeline and fail, naming the difference,
on a stage that breaks resume (draws from global numpy state) or whose DALI side differs."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from feedgpu import Pipeline
from feedgpu.stages import Decode, HorizontalFlip, RandomResizedCrop, SampleStage
from feedgpu.testing import check_conservation, check_engines_agree, check_resume

pytestmark = pytest.mark.timeout(600)


class GlobalNoise(SampleStage):
    """Wrong on purpose: brightens by a draw from numpy's global state, not from ``rng``."""

    name = "global_noise"
    deterministic = False
    draws = 0

    def apply(self, img, rng=None):
        shift = int(np.random.randint(0, 40))
        return Image.fromarray(np.clip(np.asarray(img, np.int16) + shift, 0, 255).astype(np.uint8))


class UpsideDownOnDali(SampleStage):
    """Wrong on purpose: no-op in Pillow, a vertical flip in DALI."""

    name = "upside_down_on_dali"
    has_dali = True

    def apply(self, img, rng=None):
        return img

    def dali(self, x, args, device):
        from nvidia.dali import fn

        return fn.flip(x, horizontal=0, vertical=1, device=device)


def _pipe(folder_ds, *middle):
    return Pipeline({"format": "folder", "path": str(folder_ds)},
                    [Decode(), *middle, RandomResizedCrop(32), HorizontalFlip()],
                    batch_size=40, seed=7, device="cpu")


def test_a_sound_pipeline_passes_every_check(folder_ds, no_leaked_workers):
    pipe = _pipe(folder_ds)
    r = check_resume(pipe, steps=[0, 1, 3])
    assert r["batches"] == 3 and r["checked"] == [(0, 0, 2), (1, 2, 0), (3, 0, 2)]
    c = check_conservation(pipe)
    assert c == {"delivered": 120, "skipped": 0}


def test_a_stage_drawing_from_global_numpy_state_fails_resume(folder_ds, no_leaked_workers):
    with pytest.raises(AssertionError, match=r"resumed after batch 0 of 3 \(saved with 0 workers, loaded with 2\): "
                                             r"batch 0 pixels differ"):
        check_resume(_pipe(folder_ds, GlobalNoise()), steps=[0, 1])


def test_engines_agree_and_a_stage_whose_dali_side_differs_fails(folder_ds, no_leaked_workers):
    pytest.importorskip("nvidia.dali")
    ok = check_engines_agree(_pipe(folder_ds))
    assert ok["batches"] == 3 and 0 < ok["mean"]["dali-cpu"] < 3 / 255
    with pytest.raises(AssertionError, match=r"dali-cpu: batch 0 differs from 'python' by 0\.\d+ of the value range"):
        check_engines_agree(_pipe(folder_ds, UpsideDownOnDali()))


def test_bad_arguments_are_refused(folder_ds):
    with pytest.raises(ValueError, match="outside 0..3"):
        check_resume(_pipe(folder_ds), steps=[5])
    with pytest.raises(ValueError, match="at least one worker count"):
        check_resume(_pipe(folder_ds), workers=())
