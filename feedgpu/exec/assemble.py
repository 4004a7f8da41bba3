"""Fill one batch buffer from a list of sample indices: read, run the per-sample stages, write.

This is the work a pool worker does per task, and what ``num_workers=0`` does in the main
process. Bad samples (:class:`SampleError`) are skipped and replaced by spares (reported back),
or raised with ``on_error="raise"``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import SampleError, SkipBudgetExceeded, StageError
from ..sources.base import Source
from .cache_step import CacheStep
from .pixels import batch_row
from .plan import Plan
from .steps import Sample, sample_steps


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
    """Runs a plan's CPU part for one batch at a time: each sample through the plan's steps
    (:func:`~feedgpu.exec.steps.sample_steps`: read, the sample stages, and with a cache its
    lookup and store at the cut), then into its row of the batch (the batch stage's ``write``,
    or a copy of the uint8 pixels).

    Args:
        source: where records come from.
        plan: stages and specs (see :func:`~feedgpu.exec.plan.make_plan`).
        seed: base seed; random stages draw from ``stage_random(stage, seed, epoch, index, draw key)``
            (the key: ``plan.draw_ids``).
        on_error: ``"skip"`` (replace bad samples with spares) or ``"raise"``.
        cache: a :class:`~feedgpu.exec.cache_step.CacheStep` at ``plan.cache_cut``, or an open
            :class:`~feedgpu.cache.store.CacheEntry` (then one is made), or None.
    """

    def __init__(self, source: Source, plan: Plan, seed: int, on_error: str = "skip", cache=None):
        self.source, self.plan, self.seed, self.on_error = source, plan, int(seed), on_error
        if cache is not None and not isinstance(cache, CacheStep):
            cache = CacheStep(cache, plan.cache_cut)
        self.cache = cache
        self.steps = sample_steps(source, plan, self.seed, cache)
        self._begin = [st.begin for st in self.steps if hasattr(st, "begin")]
        self.names = ["read", "cache"] + [s.name for s in plan.sample_stages] + ["write"]
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
        for begin in self._begin:
            begin(epoch)
        supply = Spares(spares, self.on_error, rep.skipped, len(indices))
        remote = getattr(self.source, "remote", None)
        try:
            for j, idx in enumerate(indices.tolist()):
                labels[j] = supply.run(lambda i: self._one(images, j, i, epoch, rep.stage_seconds), idx)
        except Exception as e:
            if remote is not None:   # a failed batch's retries and failures count too
                from ..remote.ahead_loader import process_counters

                e.feedgpu_network = process_counters(remote.cache)
            raise
        rep.rows = len(indices)
        if remote is not None:   # the shard cache's counters travel back with the batch
            from ..remote.ahead_loader import process_counters

            rep.network = process_counters(remote.cache)
        return rep

    def _one(self, images: np.ndarray, j: int, idx: int, epoch: int, secs: dict) -> int:
        s = Sample(idx)
        for step in self.steps:
            step.run(s, epoch, secs)
        t0 = time.perf_counter()
        arr = batch_row(s.x)
        if arr.shape != self.want or arr.dtype != np.uint8:
            last = self.plan.sample_stages[-1].name if self.plan.sample_stages else "source"
            raise StageError(f"stage {last!r} gave {arr.dtype} {arr.shape} for {s.key or self.source.key(idx)}; "
                             f"the batch needs uint8 {self.want}")
        if self.writer is not None:
            self.writer.write(images[j], arr)
        else:
            images[j] = arr
        secs["write"] += time.perf_counter() - t0
        return s.label
