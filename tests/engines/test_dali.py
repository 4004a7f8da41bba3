"""The DALI engine (``engine: dali``) against the Python engine, in DALI CPU mode (``device_id=None``).

What is asserted here, on the sample photos and on ``shared/cases``:

* one pipeline definition runs on either engine; same seed -> same samples in the same order;
* deterministic stages (decode, resize, resize_center_crop, normalize): DALI's and Pillow-SIMD's
  pixels agree within the tolerances below;
* random stages: the crop window and the flip are drawn in Python from the same per-sample
  generator on both engines, so they are identical; only the resampling arithmetic differs;
* each engine is reproducible for a seed (bitwise), independent of DALI's thread count, and
  resumes mid-epoch exactly (also from a Python-engine state);
* samples DALI cannot take are decoded by Pillow and rejoin the batch; bad samples are skipped
  with the same reasons as on the Python engine; a DALI failure redoes the batch on Python.

Tolerances, in 0-255 levels, measured on this machine (DALI 2.4 CPU operators vs Pillow-SIMD
12.1 with AVX2, bilinear, 120 photos x 3 seeds):

* resize_center_crop (one resample of the crop box): mean |diff| 0.12 (worst sample 0.18),
  max 1. Asserted: mean <= 0.25, worst sample mean <= 0.35, max <= 2.
* random_resized_crop + flip: mean 0.12 (worst sample 0.21); 99.9 % of pixels within 1; up to
  11 levels in the outermost row or column of the output when the crop window touches the image
  border (the two libraries treat the resampling filter's support beyond the image edge
  differently). Asserted: mean <= 0.25, worst sample mean <= 0.35, pixels off by more than
  2 levels <= 0.1 %, max <= 24.
* normalize: the same, divided by 255 * std (1 level = 0.0175 after ImageNet normalization).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("nvidia.dali")

from conftest import CASES, REPO, batches_equal, clone_all, open_format  # noqa: E402
from feedgpu import Batch, ConfigError, DataLoader, Pipeline, SkippedSampleWarning  # noqa: E402
from feedgpu.errors import DecodeError  # noqa: E402
from feedgpu.host import cpu_cores  # noqa: E402
from feedgpu.stages import (Decode, HorizontalFlip, Normalize, PythonStage, RandomResizedCrop,  # noqa: E402
                            Resize, ResizeCenterCrop)
from feedgpu.stages.draws import sample_uniforms, stage_draw_ids  # noqa: E402

pytestmark = [pytest.mark.dali, pytest.mark.timeout(120)]

DALI_CPU = {"name": "dali", "device": "cpu"}
VAL_TOL = {"mean": 0.25, "sample_mean": 0.35, "max": 2.0}
TRAIN_TOL = {"mean": 0.25, "sample_mean": 0.35, "max": 24.0, "share_over_2": 0.001}
STD = torch.tensor([0.229, 0.224, 0.225])


# -- helpers ------------------------------------------------------------------------------------------
class IndexedPhotos(torch.utils.data.Dataset):
    """The sample photos as encoded bytes with label = index, so a label names its sample."""

    def __init__(self, folder: Path):
        self.files = sorted(folder.rglob("*.jpg"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.files[i].read_bytes(), i


@pytest.fixture(scope="module")
def indexed(folder_ds):
    return IndexedPhotos(folder_ds)


def val_stages(normalize=False, **norm):
    return [Decode(), ResizeCenterCrop(256, 224)] + ([Normalize(**norm)] if normalize else [])


def train_stages(normalize=False):
    return [Decode(), RandomResizedCrop(224), HorizontalFlip()] + ([Normalize()] if normalize else [])


def pipe(src, stages, engine="python", batch_size=16, seed=0, shuffle=True, **kw):
    kw.setdefault("num_workers", 2)
    return Pipeline(src, stages, batch_size=batch_size, shuffle=shuffle, seed=seed, device="cpu",
                    engine=engine, **kw)


def levels(x: torch.Tensor, layout_nchw: bool | None = None) -> torch.Tensor:
    """Images as float 0-255 levels (normalized float output is scaled back by std)."""
    if x.dtype == torch.uint8:
        return x.float()
    x = x.float()
    shape = (1, 3, 1, 1) if x.shape[1] == 3 else (1, 1, 1, 3)
    return x * (STD.view(shape) * 255.0)


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (levels(a) - levels(b)).abs()
    per = d.flatten(1).mean(1)
    return {"mean": float(d.mean()), "sample_mean": float(per.max()), "max": float(d.max()),
            "share_over_2": float((d > 2.01).float().mean())}


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: dict, what: str = "") -> dict:
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    s = diff_stats(a, b)
    for k, limit in tol.items():
        assert s[k] <= limit, f"{what}: {k} {s[k]:.4f} > {limit} ({s})"
    return s


def cat(batches) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([b.images for b in batches]), torch.cat([b.labels for b in batches])


def run(p, **kw) -> tuple[list, dict]:
    loader = DataLoader(p, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSampleWarning)
        out = clone_all(loader)
    return out, loader.stats()


# -- parity with the Python engine ------------------------------------------------------------------
@pytest.mark.parametrize("norm", [None, {}, {"dtype": "float16"}, {"layout": "NHWC"}],
                         ids=["uint8", "float32-nchw", "float16", "nhwc"])
def test_val_pipeline_agrees_with_the_python_engine(indexed, norm):
    stages = lambda: val_stages(norm is not None, **(norm or {}))  # noqa: E731
    py, _ = run(pipe(indexed, stages(), seed=3))
    da, st = run(pipe(indexed, stages(), DALI_CPU, seed=3))
    (pi, pl), (di, dl) = cat(py), cat(da)
    assert torch.equal(pl, dl), "the same samples in the same order"
    assert sorted(pl.tolist()) == list(range(len(indexed)))
    tol = dict(VAL_TOL)
    if norm is not None and norm.get("dtype") == "float16":
        tol["max"] += 0.5  # float16 rounding of values up to ~2.6: 0.002, i.e. ~0.1 level per term
    s = assert_close(pi, di, tol, "val")
    assert s["mean"] > 0  # really two implementations
    eng = st["engine"]
    assert eng["name"] == "dali" and eng["device"] == "cpu" and eng["threads"] == 2
    assert eng["batches"] == len(py) and eng.get("python_decoded", 0) == 0 and eng.get("dali_errors", 0) == 0
    assert set(st["stage_s"]) >= {"read", "probe", "params", "dali"}


def test_resize_stage_agrees_with_the_python_engine(indexed):
    stages = lambda: [Decode(), Resize(160), ResizeCenterCrop(160, 128)]  # noqa: E731
    (pi, pl), (di, dl) = cat(run(pipe(indexed, stages(), seed=1))[0]), cat(run(pipe(indexed, stages(), DALI_CPU, seed=1))[0])
    assert torch.equal(pl, dl)
    assert_close(pi, di, VAL_TOL, "resize")


def test_train_pipeline_same_crops_and_flips_as_the_python_engine(indexed):
    """Crop windows and flips come from ``sample_uniforms(seed, epoch, index, stage)`` on both engines."""
    seed = 7
    py, _ = run(pipe(indexed, train_stages(), seed=seed, shuffle=False))
    da, _ = run(pipe(indexed, train_stages(), DALI_CPU, seed=seed, shuffle=False))
    noflip, _ = run(pipe(indexed, [Decode(), RandomResizedCrop(224)], seed=seed, shuffle=False))
    (pi, pl), (di, dl), (ni, _) = cat(py), cat(da), cat(noflip)
    assert torch.equal(pl, dl) and pl.tolist() == list(range(len(indexed)))
    assert_close(pi, di, TRAIN_TOL, "train")
    flip_key = stage_draw_ids(train_stages())[2]
    flips = (sample_uniforms(seed, 0, np.arange(len(indexed)), flip_key, 1)[:, 0] < 0.5).tolist()
    assert 0.25 < np.mean(flips) < 0.75
    for i, f in enumerate(flips):
        want = torch.flip(ni[i], dims=[1]) if f else ni[i]
        other = ni[i] if f else torch.flip(ni[i], dims=[1])
        near = (di[i].float() - want.float()).abs().mean()
        far = (di[i].float() - other.float()).abs().mean()
        assert near < 0.35 and far > 5 * near + 1, (i, f, float(near), float(far))


def test_train_pipeline_with_normalize_agrees(indexed):
    py, _ = run(pipe(indexed, train_stages(True), seed=2))
    da, _ = run(pipe(indexed, train_stages(True), DALI_CPU, seed=2))
    (pi, pl), (di, dl) = cat(py), cat(da)
    assert torch.equal(pl, dl)
    assert pi.dtype == di.dtype == torch.float32 and pi.shape == di.shape == (len(indexed), 3, 224, 224)
    assert_close(pi, di, TRAIN_TOL, "train+normalize")


@pytest.mark.parametrize("stages", [train_stages, lambda: val_stages(True)], ids=["train-normalize", "val-normalize"])
def test_window_decode_gives_the_pixels_of_whole_decode(indexed, stages):
    """Crop-on-decode (``decoders.image_slice`` over the resize window plus the filter's reach)
    against decoding whole images: the same crops, within 1 level (libjpeg's chroma upsampling
    at the window's edge)."""
    win, sw = run(pipe(indexed, stages(), DALI_CPU, seed=5))
    whole, sh = run(pipe(indexed, stages(), {**DALI_CPU, "window_decode": False}, seed=5))
    assert sw["engine"]["window_decode"] and sw["engine"]["window_decoded"] == len(indexed)
    assert not sh["engine"]["window_decode"] and sh["engine"]["whole_decoded"] == len(indexed)
    (wi, wl), (hi, hl) = cat(win), cat(whole)
    assert torch.equal(wl, hl)
    s = assert_close(wi, hi, {"mean": 0.01, "max": 1.01}, "window vs whole decode")
    assert not torch.equal(wi, hi) or s["max"] == 0


def test_breaking_off_an_epoch_drops_the_batches_dali_computed_ahead(indexed):
    """DALI runs up to prefetch_factor batches ahead; after a ``break`` the next epoch must not
    receive the stale batches of the epoch left."""
    ref = DataLoader(pipe(indexed, train_stages(True), DALI_CPU, seed=8, prefetch_factor=3))
    e0, e1 = clone_all(ref), clone_all(ref)
    loader = DataLoader(pipe(indexed, train_stages(True), DALI_CPU, seed=8, prefetch_factor=3))
    for i, _ in enumerate(loader):
        if i == 0:
            break
    loader.set_epoch(1)
    assert batches_equal(clone_all(loader), e1)
    loader.set_epoch(0)
    assert batches_equal(clone_all(loader), e0)


def test_headers_are_read_once_per_sample(indexed, monkeypatch):
    """Later epochs reuse each file's header check (size, orientation, decoder) from the first."""
    from feedgpu.stages.decode import Decode as D

    ref = DataLoader(pipe(indexed, train_stages(True), DALI_CPU, seed=10))
    e0, e1 = clone_all(ref), clone_all(ref)
    loader = DataLoader(pipe(indexed, train_stages(True), DALI_CPU, seed=10))
    assert batches_equal(clone_all(loader), e0)
    monkeypatch.setattr(D, "header", lambda self, data: pytest.fail("header read again"))
    assert batches_equal(clone_all(loader), e1)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["dali-buffers", "host-buffers"])
def test_batches_the_training_loop_keeps_are_never_overwritten(indexed, monkeypatch, zero_copy):
    """Batches are DALI's own output buffers (no CUDA: zero copy), which DALI does not reuse while
    referenced, or copies in the engine's host buffers (with CUDA: pinned), which it reuses only
    once the training loop drops a batch."""
    import feedgpu.exec.dali.engine as engine

    monkeypatch.setattr(engine, "_zero_copy_output", lambda device: zero_copy)
    ref, _ = run(pipe(indexed, train_stages(True), DALI_CPU, seed=9, batch_size=4))
    loader = DataLoader(pipe(indexed, train_stages(True), DALI_CPU, seed=9, batch_size=4))
    kept = list(loader)       # every batch held at once (host buffers: the 4 kept, then fresh memory)
    assert len(kept) > 4 and batches_equal(kept, ref)
    ptrs = [b.images.data_ptr() for b in kept]
    assert len(set(ptrs)) == len(kept)
    del kept
    loader.set_epoch(0)
    again = []
    for b in loader:          # each batch dropped before the next (host buffers: the kept ones come back)
        again.append((b.images.data_ptr(), b.images.clone(), b.labels.clone()))
    assert batches_equal([Batch(i, lab) for _, i, lab in again], ref)
    if not zero_copy:
        assert len({p for p, _, _ in again}) <= 4 and {p for p, _, _ in again} <= set(ptrs)


# -- reproducibility, threads, resume, sharding ----------------------------------------------------
def test_dali_is_reproducible_for_a_seed_and_differs_for_another(indexed):
    a, _ = run(pipe(indexed, train_stages(), DALI_CPU, seed=11))
    b, _ = run(pipe(indexed, train_stages(), DALI_CPU, seed=11))
    assert batches_equal(a, b)
    c, _ = run(pipe(indexed, train_stages(), DALI_CPU, seed=12))
    assert not torch.equal(cat(a)[1], cat(c)[1]), "another seed, another order"
    # the next epoch: another order and other crops, still the same set of samples
    loader = DataLoader(pipe(indexed, train_stages(), DALI_CPU, seed=11))
    e0, e1 = clone_all(loader), clone_all(loader)
    assert batches_equal(e0, a)
    assert sorted(cat(e1)[1].tolist()) == sorted(cat(e0)[1].tolist())
    assert not torch.equal(cat(e1)[1], cat(e0)[1])
    # same sample in both epochs: different crop
    i0, l0 = cat(e0)
    i1, l1 = cat(e1)
    k = int(l0[0])
    assert not torch.equal(i0[0], i1[int((l1 == k).nonzero()[0])])


def test_output_does_not_depend_on_dali_threads(indexed):
    one, _ = run(pipe(indexed, train_stages(True), {**DALI_CPU, "threads": 1}, seed=4))
    two, st = run(pipe(indexed, train_stages(True), {**DALI_CPU, "threads": 2}, seed=4))
    assert st["engine"]["threads"] == 2
    assert batches_equal(one, two)
    # num_workers gives the thread count when engine.threads is not set
    loader = DataLoader(pipe(indexed, val_stages(), DALI_CPU), num_workers=1)
    next(iter(loader))
    assert loader.stats()["engine"]["threads"] == 1
    loader.shutdown()


def test_auto_rebuilds_dali_with_the_balancers_thread_counts_and_the_batches_do_not_change(indexed, monkeypatch):
    """Under ``num_workers="auto"`` each decision of the balancer sets DALI's thread count and
    batches ahead between two batches (the pipelines are rebuilt); the batches equal a fixed
    thread count's, bit for bit, also those the loop holds across a rebuild (DALI's own output
    buffers, no copy, on a machine without CUDA)."""
    import feedgpu.exec.dali.engine as engine
    from feedgpu.balancer import Decision

    built = []
    real = engine.build_graph
    monkeypatch.setattr(engine, "build_graph", lambda *a, **kw: built.append(kw["threads"]) or real(*a, **kw))
    ref = DataLoader(pipe(indexed, train_stages(True), {**DALI_CPU, "threads": 1}, seed=5, batch_size=8))
    want = [clone_all(ref), clone_all(ref)]
    loader = DataLoader(pipe(indexed, train_stages(True), DALI_CPU, seed=5, batch_size=8, num_workers="auto"))
    a = loader.balancer
    assert a is not None and a.engine == "dali-cpu" and a.policy.config.unit == "DALI threads"
    a.window_s, a.min_batches, a._skip = 0.0, 1, 0
    plan = iter([(3, 1), (1, 1), (2, 2), (2, 1)] * 20)   # prefetch 1 mostly: few batches run ahead of a change
    a.policy.decide = lambda m: Decision(*next(plan), "add", "test", t=m.t, engine=m.engine)
    ref.shutdown()
    built.clear()
    seen = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        kept = list(loader)            # held, not cloned, while DALI is rebuilt under them
        seen.append((loader.num_workers, loader.prefetch_factor, loader.stats()["engine"]))
        assert batches_equal(kept, want[epoch]), f"epoch {epoch}"
        del kept
    eng = seen[-1][2]
    assert eng["rebuilds"] >= 10 and eng["threads"] in (1, 2, 3) and eng["ahead"] == a.prefetch, eng
    assert built[0] == min(cpu_cores(), 3) and set(built[1:]) == {1, 2, 3}, built   # one per core, then the decisions
    assert seen[-1][:2] == (a.workers, a.prefetch) and a.workers in (1, 2, 3)
    loader.shutdown()


def test_auto_measures_the_loop_with_dali_and_says_dali_threads(indexed):
    """The real policy on the DALI engine: windows are measured in the main process (no worker
    processes), its experiments change DALI's threads, and its words say so."""
    loader = DataLoader(pipe(indexed, val_stages(), DALI_CPU, batch_size=8, num_workers="auto"))
    a = loader.balancer
    a.window_s, a.min_batches = 0.05, 2
    epoch = 0
    while len(a.timeline) < 8 and epoch < 40:
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        epoch += 1
    st = loader.stats()
    b = st["balancer"]
    assert len(a.timeline) >= 8 and b["engine"] == "dali-cpu" and b["unit"] == "DALI threads", b
    assert "DALI threads" in b["report"] and "worker" not in b["report"], b["report"]
    assert all(m.engine == "dali-cpu" and m.cpu_cores_used == 0.0 for m in a.measurements)
    assert st["engine"]["threads"] == a.workers == loader.num_workers
    kinds = {p["decision"] for p in a.timeline}
    assert kinds & {"add", "remove", "prefetch", "revert"}, kinds   # it experiments
    loader.shutdown()


def test_resume_mid_epoch_with_dali(indexed):
    ref, _ = run(pipe(indexed, train_stages(), DALI_CPU, seed=5))
    first = DataLoader(pipe(indexed, train_stages(), DALI_CPU, seed=5))
    it = iter(first)
    head = [next(it) for _ in range(3)]
    head = [type(b)(b.images.clone(), b.labels.clone()) for b in head]
    state = first.state_dict()
    assert state["batches_seen"] == 3
    first.shutdown()
    again = DataLoader(pipe(indexed, train_stages(), DALI_CPU, seed=999))  # the state brings the seed
    again.load_state_dict(state)
    tail = clone_all(again)
    assert batches_equal(head + tail, ref)


def test_resume_across_engines_python_state_then_dali(indexed):
    """A state saved on the Python engine continues on DALI with the same samples in order."""
    ref_py, _ = run(pipe(indexed, train_stages(), seed=6))
    first = DataLoader(pipe(indexed, train_stages(), seed=6))
    it = iter(first)
    for _ in range(2):
        next(it)
    state = first.state_dict()
    first.shutdown()
    dali = DataLoader(pipe(indexed, train_stages(), DALI_CPU, seed=6))
    dali.load_state_dict(state)
    tail = clone_all(dali)
    assert len(tail) == len(ref_py) - 2
    ti, tl = cat(tail)
    ri, rl = cat(ref_py[2:])
    assert torch.equal(tl, rl)
    assert_close(ri, ti, TRAIN_TOL, "resumed on dali")
    # and back: a DALI state continues on the Python engine
    d2 = DataLoader(pipe(indexed, train_stages(), DALI_CPU, seed=6))
    it = iter(d2)
    next(it)
    state = d2.state_dict()
    d2.shutdown()
    back = DataLoader(pipe(indexed, train_stages(), seed=6))
    back.load_state_dict(state)
    assert torch.equal(cat(clone_all(back))[1], cat(ref_py[1:])[1])


def test_a_dropped_iteration_leaves_no_stale_batch(indexed):
    """The engine prepares batch b+1 while DALI runs batch b: after a ``break`` and ``set_epoch``,
    the next iteration must not get the batch prepared for the abandoned epoch."""
    loader = DataLoader(pipe(indexed, train_stages(), DALI_CPU, seed=2))
    it = iter(loader)
    next(it)
    del it  # break after one batch (batch 1 of epoch 0 is being prepared)
    loader.set_epoch(3)
    got = clone_all(loader)
    ref = DataLoader(pipe(indexed, train_stages(), DALI_CPU, seed=2))
    ref.set_epoch(3)
    assert batches_equal(got, clone_all(ref))


@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_sharding_with_dali(indexed, drop_last):
    n, bs, world = len(indexed), 16, 2
    per_rank = []
    for rank in range(world):
        loader = DataLoader(pipe(indexed, val_stages(), DALI_CPU, batch_size=bs, seed=8, drop_last=drop_last),
                            rank=rank, world_size=world)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedSampleWarning)
            batches = clone_all(loader)
        assert len(batches) == len(loader)
        per_rank.append(cat(batches)[1].tolist())
        # the same shard as the Python engine gives
        py, _ = run(pipe(indexed, val_stages(), batch_size=bs, seed=8, drop_last=drop_last),
                    rank=rank, world_size=world)
        assert cat(py)[1].tolist() == per_rank[-1]
    assert len(per_rank[0]) == len(per_rank[1])
    seen = set(per_rank[0]) | set(per_rank[1])
    if drop_last:
        assert len(per_rank[0]) == n // (world * bs) * bs and len(seen) == 2 * len(per_rank[0])
    else:
        assert seen == set(range(n)), "the ranks together cover the epoch"


# -- sources -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
def test_every_source_feeds_dali(sources, fmt):
    src = sources[fmt]
    py, _ = run(pipe(src, val_stages(True), seed=9, batch_size=32))
    da, st = run(pipe(src, val_stages(True), DALI_CPU, seed=9, batch_size=32))
    (pi, pl), (di, dl) = cat(py), cat(da)
    assert len(da) == len(py) == 4 and torch.equal(pl, dl)
    assert_close(pi, di, VAL_TOL, fmt)
    assert st["engine"]["batches"] == 4 and st["engine"].get("python_decoded", 0) == 0


def _folder_copy(folder_ds, tmp_path, n=40):
    """The first ``n`` images of ``folder_ds`` in a fresh ImageFolder (tests change files in it)."""
    from feedgpu import FolderSource

    for f in sorted(folder_ds.rglob("*.jpg"))[:n]:
        dst = tmp_path / f.parent.name / f.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(f.read_bytes())
    return FolderSource(tmp_path)


def test_later_epochs_let_dali_read_local_files(folder_ds, tmp_path, monkeypatch):
    """A folder source's files are read in Python once, for the header check; later epochs hand
    DALI the paths (fn.io.file.read) and give what the Python engine gives."""
    from feedgpu import FolderSource

    src = _folder_copy(folder_ds, tmp_path)
    py = DataLoader(pipe(src, train_stages(True), seed=4, batch_size=8))
    p0, p1 = clone_all(py), clone_all(py)
    loader = DataLoader(pipe(src, train_stages(True), DALI_CPU, seed=4, batch_size=8))
    d0 = clone_all(loader)
    reads = []
    real_read = FolderSource.read
    monkeypatch.setattr(FolderSource, "read", lambda self, i: reads.append(i) or real_read(self, i))
    d1 = clone_all(loader)
    assert reads == [], "epoch 2 read no file in Python"
    for d, p in ((d0, p0), (d1, p1)):
        (di, dl), (pi, pl) = cat(d), cat(p)
        assert torch.equal(dl, pl)
        assert_close(pi, di, TRAIN_TOL, "folder")


def test_a_local_file_changed_after_the_first_epoch(folder_ds, tmp_path):
    """Each local file is stat()ed before DALI is given its path. Deleted: skipped as unreadable,
    named, counted. Replaced by another image, even one of the same length: its header is read
    again (the kept header is keyed by length, inode and status-change time) and the new image is used.
    Garbage of the same length: read again, skipped as not an image. The loader goes on."""
    src = _folder_copy(folder_ds, tmp_path)
    loader = DataLoader(pipe(src, val_stages(), DALI_CPU, batch_size=8, shuffle=False, max_skipped=None))
    first = clone_all(loader)
    assert sum(len(b.labels) for b in first) == 40
    files = sorted(tmp_path.rglob("*.jpg"))
    size = [f.stat().st_size for f in files]
    # an image a little smaller than another: padded after its end marker to the same length
    donor, other = next((j, i) for i in range(8, 24) for j in range(26, 40) if 0 < size[i] - size[j] < 900)
    gone, junk = files[3], files[25]
    gone.unlink()
    files[other].write_bytes(files[donor].read_bytes() + b"\0" * (size[other] - size[donor]))
    assert files[other].stat().st_size == size[other]
    junk.write_bytes(b"\xff" * size[25])
    with pytest.warns(UserWarning) as caught:
        again = clone_all(loader)
    text = " ".join(str(w.message) for w in caught)
    assert str(gone) in text and str(junk) in text
    assert sum(len(b.labels) for b in again) == 40, "skipped samples are replaced, batches keep their size"
    assert loader.stats()["skipped"] == {"unreadable": 1, "not an image": 1}
    img, img2 = cat(first)[0], cat(again)[0]
    assert_close(img2[other:other + 1], img[donor:donor + 1], {"mean": 0.01}, "replaced file")
    keep = [i for i in range(40) if i not in (3, 25, other)]
    assert torch.equal(img2[keep], img[keep])
    with pytest.warns(SkippedSampleWarning):   # every epoch
        more = clone_all(loader)
    assert sum(len(b.labels) for b in more) == 40


def test_a_local_file_rewritten_with_its_modification_time_kept(tmp_path):
    """``exiftool -Orientation#=6 -P`` rewrites one byte of a JPEG and sets the modification time
    back: same length, same mtime, now rotated. The next epoch must decode the rotated image (as
    a fresh loader and the Python engine do), not crop the stored pixels by the kept header."""
    import os
    import shutil

    from feedgpu import FolderSource

    (tmp_path / "a").mkdir()
    shutil.copy(CASES / "exif_orient_1.jpg", tmp_path / "a" / "x.jpg")
    shutil.copy(CASES / "ok_rgb.jpg", tmp_path / "a" / "y.jpg")
    rotated = (CASES / "exif_orient_6.jpg").read_bytes()

    def loader(engine):
        return DataLoader(pipe(FolderSource(tmp_path), [Decode(), ResizeCenterCrop(60, 48)], engine,
                               batch_size=2, shuffle=False, num_workers=0))

    dali = loader(DALI_CPU)
    upright = clone_all(dali)[0].images[0]
    f = tmp_path / "a" / "x.jpg"
    st = f.stat()
    assert len(rotated) == st.st_size
    with open(f, "r+b") as fh:
        fh.write(rotated)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    got = clone_all(dali)[0].images[0]
    want = clone_all(loader(DALI_CPU))[0].images[0]
    assert torch.equal(got, want), "the kept header was used for the rewritten file"
    assert_close(got[None], clone_all(loader("python"))[0].images[:1], VAL_TOL, "rotated")
    assert (got.float() - upright.float()).abs().mean() > 10


# -- hard inputs ---------------------------------------------------------------------------------------
def test_probe_routes_each_case_file():
    """The header probe: bad files raise (never sent to DALI); Pillow-only files and JPEGs cut
    short go to the Python decoder; plain JPEGs go to DALI with the size a viewer shows."""
    d = Decode()
    raises = {"empty.jpg": "empty", "html_named.jpg": "not an image", "bomb_20000x20000.png": "too many pixels"}
    python = {"cmyk_adobe.jpg", "ycck.jpg", "gray_alpha.png", "palette_trns.png", "rgba_transparent.png",
              "gray16.png", "png_named.jpg", "truncated.png", "truncated_half.jpg"}
    dali = {"ok_rgb.jpg", "gray.jpg", "corrupt_entropy.jpg", "tiny_1x1.jpg", "thin_1x500.jpg", "small_166.jpg",
            *(f"exif_orient_{k}.jpg" for k in range(1, 9))}
    assert set(raises) | python | dali == {p.name for p in CASES.iterdir()}
    for name, reason in raises.items():
        with pytest.raises(DecodeError) as info:
            d.probe((CASES / name).read_bytes())
        assert info.value.reason == reason, name
    for name in python:
        assert d.probe((CASES / name).read_bytes())[2] is False, name
    for name in dali:
        w, h, ok = d.probe((CASES / name).read_bytes())
        assert ok, name
        if name not in ("corrupt_entropy.jpg",):
            assert (w, h) == d.apply((CASES / name).read_bytes()).size, name
    assert d.probe((CASES / "exif_orient_6.jpg").read_bytes())[:2] == (240, 320)
    assert Decode(exif_orientation=False).probe((CASES / "exif_orient_6.jpg").read_bytes())[:2] == (320, 240)


@pytest.mark.filterwarnings("ignore:Truncated File Read:UserWarning")   # Pillow, on the cut EXIF block
@pytest.mark.parametrize("window", [True, False], ids=["window-decode", "whole-decode"])
def test_orientations_only_pillow_reads_are_decoded_as_on_the_python_engine(tmp_path, window):
    """A JPEG whose orientation is only in an XMP block (Pillow reads it; DALI's decoder reads
    EXIF only) and one whose EXIF IFD0 Pillow stops reading before the orientation tag: the DALI
    engine gives the Python engine's image. Before, the XMP-rotated photo came out unrotated from
    DALI (mean 57 levels off)."""
    import io
    import struct

    from PIL import Image

    from feedgpu import FolderSource

    def with_app1(data: bytes, payload: bytes) -> bytes:
        return data[:2] + struct.pack(">BBH", 0xFF, 0xE1, len(payload) + 2) + payload + data[2:]

    img = Image.open(CASES / "ok_rgb.jpg").convert("RGB")
    out = io.BytesIO()
    img.save(out, "JPEG")
    plain = out.getvalue()
    xmp = b"http://ns.adobe.com/xap/1.0/\x00" b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
    ifd = [(0x010F, 2, 20, struct.pack("<I", 5000)), (0x0112, 3, 1, struct.pack("<HH", 6, 0))]
    exif = (b"Exif\x00\x00II" + struct.pack("<HIH", 42, 8, len(ifd))
            + b"".join(struct.pack("<HHI", t, ty, n) + v for t, ty, n, v in ifd) + struct.pack("<I", 0))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "0_xmp.jpg").write_bytes(with_app1(plain, xmp))
    (tmp_path / "a" / "1_exif.jpg").write_bytes(with_app1(plain, exif))
    (tmp_path / "a" / "2_plain.jpg").write_bytes(plain)
    assert Image.open(tmp_path / "a" / "0_xmp.jpg").getexif().get(0x0112) == 6

    def run_on(engine):
        loader = DataLoader(pipe(FolderSource(tmp_path), [Decode(), ResizeCenterCrop(64, 48)], engine,
                                 batch_size=3, shuffle=False, num_workers=0))
        return cat(clone_all(loader))[0], loader.stats()

    py, _ = run_on("python")
    da, st = run_on({**DALI_CPU, "window_decode": window})
    assert py.shape == da.shape == (3, 48, 48, 3)
    assert_close(da, py, VAL_TOL, "orientation Pillow reads")
    assert st["engine"]["python_decoded"] == 2


@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
def test_cases_mixed_batches_on_dali(cases_datasets, fmt):
    """Every case file through DALI with on_error='skip': same skips and reasons as the Python
    engine, Pillow-decoded samples rejoin their batch, every row agrees with the Python engine."""
    src = open_format(fmt, cases_datasets[fmt])

    def go(engine):
        loader = DataLoader(pipe(src, val_stages(), engine, batch_size=8, seed=5, shuffle=False, on_error="skip",
                                 max_skipped=None))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = clone_all(loader)
        skips = [str(w.message) for w in caught if issubclass(w.category, SkippedSampleWarning)]
        others = [str(w.message) for w in caught if not issubclass(w.category, SkippedSampleWarning)]
        return out, loader.stats(), skips, others

    py, sp, wp, _ = go("python")
    da, sd, wd, other = go(DALI_CPU)
    assert not any("DALI failed" in m for m in other), other
    assert sd["skipped"] == sp["skipped"] and sd["skipped_keys"] == sp["skipped_keys"]
    assert sorted(wd) == sorted(wp)
    assert {"truncated", "not an image", "too many pixels"} <= set(sd["skipped"])
    eng = sd["engine"]
    assert eng.get("dali_errors", 0) == 0, "bad samples are found before DALI"
    assert eng["batches"] == len(da)
    assert 7 <= eng["python_decoded"] < len(src) // 2  # cmyk, ycck, png ...: Pillow; most JPEGs: DALI
    # crop-on-decode for upright JPEGs; EXIF-rotated ones (orientations 2-8) are decoded whole
    assert eng["window_decoded"] > eng["whole_decoded"] >= 7
    (pi, pl), (di, dl) = cat(py), cat(da)
    assert torch.equal(pl, dl) and di.shape == (len(src), 224, 224, 3)
    for r in range(len(src)):
        assert_close(pi[r:r + 1], di[r:r + 1], VAL_TOL, f"{fmt} row {r}")
    # EXIF orientations (rows in file order: no shuffle, skipped rows are refilled in place)
    keys = [src.key(i) for i in range(len(src))]
    rows = {k.rsplit("/", 1)[-1]: i for i, k in enumerate(keys) if "exif_orient_" in k}
    if fmt == "parquet":
        import pyarrow.parquet as pq

        rels = pq.read_table(src.files[0], columns=["key"]).column("key").to_pylist()
        rows = {r.split("/", 1)[1]: i for i, r in enumerate(rels) if "exif_orient_" in r}
    assert len(rows) == 8
    for name, r in rows.items():
        assert_close(pi[r:r + 1], di[r:r + 1], {"max": 2.0, "mean": 0.25}, name)
    assert not torch.equal(di[rows["exif_orient_1.jpg"]], di[rows["exif_orient_3.jpg"]])  # applied


def test_on_error_raise_names_the_file_on_dali(cases_datasets):
    src = open_format("folder", cases_datasets["folder"])
    bad = next(i for i in range(len(src)) if src.key(i).endswith("truncated_half.jpg"))
    good = next(i for i in range(len(src)) if src.labels[i] == 1)
    loader = DataLoader(pipe(src, val_stages(), DALI_CPU, batch_size=2, on_error="raise"), sampler=[good, bad])
    with pytest.raises(DecodeError) as info:
        list(loader)
    assert info.value.reason == "truncated" and info.value.key.endswith("cases/truncated_half.jpg")


# -- DALI failures --------------------------------------------------------------------------------------
def test_a_dali_failure_redoes_the_batch_on_python_and_dali_goes_on(indexed, monkeypatch):
    from nvidia.dali import Pipeline as DaliPipeline

    ref_py, _ = run(pipe(indexed, train_stages(True), seed=1))
    ref_dali, _ = run(pipe(indexed, train_stages(True), DALI_CPU, seed=1))
    real_outputs, calls = DaliPipeline.outputs, []

    def flaky(self, *a, **kw):  # the engine collects batches in order: the 2nd is batch 1
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("Critical error in pipeline:\nError in CPU operator `decoders.image`\nsimulated")
        return real_outputs(self, *a, **kw)

    monkeypatch.setattr(DaliPipeline, "outputs", flaky)
    loader = DataLoader(pipe(indexed, train_stages(True), DALI_CPU, seed=1))
    with pytest.warns(UserWarning, match=r"DALI failed on batch 1 of epoch 0 \(RuntimeError: Error in CPU "
                                         r"operator `decoders.image` simulated\); redone on the Python engine"):
        got = clone_all(loader)
    assert len(got) == len(ref_py)
    assert torch.equal(got[1].images, ref_py[1].images), "the failed batch is the Python engine's"
    assert torch.equal(got[1].labels, ref_py[1].labels)
    assert batches_equal(got[:1] + got[2:], ref_dali[:1] + ref_dali[2:]), "the other batches come from DALI"
    eng = loader.stats()["engine"]
    assert eng["dali_errors"] == 1 and eng["batches"] == len(ref_py) - 1
    # still usable: another epoch, all on DALI
    more = clone_all(loader)
    assert len(more) == len(ref_py) and loader.stats()["engine"]["dali_errors"] == 1



def test_a_dali_failure_while_scheduling_ahead_keeps_every_batch_in_its_place(indexed, monkeypatch):
    """DALI refuses batch 2 while batch 1 is being computed and batch 3 is also ready to go: the
    pipelines are rebuilt and batch 1 must be fed to the new ones before batch 3 (each pipeline
    returns outputs in feeding order). Before the fix batch 3 went in first and batches 1 and 3
    came out swapped."""
    from nvidia.dali import Pipeline as DaliPipeline

    import time

    from feedgpu.exec.dali import engine as dali_engine
    from feedgpu.exec.dali.engine import DaliWork

    ref_py, _ = run(pipe(indexed, train_stages(True), seed=1))
    ref_dali, _ = run(pipe(indexed, train_stages(True), DALI_CPU, seed=1))
    jobs, state = [], {"job": None, "failed": False}
    real_compute, real_schedule = DaliWork._compute, DaliWork._schedule
    real_run = DaliPipeline.schedule_run

    class InFlight(dali_engine._InFlight):  # batches in the order they are started
        def __init__(self, *a):
            super().__init__(*a)
            jobs.append(self)

    def compute(self, job):
        if len(jobs) > 1 and job is jobs[1]:  # batches 2 and 3 prepared by then: both go ahead
            deadline = time.monotonic() + 30
            while len(jobs) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            for j in jobs[2:4]:
                j.prepared.result(timeout=30)
        return real_compute(self, job)

    def schedule(self, job):
        state["job"] = job
        return real_schedule(self, job)

    def schedule_run(self, *a, **kw):
        if len(jobs) > 2 and state["job"] is jobs[2] and not state["failed"]:
            state["failed"] = True
            raise RuntimeError("simulated: DALI refused the batch")
        return real_run(self, *a, **kw)

    monkeypatch.setattr(dali_engine, "_InFlight", InFlight)
    monkeypatch.setattr(DaliWork, "_compute", compute)
    monkeypatch.setattr(DaliWork, "_schedule", schedule)
    monkeypatch.setattr(DaliPipeline, "schedule_run", schedule_run)
    loader = DataLoader(pipe(indexed, train_stages(True), DALI_CPU, seed=1, prefetch_factor=3))
    with pytest.warns(UserWarning, match="DALI failed on batch 2 of epoch 0"):
        got = clone_all(loader)
    assert state["failed"]
    print("MATRIX", [[int(torch.equal(g.images, r.images)) for r in ref_dali[:5]] for g in got[:5]])
    assert torch.equal(got[2].images, ref_py[2].images), "the refused batch is the Python engine's"
    for b in (0, 1, 3, 4):
        assert torch.equal(got[b].images, ref_dali[b].images), f"batch {b} holds another batch's pixels"
    assert batches_equal(got[:2] + got[3:], ref_dali[:2] + ref_dali[3:])

def test_a_jpeg_dali_cannot_decode_is_skipped_via_the_python_engine(cases_datasets, monkeypatch):
    """A JPEG cut short that reaches DALI anyway (the end-of-image check turned off here) makes
    DALI raise; the batch is redone on Python, which skips the file as truncated."""
    import feedgpu.stages.decode as dec

    monkeypatch.setattr(dec, "has_eoi", lambda data: True)
    src = open_format("folder", cases_datasets["folder"])
    bad = next(i for i in range(len(src)) if src.key(i).endswith("truncated_half.jpg"))
    goods = [i for i in range(len(src)) if src.labels[i] == 1][:7]
    order = goods[:3] + [bad] + goods[3:] + goods[:8]  # batch 0 holds the bad file, batch 1 does not

    def go(engine):
        loader = DataLoader(pipe(src, val_stages(), engine, batch_size=8, max_skipped=None), sampler=order)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = clone_all(loader)
        return out, loader.stats(), [str(w.message) for w in caught]

    py, sp, _ = go("python")
    da, sd, msgs = go(DALI_CPU)
    assert any("DALI failed on batch 0" in m for m in msgs), msgs
    assert sd["engine"]["dali_errors"] == 1 and sd["engine"]["batches"] == 1
    assert sd["skipped"] == sp["skipped"] and sd["skipped"]["truncated"] == 1
    assert batches_equal(da[:1], py[:1])
    assert_close(da[1].images, py[1].images, VAL_TOL, "batch 1 on DALI")


# -- configuration ---------------------------------------------------------------------------------------
VAL_YAML = REPO / "pipelines" / "imagenet_val.yaml"


def test_the_same_yaml_runs_on_either_engine(folder_ds):
    kw = {"source": {"path": str(folder_ds)}, "output.device": "cpu", "loader.batch_size": 40}
    py = Pipeline.from_yaml(VAL_YAML, **kw)
    da = Pipeline.from_yaml(VAL_YAML, engine={"name": "dali", "device": "cpu"}, **kw)
    assert py.engine.name == "python" and da.engine.name == "dali" and da.engine.device == "cpu"
    (pi, pl), (di, dl) = cat(run(py)[0]), cat(run(da)[0])
    assert torch.equal(pl, dl)
    assert_close(pi, di, VAL_TOL, "yaml")
    # a DataLoader argument switches the engine of the same pipeline
    loader = DataLoader(py, engine="dali")
    assert loader.engine_settings.name == "dali"
    next(iter(loader))
    assert loader.stats()["engine"]["name"] == "dali"
    loader.shutdown()
    # num_workers: auto: the balancer sizes DALI's threads, from one per core
    assert f"dali cpu (threads balanced, from {cpu_cores()})" in da.explain("cpu")
    assert "dali cpu (3 threads)" in Pipeline.from_yaml(VAL_YAML, **kw, **{"engine.name": "dali", "engine.device": "cpu",
                                                                         "engine.threads": 3}).explain("cpu")


@pytest.mark.parametrize("bad, words", [
    ({"name": "tensorrt"}, ["engine.name", "'python'", "'dali'"]),
    ({"device": "tpu"}, ["engine.device", "'auto'", "'cpu'", "'gpu'"]),
    ({"threads": 0}, ["engine.threads"]),
    ({"hw_decoder_load": 1.5}, ["engine.hw_decoder_load"]),
    ({"name": "dali", "exec": "async"}, ["engine", "allowed keys", "hw_decoder_load", "threads"]),
])
def test_bad_engine_values_in_yaml(folder_ds, bad, words):
    with pytest.raises(ConfigError) as info:
        Pipeline.from_yaml(VAL_YAML, source={"path": str(folder_ds)}, engine=bad)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("bad, words", [
    ("tensorrt", ["'tensorrt'", "python", "dali"]),
    ({"name": "dali", "device": "tpu"}, ["'tpu'", "auto", "cpu", "gpu"]),
    ({"name": "dali", "threads": 0}, ["threads"]),
    ({"name": "dali", "speed": 1}, ["speed", "allowed"]),
])
def test_bad_engine_values_to_the_loader(indexed, bad, words):
    with pytest.raises(ConfigError) as info:
        DataLoader(pipe(indexed, val_stages()), engine=bad)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def _sharpen(img):
    return img


def test_a_python_stage_cannot_run_on_dali(indexed, tmp_path):
    stages = [Decode(), PythonStage(_sharpen, name="my_sharpen"), ResizeCenterCrop(64, 64)]
    # refused when the pipeline is made, not at the first batch
    with pytest.raises(ConfigError, match=r"engine 'dali' cannot run these stages: python \(my_sharpen\).*engine: python"):
        pipe(indexed, stages, DALI_CPU)
    # and when a DataLoader switches a Python-engine pipeline to DALI
    with pytest.raises(ConfigError, match="my_sharpen"):
        DataLoader(pipe(indexed, stages), engine=DALI_CPU)
    # from YAML too, naming the stage
    data = yaml.safe_load(VAL_YAML.read_text())
    data["stages"].insert(1, {"op": "python", "fn": "test_dali:_sharpen", "name": "sharpen_yaml"})
    data["engine"] = {"name": "dali", "device": "cpu"}
    f = tmp_path / "custom.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="sharpen_yaml"):
        Pipeline.from_yaml(f, source={"path": "unused"})
    # the same file on the Python engine is fine
    Pipeline.from_yaml(f, source={"path": "unused"}, engine={"name": "python"}).plan("cpu")


def test_cache_and_dali_are_refused(indexed, tmp_path):
    with pytest.raises(ConfigError, match="cache and engine 'dali'"):
        DataLoader(pipe(indexed, [Decode(), Resize(64), RandomResizedCrop(32)], DALI_CPU, cache=str(tmp_path)))


def test_explain_shows_the_dali_engine(folder_ds):
    from click.testing import CliRunner

    from feedgpu.cli.main import main

    res = CliRunner().invoke(main, ["pipeline", "explain", str(VAL_YAML), "--data", str(folder_ds), "--device", "cpu",
                                    "--set", "engine.name=dali", "--set", "engine.device=cpu"])
    assert res.exit_code == 0, res.output
    assert f"dali cpu (threads balanced, from {cpu_cores()})" in res.stdout
    for stage in ("decode", "resize_center_crop", "normalize"):
        line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith(stage))
        assert f"dali cpu (threads balanced, from {cpu_cores()})" in line, line
    res = CliRunner().invoke(main, ["pipeline", "explain", str(VAL_YAML), "--device", "cpu",
                                    "--set", "engine.name=dali", "--set", "engine.device=cpu",
                                    "--set", "engine.threads=4"])
    assert res.exit_code == 0 and "dali cpu (4 threads)" in res.stdout


# -- on a GPU (skipped here) -----------------------------------------------------------------------------
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@pytest.mark.parametrize("kind", ["val", "train"])
@pytest.mark.parametrize("norm", [False, True], ids=["uint8", "float32"])
@pytest.mark.gpu
@requires_cuda
def test_dali_gpu_agrees_with_dali_cpu(indexed, kind, norm):
    stages = (lambda: val_stages(norm)) if kind == "val" else (lambda: train_stages(norm))
    cpu, _ = run(pipe(indexed, stages(), DALI_CPU, seed=3))
    loader = DataLoader(Pipeline(indexed, stages(), batch_size=16, seed=3, device="cuda",
                                 engine={"name": "dali", "device": "gpu"}))
    got = [(b.images, b.labels) for b in loader]
    assert len(got) == len(cpu)
    for (gi, gl), c in zip(got, cpu):
        assert gi.is_cuda and gi.dtype == c.images.dtype and gi.shape == c.images.shape
        assert torch.equal(gl.cpu(), c.labels)
    gi = torch.cat([g.cpu() for g, _ in got])
    # nvJPEG/hardware decode and GPU resampling vs libjpeg-turbo and CPU resampling
    assert_close(gi, cat(cpu)[0], {"mean": 1.0, "sample_mean": 2.0, "share_over_2": 0.05}, f"gpu {kind}")
    eng = loader.stats()["engine"]
    assert eng["device"] == "gpu" and eng.get("dali_errors", 0) == 0


@pytest.mark.gpu
@requires_cuda
def test_dali_gpu_cases_and_fallback(cases_datasets):
    src = open_format("folder", cases_datasets["folder"])
    loader = DataLoader(Pipeline(src, val_stages(True), batch_size=8, shuffle=False, device="cuda",
                                 engine={"name": "dali", "device": "gpu"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [b.images.cpu() for b in loader]
    cpu, st = run(pipe(src, val_stages(True), DALI_CPU, batch_size=8, shuffle=False))
    assert loader.stats()["skipped"] == st["skipped"]
    assert loader.stats()["engine"]["python_decoded"] >= 7
    assert_close(torch.cat(got), cat(cpu)[0], {"mean": 1.0, "sample_mean": 3.0}, "gpu cases")


def test_bench_compares_engines_side_by_side(folder_ds, tmp_path):
    """``feedgpu bench --engine``: each engine in the same rounds; dali-gpu is skipped without CUDA."""
    import json

    from click.testing import CliRunner

    from feedgpu.cli.main import main

    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", "--data", str(folder_ds), "--batches", "2", "--rounds", "2",
                                    "--workers", "1", "--batch-size", "8", "--warmup", "1", "--engine", "python",
                                    "--engine", "dali-cpu", "--engine", "dali-gpu", "--no-baseline",
                                    "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    want = {"feedgpu", "feedgpu_dali_cpu"} | ({"feedgpu_dali_gpu"} if torch.cuda.is_available() else set())
    assert set(doc["summary"]) == want
    assert [r["loader"] for r in doc["runs"]] == [k for k in doc["settings"]["loaders"]] * 2  # alternating rounds
    dali = doc["summary"]["feedgpu_dali_cpu"]
    assert dali["label"] == "feedgpu DALI CPU (1 thread)" and dali["threads"] == 1 and dali["samples_per_s"] > 0
    assert doc["summary"]["feedgpu"]["workers"] == 1
    run = next(r for r in doc["runs"] if r["loader"] == "feedgpu_dali_cpu")
    assert run["engine"]["name"] == "dali" and set(run["stage_ms_per_sample"]) >= {"read", "probe", "params", "dali"}
    assert doc["speedups"]["feedgpu_dali_cpu_over_feedgpu"] > 0
    if not torch.cuda.is_available():
        assert "dali-gpu skipped: torch sees no CUDA device" in res.output
    assert "feedgpu DALI CPU (1 thread)" in res.stdout


@pytest.mark.gpu
@requires_cuda
def test_dali_gpu_auto_threads_change_nothing_in_the_batches(indexed):
    """On the GPU engine the balancer's thread changes rebuild DALI's pipelines between batches;
    the batches equal a fixed thread count's, bit for bit, and the engine reports dali-gpu."""
    from feedgpu.balancer import Decision

    gpu = {"name": "dali", "device": "gpu"}
    ref = DataLoader(Pipeline(indexed, train_stages(True), batch_size=8, seed=6, device="cuda",
                              engine={**gpu, "threads": 2}))
    want = [(b.images.cpu(), b.labels.clone()) for b in ref]
    ref.shutdown()
    loader = DataLoader(Pipeline(indexed, train_stages(True), batch_size=8, seed=6, device="cuda", engine=gpu,
                                 num_workers="auto"))
    a = loader.balancer
    assert a.engine == "dali-gpu"
    a.window_s, a.min_batches, a._skip = 0.0, 1, 0
    plan = iter([(3, 1), (1, 1), (4, 2)] * 20)
    a.policy.decide = lambda m: Decision(*next(plan), "add", "test", t=m.t, engine=m.engine)
    got = [(b.images.cpu(), b.labels.clone()) for b in loader]
    assert len(got) == len(want) and all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
                                         for g, w in zip(got, want))
    assert loader.stats()["engine"]["rebuilds"] >= 3
    loader.shutdown()
