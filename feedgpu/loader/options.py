"""A :class:`feedgpu.DataLoader`'s options: torch's keywords and the pipeline resolved once.

:class:`LoaderOptions` is frozen and made once, in the loader's constructor
(:meth:`LoaderOptions.resolve`): the loader settings
(:meth:`~feedgpu.settings.LoaderSettings.from_torch`: torch's keywords over the pipeline's
``loader:`` section, or over torch's defaults for a torch Dataset, checked there in torch's words),
the device, the cache, the engine and the executor, the collate function. The loader's live
worker count and prefetch depth (which the balancer changes) start from it.

The argument combinations torch refuses are refused here too, in torch's words
(:func:`refuse_combinations`), and :data:`UNSET` marks a keyword that was not given.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch.utils.data as tud

from ..cache.settings import CacheSettings
from ..errors import ConfigError
from ..host import cpu_cores
from ..exec.engines import EngineSettings
from ..exec.executors import ExecutorSettings, check_executor
from ..pipeline import Pipeline, resolve_device
from ..settings import TORCH_DEFAULTS, LoaderSettings, parse_worker_memory

__all__ = ["LoaderOptions", "UNSET", "refuse_combinations", "refuse_unagreed_seed"]

#: an argument not given (``None`` means something for several of them)
UNSET: Any = object()


def refuse_unagreed_seed(shuffle: bool, rank, world_size) -> None:
    """Refuse a shuffled order sharded by the loader's own ``rank``/``world_size`` whose seed
    would be drawn from each process's torch RNG: given explicitly, the ranks do not exchange
    rank 0's seed (as they do when the shards come from ``torch.distributed``), and ranks whose
    RNGs differ would read overlapping shards (samples repeated, others never read). Called when
    neither ``seed``, a ``generator`` nor a pipeline gives the seed. Raises :class:`ConfigError`."""
    if shuffle and (world_size or 1) > 1:
        raise ConfigError(f"rank={rank}, world_size={world_size} shard a shuffled order whose seed each process "
                          "draws from its own torch RNG: "
                          "give seed= (the same on every rank) or a generator seeded alike, so that every rank "
                          "draws the same permutation")


def refuse_combinations(in_order, pin_memory_device, batch_size, shuffle, sampler, batch_sampler, drop_last) -> None:
    """Raise :class:`ConfigError` for the argument combinations torch refuses (its own words) and
    for the two feedgpu cannot honour (``in_order=False``, ``pin_memory_device``)."""
    if not in_order:
        raise ConfigError("in_order=False: feedgpu always delivers batches in order (exact resume needs it)")
    if pin_memory_device:
        raise ConfigError("pin_memory_device is deprecated in torch; use device='cuda:N' instead")
    dropping = drop_last is not UNSET and bool(drop_last)   # torch tests truthiness, before drop_last's type
    if sampler is not None and shuffle:
        raise ConfigError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size is not UNSET and batch_size != 1 or shuffle or sampler is not None or dropping:
            raise ConfigError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                              "and drop_last")
    elif batch_size is None and dropping:
        raise ConfigError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")


#: torch's keywords that the loader settings hold (feedgpu's ``seed``, ``on_error``,
#: ``max_skipped`` and ``worker_memory`` too)
_SETTINGS_KEYS = ("batch_size", "shuffle", "drop_last", "num_workers", "prefetch_factor", "persistent_workers",
                  "timeout", "on_error", "max_skipped")
#: feedgpu's keywords that apply to a pipeline only
_PIPELINE_ONLY = ("on_error", "max_skipped", "device", "cache", "engine")


class _Unbatched:
    """``batch_size=None``: each sample through ``collate_fn`` alone (torch's ``default_convert``
    by default), as torch loads unbatched."""

    def __init__(self, collate_fn: Callable):
        self.collate_fn = collate_fn

    def __call__(self, items: list):
        return self.collate_fn(items[0])


def warn_many_workers(workers: int, stacklevel: int = 5) -> None:
    """Warn in torch's words (``UserWarning``) when more workers than the cores this process may
    use are asked for."""
    cores = cpu_cores()
    if workers > cores:
        warnings.warn(f"This DataLoader will create {workers} worker processes in total. Our suggested max number of "
                      f"worker in current system is {cores}, which is smaller than what this DataLoader is going to "
                      "create. Please be aware that excessive worker creation might get DataLoader running slow or "
                      "even freeze, lower the worker number to avoid potential slowness/freeze if necessary "
                      "(or let feedgpu choose: num_workers='auto').", stacklevel=stacklevel)


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """What a DataLoader runs with, resolved once (see the module docstring).

    Attributes:
        settings: the loader settings (batch size, drop_last, workers, prefetch depth, persistent
            workers, timeout, seed, on_error, max_skipped, worker_memory).
        pipeline: the pipeline run (the given one, with the ``engine``/``executor`` arguments),
            None for a torch Dataset.
        unbatched: ``batch_size=None`` (torch's unbatched loading; ``settings.batch_size`` is 1).
        shuffle: whether feedgpu's own order shuffles.
        device: where batches are delivered (``"cpu"`` for a torch Dataset).
        cache, engine, executor: the cache (None: off), engine and executor settings.
        collate: the collate function of a torch Dataset (None for a pipeline).
        remote_start: remote workers to start with (``executor: ray``).
    """

    settings: LoaderSettings
    pipeline: Pipeline | None
    unbatched: bool
    shuffle: bool
    device: str
    cache: CacheSettings | None
    engine: EngineSettings
    executor: ExecutorSettings
    collate: Callable | None
    remote_start: int

    @property
    def batch_size(self) -> int:
        return self.settings.batch_size

    @property
    def auto_workers(self) -> bool:
        """``num_workers="auto"``: the balancer sizes the pool (it starts from one worker)."""
        return self.settings.num_workers == "auto"

    @property
    def workers(self) -> int:
        """The worker count to start with (1 under ``"auto"``)."""
        return 1 if self.auto_workers else self.settings.num_workers

    @property
    def worker_memory(self):
        """The ``worker_memory`` budget as given (bytes, a size string or ``"auto"``)."""
        return self.settings.worker_memory

    @classmethod
    def resolve(cls, dataset, given: dict, own_order: bool) -> "LoaderOptions":
        """The options of a DataLoader over ``dataset`` (a :class:`Pipeline` or a map-style torch
        Dataset) from its keyword arguments ``given`` (name -> value, :data:`UNSET` or None where
        not given); ``own_order``: no ``sampler``/``batch_sampler`` was given (a pipeline's
        ``shuffle`` applies only then). Raises :class:`ConfigError` (``TypeError`` kinds where torch
        raises one) for what torch refuses and for combinations feedgpu cannot honour."""
        p = dataset if isinstance(dataset, Pipeline) else None
        unbatched = given["batch_size"] is None
        if unbatched and p is not None:
            raise ConfigError("batch_size=None (unbatched loading) needs a torch Dataset: a Pipeline assembles "
                              "whole batches in shared memory; give a batch size")
        refuse_combinations(given["in_order"], given["pin_memory_device"], given["batch_size"], given["shuffle"],
                            given["sampler"], given["batch_sampler"], given["drop_last"])
        if (given["sampler"] is not None or given["batch_sampler"] is not None) and \
                (given["rank"] is not None or given["world_size"] is not None):
            raise ConfigError("rank/world_size shard feedgpu's own sampler; with a sampler, shard in the sampler")
        base = p.loader if p is not None else TORCH_DEFAULTS
        if not own_order:
            base = dataclasses.replace(base, shuffle=False)
        # given ones only (None: torch's default, or unbatched loading for batch_size)
        torch_kw = {k: given[k] for k in _SETTINGS_KEYS if given[k] is not UNSET and given[k] is not None}
        if given["max_skipped"] is None:   # None is a value here: no limit
            torch_kw["max_skipped"] = None
        for k in ("on_error", "max_skipped"):   # checked below with the other pipeline-only keywords
            if p is None:
                torch_kw.pop(k, None)
        if given["executor"] is not None:
            executor = ExecutorSettings.make(given["executor"])
        else:   # the pipeline's, validated when it was made
            executor = p.executor if p is not None else ExecutorSettings()
        settings = LoaderSettings.from_torch(torch_kw, base, remote=executor.remote)
        if settings.num_workers != "auto":
            warn_many_workers(settings.num_workers)
        parse_worker_memory(given["worker_memory"])   # a ConfigError here, not at the first batch
        if given["worker_memory"] is not None:
            settings = dataclasses.replace(settings, worker_memory=given["worker_memory"])
        if p is not None:
            opts = cls._for_pipeline(p, given, settings, executor)
        else:
            opts = cls._for_dataset(dataset, given, settings, executor)
        check_executor(opts.executor, opts.engine, opts.cache)
        if opts.executor.remote and opts.workers == 0 and opts.remote_start < 1:
            raise ConfigError("executor 'ray' with num_workers=0 runs every batch remotely: it needs "
                              "executor.remote_workers >= 1")
        return opts

    @classmethod
    def _for_pipeline(cls, p: Pipeline, given: dict, settings: LoaderSettings,
                      executor: ExecutorSettings) -> "LoaderOptions":
        if given["collate_fn"] is not None:
            raise ConfigError("collate_fn cannot be used with a feedgpu Pipeline: batches are assembled in "
                              "shared memory by the stages; end the pipeline with a batch stage instead")
        device = resolve_device(given["device"] or p.device)
        cache = p.cache if given["cache"] is None else CacheSettings.make(given["cache"])
        if given["engine"] is not None:  # the pipeline the loader runs: this engine (and executor, checked together)
            over = {} if given["executor"] is None else {"executor": given["executor"]}
            p = p.replace(engine=given["engine"], **over)
            executor = p.executor
        if p.engine.name == "dali" and cache is not None:
            raise ConfigError("cache and engine 'dali' cannot be combined yet: the DALI engine reads the "
                              "source directly; use engine: python with a cache")
        remote = executor.start_remote(settings.num_workers == "auto") if executor.remote else 0
        return cls(settings, p, False, bool(settings.shuffle), device, cache, p.engine, executor, None, remote)

    @classmethod
    def _for_dataset(cls, dataset, given: dict, settings: LoaderSettings,
                     executor: ExecutorSettings) -> "LoaderOptions":
        if any(given[k] is not None and given[k] is not UNSET for k in _PIPELINE_ONLY):
            raise ConfigError("on_error, max_skipped, device, cache and engine apply to feedgpu Pipelines; for a torch "
                              "Dataset, errors raise as in torch and pin_memory moves nothing to the GPU")
        collate_fn = given["collate_fn"]
        if collate_fn is not None and hasattr(dataset, "make_work"):
            raise ConfigError("collate_fn cannot be used with a dataset that assembles its own batches "
                              "(a feedgpu.tabular.TablePipeline)")
        unbatched = given["batch_size"] is None
        default = tud.default_convert if unbatched else tud.default_collate
        collate = _Unbatched(collate_fn or default) if unbatched else (collate_fn or default)
        remote = executor.start_remote(settings.num_workers == "auto") if executor.remote else 0
        return cls(settings, None, unbatched, bool(settings.shuffle), "cpu", None, EngineSettings(), executor, collate,
                   remote)
