"""The cache as a step of the plan (feedgpu.exec.cache_step, feedgpu.exec.steps), the pixels it
hands on (feedgpu.exec.pixels.Pixels), stages that take arrays, and the one flush policy
(feedgpu.cache.flush). A fake entry stands in for the files: the Arrow store has its own tests
in tests/integration/test_cache.py."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from feedgpu.cache import CacheSettings, FlushPolicy
from feedgpu.errors import DecodeError, StageError
from feedgpu.exec import pixels
from feedgpu.exec.cache_step import CacheStep
from feedgpu.exec.pixels import Pixels, batch_row, rgb_image
from feedgpu.exec.plan import make_plan
from feedgpu.exec.steps import CachedSteps, Sample, StageStep, sample_steps
from feedgpu.stages import Decode, HorizontalFlip, Normalize, PythonStage, RandomResizedCrop, Resize, ResizeCenterCrop
from feedgpu.stages.draws import Draws
from feedgpu.stages.geometry import VerticalFlip


def photo(h: int = 37, w: int = 53, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# -- Pixels ------------------------------------------------------------------------------------------
def test_pixels_makes_a_missing_form_once_and_keeps_it(monkeypatch):
    a = photo()
    calls = []
    monkeypatch.setattr(pixels, "rgb_image", lambda x: calls.append("image") or rgb_image(x))
    p = Pixels(array=a)
    assert p.has_array and p.either() is a and p.array() is a
    img = p.image()
    assert img.mode == "RGB" and np.array_equal(np.asarray(img), a)
    assert p.image() is img and calls == ["image"]


def test_pixels_of_an_image_packs_it_in_rgb_and_batch_row_agrees():
    gray = Image.fromarray(photo()[:, :, 0], "L")
    p = Pixels(image=gray)
    assert not p.has_array and p.either() is gray and p.image() is gray
    assert np.array_equal(p.array(), np.asarray(gray.convert("RGB")))
    assert np.array_equal(batch_row(gray), p.array()) and np.array_equal(batch_row(p), p.array())
    with pytest.raises(ValueError):
        Pixels()


def test_rgb_image_of_a_mirrored_view():
    a = photo()
    assert np.array_equal(np.asarray(rgb_image(a[:, ::-1])), a[:, ::-1])


# -- stages that take arrays -------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [HorizontalFlip, VerticalFlip])
def test_flips_on_arrays_give_the_pixels_they_give_on_images_without_a_copy(cls):
    st = cls()
    flipped = []
    for index in range(8):
        a = photo(seed=index)
        on_image = np.asarray(st.apply(Image.fromarray(a), Draws(0, 0, index, 0)))
        on_array = st.apply(a, Draws(0, 0, index, 0))
        assert isinstance(on_array, np.ndarray) and np.array_equal(on_array, on_image)
        assert np.shares_memory(on_array, a)
        flipped.append(not np.array_equal(on_array, a))
    assert cls.takes_arrays and any(flipped) and not all(flipped)


def test_builtin_pil_stages_do_not_claim_arrays_and_the_listing_says_which_do():
    from feedgpu.stages.params import describe_stage

    assert not any(c.takes_arrays for c in (Decode, Resize, ResizeCenterCrop, RandomResizedCrop, PythonStage))
    assert describe_stage(HorizontalFlip)["takes_arrays"] is True and describe_stage(Resize)["takes_arrays"] is False


# -- the plan's cut ----------------------------------------------------------------------------------
def test_the_plan_names_its_cut_and_explains_the_cache_as_a_step(tmp_path):
    plan = make_plan([Decode(), Resize(64), RandomResizedCrop(48), HorizontalFlip(), Normalize()], "cpu")
    cut = plan.cache_cut
    assert (cut.after, cut.stage) == (2, "resize")
    assert (cut.stores.dtype, cut.stores.layout, cut.stores.shape) == ("uint8", "HWC", (None, None, 3))
    rows = plan.describe(16, CacheSettings(tmp_path, "zstd:3"))
    assert [r[0] for r in rows] == ["source", "decode", "resize", "[cache]", "random_resized_crop",
                                    "horizontal_flip", "normalize"]
    cache_row = rows[3]
    assert str(tmp_path) in cache_row[2] and "zstd:3" in cache_row[2]
    assert cache_row[4] == "uint8 HWC [?, ?, 3] stored after resize"
    assert "[cache]" not in [r[0] for r in plan.describe(16)]
    assert plan.describe(16, True)[3][2] == "local disk (Arrow IPC)"
    val = make_plan([Decode(), ResizeCenterCrop(64, 48), Normalize()], "cpu").cache_cut
    assert (val.after, val.stage, val.stores.shape) == (2, "resize_center_crop", (48, 48, 3))


# -- the cache step over a fake entry ----------------------------------------------------------------
class FakeEntry:
    """What CacheStep and FlushPolicy use of a CacheEntry, in memory."""

    def __init__(self, part_bytes: int = 1 << 30):
        self.rows: dict[int, tuple[np.ndarray, int]] = {}
        self.quarantined: dict[int, tuple[str, str]] = {}
        self.buffered = 0
        self.flushes: list[int] = []   # rows published by each flush that listed some
        self.refreshes = 0
        self.policy = FlushPolicy(self, part_bytes)

    def get(self, index):
        row = self.rows.get(index)
        return None if row is None else row[0]

    def label(self, index):
        return self.rows[index][1]

    def put(self, index, key, label, arr):
        self.rows[index] = (arr, label)
        self.buffered += arr.nbytes
        self.policy.row_added()

    @property
    def open_part_bytes(self):
        return self.buffered

    def quarantine(self, index, key, reason):
        self.quarantined[index] = (key, reason)

    def flush(self):
        if not self.buffered:
            return False
        self.flushes.append(self.buffered)
        self.buffered = 0
        return True

    def refresh(self):
        self.refreshes += 1


def cut_of(stages):
    return make_plan(stages, "cpu").cache_cut


def test_store_keeps_rgb_arrays_and_hands_on_both_forms():
    entry = FakeEntry()
    step = CacheStep(entry, cut_of([Decode(), Resize(64), RandomResizedCrop(48)]))
    gray = Image.fromarray(photo()[:, :, 1], "L")
    out = step.store(3, "k3", 7, gray)
    assert np.array_equal(entry.rows[3][0], np.asarray(gray.convert("RGB")))
    assert out.image().mode == "RGB" and out.array() is entry.rows[3][0]
    pixels_, label = step.lookup(3)
    assert pixels_ is entry.rows[3][0] and label == 7 and step.lookup(4) is None
    arr = photo()
    assert step.store(5, "k5", 1, arr).either() is arr   # a contiguous uint8 array is stored as it is
    with pytest.raises(StageError, match="stores uint8"):
        step.store(6, "k6", 0, arr.astype(np.float32))
    entry.quarantined[8] = ("k8", "corrupt")
    with pytest.raises(DecodeError) as e:
        step.lookup(8)
    assert (e.value.key, e.value.reason) == ("k8", "corrupt")


class Src:
    """A source whose payloads are arrays already (the read and decode are not the point here)."""

    def __init__(self, n: int = 4):
        self.reads: list[int] = []
        self.n = n

    def __len__(self):
        return self.n

    def key(self, i):
        return f"s{i}"

    def read(self, i):
        from types import SimpleNamespace

        self.reads.append(i)
        return SimpleNamespace(payload=Image.fromarray(photo(seed=i)), key=f"s{i}", label=i % 2)


def test_a_hit_skips_the_read_and_the_stages_before_the_cut_and_keeps_the_array(monkeypatch):
    seen = []
    before = PythonStage(lambda x: (seen.append("prefix"), x)[1], name="prefix")
    after_pil = PythonStage(lambda x, rng: (seen.append(type(x).__name__), x)[1], random=True, name="after",
                            size=(37, 53))
    st = [Decode(), before, HorizontalFlip(p=1.0), after_pil]
    plan = make_plan(st, "cpu")
    entry, src = FakeEntry(), Src()
    steps = sample_steps(src, plan, 0, CacheStep(entry, plan.cache_cut))
    steps[0].stages = steps[0].stages[1:]   # payloads are images already: no decode
    assert isinstance(steps[0], CachedSteps) and [s.stage.name for s in steps[1:]] == ["horizontal_flip", "python"]
    secs = dict.fromkeys(["read", "cache", "decode", "python", "horizontal_flip"], 0.0)
    miss, hit = Sample(1), Sample(1)
    for s in (miss, hit):
        for step in steps:
            step.run(s, 0, secs)
    assert src.reads == [1] and seen == ["prefix", "Image", "Image"]
    assert (miss.label, hit.label, hit.key) == (1, 1, None)
    assert isinstance(hit.x, Image.Image) and np.array_equal(np.asarray(hit.x), np.asarray(miss.x))
    assert np.array_equal(np.asarray(hit.x), photo(seed=1)[:, ::-1])
    assert secs["cache"] > 0 and secs["read"] > 0


def test_an_array_stage_after_the_cut_gets_the_cached_array_and_its_result_stays_pixels():
    plan = make_plan([Decode(), ResizeCenterCrop(40, 32), HorizontalFlip(p=1.0)], "cpu")
    entry = FakeEntry()
    cached = photo(32, 32)
    entry.rows[0] = (cached, 1)
    step = sample_steps(Src(), plan, 0, CacheStep(entry, plan.cache_cut))
    s = Sample(0)
    for st in step:
        st.run(s, 0, dict.fromkeys(["read", "cache", "decode", "resize_center_crop", "horizontal_flip"], 0.0))
    assert isinstance(s.x, Pixels) and s.x.has_array
    out = batch_row(s.x)
    assert np.shares_memory(out, cached) and np.array_equal(out, cached[:, ::-1])


def test_a_decode_error_before_the_cut_quarantines_the_sample():
    def bad(x):
        raise DecodeError("?", "corrupt", "made up")

    plan = make_plan([Decode(), PythonStage(bad, name="bad", size=(37, 53))], "cpu")
    entry = FakeEntry()
    steps = sample_steps(Src(), plan, 0, CacheStep(entry, plan.cache_cut))
    steps[0].stages = steps[0].stages[1:]
    with pytest.raises(DecodeError) as e:
        steps[0].run(Sample(2), 0, dict.fromkeys(["read", "cache", "python"], 0.0))
    assert e.value.key == "s2" and entry.quarantined == {2: ("s2", "corrupt")}


def test_stage_step_names_the_stage_that_failed():
    step = StageStep(3, PythonStage(lambda x: 1 / 0, name="boom"), 0, 0, Src())
    s = Sample(1)
    s.x = Pixels(array=photo())
    with pytest.raises(StageError, match=r"stage 3 \(boom\) failed on s1: ZeroDivisionError"):
        step.run(s, 0, {"python": 0.0})


# -- the flush policy --------------------------------------------------------------------------------
def test_every_trigger_goes_through_the_policy_and_publishes_only_what_is_buffered():
    entry = FakeEntry(part_bytes=3 * photo().nbytes)
    step = CacheStep(entry, cut_of([Decode(), Resize(64), RandomResizedCrop(48)]))
    pol = entry.policy
    step.begin(0)
    for i in range(4):                  # the third row fills the part
        step.store(i, f"s{i}", 0, photo(seed=i))
    assert entry.flushes == [3 * photo().nbytes] and pol.published == {"part full": 1}
    step.begin(0)                       # same epoch: nothing
    assert len(entry.flushes) == 1
    step.begin(1)                       # a new epoch publishes the last one's rows
    assert entry.flushes[-1] == photo().nbytes and pol.published["epoch change"] == 1
    step.begin(2)                       # nothing buffered: no publication counted
    assert pol.published["epoch change"] == 1 and entry.refreshes == 4
    step.store(9, "s9", 0, photo())
    step.pause()
    assert pol.published["pause"] == 1
    step.store(10, "s10", 0, photo())
    pol.end()
    assert pol.published == {"part full": 1, "epoch change": 1, "pause": 1, "end": 1}
    assert len(entry.flushes) == 4 and entry.buffered == 0


def test_a_forked_process_starts_the_policy_afresh():
    entry = FakeEntry()
    pol = entry.policy
    pol.batch(5)
    entry.buffered = 10
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child's first batch is not an epoch change: its parent's epoch is not its own
        pol.batch(6)
        os.write(w, b"%d" % len(entry.flushes))
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 8) == b"0"
    os.close(r)
    os.close(w)
    pol.batch(6)
    assert entry.flushes == [10] and pol.published == {"epoch change": 1}


def test_an_entry_nobody_holds_is_freed_at_once_despite_its_policy():
    """The policy refers to its entry weakly: no reference cycle keeps a dropped entry (and so
    its in-use lock) alive until the garbage collector runs."""
    import gc
    import weakref

    gc.disable()
    try:
        entry = FakeEntry()
        ref = weakref.ref(entry)
        pol = entry.policy
        del entry
        assert ref() is None and pol.entry is None
        pol.pause()   # an event for a freed entry does nothing
        assert pol.published == {}
    finally:
        gc.enable()


def test_nothing_but_the_policy_calls_an_entrys_flush():
    """Nothing in feedgpu calls ``flush()`` on a cache entry but the policy (the loader's work,
    the pool hook, scan and ``feedgpu cache build`` send events)."""
    root = Path(__file__).resolve().parents[2] / "feedgpu"
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "entry.flush()" in p.read_text() or "cache.flush()" in p.read_text()
                     or "self.flush()" in p.read_text())
    assert callers == ["cache/flush.py"], callers
