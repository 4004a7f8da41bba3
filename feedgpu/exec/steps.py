"""The steps one sample goes through in the CPU pool: read it, run each sample stage and, with a
cache, look it up before and store it at the cut (:class:`CachedSteps`).

:func:`sample_steps` lays a plan out as a list of steps; :class:`~feedgpu.exec.assemble.Assembler`
runs that list for each sample, the same way with a cache or without. Each step has ``run(s,
epoch, secs)``: it changes the :class:`Sample` ``s`` and adds its seconds to ``secs`` (by
stage name, ``"read"`` and ``"cache"``); a step with a ``begin(epoch)`` is told each batch.
"""
from __future__ import annotations

import time

from PIL import Image

from ..errors import DecodeError, SampleError, StageError
from ..stages.base import SampleStage, stage_random
from . import progress
from .pixels import Pixels

__all__ = ["CachedSteps", "ReadStep", "Sample", "StageStep", "WindowDecodeStep", "sample_steps", "window_pair"]


class Sample:
    """One sample between steps: its source ``index``, ``key`` (None until read: a cache hit
    does not read it), ``label`` and ``x``, what the last step made (bytes, a PIL image, an
    array or a :class:`~feedgpu.exec.pixels.Pixels`)."""

    __slots__ = ("index", "key", "label", "x")

    def __init__(self, index: int):
        self.index, self.key, self.label, self.x = index, None, None, None


class ReadStep:
    """Read the record from the source. An ``OSError`` becomes a skippable
    :class:`SampleError` (``"unreadable"``)."""

    def __init__(self, source):
        self.source = source

    def run(self, s: Sample, epoch: int, secs: dict) -> None:
        t0 = time.perf_counter()
        progress.at("read", s.index)
        try:
            rec = self.source.read(s.index)
        except OSError as e:
            raise SampleError(self.source.key(s.index), "unreadable", str(e)) from None
        s.x, s.key, s.label = rec.payload, rec.key, rec.label
        secs["read"] += time.perf_counter() - t0


class StageStep:
    """Run sample stage number ``pos`` with its per-sample randomness.

    A :class:`Pixels` input is given as the stage takes it: the array (or the image when there
    is no array) to a stage that ``takes_arrays``, whose result stays ``Pixels``; the PIL image
    to any other. A :class:`SampleError` is raised again with the sample's key; any other
    exception becomes a :class:`StageError` naming the stage and the sample."""

    def __init__(self, pos: int, stage: SampleStage, seed: int, draw_id: int, source):
        self.pos, self.stage, self.seed, self.draw_id, self.source = pos, stage, int(seed), draw_id, source
        self.label = getattr(stage, "label", stage.name)
        self.arrays = bool(getattr(stage, "takes_arrays", False))

    def run(self, s: Sample, epoch: int, secs: dict) -> None:
        t0 = time.perf_counter()
        st = self.stage
        rng = self.random(s, epoch)
        progress.at(self.label, s.index)
        x = s.x
        wrap = isinstance(x, Pixels)
        if wrap:
            x = x.either() if self.arrays else x.image()
        y = self.call(s, st.apply, x, rng)
        if wrap and self.arrays:
            y = Pixels(image=y) if isinstance(y, Image.Image) else Pixels(array=y)
        s.x = y
        secs[st.name] += time.perf_counter() - t0

    def random(self, s: Sample, epoch: int):
        """What the stage's ``apply`` gets as ``rng`` for sample ``s`` in ``epoch``."""
        return stage_random(self.stage, self.seed, epoch, s.index, self.draw_id)

    def call(self, s: Sample, fn, *args):
        """``fn(*args)`` for sample ``s``, its errors raised as :meth:`run` raises them."""
        try:
            return fn(*args)
        except SampleError as e:
            raise type(e)(s.key or self.source.key(s.index), e.reason, e.detail) from None
        except _StageFailed as e:   # already named for its own stage
            raise e.__cause__ from e.__cause__.__cause__
        except Exception as e:
            raise StageError(f"stage {self.pos} ({self.label}) failed on {s.key or self.source.key(s.index)}: "
                             f"{type(e).__name__}: {e}") from e


class _StageFailed(Exception):
    """An error another step's stage raised inside this step's call, already in its final form
    (its ``__cause__``)."""


class WindowDecodeStep:
    """Decode and the window-resizing stage right after it, as one step: the stage's window is
    drawn from the upright image's size read from the header (the same draws as the two
    separate steps), then :meth:`~feedgpu.stages.decode.Decode.apply_window` decodes the rows of
    the JPEG the window needs (at the DCT scale it allows, with ``reduce="auto"``) and the stage
    resamples the window of that image.
    Input that is not encoded bytes (a PIL image, an array, cached pixels) runs the two steps.

    Args:
        decode: the :class:`StageStep` of the decode stage (``reduce`` not ``"off"``).
        resize: the :class:`StageStep` of the next stage, which has ``window(width, height, rng)``
            and ``resize_window(img, box, out)`` (see :func:`window_pair`).
    """

    def __init__(self, decode: StageStep, resize: StageStep):
        self.decode, self.resize = decode, resize

    def run(self, s: Sample, epoch: int, secs: dict) -> None:
        if not isinstance(s.x, (bytes, bytearray, memoryview)):
            self.decode.run(s, epoch, secs)
            self.resize.run(s, epoch, secs)
            return
        t0 = time.perf_counter()
        st = self.resize.stage
        rng = self.resize.random(s, epoch)
        progress.at(self.decode.label, s.index)

        def target(width: int, height: int):
            try:
                return self.resize.call(s, st.window, width, height, rng)
            except (SampleError, StageError) as e:
                raise _StageFailed() from e

        img, box, out = self.decode.call(s, self.decode.stage.apply_window, s.x, target)
        t1 = time.perf_counter()
        secs[self.decode.stage.name] += t1 - t0
        progress.at(self.resize.label, s.index)
        s.x = self.resize.call(s, st.resize_window, img, box, out)
        secs[st.name] += time.perf_counter() - t1


class CachedSteps:
    """The cache step with the steps before its cut: ``cache.lookup`` first; on a hit the
    sample's pixels and label come from the cache and nothing before the cut runs; on a miss
    the steps run and ``cache.store`` keeps their output. A :class:`DecodeError` of a stage
    before the cut quarantines the sample in the cache. Seconds of lookup and store count as
    ``"cache"``.

    Args:
        cache: a :class:`~feedgpu.exec.cache_step.CacheStep`.
        read: the :class:`ReadStep`.
        stages: the :class:`StageStep` of each stage before the cut.
    """

    def __init__(self, cache, read: ReadStep, stages: list[StageStep]):
        self.cache, self.read, self.stages = cache, read, stages

    def begin(self, epoch: int) -> None:
        self.cache.begin(epoch)

    def run(self, s: Sample, epoch: int, secs: dict) -> None:
        t0 = time.perf_counter()
        hit = self.cache.lookup(s.index)
        secs["cache"] += time.perf_counter() - t0
        if hit is not None:
            s.x, s.label = Pixels(array=hit[0]), hit[1]
            return
        self.read.run(s, epoch, secs)
        try:
            for st in self.stages:
                st.run(s, epoch, secs)
        except DecodeError as e:
            self.cache.quarantine(s.index, e.key, e.reason)
            raise
        t1 = time.perf_counter()
        s.x = self.cache.store(s.index, s.key, s.label, s.x)
        secs["cache"] += time.perf_counter() - t1


def sample_steps(source, plan, seed: int, cache=None) -> list:
    """The steps of ``plan``'s sample stages for one sample, in order: a :class:`ReadStep` and a
    :class:`StageStep` per stage, or, with ``cache`` (a
    :class:`~feedgpu.exec.cache_step.CacheStep`), :class:`CachedSteps` over the read and the
    stages before its cut, then a :class:`StageStep` per stage after it."""
    read = ReadStep(source)
    stages = [StageStep(pos, st, seed, plan.draw_ids[pos], source) for pos, st in enumerate(plan.sample_stages)]
    k = len(stages) if cache is None else cache.after
    if window_pair(plan.sample_stages) and k != 1:   # never across the cache's cut
        stages[:2] = [WindowDecodeStep(stages[0], stages[1])]
        k = k - 1 if k >= 2 else k
    if cache is None:
        return [read, *stages]
    return [CachedSteps(cache, read, stages[:k]), *stages[k:]]


def _owner(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def window_pair(stages) -> bool:
    """True when the first two sample stages run as one :class:`WindowDecodeStep`: a decode
    stage with ``apply_window`` and ``reduce`` other than ``"off"``, then a stage with ``window`` and
    ``resize_window``, neither with an ``apply`` of a subclass that would bypass those."""
    if len(stages) < 2:
        return False
    dec, nxt = stages[0], stages[1]
    if getattr(dec, "reduce", "off") == "off" or not hasattr(dec, "apply_window"):
        return False
    if not (hasattr(nxt, "window") and hasattr(nxt, "resize_window")):
        return False
    return (_owner(type(dec), "apply") is _owner(type(dec), "apply_window")
            and _owner(type(nxt), "apply") is _owner(type(nxt), "window"))
