"""Running a torch ``IterableDataset`` the way ``torch.utils.data.DataLoader`` runs it.

:class:`IterableRunner` iterates the dataset in the main process (``num_workers=0``) or in
``num_workers`` processes that each iterate their own copy (started with the
``multiprocessing_context``: fork, spawn or forkserver; with spawn and forkserver the dataset,
``collate_fn`` and ``worker_init_fn`` are pickled). What is identical to torch:

* inside worker ``i``: ``torch.utils.data.get_worker_info()`` is torch's ``WorkerInfo(id=i,
  num_workers, seed, dataset)``; ``random``, ``torch`` and ``numpy`` are seeded as torch seeds
  them, from a base seed drawn from ``generator`` (or torch's global RNG) at every iteration
  (once with ``persistent_workers``), so ``torch.initial_seed()`` is ``base + i`` already in
  ``worker_init_fn(i)``;
* batching in the worker (``batch_size``, ``drop_last`` per worker, ``collate_fn``;
  ``batch_size=None`` passes each item through ``collate_fn``, torch's ``default_convert`` by
  default), and the order: round-robin over the workers from worker 0 at every pass, a worker
  whose stream is exhausted skipped from then on;
* at most ``prefetch_factor`` batches per worker in flight; batches travel as torch tensors in
  shared memory (``torch.multiprocessing``'s reductions);
* an exception from the dataset in a worker is raised in the main process (same type where it
  pickles, the worker's traceback as a note beginning ``Caught X in DataLoader worker process
  i``), and the next ``next()`` goes on with the next batch; ``timeout`` raises
  :class:`~feedgpu.errors.LoaderTimeout` (a ``RuntimeError``) ``DataLoader timed out after t
  seconds``; a dead worker raises :class:`~feedgpu.errors.WorkerError` (a ``RuntimeError``)
  ``DataLoader worker (pid N) is killed by signal: ...`` or ``... exited unexpectedly ...``;
* ``len()``: ``len(dataset)``, in batches when batching (``TypeError`` without ``__len__``).

Deliberate differences: an exception from ``worker_init_fn`` or from ``iter(dataset)`` in a
worker is raised once and that worker's stream then counts as exhausted (torch keeps sending
the worker tasks it cannot run); ``str()`` of a re-raised worker exception is the original
message (torch rebuilds the exception from a message with the traceback; here the traceback is
an exception note and the exception keeps its attributes); ``timeout`` is ignored with
``num_workers=0`` (torch refuses it when iterating); a new ``iter()`` stops the previous
iterator's workers.

Resume (:meth:`IterableRunner.state_dict`) needs a dataset with ``state_dict()`` and
``load_state_dict()`` (torchdata's Stateful protocol); its iterator may have them too. The
state holds, per worker, the dataset's (and iterator's) state right after that worker's last
delivered batch, which workers are exhausted, and the next worker of the round-robin, so the
first batch after :meth:`~IterableRunner.load_state_dict` is the one the saved run would have
delivered next. A restore needs the same ``num_workers``, ``batch_size`` and ``drop_last``.
"""
from __future__ import annotations

import math
import warnings
import weakref

from ...loader.epoch import close_live
from ...errors import ConfigError, IteratorSuperseded, LoaderTimeout, StateError
from ..buffers.host import pin
from ..pool.errors import unpack_exception
from ..pool.start import draw_base_seed, resolve_context
from . import datapipes
from .pool import WorkerSet
from .worker import Fetcher, is_stateful

STATE_FORMAT = "feedgpu.iterable/1"


class IterableRunner:
    """Batches of an ``IterableDataset``, run as ``torch.utils.data.DataLoader`` runs it (module doc).

    Args:
        dataset: a ``torch.utils.data.IterableDataset`` (anything iterable works).
        batch_size: items per batch (default 1), or None for unbatched loading.
        drop_last: drop each worker's last, shorter batch (default False).
        collate_fn: default torch's ``default_collate`` (``default_convert`` when unbatched);
            runs in the workers.
        num_workers: worker processes (default 0: iterate in the main process).
        prefetch_factor: batches in flight per worker (default 2 with workers; must be None
            without).
        worker_init_fn: ``worker_init_fn(worker_id)`` in each worker, after seeding.
        multiprocessing_context: None (the start method set with
            ``multiprocessing.set_start_method``, else fork: see
            :func:`~feedgpu.exec.pool.start.resolve_context`), ``"fork"``, ``"spawn"``,
            ``"forkserver"`` or a context object.
        generator: ``torch.Generator`` the base seed is drawn from (default torch's global RNG).
        timeout: seconds to wait for a worker's batch, 0 for ever (default 0).
        persistent_workers: keep the workers (and their dataset copies) between iterations.
        pin_memory: pin delivered tensors when CUDA is available.

    Raises :class:`~feedgpu.errors.ConfigError` (a ``ValueError``) for the arguments torch
    rejects with ``ValueError``, ``TypeError`` for a ``multiprocessing_context`` of the wrong type.
    """

    def __init__(self, dataset, *, batch_size: int | None = 1, drop_last: bool = False, collate_fn=None,
                 num_workers: int = 0, prefetch_factor: int | None = None, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, timeout: float = 0, persistent_workers: bool = False,
                 pin_memory: bool = False):
        import torch.utils.data as tud

        from ...settings import TORCH_DEFAULTS, LoaderSettings

        # torch's checks of its keywords, in its words, as for every other kind of dataset
        # (batch_size=None: unbatched, which an IterableDataset may be)
        given = {"batch_size": batch_size, "drop_last": drop_last, "num_workers": num_workers,
                 "prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers, "timeout": timeout}
        LoaderSettings.from_torch({k: v for k, v in given.items() if v is not None}, TORCH_DEFAULTS)
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        if batch_size is None and drop_last:
            raise ConfigError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
        self.dataset = dataset
        self.batch_size = None if batch_size is None else int(batch_size)
        self.drop_last = bool(drop_last)
        if collate_fn is None:
            collate_fn = tud.default_convert if batch_size is None else tud.default_collate
        self.collate_fn = collate_fn
        self.num_workers = int(num_workers)
        self.prefetch_factor = prefetch_factor
        self.worker_init_fn = worker_init_fn
        if multiprocessing_context is not None and self.num_workers == 0:
            raise ConfigError("multiprocessing_context can only be used with multi-process loading "
                              f"(num_workers > 0), but got num_workers={self.num_workers}")
        self.multiprocessing_context = resolve_context(multiprocessing_context) if self.num_workers > 0 else None
        self.generator = generator
        self.timeout = timeout
        self.persistent_workers = bool(persistent_workers)
        self.pin_memory = bool(pin_memory)
        if self.pin_memory:
            import torch

            if not torch.cuda.is_available():
                warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then device pinned "
                              "memory won't be used.", stacklevel=2)
                self.pin_memory = False
        self.stateful = is_stateful(dataset)
        self._len_called: int | None = None
        self._live = None                 # weakref to the latest iterator
        self._workers: WorkerSet | None = None   # persistent workers
        self._pending: dict | None = None   # a loaded state, used by the next iteration
        self._pass = 0                       # passes started (tags the workers' messages)
        # the position, kept here so that it outlives the iterator
        self._pos: dict = {"done": True}

    # -- torch's surface -----------------------------------------------------------------------
    def __len__(self) -> int:
        """``len(dataset)``, as batches when batching (``ceil``, or floor with ``drop_last``).
        Raises ``TypeError`` when the dataset has no ``__len__``. With workers this counts all
        workers' samples together, as torch does, so it is exact only for sharded datasets."""
        n = len(self.dataset)
        self._len_called = n
        if self.batch_size is not None:
            n = n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        return n

    def __iter__(self):
        self._close_live(superseded=True)
        restore, self._pending = self._pending, None
        if restore is not None and (restore["done"] or restore["workers"] is None):
            restore = None
        if self.num_workers == 0:
            it = _InlineIter(self, restore)
        else:
            it = _WorkerIter(self, restore)
        self._live = weakref.ref(it)
        return it

    def set_epoch(self, epoch: int) -> None:
        """Passed on to ``dataset.set_epoch(epoch)`` when the dataset has it (Hugging Face and
        torchdata streaming datasets reshuffle with it), else nothing: torch's loader has no
        epochs. Workers started after the call (all of them unless ``persistent_workers``) see it."""
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)

    def _close_live(self, superseded: bool = False) -> None:
        close_live(self._live, superseded)
        self._live = None

    # -- state -----------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"num_workers": self.num_workers, "batch_size": self.batch_size, "drop_last": self.drop_last}

    def state_dict(self) -> dict:
        """Where the stream stands after the last delivered batch: ``{format, num_workers,
        batch_size, drop_last, done, batches_seen, base_seed, workers: [per worker: {dataset,
        iterator, ended}], finished: [bool], next_worker}`` (``workers`` None before the first
        batch; ``done`` True after a complete pass, whose restore starts a new one).

        Raises :class:`~feedgpu.errors.StateError` when the dataset is not Stateful, or its
        ``state_dict()`` failed in a worker."""
        if not self.stateful:
            raise StateError(
                f"state_dict(): the IterableDataset {type(self.dataset).__qualname__} has no state_dict() and "
                "load_state_dict() (torchdata's Stateful protocol), so where its stream stands cannot be saved: "
                "an IterableDataset can only be resumed by itself. Give it both methods (its __iter__ continuing "
                "from the loaded state), or restart the epoch instead of resuming")
        it = self._live() if self._live is not None else None
        if it is not None:
            it.settle()
        pos = self._pos
        if pos.get("fetcher") is not None:   # num_workers=0: nothing is prefetched, the dataset is there
            pos["workers"] = [pos["fetcher"].snapshot()]
        workers = pos.get("workers")
        if workers is not None:
            for w, s in enumerate(workers):
                if isinstance(s, dict) and "error" in s:
                    raise StateError(f"state_dict(): the dataset's state_dict() failed in worker {w}: {s['error']}")
        state = {"format": STATE_FORMAT, **self._config(), "done": bool(pos.get("done")),
                 "batches_seen": int(pos.get("batches_seen", 0)), "base_seed": pos.get("base_seed"),
                 "workers": list(workers) if workers is not None else None,
                 "finished": list(pos.get("finished", [])), "next_worker": int(pos.get("next_worker", 0))}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` at the next iteration. Raises
        :class:`~feedgpu.errors.StateError` for another format or another ``num_workers``,
        ``batch_size`` or ``drop_last`` (each worker's stream depends on them)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateError(f"not a feedgpu IterableDataset state (format {STATE_FORMAT!r} expected)")
        if not self.stateful:
            raise StateError(f"load_state_dict(): the IterableDataset {type(self.dataset).__qualname__} has no "
                             "load_state_dict() (torchdata's Stateful protocol) to take the state")
        diff = {k: (state.get(k), v) for k, v in self._config().items() if state.get(k) != v}
        if diff:
            raise StateError("the state was saved with other settings, each worker's stream would differ: " +
                             ", ".join(f"{k}: saved {a!r}, here {b!r}" for k, (a, b) in diff.items()))
        self.shutdown()
        self._pending = dict(state)
        self._pos = {"done": bool(state["done"]), "workers": state["workers"], "finished": state["finished"],
                     "next_worker": state["next_worker"], "batches_seen": state["batches_seen"],
                     "base_seed": state["base_seed"]}

    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (of the live pass, or persistent), [] without any."""
        workers = getattr(self._live() if self._live is not None else None, "workers", None) or self._workers
        return workers.pids() if workers is not None and not workers.closed else []

    def shutdown(self) -> None:
        """Stop the iterator and the workers now (also done at the end of a pass unless
        ``persistent_workers``, when the iterator is dropped, and at garbage collection)."""
        self._close_live()
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass


class _InlineIter:
    """``num_workers=0``: the pass runs in the main process, one batch per ``next()``."""

    def __init__(self, runner: IterableRunner, restore: dict | None):
        self.runner, self.closed, self.superseded = runner, False, False
        if restore is None:   # an IterDataPipe's shuffle seed, drawn before the base seed as in torch
            datapipes.reseed(runner.dataset, runner.generator)
        base_seed = restore["base_seed"] if restore is not None else draw_base_seed(runner.generator)
        start = restore["workers"][0] if restore is not None else None
        self.fetcher = Fetcher(runner.dataset, runner.batch_size, runner.drop_last, runner.collate_fn,
                               runner.stateful, start)   # iter(dataset) raises here, as in torch
        self.pos = runner._pos = {"done": False, "base_seed": base_seed, "finished": [False], "next_worker": 0,
                                  "batches_seen": restore["batches_seen"] if restore is not None else 0,
                                  "workers": None, "fetcher": self.fetcher}
        self.yielded = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.superseded:
            raise superseded_error()
        if self.closed:
            raise StopIteration
        try:
            data = self.fetcher.next_batch()
        except StopIteration:
            self.close(done=True)
            raise
        self.pos["batches_seen"] += 1
        self.yielded += 1
        _len_warning(self.runner, self.yielded)
        return pin(data) if self.runner.pin_memory else data

    def settle(self) -> None:
        pass   # the runner reads the state from the fetcher

    def close(self, done: bool = False) -> None:
        if not self.closed and done:
            self.pos["workers"] = [self.fetcher.snapshot()]
            self.pos.pop("fetcher", None)
            self.pos["done"] = True
        self.closed = True


class _WorkerIter:
    """``num_workers > 0``: batches from the workers in torch's round-robin order."""

    def __init__(self, runner: IterableRunner, restore: dict | None):
        self.runner, self.closed, self.superseded = runner, False, False
        n = runner.num_workers
        workers = runner._workers if runner.persistent_workers else None
        fresh = restore is None and (workers is None or workers.closed)
        if fresh:   # an IterDataPipe's shuffle seed, drawn before the base seed as in torch
            datapipes.reseed(runner.dataset, runner.generator)
        if restore is not None:
            base_seed = restore["base_seed"]
        elif workers is not None:
            base_seed = workers.base_seed      # persistent workers are seeded once, as in torch
        else:
            base_seed = draw_base_seed(runner.generator)
        # torch draws one more pipe seed per pass: persistent workers get it with the pass
        pipe_seed = draw_base_seed(runner.generator) if restore is None and datapipes.is_datapipe(runner.dataset) \
            else None
        if workers is None or workers.closed:
            workers = WorkerSet(runner, base_seed)
            if runner.persistent_workers:
                runner._workers = workers
        self.workers = workers
        runner._pass += 1
        self.epoch = runner._pass
        states = list(restore["workers"]) if restore is not None else [None] * n
        finished = list(restore["finished"]) if restore is not None else [False] * n
        self.pos = runner._pos = {"done": False, "base_seed": base_seed, "workers": states, "finished": finished,
                                  "next_worker": restore["next_worker"] if restore is not None else 0,
                                  "batches_seen": restore["batches_seen"] if restore is not None else 0}
        # a worker's state is known once it said "ready" (or when it was restored)
        self.unknown = set() if restore is not None or not runner.stateful else set(range(n))
        for w in range(n):
            workers.reset(w, self.epoch, {"finished": True} if finished[w] else states[w],
                          None if fresh else pipe_seed)
            if finished[w] and not runner.persistent_workers:
                workers.stop(w)
        self.yielded = 0
        self._finalizer = weakref.finalize(self, _WorkerIter._drop, workers, runner.persistent_workers)

    @staticmethod
    def _drop(workers: WorkerSet, persistent: bool) -> None:
        if not persistent:
            workers.close()

    def __iter__(self):
        return self

    def _take(self, w: int) -> tuple:
        """Worker ``w``'s next message of this pass, its "ready" consumed on the way."""
        while True:
            msg = self.workers.get(w, self.epoch, self.runner.timeout)
            if msg[0] != "ready":
                return msg
            self.unknown.discard(w)
            self.pos["workers"][w] = msg[2]

    def __next__(self):
        if self.superseded:
            raise superseded_error()
        if self.closed:
            raise StopIteration
        pos, n = self.pos, self.runner.num_workers
        while True:
            w = next((k % n for k in range(pos["next_worker"], pos["next_worker"] + n)
                      if not pos["finished"][k % n]), None)
            if w is None:
                self.close(done=True)
                raise StopIteration
            try:
                kind, _, payload, snap = self._take(w)
            except LoaderTimeout:
                raise   # the pass goes on: the next next() waits again, as in torch
            except BaseException:
                self.close(broken=True)   # a dead worker ends the pass, as in torch
                raise
            pos["next_worker"] = (w + 1) % n
            if kind == "end":
                pos["finished"][w] = True
                self.unknown.discard(w)
                if not self.runner.persistent_workers:
                    self.workers.stop(w)
                continue
            self.workers.credit(w, self.epoch)
            pos["workers"][w] = snap
            if kind == "error":
                raise unpack_exception(payload, "while iterating its copy of the IterableDataset")
            pos["batches_seen"] += 1
            self.yielded += 1
            _len_warning(self.runner, self.yielded)
            return pin(payload) if self.runner.pin_memory else payload

    def settle(self) -> None:
        """Read the "ready" of workers that have delivered nothing yet (their start state)."""
        if self.closed:
            return
        for w in sorted(self.unknown):
            if not self.pos["finished"][w]:
                self.workers.wait_ready(w, self.epoch, self.pos, timeout=self.runner.timeout or None)
        self.unknown.clear()

    def close(self, done: bool = False, broken: bool = False) -> None:
        """End this pass: ``done`` when it was complete; ``broken`` after a worker died, which
        also stops persistent workers."""
        if self.closed:
            return
        self.closed = True
        if done:
            self.pos["done"] = True
        elif not broken:
            try:
                self.settle_quietly()
            except Exception:  # noqa: BLE001 - the state then starts those workers afresh
                pass
        if broken or not self.runner.persistent_workers:
            self.workers.close()
            if self.runner._workers is self.workers:
                self.runner._workers = None

    def settle_quietly(self) -> None:
        for w in sorted(self.unknown):
            if not self.pos["finished"][w]:
                self.workers.wait_ready(w, self.epoch, self.pos, timeout=1.0)
        self.unknown.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def _len_warning(runner: IterableRunner, yielded: int) -> None:
    n = runner._len_called
    if n is not None and yielded > n:
        warnings.warn(f"Length of IterableDataset {runner.dataset} was reported to be {n} (when accessing "
                      f"len(dataloader)), but {yielded} samples have been fetched. " +
                      ("For multiprocessing data-loading, this could be caused by not properly configuring the "
                       "IterableDataset replica at each worker." if runner.num_workers > 0 else ""), stacklevel=3)


def superseded_error() -> IteratorSuperseded:
    return IteratorSuperseded("this iterator of the DataLoader was stopped by a newer iter(loader): a feedgpu "
                              "DataLoader runs one iteration at a time (its position is its state_dict()), torch's "
                              "allows several; build a second DataLoader to iterate the dataset twice at once")


def runner_for_loader(dataset, *, shuffle=None, sampler=None, batch_sampler=None, batch_size=1, num_workers=0,
                      in_order: bool = True, pin_memory_device: str = "", feedgpu_options: dict | None = None,
                      **kw) -> IterableRunner:
    """The :class:`IterableRunner` that ``feedgpu.DataLoader`` delegates to for an
    ``IterableDataset``, after torch's checks of the arguments an IterableDataset refuses
    (``shuffle``, ``sampler``, ``batch_sampler``: ``ValueError`` as in torch) and feedgpu's:
    ``num_workers="auto"``, ``in_order=False``, ``pin_memory_device`` and feedgpu's own keywords
    (``feedgpu_options``: name -> value, None when unset) raise :class:`~feedgpu.errors.ConfigError`."""
    if not in_order:
        raise ConfigError("in_order=False: feedgpu delivers an IterableDataset's batches in torch's in-order "
                          "round-robin over the workers (exact resume needs it)")
    if pin_memory_device:
        raise ConfigError("pin_memory_device is deprecated in torch; pin_memory=True pins for the current device")
    dataset = datapipes.with_shuffle(dataset, shuffle)   # an IterDataPipe takes shuffle, as in torch
    if shuffle not in (False, None) and not datapipes.is_datapipe(dataset):
        raise ConfigError(f"DataLoader with IterableDataset: expected unspecified shuffle option, but got "
                          f"shuffle={shuffle}")
    if sampler is not None:
        raise ConfigError(f"DataLoader with IterableDataset: expected unspecified sampler option, but got "
                          f"sampler={sampler}")
    if batch_sampler is not None:
        raise ConfigError("DataLoader with IterableDataset: expected unspecified batch_sampler option, but got "
                          f"batch_sampler={batch_sampler}")
    if num_workers == "auto":
        raise ConfigError("num_workers='auto' cannot run an IterableDataset: each worker iterates its own shard "
                          "(chosen with get_worker_info()), so the worker count cannot change during a pass; "
                          "give an int")
    given = sorted(k for k, v in (feedgpu_options or {}).items() if v is not None)
    if given:
        raise ConfigError(f"{', '.join(given)}: feedgpu's options for map-style datasets and Pipelines; an "
                          "IterableDataset orders, shards and seeds itself (with get_worker_info() and the "
                          "loader's generator), as in torch")
    kw["worker_init_fn"] = datapipes.sharded(dataset, num_workers, kw.get("worker_init_fn"))
    return IterableRunner(dataset, batch_size=batch_size, num_workers=num_workers, **kw)
