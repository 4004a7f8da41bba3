"""A user's ``sampler`` or ``batch_sampler`` as an order of batches (:class:`UserOrder`)."""
from __future__ import annotations

import itertools
import math
import operator

import numpy as np

from .sharded import draw_spares

__all__ = ["UserOrder", "UserView", "as_keys"]


class UserOrder:
    """Batches from a user's ``sampler`` or ``batch_sampler``. Resuming replays the sampler for
    the epoch (after ``set_epoch`` when it has one) and skips the batches already seen, so the
    sampler must give the same order for the same epoch. Otherwise the sampler's epoch is its
    owner's (``set_epoch_on`` is False): as torch, the loader does not call its ``set_epoch``.

    As in torch, an epoch is what iterating the sampler gives, until it is exhausted: its
    ``len()`` (which it need not have: a generator, an infinite sampler) only answers
    ``len(loader)``. Keys are passed to the dataset as the sampler gives them: integral ones as
    ints, any other (a string key, a float) unchanged."""

    #: positions count the batches the sampler gave (:class:`~feedgpu.order.protocol.Order`)
    seekable = False

    def __init__(self, n: int, sampler, batch_sampler, batch_size: int, drop_last: bool, seed: int):
        self.n, self.sampler, self.batch_sampler = n, sampler, batch_sampler
        self.batch_size, self.drop_last, self.seed = batch_size, drop_last, seed
        self.set_epoch_on = False   # call the sampler's set_epoch(epoch) before iterating it (the loader decides)

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        k = len(self.sampler)
        return k // self.batch_size if self.drop_last else math.ceil(k / self.batch_size)

    def epoch_for(self, epoch: int, pinned: bool) -> int:
        """The epoch of the next iteration. The sampler keeps the epoch its owner gives it
        (``sampler.set_epoch``), as in torch: unless ``pinned`` (a mid-epoch state to replay, or
        the loader's ``set_epoch`` was called), the sampler's ``epoch`` attribute, when it has
        one, is the epoch, and its ``set_epoch`` is not called."""
        self.set_epoch_on = pinned
        e = getattr(self.batch_sampler if self.batch_sampler is not None else self.sampler, "epoch", None)
        if not pinned and isinstance(e, int) and not isinstance(e, bool):
            return e
        return epoch

    def known_len(self) -> int | None:
        """``len(self)``, or None when the sampler has no length."""
        try:
            return len(self)
        except TypeError:
            return None

    def end(self) -> int | None:
        """The position past the epoch's end: its batches (None: a sampler without a length)."""
        return self.known_len()

    def view(self, epoch: int, start: int = 0) -> "UserView":
        """The epoch's batches after the first ``start`` ones (start counts batches here)."""
        return UserView(self, epoch, start)

    def batches(self, epoch: int):
        src = self.batch_sampler if self.batch_sampler is not None else self.sampler
        if self.set_epoch_on and hasattr(src, "set_epoch"):
            src.set_epoch(epoch)
        if self.batch_sampler is not None:
            for b in self.batch_sampler:
                yield as_keys(list(b))
            return
        it = iter(self.sampler)
        while True:
            chunk = list(itertools.islice(it, self.batch_size))
            if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                return
            yield as_keys(chunk)

    def config(self) -> dict:
        return {"sampler": type(self.batch_sampler or self.sampler).__name__, "n": self.n,
                "batch_size": self.batch_size, "drop_last": self.drop_last}


def as_keys(keys: list) -> np.ndarray:
    """A batch of a user sampler's keys: int64 when every key is integral (``int``, a numpy
    integer, a 0-d integer tensor), else an object array holding the keys as given."""
    try:
        return np.asarray([operator.index(k) for k in keys], dtype=np.int64)
    except TypeError:
        out = np.empty(len(keys), dtype=object)
        out[:] = keys
        return out


class UserView:
    """One epoch of a :class:`UserOrder`, read in order from batch ``start``.

    ``num_batches`` is None: the epoch ends where the sampler is exhausted (iterate the view);
    ``expected`` is the sampler's ``len()`` less ``start`` when it has one (informational)."""

    open_ended = True

    def __init__(self, order: UserOrder, epoch: int, start: int):
        self.order, self.epoch, self.start, self.first = order, epoch, start, start
        known = order.known_len()
        self.expected = None if known is None else max(0, known - start)
        self.num_batches = None
        self._it = itertools.islice(order.batches(epoch), start, None)

    def __iter__(self):
        """The epoch's batches from ``start`` (int64 or object arrays), until the sampler ends."""
        return self._it

    def position(self, b: int) -> int:
        """The position (batches of the epoch) once the batches before ``b`` were taken."""
        return b

    def spares(self, b: int, k: int) -> np.ndarray:
        """``k`` replacement indices for samples of batch ``b`` that get skipped, drawn from the
        whole dataset by :func:`~feedgpu.order.sharded.draw_spares` (rank 0: a user's sampler shards
        itself; the position is the batch's number)."""
        return draw_spares(self.order.seed, self.epoch, 0, b, k, self.order.n)
