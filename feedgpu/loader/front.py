"""``feedgpu.DataLoader``: a drop-in replacement for ``torch.utils.data.DataLoader``.

This module is the torch-facing front: arguments, torch's attributes, the order (which rank and
world size, read at each iteration), ``state_dict``. One pass over an epoch is
:class:`~feedgpu.loader.epoch.EpochIterator`; the work and its pool come from :mod:`feedgpu.exec.build`.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable, TypeVar

import torch.utils.data as tud

from ..order import distributed
from . import state as loader_state
from ..cache.settings import CacheSettings
from .epoch import Ahead, EpochIterator, close_live
from ..errors import ConfigError
from ..exec.autoscale import Autoscaler, cpu_cores, default_config
from ..exec.balancer.measurement import count_unit
from ..exec.memory_budget import parse_worker_memory
from ..exec.build import make_pool, make_work
from ..exec.engines import EngineSettings
from ..exec.process_pool import ProcessPool
from ..metrics import ExecutorTotals, LoaderStats
from .samplers import (OrderRandomSampler, OrderSampler, OrderSequentialSampler, UserOrder, order_len,
                     reads_as_sharding, shard_settings, sharded)
from .arguments import (_UNSET, ArgumentTypeError, init_iterable, refuse_combinations, refuse_unagreed_seed,
                           resolve_settings, with_sections, worker_count)
from .stats import loader_stats, source_fingerprint
from ..pipeline import Pipeline
from ..remote.ahead_loader import auto_attach
from ..order.sampler_split import follow_sampler_epoch, split_order
from ..order.sharded import ShardedOrder
from ..torchvision import backend_for, dali_pipeline, explain_loader, follow_dataset

T_co = TypeVar("T_co", covariant=True)
# torch's DataLoader refuses to change these once it is built (ValueError); so does feedgpu's
_FROZEN = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


class DataLoader(tud.DataLoader[T_co]):
    """Iterate batches of a feedgpu :class:`Pipeline` or of any map-style torch Dataset.

    Accepts ``torch.utils.data.DataLoader``'s public arguments with the same meaning; for a
    :class:`Pipeline` the unset ones come from the pipeline (batch size, shuffle, drop_last,
    workers, prefetch, persistent workers, seed, timeout, on_error, device, cache). feedgpu's
    own keywords:

    Args:
        seed: base seed of the order and of random stages. Default: the pipeline's; for a torch
            Dataset drawn from ``generator`` (or torch's global RNG), as torch does.
        rank, world_size: shard feedgpu's order for distributed training; default: read when each
            iteration starts from ``torch.distributed`` when it is initialized, else 0 of 1, so a
            loader built before ``init_process_group`` shards too. Every rank gets ``len(loader)``
            batches. A ``DistributedSampler`` as ``sampler`` (what Lightning injects) is split as
            torch splits it, with its seed and epoch (:mod:`feedgpu.sampler_split`).
            Taken from ``torch.distributed``, construction (when it is initialized by then) and
            the first iteration on a world size are collective: they raise :class:`ConfigError`
            on every rank when a rank has no data or ranks hold different sample counts, and
            every rank takes rank 0's ``seed`` (:mod:`feedgpu.distributed`).
        device: for a pipeline, where batches are delivered (``"cpu"``, ``"cuda[:N]"``, ``"auto"``).
            On CUDA, batches are copied from pinned buffers on a side stream ``prefetch_factor``
            batches ahead, and normalize runs on the GPU.
        on_error: ``"skip"`` or ``"raise"`` for bad samples (pipelines only).
        max_skipped: skip budget per epoch and rank (pipelines only): a share in ``[0, 1]`` of
            the epoch's samples (default: the pipeline's, ``0.01``), an int count, or ``None``
            for no limit. Past it, iteration raises :class:`SkipBudgetExceeded` with the counts
            by reason and the first skipped samples (rules in :mod:`feedgpu.loader.skips`).
        engine: for a pipeline, overrides its engine (``"python"``, ``"dali"`` or a mapping; see
            :class:`~feedgpu.exec.engines.EngineSettings`). With DALI, ``num_workers`` gives DALI's
            thread count unless ``engine.threads`` is set, and no worker process is started;
            ``"auto"`` sizes DALI's threads and its batches ahead as it sizes a pool.
        executor: ``"local"``, ``"ray"`` or a mapping (see
            :class:`~feedgpu.exec.executors.ExecutorSettings`); for a pipeline, overrides its
            ``executor``. With ``"ray"`` batches also run on remote workers of a Ray cluster
            (:mod:`feedgpu.exec.ray_workers`) and reach the training loop in the same order, with
            the same sharding, random draws and ``state_dict()`` as the local pool; with
            ``num_workers=0`` all of them do. Under ``num_workers="auto"`` the balancer adds remote
            workers when the local pool cannot grow (a local worker more was measured not to
            train faster, or ``max_local_workers``) and the training loop still waits, and
            releases them when it stops waiting. ``worker_init_fn`` runs in local workers only.
        cache: for a pipeline, overrides its cache setting (``False`` turns it off; ``True``, a
            directory or a mapping turns it on; see :class:`~feedgpu.cache.CacheSettings`). The
            first epoch fills the cache while training; later epochs and runs read it.
        num_workers: worker processes, 0 to load in the main process, or ``"auto"``: the
            throughput balancer (:mod:`feedgpu.exec.autoscale`) starts with one worker per core
            and tries one step at a time (1 to cores + 1 workers or ``max_local_workers``,
            prefetch depth 1-4) while it runs, keeping a setting only when the training loop
            trains faster (the fewest workers within 3 % of the best measured). The batch order, random
            stages and ``state_dict()`` do not depend on the count. Default: the pipeline's
            (``"auto"`` unless set); for a torch Dataset 0, as in torch. With the DALI engine,
            ``"auto"`` balances DALI's CPU threads the same way (one step at a time, 1 to cores
            + 1; a change rebuilds DALI's pipelines between two batches), unless
            ``engine.threads`` fixes them.
        loader, output: for a pipeline, its ``loader:`` and ``output:`` sections replaced
            (:class:`~feedgpu.settings.LoaderSettings`, :class:`~feedgpu.settings.OutputSettings`
            or mappings, as :meth:`Pipeline.replace` takes them); the keywords above still
            override single fields (``DataLoader(p, loader=ls, batch_size=64)``). Default None:
            the pipeline's. ``dataset`` is then the pipeline with these sections.
        stats_callback: called after each balancer window as ``stats_callback(event)`` with the
            window's measurement and decision (dicts), to send them to your own logger.
        worker_memory: bytes each worker may hold (an int or ``"2GiB"``); default: the pipeline's, else a
            share of the available memory divided by the workers. Sizes the source's read cache, caps the
            prefetch depth and the balancer's pool (:mod:`feedgpu.exec.memory_budget`); not for an ``IterableDataset``.
        compile: for a torchvision ``ImageFolder``/``DatasetFolder`` (also in ``Subset``), compile its
            transforms into feedgpu ops (:mod:`feedgpu.torchvision`; :meth:`explain` shows what ran
            where). Default True; False runs it as a plain Dataset.

    Yields :class:`~feedgpu.exec.work.Batch` ``(images, labels)`` for pipelines, ``collate_fn``'s
    output for torch Datasets. Batches from pipelines on the CPU view shared memory without a
    copy; the memory is reused once every tensor viewing it is gone.

    A ``torch.utils.data.DataLoader`` subclass: it has torch's public attributes (``dataset``,
    ``batch_size``, ``sampler``, ``batch_sampler``, ``generator``, ``multiprocessing_context``,
    ...), and frameworks that re-create a loader from them (Lightning) get a feedgpu loader back.
    ``sampler`` is a ``RandomSampler``/``SequentialSampler`` view of feedgpu's order unless you
    give one; assigning ``batch_size``, ``sampler``, ``batch_sampler``, ``drop_last``,
    ``dataset`` or ``persistent_workers`` after construction raises ``ValueError`` as in torch.
    ``state_dict()`` records the global position (any rank can load it, on any world size).
    Where it differs from torch, and why: ``docs/guides/differences.md``.

    Raises :class:`ConfigError` (a ``ValueError``) for argument combinations it cannot honour:
    an ``IterableDataset`` or ``batch_size=None`` with a pipeline, ``collate_fn`` with a
    pipeline, ``in_order=False``, and the combinations torch rejects (``TypeError`` where torch
    raises one, e.g. a ``num_workers`` that is not an int).
    """

    #: torch's persistent iterator attribute, read by code written for torch's loader; feedgpu
    #: keeps its live iterator elsewhere (one iteration at a time), so this stays None
    _iterator = None

    def __init__(self, dataset, batch_size: int | None = _UNSET, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = _UNSET, collate_fn: Callable | None = None,
                 pin_memory: bool = False, drop_last: bool = _UNSET, timeout: float = _UNSET,
                 worker_init_fn: Callable[[int], None] | None = None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = _UNSET,
                 pin_memory_device: str = "", in_order: bool = True, seed: int | None = None,
                 rank: int | None = None, world_size: int | None = None, device: str | None = None,
                 on_error: str | None = None, cache=None, engine=None, max_skipped=_UNSET, executor=None,
                 stats_callback: Callable[[dict], None] | None = None, worker_memory=None, loader=None, output=None,
                 compile: bool = True):
        self._iterable, self.loader, self.output = None, loader, output
        dataset = dali_pipeline(with_sections(dataset, loader, output), engine, compile, collate_fn)
        if isinstance(dataset, tud.IterableDataset):  # run as torch runs it (feedgpu.exec.iterable)
            init_iterable(self, dataset, locals())
            return
        p = dataset if isinstance(dataset, Pipeline) else None
        self.pipeline, self.compile = p, compile
        self._torchvision, self._plain_why = (None, "a Pipeline") if p is not None else backend_for(dataset, compile)
        unbatched = batch_size is None
        if unbatched and p is not None:
            raise ConfigError("batch_size=None (unbatched loading) needs a torch Dataset: a Pipeline assembles "
                              "whole batches in shared memory; give a batch size")
        refuse_combinations(in_order, pin_memory_device, batch_size, shuffle, sampler, batch_sampler, drop_last)
        user_sampler = (sampler is not None and not reads_as_sharding(sampler)) or batch_sampler is not None
        if (sampler is not None or batch_sampler is not None) and (rank is not None or world_size is not None):
            raise ConfigError("rank/world_size shard feedgpu's own sampler; with a sampler, shard in the sampler")
        bs = 1 if unbatched else (batch_size if batch_size is not _UNSET else (p.batch_size if p else 1))
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ConfigError(f"batch_size should be a positive integer value, but got batch_size={bs}")
        self._batch_size = bs
        shuffle_default = p.shuffle if p is not None and sampler is None and batch_sampler is None else False
        shuffled = bool(shuffle if shuffle is not None else shuffle_default)
        if drop_last is not _UNSET and not isinstance(drop_last, bool):
            raise ConfigError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        dl = bool(drop_last if drop_last is not _UNSET else (p.drop_last if p else False))
        self.auto_workers, self.num_workers = worker_count(
            num_workers if num_workers is not _UNSET else (p.num_workers if p else 0))  # the live count under "auto"
        if self.num_workers == 0 and prefetch_factor is not None:
            raise ConfigError("prefetch_factor option could only be specified in multiprocessing.let num_workers "
                              "> 0 to enable multiprocessing, otherwise set prefetch_factor to None.")
        if persistent_workers is True and self.num_workers == 0:
            raise ConfigError("persistent_workers option needs num_workers > 0")
        if (persistent_default := persistent_workers is _UNSET):
            persistent_workers = bool(p.persistent_workers and self.num_workers > 0) if p else False
        if prefetch_factor is not None and (isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int)):
            raise ArgumentTypeError(f"prefetch_factor must be an int, got {prefetch_factor!r}")
        if prefetch_factor is not None and prefetch_factor < 0:
            raise ConfigError("prefetch_factor option should be non-negative")
        if prefetch_factor == 0:  # torch's loader would wait for ever: no batch is ever asked for
            raise ConfigError("prefetch_factor=0 asks the workers for no batch; give prefetch_factor >= 1")
        self._prefetch = int(prefetch_factor if prefetch_factor is not None else (p.prefetch_factor if p else 2))
        t = timeout if timeout is not _UNSET else (p.timeout if p else 0.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise ArgumentTypeError(f"timeout must be a number of seconds, got {t!r}")
        if (t := float(t)) < 0:
            raise ConfigError("timeout option should be non-negative")
        # the given values of feedgpu's own keywords (frameworks re-create the loader from them)
        self.rank, self.world_size, self.device, self.on_error = rank, world_size, device, on_error
        self.cache, self.engine, self.executor, self.stats_callback = cache, engine, executor, stats_callback
        parse_worker_memory(worker_memory)   # a ConfigError here, not at the first batch
        self.worker_memory = worker_memory
        self.max_skipped = None if max_skipped is _UNSET else max_skipped
        resolve_settings(self, dataset, p, collate_fn, device, on_error, cache, engine, max_skipped, executor, unbatched)
        if self._executor.remote and persistent_default and p is not None:
            persistent_workers = p.persistent_workers  # remote workers persist as local ones would
        if seed is None:
            import torch

            if p is None and generator is None:
                refuse_unagreed_seed(shuffled, rank, world_size)
            seed = p.seed if p is not None and generator is None else \
                int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        self.seed = int(seed)
        # torch's public attributes
        self.dataset, self.shuffle, self.timeout, self.worker_init_fn = dataset, shuffled, t, worker_init_fn
        self.pin_memory, self.pin_memory_device, self.in_order, self.generator = pin_memory, pin_memory_device, \
            in_order, generator
        self.persistent_workers = persistent_workers
        self.collate_fn = collate_fn if p is None else None
        self.batch_size = None if unbatched or batch_sampler is not None else bs
        self.drop_last = False if batch_sampler is not None else dl
        self.prefetch_factor = self._prefetch if self.num_workers > 0 else None
        self.multiprocessing_context = multiprocessing_context
        collective = distributed.initialized() and not user_sampler and rank is None and world_size is None
        if not collective and not user_sampler:
            self._num_samples()   # a source that cannot be opened fails here
        if user_sampler:
            self.sampler, self.batch_sampler = sampler, batch_sampler
            # torch never asks a dataset for its len() when a sampler chooses the keys
            self._user = UserOrder(self._num_samples(optional=p is None), sampler, batch_sampler, bs, dl, self.seed)
        else:
            self._user = None
            self.sampler = sampler if sampler is not None else (
                OrderRandomSampler(self, generator) if shuffled else OrderSequentialSampler(self))
            self.batch_sampler = None if unbatched else tud.BatchSampler(self.sampler, bs, dl)
        self._sharding_epoch = getattr(sampler, "epoch", None)
        self._order: ShardedOrder | None = None
        self._agreed: set[int] = set()    # world sizes whose ranks checked their data (and seed)
        self._epoch, self._start = 0, 0
        self._restored: tuple[int, int] | None = None   # set by load_state_dict until the next iteration
        self._drives_sampler_epoch = False   # set_epoch() was called: a user sampler's set_epoch follows it
        self._position, self._rows_seen, self._batches_seen = (0, 0), 0, 0
        self._fingerprint, self._pool = None, None   # str, ProcessPool
        self._ahead: Ahead | None = None   # the next epoch's first batches, already submitted
        self._work = self._live = None
        self._executor_totals, self._stats = ExecutorTotals(), LoaderStats()
        if collective:  # ranks from torch.distributed: every rank must hold the same samples (or it hangs)
            self._sharded_order(collective=True)
        if p is not None:  # samples the source left out while indexing, by reason (after the check above)
            self._stats.add_index_skips(p.source)
            auto_attach(self)   # a source read from URLs: its shards are fetched ahead (remote.ahead_loader)
        if self.pin_memory:
            import torch

            if not torch.cuda.is_available():
                warnings.warn("pin_memory=True but no CUDA device is available; batches stay in pageable memory",
                              stacklevel=2)
                self.pin_memory = False
        self._autoscaler: Autoscaler | None = None
        if self.auto_workers and self._engine.name == "dali" and self._engine.threads:
            self.num_workers = self._engine.threads   # DALI threads given: fixed
        elif self.auto_workers:   # the balancer sizes the pool, or DALI's CPU threads
            ex, cores = self._executor, cpu_cores()
            engine = f"dali-{self._engine.dali_device(self._device)}" if self._engine.name == "dali" else "python"
            self._autoscaler = Autoscaler(
                prefetch=self._prefetch, device=self._device, callback=stats_callback,
                config=default_config(cores, max_workers=ex.max_local_workers, unit=count_unit(engine)),
                max_remote=ex.max_remote_workers if ex.remote else 0, remote=self._remote_start, engine=engine)
            self._set_live(self._autoscaler.workers, self._autoscaler.prefetch)
        self._frozen = True

    # -- torch DataLoader surface --------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        if name in _FROZEN and self.__dict__.get("_frozen", False):
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is initialized")
        object.__setattr__(self, name, value)

    def _set_live(self, workers: int, prefetch: int) -> None:
        """The balancer's worker count and prefetch depth (torch's attributes follow them)."""
        self.num_workers, self._prefetch = workers, prefetch
        self.prefetch_factor = prefetch if workers > 0 else None

    def _set_seed(self, seed: int) -> None:
        self.seed = int(seed)
        if self._user is not None:
            self._user.seed = self.seed
        if isinstance(self.sampler, OrderSampler):
            self.sampler.seed = self.seed

    def _num_samples(self, optional: bool = False) -> int | None:
        """Samples in the dataset now (followed as it grows, as in torch); ``optional``: None without len()."""
        if self.pipeline is not None:
            return len(self.pipeline.source)
        return None if optional and not hasattr(self.dataset, "__len__") else len(self.dataset)

    def _rank_world(self) -> tuple[int, int, bool]:
        """``(rank, world_size, from_the_process_group)`` for the next iteration."""
        return distributed.rank_world_of(self.rank, self.world_size, self.sampler if reads_as_sharding(self.sampler)
                                         else None)

    def _sharded_order(self, collective: bool = True):
        """The order of the next iteration: a user's sampler, or feedgpu's sharded order for the
        rank and world size of now. ``collective``: on a process group's world size met for the
        first time, check with every rank that they hold the same data and take rank 0's seed."""
        if self._user is not None:
            return self._user
        rank, world, grouped = self._rank_world()
        n = None
        if collective and grouped and world not in self._agreed:
            n, seed = distributed.agree(self._num_samples, self.seed)
            self._agreed.add(world)
            if seed != self.seed:
                self.shutdown()  # workers and buffers are rebuilt with the common seed
                self._set_seed(seed)
        n = self._num_samples() if n is None else n
        if reads_as_sharding(self.sampler):   # torch's split of the sampler (feedgpu.sampler_split)
            self._order = split_order(self.sampler, n, self._batch_size, self.drop_last, self._order)
        else:
            self._order = sharded(n, self._batch_size, self.shuffle, self.seed, rank, world, self.drop_last,
                                  self._order, *shard_settings(self.pipeline))
        return self._order

    def __len__(self) -> int:
        if self._iterable is not None:
            return len(self._iterable)
        return len(self._sharded_order(collective=False))

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (its order and its random stages), from its start.

        Right after :meth:`load_state_dict`, ``set_epoch`` of the restored epoch keeps the restored
        position (a loop ``for epoch in range(start, n): loader.set_epoch(epoch)`` resumes mid-epoch
        without repeating batches); any other epoch starts from its first batch. A
        ``DistributedSampler`` given as ``sampler`` is set to ``epoch`` too (its ``set_epoch`` has
        the same effect). An ``IterableDataset``'s own ``set_epoch`` is called, if it has one."""
        if self._iterable is not None:
            return self._iterable.set_epoch(epoch)
        epoch = int(epoch)
        if reads_as_sharding(self.sampler):   # the sampler's epoch chooses the order: it follows
            self.sampler.set_epoch(epoch)
            self._sharding_epoch = epoch
        self._drives_sampler_epoch = self._user is not None
        if self._restored is not None and self._restored[0] == epoch:
            self._epoch, self._start = self._restored
        else:
            self._epoch, self._start = epoch, 0
        self._restored = None
        self._position = (self._epoch, self._start)

    @property
    def _dali_gpu(self) -> bool:
        return self._engine.name == "dali" and self._engine.dali_device(self._device) == "gpu"

    def __iter__(self):
        if self._iterable is not None:
            return iter(self._iterable)
        self._close_live(superseded=True)
        follow_dataset(self)   # a torchvision dataset's transform or Subset.indices reassigned: compiled anew
        if reads_as_sharding(self.sampler):
            follow_sampler_epoch(self)   # the DistributedSampler's epoch, as torch's loader reads it
        order = self._sharded_order()
        if self._user is not None:  # a user's sampler keeps its owner's epoch (UserOrder.epoch_for)
            self._epoch = self._user.epoch_for(self._epoch, self._restored is not None or self._drives_sampler_epoch)
        if self._start and isinstance(order, ShardedOrder) and self._start >= order.n:
            self._epoch, self._start = self._epoch + 1, 0  # the restored epoch was complete
        self._restored = None
        on_device = self.pipeline is not None and self._device != "cpu" and not self._dali_gpu
        it = EpochIterator(self, order, self._epoch, self._start, deferred_commit=on_device)
        self._start = 0
        self._live = weakref.ref(it)  # dropping the iterator (break, del) stops its workers
        if on_device:
            from .prefetch import CudaPrefetcher

            plan = self.pipeline.plan(self._device)
            return CudaPrefetcher(it, self._device, plan.batch_stage if plan.batch_on_device else None,
                                  depth=self._prefetch)
        return it

    def _close_live(self, superseded: bool = False) -> None:
        close_live(self._live, superseded)
        self._live = None

    @property
    def engine_settings(self) -> EngineSettings:
        """The engine batches run on (the ``engine`` argument, else the pipeline's)."""
        return self._engine

    @property
    def cache_settings(self) -> CacheSettings | None:
        """The cache in use (the ``cache`` argument, else the pipeline's), or None."""
        return self._cache_settings

    # -- state ------------------------------------------------------------------------------
    def _source_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = source_fingerprint(self.pipeline, self.dataset)
        return self._fingerprint

    def state_dict(self) -> dict:
        """Where the training loop is, counted in batches it received (prefetched ones are not
        counted); the schema is in :mod:`feedgpu.loader.state`. Any rank may load it, on any
        world size and worker count. For an ``IterableDataset``: see
        :meth:`feedgpu.exec.iterable.IterableRunner.state_dict`."""
        if self._iterable is not None:
            return self._iterable.state_dict()
        order = self._sharded_order(collective=False)
        epoch, start = self._position
        return loader_state.make_state(self._source_fingerprint(), epoch, start, self._batches_seen,
                                       self._rows_seen if start else 0, self.seed, order.config(),
                                       isinstance(order, ShardedOrder), order_len(order))

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next batch is the one the saved run would have got
        (on another world size: this rank's share of the rest of the epoch's order).

        Raises :class:`StateError` when the state comes from another dataset, batch size or
        sampler (the differences are listed)."""
        if self._iterable is not None:
            return self._iterable.load_state_dict(state)
        order = self._sharded_order(collective=False)
        sharded_ = isinstance(order, ShardedOrder)
        fingerprint = loader_state.fingerprint_for(state, self._source_fingerprint(), self.pipeline)
        epoch, start, batches, rows, seed = loader_state.read_state(state, fingerprint, order.config(), sharded_)
        self.shutdown()  # workers and buffers are rebuilt with the restored seed
        self._set_seed(seed)
        known = order.n if sharded_ else order_len(order)   # a sampler without len(): replayed to its end
        if known is not None and start >= known:
            epoch, start, batches, rows = epoch + 1, 0, 0, 0
        self._epoch, self._start, self._position = epoch, start, (epoch, start)
        self._restored = (epoch, start) if start else None
        self._rows_seen, self._batches_seen = rows, batches

    # -- observability -------------------------------------------------------------------------
    def explain(self) -> str:
        """What runs where (:func:`feedgpu.torchvision.explain_loader`): stages, transforms, or why not compiled."""
        return explain_loader(self)

    def stats(self) -> dict:
        """Counters since the loader was made: batches, samples, rate, consumer wait, seconds per
        stage (summed over workers), skipped samples by reason and the last skipped keys, the
        latest iteration's skip budget (``{max_skipped, limit, epoch, skipped, by_reason}``,
        ``None`` before the first), the cache's state (``None`` without a cache) and the executor
        (``{"name": "local"}``; with Ray the remote workers, batches run on each side, and the
        batches redone after a remote worker died with the reasons, see
        :meth:`~feedgpu.metrics.ExecutorTotals.report`) and the network of a source read from URLs
        (``None`` otherwise; :func:`~feedgpu.remote.ahead_loader.network_stats`)."""
        return loader_stats(self)

    @property
    def balancer(self) -> Autoscaler | None:
        """The :class:`~feedgpu.exec.autoscale.Autoscaler` sizing the pool under ``num_workers="auto"``
        (its ``timeline`` and ``measurements`` hold every window), else None."""
        return self._autoscaler

    def worker_pids(self) -> list[int]:
        if self._iterable is not None:
            return self._iterable.worker_pids() if hasattr(self._iterable, "worker_pids") else []
        return self._pool.pids() if self._pool is not None and not self._pool.closed else []

    # -- workers --------------------------------------------------------------------------------
    def _make_work(self):
        if self._work is None:
            self._work = make_work(self)
        return self._work

    def _acquire_pool(self):
        """The running pool (see :func:`~feedgpu.exec.build.make_pool`)."""
        if self._pool is None or self._pool.closed:
            self._pool = make_pool(self, self._make_work())
        return self._pool

    def _inflight_limit(self) -> int:
        """Batches in flight at most: ``prefetch_factor`` per worker, local and remote."""
        remote = self._pool.remote_workers if self._pool is not None else 0
        return (self.num_workers + remote) * self._prefetch

    def _release_pool(self, force: bool = False) -> None:
        """Stop the workers unless they persist; ``force`` also frees the batch buffers (else kept for the
        next epoch's workers: no new page faults)."""
        if force:
            self._ahead = None  # its tasks die with the pool and its buffers with the work
        if self._pool is not None and (force or not self.persistent_workers):
            counters = self._pool.stats()
            if counters is not None:  # remote workers: counters kept for stats()
                self._executor_totals.add(counters)
            self._pool.close()
            self._pool = None
        if force and self._work is not None:
            self._work.close()
            self._work = None

    def shutdown(self) -> None:
        """Stop the workers now (also at epoch end unless ``persistent_workers``, on errors, at gc)."""
        if getattr(self, "_iterable", None) is not None:
            return self._iterable.shutdown()
        self._close_live()
        self._ahead = None
        self._release_pool(force=True)

    def __del__(self):
        if getattr(self, "_iterable", None) is not None:
            # a live iterator holds the runner, which stops its workers when it goes (not the loader)
            return
        try:
            self.shutdown()
        except Exception:
            pass
