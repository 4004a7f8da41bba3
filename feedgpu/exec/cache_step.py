"""The pixel cache as a step of a plan: what it gives for a sample it holds, and what it stores
for one it does not."""
from __future__ import annotations

import numpy as np
from PIL import Image

from ..errors import DecodeError, StageError
from .pixels import Pixels, rgb, rgb_array
from .plan import CacheCut

__all__ = ["CacheStep"]


class CacheStep:
    """The cache at a plan's cut, over one open cache entry.

    Per sample, :meth:`lookup` answers first: the stored pixels and label (then the source is
    not read, nor are the ``cut.after`` stages before the cut run), or None; for a sample it
    does not hold, the stages before the cut run and :meth:`store` keeps their output. Both give
    the stages after the cut a :class:`~feedgpu.exec.pixels.Pixels`: a stage that takes arrays
    (``takes_arrays``) and the batch writer get the array, others a PIL RGB image, so a hit
    converts nothing that no stage needs and a miss converts the image once, to store it.

    Flushing goes through the entry's :class:`~feedgpu.cache.flush.FlushPolicy`: :meth:`begin`
    (each batch), :meth:`pause` (worker idle or stopping), :meth:`close`.

    Args:
        entry: the open :class:`~feedgpu.cache.store.CacheEntry` (``open_entry``).
        cut: where the plan is cut (:attr:`~feedgpu.exec.plan.Plan.cache_cut`).
    """

    name = "cache"

    def __init__(self, entry, cut: CacheCut):
        self.entry, self.cut = entry, cut

    @property
    def after(self) -> int:
        """The leading sample stages whose output is stored."""
        return self.cut.after

    def lookup(self, index: int) -> tuple[np.ndarray, int] | None:
        """``(pixels, label)`` of sample ``index`` (uint8 ``(height, width, 3)``, read-only,
        possibly a view of a memory-mapped part; the label an int), or None when the entry does
        not hold it (or its row was corrupt: then the sample is recomputed). Raises
        :class:`DecodeError` for a sample quarantined in the entry (not read again)."""
        q = self.entry.quarantined.get(index)
        if q is not None:
            raise DecodeError(q[0], q[1], "quarantined in the cache")
        pixels = self.entry.get(index)
        if pixels is None:
            return None
        return pixels, self.entry.label(index)

    def store(self, index: int, key: str, label: int, x) -> Pixels:
        """Keep ``x``, the output of the stages before the cut for sample ``index`` (a PIL image,
        converted to RGB first, or a uint8 ``(height, width, 3)`` array), and return it as
        :class:`Pixels` holding both the image (if any) and the stored array. Raises
        :class:`StageError` for anything else (the batch could not take it either)."""
        if isinstance(x, Image.Image):
            image = rgb(x)
            arr = rgb_array(image)
        else:
            image, arr = None, np.ascontiguousarray(x)
            if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
                raise StageError(f"stage {self.cut.stage!r} gave {arr.dtype} {arr.shape} for {key}; the cache "
                                 "after it stores uint8 (height, width, 3) RGB arrays or PIL images")
        self.entry.put(index, key, label, arr)
        return Pixels(image, arr)

    def quarantine(self, index: int, key: str, reason: str) -> None:
        """Record a sample the stages before the cut could not decode: later epochs skip it."""
        self.entry.quarantine(index, key, reason)

    def begin(self, epoch: int) -> None:
        """Before each batch: the policy's ``batch`` event, then pick up parts others published."""
        self.entry.policy.batch(epoch)
        self.entry.refresh()

    def refresh(self) -> None:
        """Pick up parts and quarantined samples other processes published."""
        self.entry.refresh()

    def pause(self) -> None:
        """The worker idles, is asked to flush, or stops (the policy's ``pause`` event)."""
        self.entry.policy.pause()

    def close(self) -> None:
        """Release the entry (what is buffered is published first)."""
        self.entry.close()
