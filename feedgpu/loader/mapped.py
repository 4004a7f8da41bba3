"""The backend of a map-style dataset: feedgpu's order (or a user's sampler), its position, and
the work and pool its epochs run on.

:class:`MapBackend` is what the pipeline, the torch Dataset and the torchvision backends share
(:mod:`feedgpu.loader.kinds` holds what differs: the work, the spares, what ``explain()`` says).
It owns the loader's :class:`~feedgpu.loader.state.Position` and hands it to each pass's
:class:`~feedgpu.loader.epoch.EpochRunner`, which commits batches to it as the training loop
receives them.
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch.utils.data as tud

from ..balancer.autoscale import Autoscaler, default_config
from ..balancer.measurement import count_unit
from ..exec.build import make_pool
from ..exec.memory_budget import BudgetPlan, MemoryBudgetWarning, plan_budget
from ..host import cpu_cores
from ..metrics import ExecutorTotals, LoaderStats
from ..order import distributed
from ..order.sampler_split import split_order
from ..order.sharded import ShardedOrder
from . import state as loader_state
from .epoch import Ahead, EpochRunner, close_live
from .options import LoaderOptions, refuse_unagreed_seed
from .read_ahead import ReadAhead
from ..order.user import UserOrder
from .samplers import (OrderRandomSampler, OrderSampler, OrderSequentialSampler, reads_as_sharding, shard_settings,
                       sharded)
from .state import Position
from .stats import loader_stats

__all__ = ["MapBackend"]


def _pinned(pin_memory: bool) -> bool:
    """``pin_memory``, False (with a warning) where no CUDA device is available."""
    if pin_memory:
        import torch

        if not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no CUDA device is available; batches stay in pageable memory",
                          stacklevel=5)
            return False
    return bool(pin_memory)


class MapBackend:
    """A map-style dataset's batches in feedgpu's order or a user's sampler (module docstring).

    Args:
        dataset: what the loader was given (a :class:`~feedgpu.Pipeline` or a torch Dataset).
        options: the loader's resolved :class:`~feedgpu.loader.options.LoaderOptions`.
        given: the loader's keyword arguments (``sampler``, ``batch_sampler``, ``seed``,
            ``generator``, ``rank``, ``world_size``, ``pin_memory``, ``worker_init_fn``,
            ``multiprocessing_context``, ``stats_callback``).
    """

    #: whether batches carry a report (skips, stage seconds) and draw spares: pipelines
    reports = False

    def __init__(self, dataset, options: LoaderOptions, given: dict):
        self.dataset, self.options, self.pipeline = dataset, options, options.pipeline
        self.batch_size, self.shuffle = options.batch_size, options.shuffle
        given = self._read_order_view(given)
        self.drop_last, self.max_skipped = options.settings.drop_last, options.settings.max_skipped
        self.timeout, self.cached = options.settings.timeout, options.cache is not None
        self.persistent_workers = options.settings.persistent_workers
        self.rank, self.world_size, self.generator = given["rank"], given["world_size"], given["generator"]
        self.worker_init_fn, self.context = given["worker_init_fn"], given["multiprocessing_context"]
        self.sampler, self.batch_sampler = given["sampler"], given["batch_sampler"]
        self.pin_memory = _pinned(given["pin_memory"])
        self.num_workers, self.prefetch = options.workers, options.settings.prefetch_factor
        self.position, self.metrics, self.executor_totals = Position(), LoaderStats(), ExecutorTotals()
        self.work = self.pool = self.ahead = self.live = self.fingerprint = None
        self.memory_budget, self.warned_prefetch_cap = None, False
        self.memory_watch = None   # a torch Dataset's copy-on-read watch (DatasetBackend)
        self.mirror = None   # writes the live values onto the loader's attributes (set by the loader)
        self.start, self.restored = 0, None   # the next iteration's start; a loaded state until then
        self.seeks = 0   # set_epoch / load_state_dict calls so far (a pass started before one is older)
        self.agreed: set[int] = set()    # world sizes whose ranks checked their data (and seed)
        self.order_cache: ShardedOrder | None = None
        self.drives_sampler_epoch = False   # set_epoch() was called: a user sampler's set_epoch follows it
        self.seed = self._seed(given["seed"])
        self._init_order(given)
        self.read_ahead = ReadAhead.for_loader(self.pipeline, self.user is None, self._cache_entry_ref())
        self.autoscaler = self._balancer(given["stats_callback"])
        if self.autoscaler is not None:
            self.read_ahead.on_wait = self.autoscaler.add_network_wait

    def torch_attributes(self, given: dict) -> dict:
        """torch's attributes of the loader (and ``seed``, ``pipeline``, ``auto_workers``), from its
        keyword arguments ``given``."""
        o, s = self.options, self.options.settings
        batch_sampler = given["batch_sampler"] is not None
        collate = given["collate_fn"]
        if collate is None and o.pipeline is None and not hasattr(self.dataset, "make_work"):
            collate = tud.default_convert if o.unbatched else tud.default_collate   # torch's, as torch shows it
        return {"seed": self.seed, "pipeline": o.pipeline, "auto_workers": o.auto_workers, "shuffle": self.shuffle,
                "timeout": s.timeout, "persistent_workers": s.persistent_workers,
                "collate_fn": collate,
                "batch_size": None if o.unbatched or batch_sampler else s.batch_size,
                "drop_last": False if batch_sampler else s.drop_last, "sampler": self.sampler,
                "batch_sampler": self.batch_sampler, "multiprocessing_context": given["multiprocessing_context"]}

    # -- construction ---------------------------------------------------------------------------
    def _seed(self, seed) -> int:
        if seed is None:
            import torch

            if self.pipeline is None and self.generator is None:
                refuse_unagreed_seed(self.shuffle, self.rank, self.world_size)
            seed = self.options.settings.seed if self.pipeline is not None and self.generator is None else \
                int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        return int(seed)

    def _read_order_view(self, given: dict) -> dict:
        """``given``, where its ``sampler`` is the order view of a feedgpu loader over the same
        dataset (``loader.sampler``, passed back by a framework that re-creates the loader from its
        attributes) read as that loader's order: its ``shuffle`` and seed, so this loader orders
        its own epochs as that one does (a view iterated as a user's sampler would give the other
        loader's epoch every time). A ``seed`` given that differs keeps the view a user's sampler."""
        view = given["sampler"]
        if not isinstance(view, OrderSampler) or view.data_source is not self.dataset or \
                given["batch_sampler"] is not None or given["seed"] not in (None, view.seed):
            return given
        self.shuffle = view.shuffle
        return {**given, "sampler": None, "seed": view.seed}

    def _init_order(self, given: dict) -> None:
        sampler, batch_sampler = given["sampler"], given["batch_sampler"]
        user_sampler = (sampler is not None and not reads_as_sharding(sampler)) or batch_sampler is not None
        collective = distributed.initialized() and not user_sampler and self.rank is None and self.world_size is None
        if not collective and not user_sampler:
            self.num_samples()   # a source that cannot be opened fails here
        bs, dl = self.batch_size, self.drop_last
        if user_sampler:
            # torch never asks a dataset for its len() when a sampler chooses the keys
            self.user = UserOrder(self.num_samples(optional=self.pipeline is None), sampler, batch_sampler, bs, dl,
                                  self.seed)
        else:
            self.user = None
            self.sampler = sampler if sampler is not None else (
                OrderRandomSampler(self, self.generator) if self.shuffle else OrderSequentialSampler(self))
            self.batch_sampler = None if self.options.unbatched else tud.BatchSampler(self.sampler, bs, dl)
        self.sharding_epoch = getattr(sampler, "epoch", None)
        if collective:  # ranks from torch.distributed: every rank must hold the same samples (or it hangs)
            self.order(collective=True)

    def _balancer(self, callback) -> Autoscaler | None:
        """The balancer under ``num_workers="auto"`` (it sizes the pool, or DALI's CPU threads)."""
        o = self.options
        if not o.auto_workers:
            return None
        if o.engine.name == "dali" and o.engine.threads:
            self.num_workers = o.engine.threads   # DALI threads given: fixed
            return None
        ex = o.executor
        engine = f"dali-{o.engine.dali_device(o.device)}" if o.engine.name == "dali" else "python"
        auto = Autoscaler(prefetch=self.prefetch, device=o.device, callback=callback,
                          config=default_config(cpu_cores(), max_workers=ex.max_local_workers, unit=count_unit(engine)),
                          max_remote=ex.max_remote_workers if ex.remote else 0, remote=o.remote_start, engine=engine)
        self.set_live(auto.workers, auto.prefetch)
        return auto

    def _cache_entry_ref(self):
        """The pixel cache entry of the work now (None without one), without holding the backend."""
        ref = weakref.ref(self)

        def entry():
            me = ref()
            work = me.work if me is not None else None
            return work.cache_entry() if work is not None else None
        return entry

    # -- what the kinds of dataset say ------------------------------------------------------------
    def num_samples(self, optional: bool = False) -> int | None:
        """Samples in the dataset now (followed as it grows, as in torch); ``optional``: None without len()."""
        return None if optional and not hasattr(self.dataset, "__len__") else len(self.dataset)

    def build_work(self):
        """A new work object for the current settings (the kinds say which)."""
        raise NotImplementedError

    def begin(self) -> None:
        """An iteration starts: follow what changed in the dataset (the kinds say what)."""

    def wrap(self, it):
        """The iterator the training loop gets for the pass ``it`` (device prefetch: pipelines)."""
        return it

    def explain(self) -> str:
        raise NotImplementedError

    @property
    def inline(self) -> bool:
        """Batches run in the main process: no workers (local or remote), or the DALI engine."""
        return (self.num_workers == 0 and not self.options.executor.remote) or self.options.engine.name == "dali"

    # -- the live worker count and prefetch depth -----------------------------------------------
    @property
    def prefetch_factor(self) -> int | None:
        """torch's ``prefetch_factor``: the live prefetch depth, None without workers."""
        return self.prefetch if self.num_workers > 0 else None

    def set_live(self, workers: int, prefetch: int) -> None:
        """The balancer's worker count and prefetch depth (the loader's attributes follow them)."""
        self.num_workers, self.prefetch = workers, prefetch
        if self.mirror is not None:
            self.mirror(num_workers=workers, prefetch_factor=self.prefetch_factor)

    def inflight_limit(self) -> int:
        """Batches in flight at most: ``prefetch_factor`` per worker, local and remote."""
        remote = self.pool.remote_workers if self.pool is not None else 0
        return (self.num_workers + remote) * self.prefetch

    def set_seed(self, seed: int) -> None:
        self.seed = int(seed)
        if self.mirror is not None:
            self.mirror(seed=self.seed)
        if self.user is not None:
            self.user.seed = self.seed
        if isinstance(self.sampler, OrderSampler):
            self.sampler.seed = self.seed

    # -- the order --------------------------------------------------------------------------------
    def rank_world(self) -> tuple[int, int, bool]:
        """``(rank, world_size, from_the_process_group)`` for the next iteration."""
        return distributed.rank_world_of(self.rank, self.world_size, self.sampler if reads_as_sharding(self.sampler)
                                         else None)

    def order(self, collective: bool = True):
        """The order of the next iteration: a user's sampler, or feedgpu's sharded order for the
        rank and world size of now. ``collective``: on a process group's world size met for the
        first time, check with every rank that they hold the same data and take rank 0's seed."""
        if self.user is not None:
            return self.user
        rank, world, grouped = self.rank_world()
        n = None
        if collective and grouped and world not in self.agreed:
            n, seed = distributed.agree(self.num_samples, self.seed)
            self.agreed.add(world)
            if seed != self.seed:
                self.shutdown()  # workers and buffers are rebuilt with the common seed
                self.set_seed(seed)
        n = self.num_samples() if n is None else n
        if reads_as_sharding(self.sampler):   # torch's split of the sampler (feedgpu.order.sampler_split)
            self.order_cache = split_order(self.sampler, n, self.batch_size, self.drop_last, self.order_cache)
        else:
            self.order_cache = sharded(n, self.batch_size, self.shuffle, self.seed, rank, world, self.drop_last,
                                       self.order_cache, *shard_settings(self.pipeline))
        return self.order_cache

    def __len__(self) -> int:
        return len(self.order(collective=False))

    def set_epoch(self, epoch: int) -> None:
        """See :meth:`feedgpu.DataLoader.set_epoch`."""
        epoch = int(epoch)
        if reads_as_sharding(self.sampler):   # the sampler's epoch chooses the order: it follows
            self.sampler.set_epoch(epoch)
            self.sharding_epoch = epoch
        self.drives_sampler_epoch = self.user is not None
        self.seeks += 1
        if self.restored is not None and self.restored[0] == epoch:
            epoch, self.start = self.restored
        else:
            self.start = 0
        self.restored = None
        self.position.seek(epoch, self.start)

    def follow_sampler_epoch(self) -> None:
        """Choose the next epoch from the ``DistributedSampler`` given as ``sampler``, as torch's loader
        does: the sampler's ``epoch``, which only its ``set_epoch`` changes (an epoch without
        ``set_epoch`` repeats the order of the one before). A state loaded since the last
        iteration keeps its epoch and position unless ``set_epoch`` chose another epoch."""
        e = int(self.sampler.epoch)
        if e != self.sharding_epoch:
            self.sharding_epoch = e
            self.set_epoch(e)
        elif self.restored is None and self.position.next_epoch != e:
            self.position.next_epoch, self.start = e, 0

    # -- iteration ----------------------------------------------------------------------------------
    def __iter__(self):
        self.close_live(superseded=True)
        self.begin()
        if reads_as_sharding(self.sampler):
            self.follow_sampler_epoch()   # the DistributedSampler's epoch, as torch's loader reads it
        order = self.order()
        pos = self.position
        if self.user is not None:  # a user's sampler keeps its owner's epoch (UserOrder.epoch_for)
            pos.next_epoch = self.user.epoch_for(pos.next_epoch, self.restored is not None or self.drives_sampler_epoch)
        if self.start and order.seekable and self.start >= order.end():
            pos.next_epoch, self.start = pos.next_epoch + 1, 0  # the restored epoch was complete
        self.restored = None
        it = EpochRunner(self, order, pos.next_epoch, self.start, deferred_commit=self.deferred_commit)
        self.start = 0
        self.live = weakref.ref(it)  # dropping the iterator (break, del) stops its workers
        return self.wrap(it)

    #: batches count as seen when a device prefetcher hands them to the training loop (pipelines on CUDA)
    deferred_commit = False

    def close_live(self, superseded: bool = False) -> None:
        close_live(self.live, superseded)
        self.live = None

    def live_iterator(self):
        """The running pass's :class:`EpochRunner`, None when there is none."""
        return self.live() if self.live is not None else None

    def take_ahead(self) -> Ahead | None:
        """The next epoch's batches a finished pass left submitted (taken: at most one pass adopts them)."""
        ahead, self.ahead = self.ahead, None
        return ahead

    def keep_ahead(self, ahead: Ahead) -> None:
        self.ahead = ahead

    # -- state --------------------------------------------------------------------------------------
    def source_fingerprint(self) -> str:
        if self.fingerprint is None:
            self.fingerprint = self.identity()
        return self.fingerprint

    def identity(self) -> str:
        """Which records, in which order (not their bytes): the kinds say how."""
        size = len(self.dataset) if hasattr(self.dataset, "__len__") else "unsized"
        return f"{type(self.dataset).__module__}.{type(self.dataset).__qualname__}:{size}"

    def state_dict(self) -> dict:
        order = self.order(collective=False)
        p = self.position
        return loader_state.make_state(self.source_fingerprint(), p.epoch, p.start, p.batches_seen,
                                       p.rows_seen if p.start else 0, self.seed, order.config(), order.seekable,
                                       order.known_len())

    def load_state_dict(self, state: dict) -> None:
        order = self.order(collective=False)
        fingerprint = loader_state.fingerprint_for(state, self.source_fingerprint(), self.pipeline)
        epoch, start, batches, rows, seed = loader_state.read_state(state, fingerprint, order.config(), order.seekable)
        self.shutdown()  # workers and buffers are rebuilt with the restored seed
        self.set_seed(seed)
        known = order.end()   # None: a sampler without len(), replayed to its end
        if known is not None and start >= known:
            epoch, start, batches, rows = epoch + 1, 0, 0, 0
        self.start = start
        self.position.seek(epoch, start, rows, batches)
        self.restored = (epoch, start) if start else None
        self.seeks += 1

    def unused_start(self, epoch: int, start: int, seeks: int) -> None:
        """A pass that began ``epoch`` at the restored position ``start`` ended before its first
        batch (an iterator made and dropped, as ``len(iter(loader))`` does): the next pass starts
        there again, unless ``set_epoch`` or ``load_state_dict`` chose since (``seeks``)."""
        if seeks == self.seeks and self.start == 0 and self.restored is None and self.position.next_epoch == epoch:
            self.start, self.restored = start, (epoch, start)

    # -- workers ------------------------------------------------------------------------------------
    def make_work(self):
        """The work of the passes (made once; :meth:`release_pool` with ``force`` drops it)."""
        if self.work is None:
            self.work = self.build_work()
        return self.work

    def apply_budget(self, plan: BudgetPlan) -> None:
        """Size the worker side by the memory budget's ``plan`` before the workers start: the
        balancer's prefetch bound and RAM limit, the prefetch depth (lowered once with a
        :class:`MemoryBudgetWarning`)."""
        auto = self.autoscaler
        if auto is not None:
            c = auto.policy.config
            if c.max_prefetch > plan.prefetch_cap:
                auto.policy.config = dataclasses.replace(c, max_prefetch=max(c.min_prefetch, plan.prefetch_cap))
                auto.prefetch = min(auto.prefetch, auto.policy.config.max_prefetch)
            auto.memory_budget = plan.total_bytes
        warning = plan.capped_warning(self.prefetch)
        if warning is not None:
            if not self.warned_prefetch_cap:
                self.warned_prefetch_cap = True
                warnings.warn(warning, MemoryBudgetWarning, stacklevel=7)
            self.set_live(self.num_workers, plan.prefetch_cap)
        self.memory_budget = plan.budget

    def plan_budget(self, sample_shape: tuple | None = None, dtype=None) -> BudgetPlan:
        """The memory budget's plan for the largest pool this loader may run."""
        auto = self.autoscaler
        workers = auto.policy.config.max_workers if auto is not None else max(1, self.num_workers)
        return plan_budget(self.options.worker_memory, workers, self.batch_size, sample_shape, dtype)

    def acquire_pool(self):
        """The running pool (see :func:`~feedgpu.exec.build.make_pool`)."""
        if self.pool is None or self.pool.closed:
            work, auto = self.make_work(), self.autoscaler
            remote = auto.remote if auto is not None else self.options.remote_start
            self.pool = make_pool(work, workers=self.num_workers, worker_init_fn=self.worker_init_fn,
                                  context=self.context, dataset=self.dataset, generator=self.generator,
                                  cached=self.cached, executor=self.options.executor, remote=remote)
        return self.pool

    def release_pool(self, force: bool = False) -> None:
        """Stop the workers unless they persist; ``force`` also frees the batch buffers (else kept for the
        next epoch's workers: no new page faults)."""
        if force:
            self.ahead = None  # its tasks die with the pool and its buffers with the work
        if self.pool is not None and (force or not self.persistent_workers):
            counters = self.pool.stats()
            if counters is not None:  # remote workers: counters kept for stats()
                self.executor_totals.add(counters)
            self.pool.close()
            self.pool = None
        if force and self.work is not None:
            self.work.close()
            self.work = None

    def stats(self) -> dict:
        """``DataLoader.stats()`` (:func:`~feedgpu.loader.stats.loader_stats`)."""
        return loader_stats(self)

    def worker_pids(self) -> list[int]:
        return self.pool.pids() if self.pool is not None and not self.pool.closed else []

    def shutdown(self) -> None:
        self.close_live()
        self.ahead = None
        self.release_pool(force=True)

    def __del__(self):
        # the loader and its iterator are gone (an iterator holds its backend): stop the workers
        try:
            self.shutdown()
        except Exception:
            pass
