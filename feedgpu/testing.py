"""Checks for people who write stages and pipelines, to call from their own tests.

Each check runs real loaders over a real :class:`~feedgpu.Pipeline` and raises
``AssertionError`` naming the first difference it finds; it returns what it compared, so a test
can say more. They hold on a busy machine: nothing is timed.

* :func:`check_resume`: a loader state saved after any batch of an epoch, loaded by a new loader
  with another worker count, gives exactly the batches that would have come (bit-equal pixels,
  equal labels), and no sample is lost or repeated. A random stage that draws from anything but
  the ``rng`` it is given (``random``, global ``numpy.random``, the time) fails it.
* :func:`check_engines_agree`: the Python and DALI (CPU) engines give the same labels in the same
  order and pixels within a tolerance (the two engines decode and resample with their own code,
  so pixels are close, not equal). A stage whose DALI implementation draws or computes
  differently from its Pillow one fails it.
* :func:`check_conservation`: one epoch delivers every sample of the source once with the label
  the source gives it, or the loader counts it as skipped.
* :func:`check_cache_agrees`: batches with the pixel cache are bit-equal to those without it,
  for samples the cache is filled with (misses) and those read from it (hits). A stage after
  the cache that declares ``takes_arrays`` but treats an array otherwise than the PIL image of
  it fails it.

Example (pytest)::

    from feedgpu import Pipeline
    from feedgpu.testing import check_engines_agree, check_resume

    def test_my_blur_resumes_and_agrees(tmp_path):
        pipe = Pipeline({"format": "folder", "path": "data/small"}, [Decode(), Blur(2), RandomResizedCrop(64)],
                        batch_size=8, seed=3, device="cpu")
        check_resume(pipe)
        check_engines_agree(pipe)
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

__all__ = ["check_cache_agrees", "check_conservation", "check_engines_agree", "check_resume", "epoch_batches"]

#: The DALI engine on the CPU, as :func:`check_engines_agree` runs it by default.
DALI_CPU = {"name": "dali", "device": "cpu"}


def epoch_batches(loader, epoch: int | None = None) -> list[tuple[Any, Any]]:
    """``[(images, labels), ...]`` of one epoch of ``loader`` (``set_epoch(epoch)`` first when
    given), each tensor cloned out of the loader's reusable buffers."""
    if epoch is not None:
        loader.set_epoch(epoch)
    out = []
    for b in loader:
        images, labels = b[0], b[1]
        out.append((images.clone(), labels.clone()))
    return out


def _loader(pipeline, **kwargs):
    from .loader.front import DataLoader

    return DataLoader(pipeline, **kwargs)


def _diff(want: list, got: list, what: str) -> str | None:
    """The first batch where ``got`` differs from ``want`` (bit-equal images, equal labels)."""
    import torch

    if len(got) != len(want):
        return f"{what}: {len(got)} batches instead of {len(want)}"
    for i, ((wi, wl), (gi, gl)) in enumerate(zip(want, got)):
        if not torch.equal(wl, gl):
            return f"{what}: batch {i} has labels {gl.tolist()} instead of {wl.tolist()}"
        if wi.shape != gi.shape or wi.dtype != gi.dtype:
            return f"{what}: batch {i} is {tuple(gi.shape)} {gi.dtype} instead of {tuple(wi.shape)} {wi.dtype}"
        if not torch.equal(wi, gi):
            d = (wi.double() - gi.double()).abs()
            return f"{what}: batch {i} pixels differ (max {d.max().item():.4g}, {int((d > 0).sum())} values)"
    return None


def _steps(n: int, steps: Sequence[int] | None) -> list[int]:
    if steps is not None:
        bad = [k for k in steps if not 0 <= k <= n]
        if bad:
            raise ValueError(f"steps {bad} outside 0..{n} (the epoch has {n} batches)")
        return sorted(set(steps))
    if n <= 8:
        return list(range(n + 1))
    return sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 1, n})


def check_resume(pipeline, *, epoch: int = 1, workers: Sequence[int] = (0, 2),
                 steps: Sequence[int] | None = None, **loader_kwargs) -> dict:
    """Save a loader's state after ``k`` batches of epoch ``epoch`` for each ``k`` in ``steps``
    and resume it in a new loader with another worker count: head + tail must equal the epoch
    of an uninterrupted loader, batch for batch (``torch.equal``); a state saved after the last
    batch must start the next epoch as the uninterrupted loader does.

    Args:
        pipeline: a :class:`~feedgpu.Pipeline` (or anything ``feedgpu.DataLoader`` takes).
        epoch: the epoch checked (default 1: not the first, so the epoch's seed is exercised).
        workers: worker counts; the state saved with ``workers[i]`` is loaded with
            ``workers[(i + 1) % len(workers)]`` (default ``(0, 2)``: the main process, then a pool).
        steps: batches taken before saving (default: every one for epochs of up to 8 batches,
            else 0, 1, a quarter, half, three quarters, the last and the end).
        **loader_kwargs: more ``DataLoader`` keywords (``engine=``, ``drop_last=``...).

    Returns:
        ``{"batches": n, "checked": [(k, saved_with, loaded_with), ...]}``.

    Raises:
        AssertionError: naming the step, the worker counts and the first batch that differs.
        ValueError: a step outside ``0..n`` or no worker count.
    """
    if not workers:
        raise ValueError("workers: give at least one worker count")
    ref_loader = _loader(pipeline, num_workers=workers[0], **loader_kwargs)
    reference = epoch_batches(ref_loader, epoch)
    following = epoch_batches(ref_loader, epoch + 1)   # a state saved at the end starts the next epoch
    ref_loader.shutdown()
    n = len(reference)
    checked = []
    for j, k in enumerate(_steps(n, steps)):
        saved_with = workers[j % len(workers)]
        loaded_with = workers[(j + 1) % len(workers)]
        first = _loader(pipeline, num_workers=saved_with, **loader_kwargs)
        first.set_epoch(epoch)
        head = []
        it = iter(first)
        for _ in range(k):
            b = next(it)
            head.append((b[0].clone(), b[1].clone()))
        state = first.state_dict()
        del it
        first.shutdown()
        again = _loader(pipeline, num_workers=loaded_with, **loader_kwargs)
        again.load_state_dict(state)
        tail = epoch_batches(again)
        again.shutdown()
        want = reference + following if k == n else reference
        problem = _diff(want, head + tail,
                        f"resumed after batch {k} of {n} (saved with {saved_with} workers, loaded with {loaded_with})")
        if problem:
            raise AssertionError(problem)
        checked.append((k, saved_with, loaded_with))
    return {"batches": n, "checked": checked}


def check_engines_agree(pipeline, *, engines: Sequence[Any] = ("python", DALI_CPU), epoch: int = 0,
                        mean_tol: float = 3.0 / 255, max_tol: float | None = None, num_workers: int = 0,
                        **loader_kwargs) -> dict:
    """One epoch on each engine: the same number of batches, equal labels in the same order,
    and pixels close to the first engine's.

    Args:
        pipeline: a :class:`~feedgpu.Pipeline`.
        engines: engine settings as ``DataLoader(engine=...)`` takes them (default: the Python
            engine, then DALI on the CPU).
        epoch: the epoch compared.
        mean_tol: largest mean absolute difference per batch, as a share of the reference
            batch's value range (default 3/255: three levels of a uint8 image).
        max_tol: largest single difference, the same units; ``None`` (default) for no bound
            (the engines' resamplers differ most on edges).
        num_workers: worker count of every loader (default 0).
        **loader_kwargs: more ``DataLoader`` keywords.

    Returns:
        ``{"batches": n, "mean": {engine: worst batch mean share}, "max": {...}}``.

    Raises:
        AssertionError: naming the engine, the batch and the figure over its bound.
        ImportError: the DALI engine asked for without NVIDIA DALI installed.
    """
    runs = []
    for engine in engines:
        loader = _loader(pipeline, engine=engine, num_workers=num_workers, **loader_kwargs)
        runs.append((engine, epoch_batches(loader, epoch)))
        loader.shutdown()
    (ref_engine, ref), out = runs[0], {"batches": len(runs[0][1]), "mean": {}, "max": {}}
    for engine, got in runs[1:]:
        name = engine if isinstance(engine, str) else "-".join(str(v) for v in dict(engine).values())
        if len(got) != len(ref):
            raise AssertionError(f"{name}: {len(got)} batches, {ref_engine!r}: {len(ref)}")
        worst_mean = worst_max = 0.0
        for i, ((ri, rl), (gi, gl)) in enumerate(zip(ref, got)):
            if rl.tolist() != gl.tolist():
                raise AssertionError(f"{name}: batch {i} labels {gl.tolist()}, {ref_engine!r}: {rl.tolist()}")
            if ri.shape != gi.shape:
                raise AssertionError(f"{name}: batch {i} is {tuple(gi.shape)}, {ref_engine!r}: {tuple(ri.shape)}")
            r, g = ri.double(), gi.double()
            span = max(float(r.max() - r.min()), 1e-12)
            d = (r - g).abs()
            mean, big = float(d.mean()) / span, float(d.max()) / span
            worst_mean, worst_max = max(worst_mean, mean), max(worst_max, big)
            if mean > mean_tol:
                raise AssertionError(f"{name}: batch {i} differs from {ref_engine!r} by {mean:.4f} of the value "
                                     f"range on average (bound {mean_tol:.4f})")
            if max_tol is not None and big > max_tol:
                raise AssertionError(f"{name}: batch {i} differs from {ref_engine!r} by up to {big:.4f} of the "
                                     f"value range (bound {max_tol:.4f})")
        out["mean"][name], out["max"][name] = worst_mean, worst_max
    return out


def check_conservation(pipeline, *, epoch: int = 0, **loader_kwargs) -> dict:
    """One epoch delivers each sample of ``pipeline.source`` once with its label, except the
    samples the loader counts as skipped (whose rows are refilled from spares, so the extra
    deliveries must equal the skip count).

    Returns:
        ``{"delivered": n, "skipped": samples skipped while loading}``.

    Raises:
        AssertionError: a label delivered more (or fewer) times than the source holds it, beyond
            what the skips (and ``drop_last``'s short batch) explain. One rank; labels stand for
            samples, so a check over a source whose labels repeat is a check of counts per label.
    """
    loader = _loader(pipeline, **loader_kwargs)
    got = Counter()
    for _, labels in epoch_batches(loader, epoch):
        got.update(labels.tolist())
    stats, dropped = loader.stats(), (loader.batch_size - 1 if loader.drop_last else 0)
    loader.shutdown()
    want = Counter(int(v) for v in pipeline.source.labels.tolist())
    skipped = stats["skipped_total"] - stats["skipped_while_indexing"]   # those are not in the source
    missing, extra = want - got, got - want
    if sum(missing.values()) > skipped + dropped:
        raise AssertionError(f"labels delivered too few times: {dict(missing)} (skipped: {skipped})")
    if sum(extra.values()) > skipped:
        raise AssertionError(f"labels delivered too many times: {dict(extra)} (skipped: {skipped})")
    return {"delivered": sum(got.values()), "skipped": skipped}


def check_cache_agrees(pipeline, cache_dir, *, epochs: int = 2, num_workers: int = 0, **loader_kwargs) -> dict:
    """Epochs ``0..epochs-1`` with the pixel cache off, then with a cache in ``cache_dir`` (the
    first epoch fills it: every sample a miss; the others read it: every sample a hit), then
    epoch ``epochs - 1`` again by a new loader (hits in a new process): bit-equal pixels, equal
    labels, every time.

    Args:
        pipeline: a :class:`~feedgpu.Pipeline` whose stages begin with a deterministic prefix.
        cache_dir: an empty folder (the cache root; it must not hold an entry of this pipeline).
        epochs: epochs compared (at least 2: one filling, one reading).
        num_workers: for the cached loaders (the reference runs in the main process).
        **loader_kwargs: more ``DataLoader`` keywords (``drop_last`` is False unless given: the
            first epoch must visit every sample for the next to read them all).

    Returns:
        ``{"epochs": epochs, "batches": per epoch, "cached": samples the cache holds}``.

    Raises:
        AssertionError: naming the epoch and the first batch that differs, or when an epoch
            after the first decoded images (the cache was not read).
        ValueError: ``epochs`` below 2.
    """
    if epochs < 2:
        raise ValueError("epochs: at least 2 (one fills the cache, the next reads it)")
    loader_kwargs.setdefault("drop_last", False)
    ref = _loader(pipeline, num_workers=0, cache=False, **loader_kwargs)
    want = [epoch_batches(ref, e) for e in range(epochs)]
    ref.shutdown()
    runs = [("filled", range(epochs)), ("read by a new loader", [epochs - 1])]
    cached = 0
    for what, which in runs:
        loader = _loader(pipeline, num_workers=num_workers, cache={"dir": str(cache_dir)}, **loader_kwargs)
        decoded = 0.0
        for e in which:
            got = epoch_batches(loader, e)
            spent = loader.stats()["stage_s"].get("decode", 0.0)
            kind = "misses" if what == "filled" and e == 0 else "hits"
            if kind == "hits" and spent > decoded:
                raise AssertionError(f"cache {what}, epoch {e}: images were decoded; the cache was not read")
            decoded = spent
            problem = _diff(want[e], got, f"cache {what}, epoch {e} ({kind})")
            if problem:
                raise AssertionError(problem)
        cached = loader.stats()["cache"]["cached"]
        loader.shutdown()
    return {"epochs": epochs, "batches": len(want[0]), "cached": cached}
