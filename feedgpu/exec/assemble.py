"""Fill one batch buffer from a list of sample indices: read, run the per-sample stages, write.

This is the work a pool worker does per task, and what ``num_workers=0`` does in the main
process. Bad samples (:class:`SampleError`) are skipped and replaced by spares (reported back),
or raised with ``on_error="raise"``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from ..errors import DecodeError, SampleError, SkipBudgetExceeded, StageError
from ..sources.base import Source
from ..stages.base import stage_random
from .plan import Plan
from . import progress
from .pixels import rgb_array, rgb_image


@dataclass
class BatchReport:
    """What a filled batch tells the loader: rows written, skips, seconds per stage."""

    rows: int = 0
    skipped: list = field(default_factory=list)          # [(key, reason, detail)]
    stage_seconds: dict = field(default_factory=dict)    # {"read": s, "decode": s, ...}
    network: tuple | None = None   # a remote source: (process, its ShardCache.counters()), else None


class Spares:
    """Replaces bad samples of one batch: ``run(fn, idx)`` returns ``fn(idx)``; when it raises
    :class:`SampleError` the sample is recorded in ``skipped`` (``on_error="skip"``) and the next
    spare index is tried, or the error is raised (``on_error="raise"``). A bad sample is recorded
    once per batch, however often it comes up (as a sample and as spares, or as several spares),
    and is not read again in the batch. Raises :class:`SkipBudgetExceeded` when the spares run
    out; its message counts distinct bad samples."""

    def __init__(self, spares: np.ndarray, on_error: str, skipped: list, batch_len: int):
        self._it = iter(spares.tolist())
        self.n, self.on_error, self.skipped, self.batch_len = len(spares), on_error, skipped, batch_len
        self._bad: set[int] = set()       # indices found bad in this batch
        self._keys: set[str] = set()      # their keys, recorded once

    def run(self, fn, idx: int):
        last = None
        while True:
            if idx not in self._bad:
                try:
                    return fn(idx)
                except SampleError as e:
                    if self.on_error == "raise":
                        raise
                    self._bad.add(idx)
                    last = e
                    if e.key not in self._keys:
                        self._keys.add(e.key)
                        self.skipped.append((e.key, e.reason, e.detail))
            idx = next(self._it, None)
            if idx is None:
                raise SkipBudgetExceeded(
                    f"{len(self._keys)} bad sample(s) in one batch of {self.batch_len} used up its "
                    f"{self.n} spares; last: {last or 'a sample found bad earlier in the batch'}") from None



def source_indices(indices: np.ndarray, n: int) -> np.ndarray:
    """A batch's indices into a source of ``n`` samples, as a Python sequence takes them: a
    negative index ``-n <= i < 0`` is ``i + n`` (so the sample, its label and its random draws
    are those of ``i + n``).

    Raises ``TypeError`` for a non-integral index and ``IndexError`` for one out of range (a
    user's sampler gave it), naming it: the batch fails as torch's would on ``dataset[i]``."""
    if indices.dtype.kind not in "iu":
        bad = next((k for k in indices.tolist() if not isinstance(k, int)), None)
        raise TypeError(f"pipeline indices must be integers, got {bad!r} ({type(bad).__name__}) from the sampler")
    out = indices.astype(np.int64, copy=False)
    wrong = (out < -n) | (out >= n)
    if wrong.any():
        raise IndexError(f"index {int(out[wrong][0])} from the sampler is out of range for the pipeline's "
                         f"{n} samples")
    return np.where(out < 0, out + n, out) if (out < 0).any() else out

class Assembler:
    """Runs a plan's CPU part for one batch at a time.

    Args:
        source: where records come from.
        plan: stages and specs (see :func:`~feedgpu.exec.plan.make_plan`).
        seed: base seed; random stages draw from ``stage_random(stage, seed, epoch, index, draw key)``
            (the key: ``plan.draw_ids``).
        on_error: ``"skip"`` (replace bad samples with spares) or ``"raise"``.
    """

    def __init__(self, source: Source, plan: Plan, seed: int, on_error: str = "skip", cache=None):
        self.source, self.plan, self.seed, self.on_error = source, plan, int(seed), on_error
        self.cache = cache  # a CacheEntry holding the output of the first plan.cache_prefix stages
        self.prefix = plan.cache_prefix if cache is not None else 0
        self.stages = plan.sample_stages
        self.names = ["read", "cache"] + [s.name for s in self.stages] + ["write"]
        self.writer = None if plan.batch_on_device else plan.batch_stage
        self.want = (plan.pool_spec.height, plan.pool_spec.width, 3)

    def fill(self, images: np.ndarray, labels: np.ndarray, indices: np.ndarray,
             spares: np.ndarray, epoch: int) -> BatchReport:
        """Write ``len(indices)`` samples into ``images[:n]`` / ``labels[:n]``.

        Raises :class:`SampleError` (``on_error="raise"``), :class:`StageError` for a stage
        bug, :class:`SkipBudgetExceeded` when the batch runs out of spares, and ``IndexError`` /
        ``TypeError`` for an index a user's sampler gave that the source does not hold (see
        :func:`source_indices`).
        """
        indices = source_indices(indices, len(self.source))
        rep = BatchReport(stage_seconds=dict.fromkeys(self.names, 0.0))
        if self.cache is not None:
            self.cache.refresh()
        supply = Spares(spares, self.on_error, rep.skipped, len(indices))
        for j, idx in enumerate(indices.tolist()):
            labels[j] = supply.run(lambda i: self._one(images, j, i, epoch, rep.stage_seconds), idx)
        rep.rows = len(indices)
        remote = getattr(self.source, "remote", None)
        if remote is not None:   # the shard cache's counters travel back with the batch
            from ..remote.ahead_loader import process_counters

            rep.network = process_counters(remote.cache)
        return rep

    def _one(self, images: np.ndarray, j: int, idx: int, epoch: int, secs: dict) -> int:
        t0 = time.perf_counter()
        x, start = None, 0
        cache = self.cache
        if cache is not None:
            q = cache.quarantined.get(idx)
            if q is not None:
                raise DecodeError(q[0], q[1], "quarantined in the cache")
            pixels = cache.get(idx)
            if pixels is not None:
                key, label = None, cache.label(idx)
                x = rgb_image(pixels)
                start = self.prefix
        if x is None:
            progress.at("read", idx)
            try:
                rec = self.source.read(idx)
            except OSError as e:
                raise SampleError(self.source.key(idx), "unreadable", str(e)) from None
            x, key, label = rec.payload, rec.key, rec.label
        t1 = time.perf_counter()
        secs["read" if start == 0 else "cache"] += t1 - t0
        for pos in range(start, len(self.stages)):
            st = self.stages[pos]
            rng = stage_random(st, self.seed, epoch, idx, self.plan.draw_ids[pos])
            progress.at(getattr(st, "label", st.name), idx)
            try:
                x = st.apply(x, rng)
            except SampleError as e:
                key = key or self.source.key(idx)
                if cache is not None and pos < self.prefix and isinstance(e, DecodeError):
                    cache.quarantine(idx, key, e.reason)
                raise type(e)(key, e.reason, e.detail) from None
            except Exception as e:
                label_ = getattr(st, "label", st.name)
                raise StageError(f"stage {pos} ({label_}) failed on {key or self.source.key(idx)}: "
                                 f"{type(e).__name__}: {e}") from e
            t2 = time.perf_counter()
            secs[st.name] += t2 - t1
            t1 = t2
            if cache is not None and pos + 1 == self.prefix:
                # the stages after the cache get what a cache hit gives them: a PIL RGB image
                if isinstance(x, Image.Image):
                    x = _rgb(x)
                    cache.put(idx, key, label, rgb_array(x))
                else:  # a prefix that returns arrays
                    pixels = np.ascontiguousarray(x)
                    cache.put(idx, key, label, pixels)
                    x = rgb_image(pixels)
                t1 = time.perf_counter()
                secs["cache"] += t1 - t2
        x = _rgb(x)
        arr = rgb_array(x) if isinstance(x, Image.Image) else np.asarray(x)
        if arr.shape != self.want or arr.dtype != np.uint8:
            last = self.stages[-1].name if self.stages else "source"
            raise StageError(f"stage {last!r} gave {arr.dtype} {arr.shape} for {key or self.source.key(idx)}; "
                             f"the batch needs uint8 {self.want}")
        if self.writer is not None:
            self.writer.write(images[j], arr)
        else:
            images[j] = arr
        secs["write"] += time.perf_counter() - t1
        return label


def _rgb(x):
    return x.convert("RGB") if isinstance(x, Image.Image) and x.mode != "RGB" else x
