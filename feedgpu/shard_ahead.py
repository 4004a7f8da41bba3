"""Read-ahead of shards: fetch the shards an epoch's order needs before its reader gets there.

The sampler knows which samples come next (a rank's view of the epoch order,
:class:`~feedgpu.order.sharded.EpochShard`), and the source which shard each is in
(:meth:`~feedgpu.sources.base.Source.shard_of`). :class:`ShardAhead` turns them into the order
in which shards are first needed and keeps a :class:`Fetcher` (a node-local shard cache) busy
ahead of the reader, within two budgets:

* ``max_in_flight``: fetches requested and not finished, never more (the network's share);
* ``max_held``: shards fetched or in flight and not yet released (the disk's share): a shard is
  released once every read the order plans for it this epoch is done (reference counts by
  position), and only then is a further shard fetched ahead. A shard the reader waits for is
  requested even when the held budget is spent (the reader never waits on the budget, only on
  the network), so reading never deadlocks whatever the budget; the in-flight cap still holds.

Requests follow the order of need; a shard the reader asks for before its turn (a replacement
sample, a reader that runs ahead) is requested next. The time the reader spends blocked in
:meth:`ShardAhead.acquire` is "waiting for the network" (:meth:`ShardAhead.stats`,
``network_wait_s``): the balancer and ``feedgpu bench`` report it as its own cause.

A fetch that fails reaches the reader as :class:`~feedgpu.errors.ShardFetchError` naming the
shard, at every acquire of that shard (the reader counts its samples as skipped, or raises), and
frees its place in both budgets, so the read-ahead goes on. :meth:`ShardAhead.close` stops the
thread, cancels fetches not started, and wakes any reader with a ``ShardFetchError``.
"""
from __future__ import annotations

import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .errors import ConfigError, ShardFetchError

_WAITING, _FLIGHT, _READY, _FAILED, _RELEASED = range(5)


class Fetcher(Protocol):
    """What :class:`ShardAhead` needs of a shard cache: ``fetch_async(shard)`` returns a
    ``concurrent.futures.Future`` whose result is what the reader opens (a local path), or which
    raises when the fetch fails. ``shard`` is a shard's name (:meth:`Source.shard_names`) or, without
    names, its id. A fetcher may also have ``release(shard)``, called once a shard is released."""

    def fetch_async(self, shard) -> Future:  # pragma: no cover - protocol
        ...


def _check_budgets(max_in_flight, max_held) -> None:
    for label, v in (("max_in_flight", max_in_flight), ("max_held", max_held)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"ShardAhead: {label} must be an int >= 1, got {v!r}")


def _run(ref) -> None:
    while True:
        ahead = ref()
        if ahead is None or not ahead._step():
            return
        del ahead


class ShardAhead:
    """Fetch ahead the shards of ``order`` (see the module docstring).

    Args:
        order: the sample indices in the order they will be read (int array; a rank's
            ``EpochShard.indices``, padding included).
        shard_of: the shard of each sample of the source (int array indexed by sample).
        fetcher: a :class:`Fetcher`.
        names: the shards' names (index = shard id) passed to the fetcher; None: the ids.
        max_in_flight: fetches in flight at most (int >= 1, default 4).
        max_held: shards held (fetched or in flight, not released) at most (int >= 1); None
            (default): the most shards the order has open at once plus ``max_in_flight``.
        timeout: seconds an :meth:`acquire` waits before :class:`ShardFetchError` (None: no limit).
        on_wait: called with the seconds each blocked :meth:`acquire` waited (for the loader:
            :meth:`Autoscaler.add_network_wait <feedgpu.balancer.autoscale.Autoscaler.add_network_wait>`),
            outside the read-ahead's lock; None (default): only :meth:`stats` counts them.
        clock: monotonic clock in seconds (tests inject one).

    Raises :class:`ConfigError` for bad budgets or an order that names a sample outside
    ``shard_of``.
    """

    def __init__(self, order, shard_of, fetcher: Fetcher, *, names: Sequence[str] | None = None,
                 max_in_flight: int = 4, max_held: int | None = None, timeout: float | None = None,
                 on_wait: Callable[[float], None] | None = None, clock: Callable[[], float] = time.monotonic):
        _check_budgets(max_in_flight, max_held)
        order = np.asarray(order, dtype=np.int64)
        shard_of = np.asarray(shard_of)
        if len(order) and (order.min() < 0 or order.max() >= len(shard_of)):
            raise ConfigError(f"ShardAhead: the order names samples outside [0, {len(shard_of)})")
        self.seq = shard_of[order].astype(np.int64)          # the shard of each position
        shards = max(len(names) if names is not None else 0, int(shard_of.max()) + 1 if len(shard_of) else 0)
        pos = np.arange(len(self.seq), dtype=np.int64)
        first = np.full(shards, len(self.seq), np.int64)
        np.minimum.at(first, self.seq, pos)
        used = np.flatnonzero(first < len(self.seq))
        #: shard ids in the order they are first needed
        self.need = used[np.argsort(first[used], kind="stable")]
        self._refs = np.bincount(self.seq, minlength=shards).astype(np.int64)
        if max_held is None:
            from .order.shard_shuffle import max_open

            max_held = (max_open(order, shard_of) if len(order) else 1) + max_in_flight
        self.max_in_flight, self.max_held, self.timeout = max_in_flight, max_held, timeout
        self.fetcher, self.names, self.clock, self.on_wait = fetcher, names, clock, on_wait
        self._state = np.full(shards, _WAITING, np.int8)
        self._result: dict[int, Any] = {}
        self._error: dict[int, str] = {}
        self._exc: dict[int, BaseException] = {}   # the fetch's own exception (a ShardFetchError's cause)
        self._futures: dict[int, Future] = {}
        self._next = 0                      # index into need of the next shard to fetch ahead
        self._demand: list[int] = []        # shards a reader waits for, not requested yet
        self._in_flight = self._held = self._waiting = 0
        self._cond = threading.Condition()
        self._closed = False
        self._stats = {"network_wait_s": 0.0, "waits": 0, "fetched": 0, "failed": 0, "released": 0,
                       "max_in_flight": 0, "max_held": 0, "over_budget": 0}
        #: shard ids in the order they were requested (for reports and tests)
        self.requested: list[int] = []
        # the thread holds the read-ahead weakly between steps: one dropped without close() ends
        self._thread = threading.Thread(target=_run, args=(weakref.ref(self),), name="feedgpu-shard-ahead",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def for_view(cls, view, source, fetcher: Fetcher, **options) -> "ShardAhead":
        """The read-ahead of one rank's epoch: ``view`` an :class:`~feedgpu.order.sharded.EpochShard`
        (``order.view(epoch, start)``, so a resumed epoch fetches only what is left), ``source``
        a :class:`~feedgpu.sources.base.Source` (its ``shard_of()`` and ``shard_names()``);
        ``options`` as for the constructor."""
        return cls(view.indices, source.shard_of(), fetcher, names=source.shard_names(), **options)

    # -- the reader's side ----------------------------------------------------------------------
    def name(self, shard: int) -> str:
        """The shard's name (its id as text without names)."""
        return str(self.names[shard]) if self.names is not None else str(shard)

    def acquire(self, pos: int):
        """Wait until the shard of position ``pos`` is fetched; its fetch's result (a local
        path). Raises :class:`ShardFetchError` naming the shard when its fetch failed, timed
        out (``timeout``) or the read-ahead was closed."""
        return self._acquire(int(self.seq[pos]))

    def ready(self, pos: int) -> bool:
        """True when :meth:`acquire` of ``pos`` would not wait (its shard is fetched, or its fetch
        failed); a shard not requested yet is requested next, as for a waiting reader."""
        s = int(self.seq[pos])
        with self._cond:
            self._demand_locked(s)
            return self._state[s] in (_READY, _FAILED) or self._closed

    def release(self, pos: int) -> None:
        """The read of position ``pos`` is done (each position once): the shard is released
        when every read the order plans for it is done."""
        self._drop(int(self.seq[pos]))

    def acquire_shard(self, shard: int):
        """:meth:`acquire` for a read the order does not plan (a replacement sample): the shard
        is held (fetched again if it was released) until the matching :meth:`release_shard`."""
        with self._cond:
            self._refs[shard] += 1
        return self._acquire(int(shard))

    def release_shard(self, shard: int) -> None:
        """The unplanned read of :meth:`acquire_shard` is done."""
        self._drop(int(shard))

    def _demand_locked(self, s: int) -> None:
        """Ask for shard ``s`` next (fetched again if it was released); the caller holds the lock."""
        if self._state[s] in (_WAITING, _RELEASED):
            if self._state[s] == _RELEASED:
                self._state[s] = _WAITING
            if s not in self._demand:
                self._demand.append(s)
            self._cond.notify_all()

    def _acquire(self, s: int):
        waited: list[float] = []
        try:
            return self._wait_for(s, waited)
        finally:
            if waited and self.on_wait is not None:
                self.on_wait(waited[0])

    def _wait_for(self, s: int, waited: list):
        with self._cond:
            self._demand_locked(s)
            t0 = None
            try:
                while self._state[s] not in (_READY, _FAILED) and not self._closed:
                    now = self.clock()
                    if t0 is None:
                        t0 = now
                        self._waiting += 1
                    left = None if self.timeout is None else self.timeout - (now - t0)
                    if left is not None and left <= 0:
                        raise ShardFetchError(self.name(s), f"not fetched within {self.timeout:g} s")
                    self._cond.wait(left if left is not None else 0.5)
            finally:
                if t0 is not None:
                    self._waiting -= 1
                    waited.append(self._account(t0))
            if self._state[s] == _READY:
                return self._result[s]
            if self._state[s] == _FAILED:
                err = ShardFetchError(self.name(s), self._error[s])
                err.__cause__ = self._exc.get(s)
                raise err
            raise ShardFetchError(self.name(s), "the read-ahead was closed before it was fetched")

    def _account(self, t0: float) -> float:
        dt = max(0.0, self.clock() - t0)
        self._stats["network_wait_s"] += dt
        self._stats["waits"] += 1
        return dt

    def _drop(self, s: int) -> None:
        release = None
        with self._cond:
            self._refs[s] -= 1
            if self._refs[s] <= 0 and self._state[s] in (_READY, _FAILED):
                if self._state[s] == _READY:
                    self._held -= 1
                    self._stats["released"] += 1
                    release = getattr(self.fetcher, "release", None)
                self._state[s] = _RELEASED
                self._result.pop(s, None)
                self._cond.notify_all()
        if callable(release):
            release(self._key(s))

    # -- the fetching thread ---------------------------------------------------------------------
    def _key(self, s: int):
        return self.names[s] if self.names is not None else s

    def _pick(self) -> int | None:
        """The next shard to request, or None (the caller holds the lock)."""
        if self._in_flight >= self.max_in_flight:
            return None
        while self._demand:
            s = self._demand.pop(0)
            if self._state[s] == _WAITING:
                if self._held >= self.max_held:
                    self._stats["over_budget"] += 1
                return s
        while self._next < len(self.need) and self._state[self.need[self._next]] != _WAITING:
            self._next += 1   # already requested on demand
        if self._next < len(self.need) and self._held < self.max_held:
            s = int(self.need[self._next])
            self._next += 1
            return s
        return None

    def _step(self) -> bool:
        """Request one shard when the budgets allow, else wait up to 1 s for a change; False
        once closed."""
        with self._cond:
            s = self._pick()
            if s is None and not self._closed:
                self._cond.wait(1.0)
                s = self._pick()
            if self._closed:
                return False
            if s is not None:
                self._state[s] = _FLIGHT
                self._in_flight += 1
                self._held += 1
                st = self._stats
                st["max_in_flight"] = max(st["max_in_flight"], self._in_flight)
                st["max_held"] = max(st["max_held"], self._held)
                self.requested.append(s)
        if s is None:
            return True
        try:
            fut = self.fetcher.fetch_async(self._key(s))
        except Exception as e:  # noqa: BLE001 - a fetcher that raises at once fails the shard
            fut = Future()
            fut.set_exception(e)
        with self._cond:
            self._futures[s] = fut
        fut.add_done_callback(lambda f, s=s: self._landed(s, f))
        return True

    def _landed(self, s: int, fut: Future) -> None:
        with self._cond:
            self._futures.pop(s, None)
            self._in_flight -= 1
            if self._closed or self._state[s] != _FLIGHT:
                return
            if fut.cancelled():
                self._state[s], self._error[s] = _FAILED, "its fetch was cancelled"
            elif fut.exception() is not None:
                e = fut.exception()
                self._state[s], self._error[s] = _FAILED, f"{type(e).__name__}: {e}"
                self._exc[s] = e
            else:
                self._state[s], self._result[s] = _READY, fut.result()
            release = None
            if self._state[s] == _FAILED:
                self._held -= 1
                self._stats["failed"] += 1
                if self._refs[s] <= 0:
                    self._state[s] = _RELEASED
            else:
                self._stats["fetched"] += 1
                if self._refs[s] <= 0:   # every read of it was released before it landed
                    self._state[s], self._held = _RELEASED, self._held - 1
                    self._result.pop(s, None)
                    self._stats["released"] += 1
                    release = getattr(self.fetcher, "release", None)
            self._cond.notify_all()
        if callable(release):
            release(self._key(s))

    # -- lifetime and figures --------------------------------------------------------------------
    def stats(self) -> dict:
        """``network_wait_s`` (seconds readers spent blocked in :meth:`acquire`), ``waits``
        (acquires that blocked), ``fetched``, ``failed``, ``released`` (shards), ``in_flight``,
        ``held`` and ``waiting`` (readers blocked) now, ``max_in_flight`` and ``max_held`` (the most at once so far),
        ``over_budget`` (shards requested for a waiting reader past ``max_held``)."""
        with self._cond:
            return dict(self._stats, in_flight=self._in_flight, held=self._held, waiting=self._waiting,
                        network_wait_s=round(self._stats["network_wait_s"], 6))

    def close(self, timeout: float = 5.0) -> None:
        """Stop fetching ahead: the thread ends, fetches not started are cancelled, readers
        waiting get :class:`ShardFetchError`. Idempotent."""
        with self._cond:
            self._closed = True
            pending = list(self._futures.values())
            self._cond.notify_all()
        for f in pending:
            f.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "ShardAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close(timeout=0)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# -- the loader's hook ---------------------------------------------------------------------------
def attach(loader, fetcher: Fetcher | None, **options) -> None:
    """Fetch each epoch's shards ahead for ``loader`` (a :class:`~feedgpu.DataLoader` over a
    :class:`~feedgpu.Pipeline` with feedgpu's own order) through ``fetcher``; ``options`` as for
    :class:`ShardAhead` (``max_in_flight``, ``max_held``, ``timeout``); ``None`` detaches.

    From the next iteration on, the loader acquires the shards of each batch before it hands the
    batch to a worker (or runs it inline) and releases them once the batch is delivered. Batches
    after the one the training loop waits for go to the workers only once their shards are
    fetched; the loader blocks only for the shards of that next batch, and that time is "waiting
    for the network" (the balancer's
    ``network_wait_fraction``, ``loader.stats()["read_ahead"]``). A shard whose fetch fails is
    named in a warning and left to the source's own reader, which reads it or counts its samples
    as skipped; one lost for good (a download error) whose samples the skip budget cannot hold
    ends the epoch with :class:`ShardFetchError` before any of them is read (:func:`fetch_batch`). The next epoch's first batches are not started early while a fetcher is attached
    (they would need that epoch's shards). Raises :class:`ConfigError` for a loader without a
    pipeline or with a user's sampler."""
    unknown = set(options) - {"max_in_flight", "max_held", "timeout"}
    if unknown:
        raise ConfigError(f"shard read-ahead: unknown options {sorted(unknown)}; allowed: max_held, max_in_flight, "
                          "timeout")
    _check_budgets(options.get("max_in_flight", 4), options.get("max_held"))
    loader.read_ahead.attach(fetcher, **options)


def batch_positions(view, b: int) -> range:
    """The positions of ``view.indices`` that batch ``b`` reads."""
    bs = view.order.batch_size
    k = b - view.first
    return range(k * bs, min((k + 1) * bs, len(view.indices)))


def fetch_batch(ahead: ShardAhead, view, b: int, warned: set, budget=None, lost: dict | None = None) -> None:
    """Acquire the shards of batch ``b``; a failed one is warned about once (``warned``: names)
    and left to the source's reader, whose samples of it become ``"bad shard"`` skips.

    A shard whose download failed for good (:class:`~feedgpu.errors.DownloadError`) is lost for
    the epoch: when the skip budget (``budget``, a :class:`~feedgpu.loader.skips.SkipBudget`) cannot
    hold the samples the epoch still reads from it (``lost``: shard -> samples, the shards
    already given up this epoch), raises :class:`ShardFetchError` naming it and the cause
    instead, before any of its samples is read (no spare stands in for them)."""
    from .errors import DownloadError

    for pos in batch_positions(view, b):
        try:
            ahead.acquire(pos)
        except ShardFetchError as e:
            s = int(ahead.seq[pos])
            if budget is not None and lost is not None and isinstance(e.__cause__, DownloadError) and s not in lost:
                n = int(np.count_nonzero(ahead.seq[pos:] == s))
                if budget.limit is not None and max(budget.total, sum(lost.values())) + n > budget.limit:
                    why = str(e.__cause__).removeprefix(f"{e.shard}: ")
                    err = ShardFetchError(e.shard, f"{why}; the {n} sample(s) this epoch still reads from "
                                          f"it do not fit the skip budget (max_skipped={budget.max_skipped!r}, "
                                          f"{budget.limit} per epoch, {budget.total} used), so the epoch stops "
                                          "here instead of training on part of the data (raise max_skipped to go "
                                          "on without it)")
                    err.__cause__ = e.__cause__
                    raise err
                lost[s] = n
            if e.shard not in warned:
                warned.add(e.shard)
                warnings.warn(f"feedgpu: {e}; its samples are read by the source directly", stacklevel=3)


def batch_ready(ahead: ShardAhead, view, b: int) -> bool:
    """True when every shard batch ``b`` reads is fetched (or failed): acquiring them would not wait."""
    return all(ahead.ready(pos) for pos in batch_positions(view, b))


def release_batch(ahead: ShardAhead, view, b: int) -> None:
    for pos in batch_positions(view, b):
        ahead.release(pos)
