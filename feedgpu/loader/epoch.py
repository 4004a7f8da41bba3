"""One pass over an epoch's batches, behind :class:`feedgpu.DataLoader`.

The loader (the torch-facing front, :mod:`feedgpu.loader`) chooses the order and the work; an
:class:`EpochRunner` submits batches of indices to the pool (or runs them inline), hands the
results to the training loop in order, counts skips against the budget and records the position
the loader's ``state_dict()`` reports.

As in torch, an exception raised while loading one batch (in the dataset, a stage or
``collate_fn``) is raised by that ``next()`` and the following ``next()`` gives the next batch;
a worker that died beyond recovery, a timeout and an exceeded skip budget end the iteration.
"""
from __future__ import annotations

import itertools
import sys
import time
import warnings

import numpy as np

from ..errors import IteratorSuperseded, ShardFetchError, SkipBudgetExceeded
from ..exec.buffers.host import pin
from ..exec.contract import Control, Elastic, RunsAhead
from ..exec.pool.errors import unpack_exception
from .listeners import ReadAheadListener, pass_listeners
from .skips import SkipBudget, epoch_samples

_tags = itertools.count(1)
#: Seconds a worker that a balancer experiment stopped using stays parked (idle, warm) before it is
#: retired: an experiment is judged within about a dozen one-second windows.
PARK_S = 30.0


class BatchFailed(Exception):
    """Internal: the batch's own work raised (``cause``); the iteration may go on."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class Ahead:
    """The next epoch's first batches, submitted to persistent workers while the current epoch
    ends, so the training loop does not wait for the pool to refill at every epoch start. The
    next iteration adopts them if it starts that epoch from its first batch; otherwise they are
    dropped (results discarded on arrival). Batches depend only on (seed, epoch, batch), so
    computing them early changes nothing in what is delivered."""

    def __init__(self, epoch: int, pool):
        self.epoch, self.pool, self.tag = epoch, pool, next(_tags)
        self.pending: dict[int, tuple] = {}
        self.ready: dict[int, tuple] = {}
        self.submitted = 0

    def __len__(self) -> int:
        return len(self.pending) + len(self.ready)

    def drop(self, work) -> None:
        for seq, task in self.pending.items():
            work.orphans[(self.tag, seq)] = task
        for task, _, _ in self.ready.values():
            work.discard(task)
        self.pending.clear()
        self.ready.clear()


class EpochRunner:
    """One pass over an epoch's batches, from position ``start`` (see the order's ``view``);
    batches come out in order.

    It owns the in-order window (``pending``, ``ready``), the orphans of abandoned passes (on the
    work) and the commit of the backend's :class:`~feedgpu.loader.state.Position`; the counters,
    the skip budget, the shard read-ahead, the copy-on-read watch and the balancer subscribe to
    its events (:mod:`feedgpu.loader.listeners`). ``host``: the backend
    (:class:`~feedgpu.loader.mapped.MapBackend`)."""

    def __init__(self, host, order, epoch: int, start: int, deferred_commit: bool = False):
        self.host, self.epoch, self.order = host, epoch, order
        self.position = host.position
        self.view = order.view(epoch, start)
        self.listeners: list = []   # (pass_listeners, once the work and the pool are up)
        self._fatal: tuple | None = None    # (batch, error): a lost shard the skip budget cannot hold
        first = self.next_b = self.view.first   # batches are numbered as in the whole epoch
        self.first_b, self.start, self.seeks = first, start, host.seeks
        # With device prefetch, a batch counts as seen when the prefetcher hands it to the
        # training loop (it calls commit()), not when it leaves the CPU pool.
        self.deferred = deferred_commit
        self.uncommitted: list[tuple[int, int]] = []
        # a user's sampler ends where it is exhausted (its len() need not exist or be right):
        # the end of the numbering is found when the sampler runs out (_ended)
        self.open = self.view.num_batches is None
        self.nb = sys.maxsize if self.open else first + self.view.num_batches   # the end of the numbering
        self.tag = next(_tags)
        self.closed = False
        self.superseded = False   # a newer iteration of the loader stopped this one
        self.pending: dict[int, tuple] = {}      # seq -> task (submitted, result not yet used)
        self.ready: dict[int, tuple] = {}        # seq -> (task, ok, payload)
        view = self.view   # not self: the generator would hold the iterator in a cycle
        self._batches = iter(view) if self.open else (view.batch(b) for b in range(first, self.nb))
        self.submitted = first
        self.budget = SkipBudget(host.max_skipped, epoch_samples(order), epoch)
        self._bad: set[str] = set()   # keys skipped in this epoch
        self._peeked: dict[int, np.ndarray] = {}   # inline mode: batch -> indices, read ahead
        self._peeked_to = first
        self._ahead_to = first   # inline: batches below this were started ahead (RunsAhead.lookahead)
        self.submitted_all = False   # an open-ended epoch's sampler is exhausted
        self.inline = host.inline
        self.work = host.make_work()
        self.work.refresh()  # workers forked below inherit an up-to-date cache index
        self.pool = None if self.inline else host.acquire_pool()
        self.shards = host.read_ahead.for_view(self.view)   # shards fetched ahead (None: not attached)
        # the balancer sizes the pool, or the DALI engine's threads (set_threads)
        self.balanced = host.autoscaler is not None and (self.pool is not None or isinstance(self.work, Elastic))
        self.listeners = pass_listeners(host, self)
        self.fetching = next((x for x in self.listeners if isinstance(x, ReadAheadListener)), None)
        for listener in self.listeners:
            listener.on_start()
        self.ahead: Ahead | None = None      # the next epoch's batches this iterator submits
        self._adopt(host.take_ahead(), epoch, start)
        self.position.begin(epoch, start)
        self.fill()

    def _adopt(self, ahead: "Ahead | None", epoch: int, start: int) -> None:
        """Take over the batches the previous iteration submitted for this epoch, if they fit."""
        if ahead is None:
            return
        if ahead.epoch != epoch or start != 0 or ahead.pool is not self.pool or self.pool is None:
            ahead.drop(self.work)
            return
        self.tag, self.pending, self.ready = ahead.tag, ahead.pending, ahead.ready
        self.submitted = ahead.submitted
        view = self.view
        self._batches = (view.batch(b) for b in range(self.submitted, self.nb))

    def _lookahead_ok(self) -> bool:
        # not with a cache: its rows become readable at the epoch-end flush, which must come first
        return (self.host.persistent_workers and self.order.seekable and self.pool is not None
                and not self.host.cached and self.shards is None)

    def _take(self) -> np.ndarray | None:
        """The next batch's indices from the order; None where an open-ended epoch ends."""
        if self.submitted_all:
            return None
        try:
            return next(self._batches)
        except StopIteration:
            if not self.open:
                raise
            self.submitted_all = True
            return None

    def _ended(self, end: int) -> None:
        """The user's sampler ran out: batch ``end`` is the end of the epoch."""
        self.nb = end
        if self.next_b >= end and not self.uncommitted:  # every batch before it was committed
            self._complete()

    def _indices(self, b: int) -> np.ndarray | None:
        """Indices of batch ``b``, None past the epoch's end (inline mode reads
        ``prefetch_factor`` batches ahead with DALI)."""
        while self._peeked_to <= b:
            ks = self._take()
            if ks is None:
                self._ended(self._peeked_to)
                return None
            self._peeked[self._peeked_to] = ks
            self._peeked_to += 1
        for old in [k for k in self._peeked if k < self.next_b]:
            del self._peeked[old]
        return self._peeked[b]

    def _spares(self, b: int, size: int, epoch: int | None = None) -> np.ndarray:
        if not self.host.reports:   # a torch Dataset: no spares
            return np.zeros(0, np.int64)
        view = self.view if epoch is None or epoch == self.epoch else self.order.view(epoch)
        return view.spares(b, max(4, size))

    def _submitting(self, b: int) -> None:
        for listener in self.listeners:
            listener.on_submit(b)

    def _submit(self, tag: int, seq: int, epoch: int, indices: np.ndarray, pending: dict) -> None:
        task = self.work.task(tag, seq, epoch, indices, self._spares(seq, len(indices), epoch))
        self.pool.submit(task)
        pending[seq] = task

    def fill(self) -> None:
        """Submit batches up to the in-flight limit (and the next epoch's first ones, when this one is all
        submitted and persistent workers run it)."""
        limit = self.host.inflight_limit()
        while (self.submitted < self.nb and len(self.pending) + len(self.ready) < limit
               and self.work.can_submit()):
            if self.fetching is not None and self.submitted > self.next_b and not self.fetching.ready(self.submitted):
                break   # a later batch waits for its shards; only the next one blocks on the network
            if self._fatal is not None:
                break
            try:
                self._submitting(self.submitted)   # its shards first: a shard lost for good stops here
            except ShardFetchError as e:
                self._fatal = (self.submitted, e)   # raised when the loop asks for this batch
                break
            indices = self._take()
            if indices is None:
                self._ended(self.submitted)
                break
            self._submit(self.tag, self.submitted, self.epoch, indices, self.pending)
            self.submitted += 1
        if self.submitted < self.nb or not self._lookahead_ok():
            return
        # this epoch is all submitted: start the next one's first batches with the spare capacity
        nxt = self.epoch + 1
        if self.ahead is None:
            self.ahead = Ahead(nxt, self.pool)
        a = self.ahead
        full = len(self.order)
        while (a.submitted < full and len(self.pending) + len(self.ready) + len(a) < limit
               and self.work.can_submit()):
            self._submit(a.tag, a.submitted, nxt, self.order.view(nxt).batch(a.submitted), a.pending)
            a.submitted += 1

    def __iter__(self):
        return self

    def __len__(self) -> int:
        """Batches of this pass, as torch's iterator counts them: ``len(loader)`` from an epoch's
        start, what remains after a restored position. Raises ``TypeError`` for a user's sampler
        without ``len()``, as torch does."""
        if not self.open:
            return self.view.num_batches
        if self.view.expected is None:
            src = self.order.batch_sampler if self.order.batch_sampler is not None else self.order.sampler
            raise TypeError(f"object of type '{type(src).__name__}' has no len()")
        return self.view.expected

    def __next__(self):
        if self.superseded:
            raise IteratorSuperseded(
                f"this iterator of the DataLoader was stopped at batch {self.next_b} of epoch {self.epoch} by a newer "
                "iter(loader): a feedgpu DataLoader runs one iteration at a time (its position is its state_dict()), "
                "torch's allows several; build a second DataLoader to iterate the dataset twice at once")
        if self.closed or self.next_b >= self.nb:
            self.close()
            raise StopIteration
        b = self.next_b
        if self._fatal is not None and b >= self._fatal[0]:   # a shard lost for good, over the skip budget
            error = self._fatal[1]
            self.close()
            self.host.release_pool(force=True)
            raise error
        if self.inline and self._indices(b) is None:  # the user's sampler ended: so does the epoch
            self.close()
            raise StopIteration
        t0 = time.perf_counter()
        cause = None
        try:
            if self.inline:
                indices = self._indices(b)
                self._submitting(b)
                window = self.work.lookahead(self.host.prefetch) if isinstance(self.work, RunsAhead) else 0
                if window:  # DALI: start the batches of its window not started yet, in order
                    for k in range(max(b, self._ahead_to), min(self.nb, b + 1 + window)):
                        ks = self._indices(k)
                        if ks is None:
                            break
                        self._submitting(k)
                        self.work.prefetch(k, self.epoch, ks, self._spares(k, len(ks)))
                        self._ahead_to = k + 1
                    batch, report = self.work.run_inline(b, self.epoch, indices, self._spares(b, len(indices)))
                else:
                    try:
                        batch, report = self.work.run_inline(b, self.epoch, indices,
                                                             self._spares(b, len(indices)))
                    except Exception as e:  # noqa: BLE001 - the batch's own error: raised, then go on
                        raise BatchFailed(e) from None
            else:
                batch, report = self._wait(b)
        except BatchFailed as failed:  # as torch: this next() raises, the next one gives batch b + 1
            cause = failed.cause
        except BaseException:
            self.close()
            self.host.release_pool(force=True)  # after an error, even persistent workers restart
            raise
        for listener in self.listeners:
            listener.on_result(b)
        if cause is not None:
            self._skip_failed(b)
            # raised outside the handler (no context) and without `self` in this frame, which the
            # traceback keeps: an iterator the caller drops (an exception leaving a for loop) is
            # freed and stops its workers at once
            del self
            raise cause
        if report is not None:
            if report.skipped:  # a bad sample met again as another's spare: one skip per epoch
                report.skipped = [s for s in report.skipped if s[0] not in self._bad]
                self._bad.update(key for key, _, _ in report.skipped)
            try:
                for listener in self.listeners:
                    listener.on_report(b, report)
            except SkipBudgetExceeded:
                self.close()
                self.host.release_pool(force=True)
                raise
        rows = _rows(batch)
        waited = time.perf_counter() - t0
        for listener in self.listeners:
            listener.on_delivered(b, rows, waited)
        self.next_b = b + 1
        if self.host.pin_memory:
            batch = pin(batch)
        if self.deferred:
            self.uncommitted.append((b, rows))
        else:
            self._commit(b, rows)
        if self.next_b >= self.nb:
            self.close()
        return batch

    def pids(self) -> list[int]:
        return [] if self.pool is None else self.pool.pids()

    def apply(self, d) -> None:
        """Resize the pool (or DALI's threads) and the prefetch depth between two batches (the
        epoch goes on). A worker that an experiment stops using is parked for ``PARK_S``
        seconds, so that undoing the experiment takes it back warm instead of starting one; a
        kept experiment retires it."""
        host = self.host
        if self.pool is not None and d.experiment is not None and d.experiment.get("kept"):
            self.pool.retire_parked()
        if not d.changes:
            return
        if self.pool is None:   # the DALI engine: its batches ahead follow the live prefetch depth
            self.work.set_threads(d.workers, d.prefetch)
            host.set_live(d.workers, d.prefetch)
            return
        if d.workers != self.pool.num_workers:
            self.pool.resize(d.workers, park_s=PARK_S if d.tentative else 0.0)
        if d.remote_workers != self.pool.remote_workers:
            self.pool.resize_remote(d.remote_workers)
        host.set_live(d.workers, d.prefetch)
        self.fill()

    def _skip_failed(self, b: int) -> None:
        """Batch ``b`` raised: it counts as consumed (a resume does not meet it again)."""
        self.next_b = b + 1
        if self.deferred:
            self.uncommitted.append((b, 0))
        else:
            self._commit(b, 0)
        if self.next_b >= self.nb:
            self.close()
        elif not self.inline:
            self.fill()

    def commit(self) -> None:
        """The oldest batch handed out by this iterator has reached the training loop."""
        self._commit(*self.uncommitted.pop(0))

    def _commit(self, b: int, rows: int) -> None:
        if b + 1 >= self.nb:  # the epoch is complete: the next iteration starts the next one
            self._complete()
        else:
            self.position.commit(self.epoch, self.view.position(b + 1), rows)

    def _complete(self) -> None:
        self.position.complete(self.epoch)

    def _wait(self, b: int):
        while b not in self.ready:
            if self.fetching is not None and self.submitted <= b:   # held back for its shards
                self.fill()
                if self._fatal is not None and b >= self._fatal[0]:
                    raise self._fatal[1]   # a shard lost for good: __next__ closes and raises it
            tag, seq, wid, ok, payload = self.pool.get(self.host.timeout or None)
            if tag is Control.START_FAILED:  # worker_init_fn failed
                raise unpack_exception(payload, "in worker_init_fn")
            if self.ahead is not None and tag == self.ahead.tag:  # the next epoch's, kept for it
                self.ahead.ready[seq] = (self.ahead.pending.pop(seq), ok, payload)
                continue
            if tag != self.tag:  # from an abandoned iteration of persistent workers
                orphan = self.work.orphans.pop((tag, seq), None)
                if orphan is not None:
                    self.work.discard(orphan)
                continue
            self.ready[seq] = (self.pending.pop(seq), ok, payload)
        task, ok, payload = self.ready.pop(b)
        if not ok:  # raised in batch order: every earlier batch has been delivered
            self.work.discard(task)
            exc = unpack_exception(payload, f"while assembling batch {b} of epoch {self.epoch}")
            net = getattr(exc, "feedgpu_network", None)
            if net is not None:   # what the worker retried and gave up on, though its batch failed
                self.host.metrics.network[net[0]] = net[1]
            raise BatchFailed(exc)
        batch = self.work.finish(task, payload)
        self.fill()
        report = payload if self.host.reports else None
        return batch, report

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for listener in self.listeners:
            listener.on_close()
        keep_pool = self.host.persistent_workers
        for seq, task in self.pending.items():
            if keep_pool:  # its result still comes and is dropped on arrival
                self.work.orphans[(self.tag, seq)] = task
            else:  # the workers are stopped below: nothing writes there any more
                self.work.discard(task)
        self.pending.clear()
        for task, _, _ in self.ready.values():
            self.work.discard(task)
        self.ready.clear()
        if self.ahead is not None:
            if self.next_b >= self.nb and keep_pool:  # finished: the next iteration may adopt them
                self.host.keep_ahead(self.ahead)
            else:
                self.ahead.drop(self.work)
            self.ahead = None
        if self.inline:
            self.work.on_exit()  # workers do this when they stop
        elif keep_pool and self.host.cached and not self.pool.closed:
            self._flush_workers()
        self.host.release_pool()
        if self.next_b == self.first_b and self.start:   # no batch taken: the restored position stays
            self.host.unused_start(self.epoch, self.start, self.seeks)

    def _flush_workers(self) -> None:
        """Persistent workers write what they cached this epoch, so the next one reads it."""
        try:
            for tag, seq, _, _, _ in self.pool.flush():
                orphan = self.work.orphans.pop((tag, seq), None)
                if orphan is not None:
                    self.work.discard(orphan)
        except Exception as e:  # noqa: BLE001 - the cache is an optimisation: never fail training
            warnings.warn(f"feedgpu cache: workers could not write their rows at the end of the epoch ({e})",
                          stacklevel=3)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _rows(batch) -> int:
    """Samples in a collated batch, for the counters: the length of its first field; a field
    without a usable ``len()`` (a nested tensor: ``size(0)``; a scalar; an empty container)
    counts what it can, never fails the batch."""
    first = batch
    if isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
    elif isinstance(batch, dict) and batch:
        first = next(iter(batch.values()))
    try:
        return len(first)
    except Exception:  # noqa: BLE001 - nested tensors raise RuntimeError, scalars TypeError
        pass
    try:
        return int(first.size(0))
    except Exception:  # noqa: BLE001
        return 1


def close_live(ref, superseded: bool = False) -> None:
    """Close the iterator a loader's weak reference ``ref`` (or None) points to, if it is alive;
    ``superseded``: a newer ``iter()`` took over, so its next ``next()`` raises rather than
    ending the pass early."""
    it = ref() if ref is not None else None
    if it is not None:
        if superseded and not it.closed:
            it.superseded = True
        it.close()
