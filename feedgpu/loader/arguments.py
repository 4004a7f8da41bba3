"""Setting a :class:`feedgpu.DataLoader` up: feedgpu's own settings from its arguments and the
pipeline's, and the hand-over of an ``IterableDataset`` to :mod:`feedgpu.exec.iterable`."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch.utils.data as tud

from ..cache.settings import CacheSettings
from ..errors import ConfigError
from ..exec.autoscale import cpu_cores
from ..exec.engines import EngineSettings
from ..exec.executors import ExecutorSettings, check_executor
from ..pipeline import resolve_device

#: an argument not given (``None`` means something for several of them)
_UNSET: Any = object()


class ArgumentTypeError(ConfigError, TypeError):
    """An argument of the wrong type, where torch raises ``TypeError``."""


def worker_count(nw) -> tuple[bool, int]:
    """``(auto, workers)`` for ``num_workers`` (an int >= 0 or ``"auto"``; ``"auto"`` starts at 1).

    Raises :class:`ArgumentTypeError` for another type, :class:`ConfigError` for a negative
    count, in torch's words; warns (``UserWarning``, torch's words) when more workers than the
    cores this process may use are asked for."""
    if nw == "auto":
        return True, 1
    if isinstance(nw, bool) or not isinstance(nw, int):
        raise ArgumentTypeError(f"num_workers must be an int >= 0 or 'auto', got {nw!r}")
    if nw < 0:
        raise ConfigError("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
    cores = cpu_cores()
    if nw > cores:
        warnings.warn(f"This DataLoader will create {nw} worker processes in total. Our suggested max number of "
                      f"worker in current system is {cores}, which is smaller than what this DataLoader is going to "
                      "create. Please be aware that excessive worker creation might get DataLoader running slow or "
                      "even freeze, lower the worker number to avoid potential slowness/freeze if necessary "
                      "(or let feedgpu choose: num_workers='auto').", stacklevel=3)
    return False, int(nw)


class _Unbatched:
    """``batch_size=None``: each sample through ``collate_fn`` alone (torch's ``default_convert``
    by default), as torch loads unbatched."""

    def __init__(self, collate_fn: Callable):
        self.collate_fn = collate_fn

    def __call__(self, items: list):
        return self.collate_fn(items[0])


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
    dropping = drop_last is not _UNSET and bool(drop_last)   # torch tests truthiness, before drop_last's type
    if sampler is not None and shuffle:
        raise ConfigError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size is not _UNSET and batch_size != 1 or shuffle or sampler is not None or dropping:
            raise ConfigError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                              "and drop_last")
    elif batch_size is None and dropping:
        raise ConfigError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")


def with_sections(dataset, loader, output):
    """``dataset`` with the ``loader``/``output`` settings given to the DataLoader: a pipeline
    with those sections replaced (:meth:`Pipeline.replace`, validated); ``dataset`` itself when
    neither is given. Raises :class:`ConfigError` for a torch Dataset (it takes torch's keywords)."""
    if loader is None and output is None:
        return dataset
    from ..pipeline import Pipeline

    if not isinstance(dataset, Pipeline):
        raise ConfigError("loader=/output= settings objects go with a feedgpu Pipeline; a torch Dataset takes "
                          "torch's keywords (batch_size=, shuffle=, num_workers=, ...)")
    return dataset.replace(**{k: v for k, v in (("loader", loader), ("output", output)) if v is not None})


def init_iterable(self, dataset, given: dict) -> None:
    """Set ``self`` (a DataLoader) up to run an ``IterableDataset`` as torch does
    (:mod:`feedgpu.exec.iterable`); ``given`` holds the constructor's arguments."""
    from ..exec.iterable import runner_for_loader

    def arg(name, default):
        return default if given[name] is _UNSET else given[name]

    opts = {k: given[k] for k in ("seed", "rank", "world_size", "device", "on_error", "cache", "engine",
                                  "executor", "stats_callback")}
    opts["max_skipped"] = arg("max_skipped", None)
    r = self._iterable = runner_for_loader(
        dataset, shuffle=given["shuffle"], sampler=given["sampler"], batch_sampler=given["batch_sampler"],
        batch_size=arg("batch_size", 1), num_workers=arg("num_workers", 0), collate_fn=given["collate_fn"],
        pin_memory=given["pin_memory"], drop_last=arg("drop_last", False), timeout=arg("timeout", 0),
        worker_init_fn=given["worker_init_fn"], multiprocessing_context=given["multiprocessing_context"],
        generator=given["generator"], prefetch_factor=given["prefetch_factor"],
        persistent_workers=arg("persistent_workers", False), feedgpu_options=opts,
        in_order=given["in_order"], pin_memory_device=given["pin_memory_device"])
    self.dataset, self.pipeline, self.batch_size, self.drop_last = dataset, None, r.batch_size, r.drop_last
    self.num_workers, self.prefetch_factor, self.timeout = r.num_workers, r.prefetch_factor, r.timeout
    self.collate_fn, self.worker_init_fn, self.pin_memory = r.collate_fn, r.worker_init_fn, r.pin_memory
    self.persistent_workers, self.generator, self.sampler, self.batch_sampler = r.persistent_workers, \
        given["generator"], None, None
    self.pin_memory_device, self.in_order, self.shuffle = given["pin_memory_device"], given["in_order"], False
    self.multiprocessing_context = given["multiprocessing_context"] if r.num_workers > 0 else None
    self._frozen = True

def resolve_settings(self, dataset, p, collate_fn, device, on_error, cache, engine, max_skipped, executor,
                 unbatched) -> None:
    """Resolve ``self``'s (a DataLoader's) feedgpu settings into private attributes (the public
    ones keep what was given). Raises :class:`ConfigError` for combinations it cannot honour."""
    if p is not None:
        if collate_fn is not None:
            raise ConfigError("collate_fn cannot be used with a feedgpu Pipeline: batches are assembled in "
                              "shared memory by the stages; end the pipeline with a batch stage instead")
        # the loader's overrides of the pipeline's settings, validated by the settings classes
        over = {} if on_error is None else {"on_error": on_error}
        if max_skipped is not _UNSET:
            over["max_skipped"] = max_skipped
        loader = dataclasses.replace(p.loader, **over) if over else p.loader
        self._on_error, self._max_skipped = loader.on_error, loader.max_skipped
        self._device = resolve_device(device or p.device)
        self._cache_settings = p.cache if cache is None else CacheSettings.make(cache)
        if engine is not None:  # the pipeline the loader runs: this engine (and executor, checked together)
            p = self.pipeline = p.replace(engine=engine, **({} if executor is None else {"executor": executor}))
        self._engine = p.engine
        self._executor = p.executor if executor is None else ExecutorSettings.make(executor)
        if self._engine.name == "dali" and self._cache_settings is not None:
            raise ConfigError("cache and engine 'dali' cannot be combined yet: the DALI engine reads the "
                              "source directly; use engine: python with a cache")
        self._collate = None
    else:
        self._engine = EngineSettings()
        self._executor = ExecutorSettings.make(executor)
        if on_error is not None or device is not None or cache is not None or engine is not None \
                or max_skipped not in (_UNSET, None):
            raise ConfigError("on_error, max_skipped, device, cache and engine apply to feedgpu Pipelines; for a torch Dataset, errors "
                              "raise as in torch and pin_memory moves nothing to the GPU")
        self._on_error, self._device, self._cache_settings, self._max_skipped = "raise", "cpu", None, None
        if collate_fn is not None and hasattr(dataset, "make_work"):
            raise ConfigError("collate_fn cannot be used with a dataset that assembles its own batches "
                              "(a feedgpu.tabular.TablePipeline)")
        default = tud.default_convert if unbatched else tud.default_collate
        self._collate = _Unbatched(collate_fn or default) if unbatched else (collate_fn or default)
    check_executor(self._executor, self._engine, self._cache_settings)
    self._remote_start = self._executor.start_remote(self.auto_workers) if self._executor.remote else 0
    if self._executor.remote and self.num_workers == 0 and self._remote_start < 1:
        raise ConfigError("executor 'ray' with num_workers=0 runs every batch remotely: it needs "
                          "executor.remote_workers >= 1")
