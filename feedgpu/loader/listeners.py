"""What listens to a pass of the epoch runner (:class:`~feedgpu.loader.epoch.EpochRunner`).

The runner owns the in-order window, the orphan ledger and the commit of the position; the rest
subscribes to its events, in the order :func:`pass_listeners` lists them:

* ``on_start()``: the pass's work and pool are up (before the first batch is submitted);
* ``on_submit(b)``: batch ``b`` goes to the workers, or runs in the main process, next (may raise:
  a shard lost for good);
* ``on_result(b)``: batch ``b``'s result is in (delivered or failed);
* ``on_report(b, report)``: batch ``b``'s report (skips, stage seconds), a skip met again as
  another sample's spare already removed (may raise :class:`~feedgpu.errors.SkipBudgetExceeded`);
* ``on_delivered(b, rows, waited)``: batch ``b`` of ``rows`` samples goes to the training loop
  after it waited ``waited`` seconds for it;
* ``on_close()``: the pass closed.

Listeners hold the runner weakly where they need it: a dropped iterator must be freed at once
(it stops its workers).
"""
from __future__ import annotations

import weakref

from .. import shard_ahead

__all__ = ["BalancerListener", "Counters", "Listener", "MemoryWatchListener", "ReadAheadListener",
           "SkipBudgetListener", "pass_listeners"]


class Listener:
    """A listener that does nothing on every event (subclasses override what they need)."""

    def on_start(self) -> None:
        pass

    def on_submit(self, b: int) -> None:
        pass

    def on_result(self, b: int) -> None:
        pass

    def on_report(self, b: int, report) -> None:
        pass

    def on_delivered(self, b: int, rows: int, waited: float) -> None:
        pass

    def on_close(self) -> None:
        pass


class Counters(Listener):
    """The loader's counters (:class:`~feedgpu.metrics.LoaderStats`) and the network warning of a
    worker that could not reach the store (:class:`~feedgpu.loader.read_ahead.ReadAhead`)."""

    def __init__(self, metrics, read_ahead):
        self.metrics, self.read_ahead = metrics, read_ahead

    def on_report(self, b: int, report) -> None:
        self.metrics.add_report(report)
        self.read_ahead.note_report(report)

    def on_delivered(self, b: int, rows: int, waited: float) -> None:
        self.metrics.delivered(rows, waited)


class SkipBudgetListener(Listener):
    """The pass's :class:`~feedgpu.loader.skips.SkipBudget`: skipped samples count against it."""

    def __init__(self, budget):
        self.budget = budget

    def on_report(self, b: int, report) -> None:
        if report.skipped:
            self.budget.add(report.skipped)


class ReadAheadListener(Listener):
    """The pass's shard read-ahead (:class:`~feedgpu.shard_ahead.ShardAhead` ``shards`` over
    ``view``): a batch's shards are acquired before it is submitted and released once its result
    is in. A shard lost for good that the skip budget (``budget``) cannot hold raises
    :class:`~feedgpu.errors.ShardFetchError` from :meth:`on_submit`."""

    def __init__(self, read_ahead, shards, view, budget):
        self.read_ahead, self.shards, self.view, self.budget = read_ahead, shards, view, budget
        self.warned: set[str] = set()
        self.lost: dict[int, int] = {}     # shards whose download failed for good -> samples left

    def ready(self, b: int) -> bool:
        """Batch ``b``'s shards are in: submitting it would not wait for the network."""
        return shard_ahead.batch_ready(self.shards, self.view, b)

    def on_submit(self, b: int) -> None:
        shard_ahead.fetch_batch(self.shards, self.view, b, self.warned, self.budget, self.lost)

    def on_result(self, b: int) -> None:
        shard_ahead.release_batch(self.shards, self.view, b)

    def on_close(self) -> None:
        self.read_ahead.closed(self.shards)   # its figures kept; remote sources: download threads


class MemoryWatchListener(Listener):
    """A torch Dataset's copy-on-read growth in the workers (:class:`~feedgpu.exec.memory_watch.CopyOnReadWatch`)."""

    def __init__(self, watch, runner):
        self.watch, self.runner = watch, weakref.ref(runner)

    def on_start(self) -> None:
        r = self.runner()
        self.watch.start(r.pool.pids(), r.epoch)

    def on_delivered(self, b: int, rows: int, waited: float) -> None:
        r = self.runner()
        if not self.watch.done:
            self.watch.on_batch(r.epoch, b, r.view.first, r.nb, r.pool.pids())


class BalancerListener(Listener):
    """The throughput balancer (:class:`~feedgpu.balancer.autoscale.Autoscaler`): it measures each
    delivered batch and its decisions resize the pass's pool (or DALI's threads) between batches."""

    def __init__(self, auto, runner):
        self.auto, self.runner = auto, weakref.ref(runner)

    def on_start(self) -> None:
        self.auto.start(self.runner().pids())

    def on_delivered(self, b: int, rows: int, waited: float) -> None:
        r = self.runner()
        d = self.auto.on_batch(rows, waited, r.pids(), remote_started=None if r.pool is None else r.pool.remote_started)
        if d is not None:
            r.apply(d)


def pass_listeners(host, runner) -> list[Listener]:
    """The listeners of one pass of ``runner`` over the backend ``host``'s components: counters,
    skip budget, shard read-ahead (when attached), copy-on-read watch (with workers), balancer."""
    out: list[Listener] = [Counters(host.metrics, host.read_ahead), SkipBudgetListener(runner.budget)]
    if runner.shards is not None:
        out.append(ReadAheadListener(host.read_ahead, runner.shards, runner.view, runner.budget))
    if host.memory_watch is not None and runner.pool is not None:
        out.append(MemoryWatchListener(host.memory_watch, runner))
    if runner.balanced:
        out.append(BalancerListener(host.autoscaler, runner))
    return out
