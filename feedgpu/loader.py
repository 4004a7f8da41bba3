"""``feedgpu.DataLoader``: a drop-in replacement for ``torch.utils.data.DataLoader``."""
from __future__ import annotations

import itertools
import math
import weakref
import time
import warnings
from typing import Any, Callable

import numpy as np

from .errors import ConfigError, SkipBudgetExceeded, StateError
from .exec.assemble import Assembler
from .exec.autoscale import Autoscaler, cpu_cores, default_config
from .exec.process_pool import ProcessPool, draw_base_seed, resolve_context, unpack_exception
from .exec.work import DatasetWork, PipelineWork
from .metrics import ExecutorTotals, LoaderStats
from .cache.settings import CacheSettings
from .exec.engines import EngineSettings
from .exec.executors import ExecutorSettings, check_executor
from .pipeline import Pipeline, resolve_device
from .sampling import ShardedOrder
from .skips import SkipBudget, check_max_skipped, epoch_samples

STATE_FORMAT = "feedgpu.loader/1"
_UNSET: Any = object()
_tags = itertools.count(1)


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _UserOrder:
    """Batches from a user's ``sampler`` or ``batch_sampler``. Resuming replays the sampler for
    the epoch (after ``set_epoch`` when it has one) and skips the batches already seen, so the
    sampler must give the same order for the same epoch."""

    def __init__(self, n: int, sampler, batch_sampler, batch_size: int, drop_last: bool, seed: int):
        self.n, self.sampler, self.batch_sampler = n, sampler, batch_sampler
        self.batch_size, self.drop_last, self.seed = batch_size, drop_last, seed
        if batch_sampler is not None:
            self.num_batches = len(batch_sampler)
        else:
            k = len(sampler)
            self.num_batches = k // batch_size if drop_last else math.ceil(k / batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def batches(self, epoch: int):
        src = self.batch_sampler if self.batch_sampler is not None else self.sampler
        if hasattr(src, "set_epoch"):
            src.set_epoch(epoch)
        if self.batch_sampler is not None:
            for b in self.batch_sampler:
                yield np.asarray(list(b), dtype=np.int64)
            return
        it = iter(self.sampler)
        while True:
            chunk = list(itertools.islice(it, self.batch_size))
            if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                return
            yield np.asarray(chunk, dtype=np.int64)

    def spares(self, epoch: int, b: int, k: int) -> np.ndarray:
        return np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, epoch, b, 1]).integers(0, self.n, size=k)

    def config(self) -> dict:
        return {"sampler": type(self.batch_sampler or self.sampler).__name__, "n": self.n,
                "batch_size": self.batch_size, "drop_last": self.drop_last}


class DataLoader:
    """Iterate batches of a feedgpu :class:`Pipeline` or of any map-style torch Dataset.

    Accepts ``torch.utils.data.DataLoader``'s public arguments with the same meaning; for a
    :class:`Pipeline` the unset ones come from the pipeline (batch size, shuffle, drop_last,
    workers, prefetch, persistent workers, seed, timeout, on_error, device, cache). feedgpu's
    own keywords:

    Args:
        seed: base seed of the order and of random stages. Default: the pipeline's; for a torch
            Dataset drawn from ``generator`` (or torch's global RNG), as torch does.
        rank, world_size: shard for distributed training; default from ``torch.distributed`` when
            it is initialized, else 0 of 1. Every rank gets ``len(loader)`` batches. Taken from
            ``torch.distributed``, construction is collective and raises :class:`ConfigError` on
            every rank when a rank has no data or ranks hold different sample counts
            (:mod:`feedgpu.distributed`).
        device: for a pipeline, where batches are delivered (``"cpu"``, ``"cuda[:N]"``, ``"auto"``).
            On CUDA, batches are copied from pinned buffers on a side stream ``prefetch_factor``
            batches ahead, and normalize runs on the GPU.
        on_error: ``"skip"`` or ``"raise"`` for bad samples (pipelines only).
        max_skipped: skip budget per epoch and rank (pipelines only): a share in ``[0, 1]`` of
            the epoch's samples (default: the pipeline's, ``0.01``), an int count, or ``None``
            for no limit. Past it, iteration raises :class:`SkipBudgetExceeded` with the counts
            by reason and the first skipped samples (rules in :mod:`feedgpu.skips`).
        engine: for a pipeline, overrides its engine (``"python"``, ``"dali"`` or a mapping; see
            :class:`~feedgpu.exec.engines.EngineSettings`). With DALI, ``num_workers`` gives DALI's
            thread count unless ``engine.threads`` is set, and no worker process is started.
        executor: ``"local"``, ``"ray"`` or a mapping (see
            :class:`~feedgpu.exec.executors.ExecutorSettings`); for a pipeline, overrides its
            ``executor``. With ``"ray"`` batches also run on remote workers of a Ray cluster
            (:mod:`feedgpu.exec.ray_workers`) and reach the training loop in the same order, with
            the same sharding, random draws and ``state_dict()`` as the local pool; with
            ``num_workers=0`` all of them do. Under ``num_workers="auto"`` the balancer adds remote
            workers when the local pool is at its CPU budget and the training loop still waits,
            and releases them when it stops waiting. ``worker_init_fn`` runs in local workers only.
        cache: for a pipeline, overrides its cache setting (``False`` turns it off; ``True``, a
            directory or a mapping turns it on; see :class:`~feedgpu.cache.CacheSettings`). The
            first epoch fills the cache while training; later epochs and runs read it.
        num_workers: worker processes, 0 to load in the main process, or ``"auto"``: the
            throughput balancer (:mod:`feedgpu.exec.autoscale`) starts with half the cores and
            grows or shrinks the pool (and the prefetch depth, 1-4) while it runs, to deliver
            what the training loop consumes with the fewest workers. The batch order, random
            stages and ``state_dict()`` do not depend on the count. Default: the pipeline's
            (``"auto"`` unless set); for a torch Dataset 0, as in torch. With the DALI engine,
            ``"auto"`` gives DALI one thread per core but one (fixed while it runs).
        stats_callback: called after each balancer window as ``stats_callback(event)`` with the
            window's measurement and decision (dicts), to send them to your own logger.

    Yields :class:`~feedgpu.exec.work.Batch` ``(images, labels)`` for pipelines, ``collate_fn``'s
    output for torch Datasets. Batches from pipelines on the CPU view shared memory without a
    copy; the memory is reused once every tensor viewing it is gone.

    Raises :class:`ConfigError` for argument combinations it cannot honour: an
    ``IterableDataset``, ``batch_size=None``, ``collate_fn`` with a pipeline, a
    ``multiprocessing_context`` other than fork, ``in_order=False``,
    and the combinations torch rejects too.
    """

    def __init__(self, dataset, batch_size: int | None = _UNSET, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = _UNSET, collate_fn: Callable | None = None,
                 pin_memory: bool = False, drop_last: bool = _UNSET, timeout: float = _UNSET,
                 worker_init_fn: Callable[[int], None] | None = None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = _UNSET,
                 pin_memory_device: str = "", in_order: bool = True, seed: int | None = None,
                 rank: int | None = None, world_size: int | None = None, device: str | None = None,
                 on_error: str | None = None, cache=None, engine=None, max_skipped=_UNSET, executor=None,
                 stats_callback: Callable[[dict], None] | None = None):
        import torch.utils.data as tud

        if isinstance(dataset, tud.IterableDataset):
            raise ConfigError("feedgpu.DataLoader needs a map-style dataset or a Pipeline: an IterableDataset "
                              "has no random access, so shuffling, sharding and exact resume cannot be honoured")
        # as torch: None, a start method's name or a context object (ValueError/TypeError otherwise)
        self.multiprocessing_context = (None if multiprocessing_context is None
                                        else resolve_context(multiprocessing_context))
        self.generator = generator
        if not in_order:
            raise ConfigError("in_order=False: feedgpu always delivers batches in order (exact resume needs it)")
        if pin_memory_device:
            raise ConfigError("pin_memory_device is deprecated in torch; use device='cuda:N' instead")
        if batch_size is None:
            raise ConfigError("batch_size=None (unbatched loading) is not supported; give a batch size")
        self.pipeline = dataset if isinstance(dataset, Pipeline) else None
        p = self.pipeline
        if batch_sampler is not None:
            if batch_size is not _UNSET and batch_size != 1 or shuffle or sampler is not None or drop_last is True:
                raise ConfigError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                                  "and drop_last")
        if sampler is not None and shuffle:
            raise ConfigError("sampler option is mutually exclusive with shuffle")
        if (sampler is not None or batch_sampler is not None) and (rank is not None or world_size is not None):
            raise ConfigError("rank/world_size shard feedgpu's own sampler; with a custom sampler, shard in the sampler")
        self.dataset = dataset
        self.batch_size = int(batch_size if batch_size is not _UNSET else (p.batch_size if p else 1))
        self.shuffle = bool(shuffle if shuffle is not None else (p.shuffle if p and sampler is None and batch_sampler is None else False))
        self.drop_last = bool(drop_last if drop_last is not _UNSET else (p.drop_last if p else False))
        nw = num_workers if num_workers is not _UNSET else (p.num_workers if p else 0)
        self.auto_workers = nw == "auto"
        if not self.auto_workers and (isinstance(nw, bool) or not isinstance(nw, int) or nw < 0):
            raise ConfigError(f"num_workers must be an int >= 0 or 'auto', got {nw!r}")
        self.stats_callback = stats_callback
        self._autoscaler: Autoscaler | None = None
        self.num_workers = 1 if self.auto_workers else int(nw)  # the live count under "auto"
        if not self.auto_workers and self.num_workers > cpu_cores():
            warnings.warn(f"num_workers={self.num_workers} exceeds the {cpu_cores()} cores this process may use: the "
                          "workers compete for them and each one's start-up and memory add up; consider "
                          "num_workers='auto'", stacklevel=2)
        if self.num_workers == 0 and prefetch_factor is not None:
            raise ConfigError("prefetch_factor option could only be specified in multiprocessing; "
                              "let num_workers > 0 to enable multiprocessing")
        if persistent_workers is True and self.num_workers == 0:
            raise ConfigError("persistent_workers option needs num_workers > 0")
        persistent_default = persistent_workers is _UNSET
        if persistent_workers is _UNSET:
            persistent_workers = bool(p.persistent_workers and self.num_workers > 0) if p else False
        self.prefetch_factor = int(prefetch_factor if prefetch_factor is not None else (p.prefetch_factor if p else 2))
        self.timeout = float(timeout if timeout is not _UNSET else (p.timeout if p else 0.0))
        if self.timeout < 0:
            raise ConfigError("timeout option should be non-negative")
        self.persistent_workers = persistent_workers
        self.worker_init_fn = worker_init_fn
        self.pin_memory = pin_memory
        if p is not None:
            if collate_fn is not None:
                raise ConfigError("collate_fn cannot be used with a feedgpu Pipeline: batches are assembled in "
                                  "shared memory by the stages; end the pipeline with a batch stage instead")
            self.on_error = on_error or p.on_error
            self.max_skipped = check_max_skipped(p.max_skipped if max_skipped is _UNSET else max_skipped)
            self.device = resolve_device(device or p.device)
            self.cache_settings = p.cache if cache is None else CacheSettings.make(cache)
            if engine is not None:
                import copy

                p = self.pipeline = copy.copy(p)
                p.engine = EngineSettings.make(engine)
                if p.engine.name == "dali":
                    from .exec.dali_engine import check_dali_plan
                    from .exec.plan import make_plan

                    check_dali_plan(make_plan(p.stages, "cpu"))
            self.engine = p.engine
            self.executor = p.executor if executor is None else ExecutorSettings.make(executor)
            if self.engine.name == "dali" and self.cache_settings is not None:
                raise ConfigError("cache and engine 'dali' cannot be combined yet: the DALI engine reads the "
                                  "source directly; use engine: python with a cache")
        else:
            self.engine = EngineSettings()
            self.executor = ExecutorSettings.make(executor)
            if on_error is not None or device is not None or cache is not None or engine is not None \
                    or max_skipped is not _UNSET:
                raise ConfigError("on_error, max_skipped, device, cache and engine apply to feedgpu Pipelines; for a torch Dataset, errors "
                                  "raise as in torch and pin_memory moves nothing to the GPU")
            self.on_error, self.device, self.cache_settings, self.max_skipped = "raise", "cpu", None, None
            if collate_fn is not None and hasattr(dataset, "make_work"):
                raise ConfigError("collate_fn cannot be used with a dataset that assembles its own batches "
                                  "(a feedgpu.tabular.TablePipeline)")
            self.collate_fn = collate_fn or tud.default_collate
        check_executor(self.executor, self.engine, self.cache_settings)
        self._remote_start = self.executor.start_remote(self.auto_workers) if self.executor.remote else 0
        if self.executor.remote and self.num_workers == 0:
            if self._remote_start < 1:
                raise ConfigError("executor 'ray' with num_workers=0 runs every batch remotely: it needs "
                                  "executor.remote_workers >= 1")
            if persistent_default and p is not None:  # remote workers persist as local ones would
                self.persistent_workers = p.persistent_workers
        if seed is None:
            if p is not None and generator is None:
                seed = p.seed
            else:
                import torch

                seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        self.seed = int(seed)
        def count() -> int:
            return len(p.source) if p is not None else len(dataset)

        from . import distributed

        # ranks from torch.distributed: every rank must hold the same samples (checked, or it hangs)
        auto_dist = sampler is None and batch_sampler is None and rank is None and world_size is None
        n = distributed.agree_on_length(count) if auto_dist and distributed.initialized() else count()
        if sampler is not None or batch_sampler is not None:
            self._order = _UserOrder(n, sampler, batch_sampler, self.batch_size, self.drop_last, self.seed)
        else:
            r, w = _dist_rank_world() if rank is None and world_size is None else (rank or 0, world_size or 1)
            self._order = ShardedOrder(n, self.batch_size, shuffle=self.shuffle, seed=self.seed, rank=r,
                                       world_size=w, drop_last=self.drop_last)
        self._epoch = 0
        self._start = 0
        self._restored: tuple[int, int] | None = None   # set by load_state_dict until the next iteration
        self._position = (0, 0)
        self._rows_seen = 0
        self._fingerprint: str | None = None
        self._pool: ProcessPool | None = None
        self._ahead: _Ahead | None = None   # the next epoch's first batches, already submitted
        self._work = None
        self._live = None
        self._executor_totals = ExecutorTotals()
        self._stats = LoaderStats()
        if self.pin_memory:
            import torch

            if not torch.cuda.is_available():
                warnings.warn("pin_memory=True but no CUDA device is available; batches stay in pageable memory",
                              stacklevel=2)
                self.pin_memory = False
        if self.auto_workers:
            if self.engine.name == "dali":  # DALI's threads are fixed when its pipeline is built
                self.num_workers = max(1, cpu_cores() - 1)
            else:
                ex = self.executor
                cores = cpu_cores() if ex.max_local_workers is None else min(cpu_cores(), ex.max_local_workers)
                self._autoscaler = Autoscaler(prefetch=self.prefetch_factor, device=self.device,
                                              callback=stats_callback, config=default_config(cores),
                                              max_remote=ex.max_remote_workers if ex.remote else 0,
                                              remote=self._remote_start)
                self.num_workers, self.prefetch_factor = self._autoscaler.workers, self._autoscaler.prefetch

    # -- torch DataLoader surface --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._order)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (its order and its random stages), from its start.

        Right after :meth:`load_state_dict`, ``set_epoch`` of the restored epoch keeps the restored
        position (a loop ``for epoch in range(start, n): loader.set_epoch(epoch)`` resumes mid-epoch
        without repeating batches); any other epoch starts from its first batch."""
        epoch = int(epoch)
        if self._restored is not None and self._restored[0] == epoch:
            self._epoch, self._start = self._restored
        else:
            self._epoch, self._start = epoch, 0
        self._restored = None
        self._position = (self._epoch, self._start)

    @property
    def _dali_gpu(self) -> bool:
        return self.engine.name == "dali" and self.engine.dali_device(self.device) == "gpu"

    def __iter__(self):
        self._close_live()
        self._restored = None
        on_device = self.pipeline is not None and self.device != "cpu" and not self._dali_gpu
        it = _EpochIterator(self, self._epoch, self._start, deferred_commit=on_device)
        self._start = 0
        self._live = weakref.ref(it)  # dropping the iterator (break, del) stops its workers
        if on_device:
            from .prefetch import CudaPrefetcher

            plan = self.pipeline.plan(self.device)
            return CudaPrefetcher(it, self.device, plan.batch_stage if plan.batch_on_device else None,
                                  depth=self.prefetch_factor)
        return it

    def _close_live(self) -> None:
        it = self._live() if self._live is not None else None
        if it is not None:
            it.close()
        self._live = None

    # -- state ------------------------------------------------------------------------------
    def _source_fingerprint(self) -> str:
        if self._fingerprint is None:
            if self.pipeline is not None:
                self._fingerprint = self.pipeline.source.identity()
            else:
                d = self.dataset
                self._fingerprint = d.identity() if hasattr(d, "make_work") else \
                    f"{type(d).__module__}.{type(d).__qualname__}:{len(d)}"
        return self._fingerprint

    def state_dict(self) -> dict:
        """``{format, fingerprint, epoch, batches_seen, samples_seen, seed, sampler}``: where the
        training loop is, counted in batches it received (prefetched ones are not counted)."""
        epoch, b = self._position
        return {"format": STATE_FORMAT, "fingerprint": self._source_fingerprint(), "epoch": epoch,
                "batches_seen": b, "samples_seen": self._rows_seen if b else 0, "seed": self.seed,
                "sampler": self._order.config(), "num_batches": len(self)}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next batch is the one the saved run would have got.

        Raises :class:`StateError` when the state comes from another dataset, batch size, sampler
        or world size (the differences are listed)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateError(f"not a feedgpu loader state (format {STATE_FORMAT!r} expected)")
        if state["fingerprint"] != self._source_fingerprint():
            raise StateError("the state was saved for another dataset (source fingerprint differs)")
        mine, theirs = dict(self._order.config()), dict(state["sampler"])
        mine.pop("seed", None)
        theirs.pop("seed", None)
        diff = {k: (theirs.get(k), mine.get(k)) for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
        if diff:
            raise StateError("the state's sampler differs from this loader's: " +
                             ", ".join(f"{k}: saved {a!r}, here {b!r}" for k, (a, b) in sorted(diff.items())))
        self.shutdown()  # workers and buffers are rebuilt with the restored seed
        self.seed = int(state["seed"])
        if isinstance(self._order, ShardedOrder):
            c = self._order.config()
            c.pop("n")
            c["seed"] = self.seed
            self._order = ShardedOrder(self._order.n, **c)
        else:
            self._order.seed = self.seed
        epoch, b = int(state["epoch"]), int(state["batches_seen"])
        if b >= len(self):
            epoch, b = epoch + 1, 0
        self._epoch, self._start, self._position = epoch, b, (epoch, b)
        self._restored = (epoch, b) if b else None
        self._rows_seen = int(state.get("samples_seen", 0))

    # -- observability -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters since the loader was made: batches, samples, rate, consumer wait, seconds per
        stage (summed over workers), skipped samples by reason and the last skipped keys, the
        latest iteration's skip budget (``{max_skipped, limit, epoch, skipped, by_reason}``,
        ``None`` before the first), the cache's state (``None`` without a cache) and the executor
        (``{"name": "local"}``; with Ray the remote workers, batches run on each side, and the
        batches redone after a remote worker died with the reasons, see
        :meth:`~feedgpu.metrics.ExecutorTotals.report`)."""
        d = self._stats.as_dict()
        d.update(num_workers=self.num_workers, prefetch_factor=self.prefetch_factor, epoch=self._position[0],
                 batches_seen=self._position[1])
        d["balancer"] = self._autoscaler.stats() if self._autoscaler is not None else None
        live = self._live() if self._live is not None else None
        d["skip_budget"] = live.budget.as_dict() if live is not None else None
        d["engine"] = self._work.stats() if hasattr(self._work, "stats") else {"name": self.engine.name}
        live_pool = self._pool if self._pool is not None and not self._pool.closed and hasattr(self._pool, "stats") \
            else None
        d["executor"] = self._executor_totals.report(self.executor, live_pool.stats() if live_pool else None)
        entry = getattr(getattr(self._work, "assembler", None), "cache", None)
        if entry is not None:
            entry.refresh()
            d["cache"] = {"dir": str(entry.dir), "cached": entry.cached, "quarantined": len(entry.quarantined),
                          "samples": entry.n, "complete": entry.complete}
        else:
            d["cache"] = None
        return d

    @property
    def balancer(self) -> Autoscaler | None:
        """The :class:`~feedgpu.exec.autoscale.Autoscaler` sizing the pool under
        ``num_workers="auto"`` (its ``timeline`` and ``measurements`` hold every window), else None."""
        return self._autoscaler

    def worker_pids(self) -> list[int]:
        return self._pool.pids() if self._pool is not None and not self._pool.closed else []

    # -- workers --------------------------------------------------------------------------------
    def _make_work(self):
        if self._work is None:
            inflight = self.num_workers * self.prefetch_factor
            most = inflight
            if self._autoscaler is not None:  # buffers for the largest pool the balancer may choose
                c = self._autoscaler.policy.config
                most = max(inflight, (c.max_workers + self._autoscaler.max_remote) * c.max_prefetch)
            elif self.executor.remote:
                inflight = most = (self.num_workers + self._remote_start) * self.prefetch_factor
            if self.pipeline is not None and self.engine.name == "dali":
                from .exec.dali_engine import DaliWork

                p = self.pipeline
                plan = p.plan(self.device)
                dd = self.engine.dali_device(self.device)
                dev_id = int(self.device.split(":")[1]) if self.device.startswith("cuda:") else 0
                self._work = DaliWork(p.source, plan, self.seed, self.on_error, self.batch_size, device=dd,
                                      threads=self.engine.threads or max(1, self.num_workers), device_id=dev_id,
                                      hw_decoder_load=self.engine.hw_decoder_load,
                                      window_decode=self.engine.window_decode,
                                      in_dali_batch_stage=not plan.batch_on_device, ahead=self.prefetch_factor)
            elif self.pipeline is not None:
                p = self.pipeline
                plan = p.plan(self.device)
                entry = None
                if self.cache_settings is not None:
                    from .cache import open_entry

                    entry = open_entry(self.cache_settings, p.source, p.stages, plan)
                asm = Assembler(p.source, plan, self.seed, self.on_error, cache=entry)
                self._work = PipelineWork(asm, self.batch_size, most, populate=inflight)
                if self._autoscaler is not None:
                    self._autoscaler.buffer_bytes = self._work.slots.nbytes * (inflight + self._work.keep_views)
            elif hasattr(self.dataset, "make_work"):  # a dataset that batches itself (feedgpu.tabular)
                self._work = self.dataset.make_work(self.seed)
            else:
                self._work = DatasetWork(self.dataset, self.collate_fn, self.seed)
        return self._work

    def _acquire_pool(self):
        """The running pool: a :class:`ProcessPool`, or with ``executor: ray`` a
        :class:`~feedgpu.exec.mixed_pool.MixedPool` (local workers, if any, and remote ones)."""
        if self._pool is None or self._pool.closed:
            work = self._make_work()
            local = None
            if self.num_workers > 0:
                # with a cache, workers get time to write their last rows when they stop
                local = ProcessPool(work.handle, self.num_workers, self.worker_init_fn, on_exit=work.on_exit,
                                    grace_s=10.0 if self.cache_settings is not None else 1.0,
                                    describe=getattr(work, "describe", None), on_start=getattr(work, "on_start", None),
                                    context=self.multiprocessing_context, dataset=self.dataset,
                                    base_seed=draw_base_seed(self.generator))  # per pool start (torch: per iterator)
            if not self.executor.remote:
                self._pool = local
            else:
                from .exec.mixed_pool import MixedPool

                remote = self._autoscaler.remote if self._autoscaler is not None else self._remote_start
                try:
                    self._pool = MixedPool(local, work.remote_handler(), work.land, remote, self.executor)
                except BaseException:
                    if local is not None:
                        local.close()
                    raise
        return self._pool

    def _inflight_limit(self) -> int:
        """Batches in flight at most: ``prefetch_factor`` per worker, local and remote."""
        remote = self._pool.remote_workers if self._pool is not None and hasattr(self._pool, "remote_workers") else 0
        return (self.num_workers + remote) * self.prefetch_factor

    def _release_pool(self, force: bool = False) -> None:
        """Stop the workers unless they persist; ``force`` also frees the batch buffers, which
        otherwise outlive the pool and serve the next epoch's workers (no new page faults)."""
        if force:
            self._ahead = None  # its tasks die with the pool and its buffers with the work
        if self._pool is not None and (force or not self.persistent_workers):
            if hasattr(self._pool, "stats"):  # remote workers: counters kept for stats()
                self._executor_totals.add(self._pool.stats())
            self._pool.close()
            self._pool = None
        if force and self._work is not None:
            self._work.close()
            self._work = None

    def shutdown(self) -> None:
        """Stop the workers now (also done at epoch end unless ``persistent_workers``, on errors
        and at garbage collection)."""
        self._close_live()
        self._ahead = None
        self._release_pool(force=True)

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


class _Ahead:
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


class _EpochIterator:
    """One pass over an epoch's batches, from batch ``start``; batches come out in order."""

    def __init__(self, loader: DataLoader, epoch: int, start: int, deferred_commit: bool = False):
        self.loader, self.epoch, self.next_b = loader, epoch, start
        # With device prefetch, a batch counts as seen when the prefetcher hands it to the
        # training loop (it calls commit()), not when it leaves the CPU pool.
        self.deferred = deferred_commit
        self.uncommitted: list[tuple[int, int]] = []
        self.nb = len(loader)
        self.tag = next(_tags)
        self.closed = False
        self.pending: dict[int, tuple] = {}      # seq -> task (submitted, result not yet used)
        self.ready: dict[int, tuple] = {}        # seq -> (task, ok, payload)
        order = loader._order
        if isinstance(order, ShardedOrder):
            self._batches = (order.batch(epoch, b) for b in range(start, self.nb))
        else:
            self._batches = itertools.islice(order.batches(epoch), start, None)
        self.submitted = start
        self.budget = SkipBudget(loader.max_skipped, epoch_samples(order), epoch)
        self._bad: set[str] = set()   # keys skipped in this epoch
        self._peeked: dict[int, np.ndarray] = {}   # inline mode: batch -> indices, read ahead
        self._peeked_to = start
        self.inline = (loader.num_workers == 0 and not loader.executor.remote) or loader.engine.name == "dali"
        self.work = loader._make_work()
        self.work.refresh()  # workers forked below inherit an up-to-date cache index
        self.pool = None if self.inline else loader._acquire_pool()
        if self.pool is not None and loader._autoscaler is not None:
            loader._autoscaler.start(self.pool.pids())
        self.ahead: _Ahead | None = None     # the next epoch's batches this iterator submits
        self._adopt(loader, order, epoch, start)
        loader._position = (epoch, start)
        if start == 0:
            loader._rows_seen = 0
        self._fill()

    def _adopt(self, loader: DataLoader, order, epoch: int, start: int) -> None:
        """Take over the batches the previous iteration submitted for this epoch, if they fit."""
        ahead, loader._ahead = loader._ahead, None
        if ahead is None:
            return
        if ahead.epoch != epoch or start != 0 or ahead.pool is not self.pool or self.pool is None:
            ahead.drop(self.work)
            return
        self.tag, self.pending, self.ready = ahead.tag, ahead.pending, ahead.ready
        self.submitted = ahead.submitted
        self._batches = (order.batch(epoch, b) for b in range(self.submitted, self.nb))

    def _lookahead_ok(self) -> bool:
        loader = self.loader
        # not with a cache: its rows become readable at the epoch-end flush, which must come first
        return (loader.persistent_workers and isinstance(loader._order, ShardedOrder) and self.pool is not None
                and loader.cache_settings is None)

    def _indices(self, b: int) -> np.ndarray:
        """Indices of batch ``b`` (inline mode reads ``prefetch_factor`` batches ahead)."""
        while self._peeked_to <= b:
            self._peeked[self._peeked_to] = next(self._batches)
            self._peeked_to += 1
        for old in [k for k in self._peeked if k < self.next_b]:
            del self._peeked[old]
        return self._peeked[b]

    def _spares(self, b: int, size: int, epoch: int | None = None) -> np.ndarray:
        epoch = self.epoch if epoch is None else epoch
        return self.loader._order.spares(epoch, b, max(4, size)) if self.loader.pipeline is not None \
            else np.zeros(0, np.int64)

    def _submit(self, tag: int, seq: int, epoch: int, indices: np.ndarray, pending: dict) -> None:
        task = self.work.task(tag, seq, epoch, indices, self._spares(seq, len(indices), epoch))
        self.pool.submit(task)
        pending[seq] = task

    def _fill(self) -> None:
        limit = self.loader._inflight_limit()
        while (self.submitted < self.nb and len(self.pending) + len(self.ready) < limit
               and self.work.can_submit()):
            self._submit(self.tag, self.submitted, self.epoch, next(self._batches), self.pending)
            self.submitted += 1
        if self.submitted < self.nb or not self._lookahead_ok():
            return
        # this epoch is all submitted: start the next one's first batches with the spare capacity
        nxt = self.epoch + 1
        if self.ahead is None:
            self.ahead = _Ahead(nxt, self.pool)
        a = self.ahead
        while (a.submitted < self.nb and len(self.pending) + len(self.ready) + len(a) < limit
               and self.work.can_submit()):
            self._submit(a.tag, a.submitted, nxt, self.loader._order.batch(nxt, a.submitted), a.pending)
            a.submitted += 1

    def __iter__(self):
        return self

    def __next__(self):
        if self.closed or self.next_b >= self.nb:
            self.close()
            raise StopIteration
        b = self.next_b
        t0 = time.perf_counter()
        try:
            if self.inline:
                indices = self._indices(b)
                if hasattr(self.work, "prefetch"):  # DALI: start this and the next batches, in order
                    for k in range(b, min(self.nb, b + 1 + self.loader.prefetch_factor)):
                        ks = self._indices(k)
                        self.work.prefetch(k, self.epoch, ks, self._spares(k, len(ks)))
                batch, report = self.work.run_inline(b, self.epoch, indices, self._spares(b, len(indices)))
            else:
                batch, report = self._wait(b)
        except BaseException:
            self.close()
            self.loader._release_pool(force=True)  # after an error, even persistent workers restart
            raise
        loader = self.loader
        if report is not None:
            if report.skipped:  # a bad sample met again as another's spare: one skip per epoch
                report.skipped = [s for s in report.skipped if s[0] not in self._bad]
                self._bad.update(key for key, _, _ in report.skipped)
            loader._stats.add_report(report)
            if report.skipped:
                try:
                    self.budget.add(report.skipped)
                except SkipBudgetExceeded:
                    self.close()
                    loader._release_pool(force=True)
                    raise
        rows = _rows(batch)
        waited = time.perf_counter() - t0
        loader._stats.delivered(rows, waited)
        if loader._autoscaler is not None and not self.inline:
            d = loader._autoscaler.on_batch(rows, waited, self.pool.pids(),
                                            remote_started=getattr(self.pool, "remote_started", None))
            if d is not None and d.changes:
                self._apply(d)
        self.next_b = b + 1
        if loader.pin_memory:
            batch = _pin(batch)
        if self.deferred:
            self.uncommitted.append((b, rows))
        else:
            self._commit(b, rows)
        if self.next_b >= self.nb:
            self.close()
        return batch

    def _apply(self, d) -> None:
        """Resize the pool and the prefetch depth between two batches (the epoch goes on)."""
        loader = self.loader
        if d.workers != self.pool.num_workers:
            self.pool.resize(d.workers)
        if d.remote_workers != getattr(self.pool, "remote_workers", 0):
            self.pool.resize_remote(d.remote_workers)
        loader.num_workers, loader.prefetch_factor = d.workers, d.prefetch
        self._fill()

    def commit(self) -> None:
        """The oldest batch handed out by this iterator has reached the training loop."""
        self._commit(*self.uncommitted.pop(0))

    def _commit(self, b: int, rows: int) -> None:
        loader = self.loader
        if b + 1 >= self.nb:  # the epoch is complete: the next iteration starts the next one
            loader._epoch = self.epoch + 1
            loader._position = (self.epoch + 1, 0)
            loader._rows_seen = 0
        else:
            loader._position = (self.epoch, b + 1)
            loader._rows_seen += rows

    def _wait(self, b: int):
        while b not in self.ready:
            tag, seq, wid, ok, payload = self.pool.get(self.loader.timeout or None)
            if tag is None:  # worker_init_fn failed
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
            raise unpack_exception(payload, f"while assembling batch {b} of epoch {self.epoch}")
        batch = self.work.finish(task, payload)
        self._fill()
        report = payload if self.loader.pipeline is not None else None
        return batch, report

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        keep_pool = self.loader.persistent_workers
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
                self.loader._ahead = self.ahead
            else:
                self.ahead.drop(self.work)
            self.ahead = None
        if self.inline:
            self.work.on_exit()  # workers do this when they stop
        elif keep_pool and self.loader.cache_settings is not None and not self.pool.closed:
            self._flush_workers()
        self.loader._release_pool()

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
    first = batch[0] if isinstance(batch, (tuple, list)) else (next(iter(batch.values())) if isinstance(batch, dict) else batch)
    return len(first) if hasattr(first, "__len__") else 1


def _pin(batch):
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_pin(x) for x in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_pin(x) for x in batch)
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    return batch
