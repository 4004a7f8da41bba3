"""``feedgpu.DataLoader``: a drop-in replacement for ``torch.utils.data.DataLoader``.

This module is the torch-facing front: torch's arguments and attributes. The loader picks a
backend for its kind of dataset once (:func:`pick_backend`; the kinds and their protocol:
:mod:`feedgpu.loader.backend`), which resolves the options (:mod:`feedgpu.loader.options`), and
delegates to it: iteration, ``len()``, ``set_epoch``, ``state_dict``, workers and counters.
"""
from __future__ import annotations

import weakref
from typing import Callable, TypeVar

import torch.utils.data as tud

from ..cache.settings import CacheSettings
from ..balancer.autoscale import Autoscaler
from ..errors import ConfigError
from ..exec.engines import EngineSettings
from ..pipeline import Pipeline
from ..torchvision import backend_for, dali_pipeline
from .backend import Backend
from .iterable import IterableBackend
from .kinds import DatasetBackend, PipelineBackend, TorchvisionDaliBackend, TorchvisionDatasetBackend
from .options import UNSET, LoaderOptions
from .read_ahead import ReadAhead

__all__ = ["DataLoader", "pick_backend"]

T_co = TypeVar("T_co", covariant=True)
# torch's DataLoader refuses to change these once it is built (ValueError); so does feedgpu's, and
# its skip budget, which the backend holds
_FROZEN = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers", "max_skipped")
#: torch's attributes a map-style backend reads when a pass starts (its name for them): assigned after
#: construction (Lightning sets ``worker_init_fn``), they reach the backend, as torch reads its own
_FORWARDED = {"worker_init_fn": "worker_init_fn", "multiprocessing_context": "context", "generator": "generator",
              "timeout": "timeout", "pin_memory": "pin_memory", "num_workers": "num_workers"}
#: feedgpu's own keywords and torch's passed through, kept as given (frameworks re-create the
#: loader from its attributes)
_GIVEN = ("rank", "world_size", "device", "on_error", "cache", "engine", "executor", "stats_callback",
          "worker_memory", "worker_init_fn", "pin_memory_device", "in_order", "generator")


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
            torch splits it, with its seed and epoch (:mod:`feedgpu.order.sampler_split`).
            Taken from ``torch.distributed``, construction (when it is initialized by then) and
            the first iteration on a world size are collective: they raise :class:`ConfigError`
            on every rank when a rank has no data or ranks hold different sample counts, and
            every rank takes rank 0's ``seed`` (:mod:`feedgpu.order.distributed`).
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
            (:mod:`feedgpu.exec.remote.ray_workers`) and reach the training loop in the same order, with
            the same sharding, random draws and ``state_dict()`` as the local pool; with
            ``num_workers=0`` all of them do. Under ``num_workers="auto"`` the balancer adds remote
            workers when the local pool cannot grow (a local worker more was measured not to
            train faster, or ``max_local_workers``) and the training loop still waits, and
            releases them when it stops waiting. ``worker_init_fn`` runs in local workers only.
        cache: for a pipeline, overrides its cache setting (``False`` turns it off; ``True``, a
            directory or a mapping turns it on; see :class:`~feedgpu.cache.CacheSettings`). The
            first epoch fills the cache while training; later epochs and runs read it.
        num_workers: worker processes, 0 to load in the main process, or ``"auto"``: the
            throughput balancer (:mod:`feedgpu.balancer.autoscale`) starts with one worker per core
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
    ``dataset`` or ``persistent_workers`` after construction raises ``ValueError`` as in torch
    (and ``max_skipped``, the skip budget in force).
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

    def __init__(self, dataset, batch_size: int | None = UNSET, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = UNSET, collate_fn: Callable | None = None,
                 pin_memory: bool = False, drop_last: bool = UNSET, timeout: float = UNSET,
                 worker_init_fn: Callable[[int], None] | None = None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = UNSET,
                 pin_memory_device: str = "", in_order: bool = True, seed: int | None = None,
                 rank: int | None = None, world_size: int | None = None, device: str | None = None,
                 on_error: str | None = None, cache=None, engine=None, max_skipped=UNSET, executor=None,
                 stats_callback: Callable[[dict], None] | None = None, worker_memory=None, loader=None, output=None,
                 compile: bool = True):
        given = {k: v for k, v in locals().items() if k not in ("self", "dataset")}
        self.loader, self.output, self.compile = loader, output, compile
        self._backend = b = pick_backend(dataset, given)
        for name in _GIVEN:
            setattr(self, name, given[name])
        self.max_skipped = b.max_skipped   # the budget in force: the same loader when passed back
        self.dataset, self.pin_memory, self.num_workers = b.dataset, b.pin_memory, b.num_workers
        self.prefetch_factor = b.prefetch_factor   # (before multiprocessing_context: torch's setter reads them)
        for name, value in b.torch_attributes(given).items():   # multiprocessing_context last: torch's setter
            setattr(self, name, value)                            # reads num_workers
        b.mirror = _mirror(self)   # the live worker count, prefetch depth and seed, as attributes
        self._frozen = True

    # -- torch DataLoader surface --------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        frozen = self.__dict__.get("_frozen", False)
        if name in _FROZEN and frozen:
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is initialized")
        object.__setattr__(self, name, value)
        if name in _FORWARDED and frozen and getattr(self._backend, "options", None) is not None:
            setattr(self._backend, _FORWARDED[name], getattr(self, name))   # read when the next pass starts

    def __len__(self) -> int:
        return len(self._backend)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (its order and its random stages), from its start.

        Right after :meth:`load_state_dict`, ``set_epoch`` of the restored epoch keeps the restored
        position (a loop ``for epoch in range(start, n): loader.set_epoch(epoch)`` resumes mid-epoch
        without repeating batches); any other epoch starts from its first batch. A
        ``DistributedSampler`` given as ``sampler`` is set to ``epoch`` too (its ``set_epoch`` has
        the same effect). An ``IterableDataset``'s own ``set_epoch`` is called, if it has one."""
        self._backend.set_epoch(epoch)

    def __iter__(self):
        return iter(self._backend)

    @property
    def engine_settings(self) -> EngineSettings:
        """The engine batches run on (the ``engine`` argument, else the pipeline's)."""
        return self._backend.options.engine

    @property
    def cache_settings(self) -> CacheSettings | None:
        """The cache in use (the ``cache`` argument, else the pipeline's), or None."""
        return self._backend.options.cache

    @property
    def memory_budget(self):
        """The workers' :class:`~feedgpu.exec.memory_budget.MemoryBudget` in force, None before the
        first iteration builds them (and for an ``IterableDataset``)."""
        return getattr(self._backend, "memory_budget", None)

    @property
    def read_ahead(self):
        """The shard read-ahead (:class:`~feedgpu.loader.read_ahead.ReadAhead`); attach a fetcher
        with :func:`feedgpu.shard_ahead.attach`."""
        return getattr(self._backend, "read_ahead", None) or _NO_READ_AHEAD

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the training loop is, counted in batches it received (prefetched ones are not
        counted); the schema is in :mod:`feedgpu.loader.state`. Any rank may load it, on any
        world size and worker count. For an ``IterableDataset``: see
        :meth:`feedgpu.exec.iterable.runner.IterableRunner.state_dict`."""
        return self._backend.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next batch is the one the saved run would have got
        (on another world size: this rank's share of the rest of the epoch's order).

        Raises :class:`StateError` when the state comes from another dataset, batch size or
        sampler (the differences are listed)."""
        self._backend.load_state_dict(state)

    # -- observability -------------------------------------------------------------------------
    def explain(self) -> str:
        """What runs where: a pipeline's stages, a torchvision dataset's transforms (compiled or run
        as Python, and why), or a plain Dataset and why it was not compiled."""
        return self._backend.explain()

    def stats(self) -> dict:
        """Counters since the loader was made: batches, samples, rate, consumer wait, seconds per
        stage (summed over workers), skipped samples by reason and the last skipped keys, the
        latest iteration's skip budget (``{max_skipped, limit, epoch, skipped, by_reason}``,
        ``None`` before the first), the cache's state (``None`` without a cache) and the executor
        (``{"name": "local"}``; with Ray the remote workers, batches run on each side, and the
        batches redone after a remote worker died with the reasons, see
        :meth:`~feedgpu.metrics.ExecutorTotals.report`) and the network of a source read from URLs
        (``None`` otherwise; :func:`~feedgpu.remote.ahead_loader.network_stats`)."""
        return self._backend.stats()

    @property
    def balancer(self) -> Autoscaler | None:
        """The :class:`~feedgpu.balancer.autoscale.Autoscaler` sizing the pool under ``num_workers="auto"``
        (its ``timeline`` and ``measurements`` hold every window), else None."""
        return getattr(self._backend, "autoscaler", None)

    def worker_pids(self) -> list[int]:
        return self._backend.worker_pids()

    def shutdown(self) -> None:
        """Stop the workers now (also at epoch end unless ``persistent_workers``, on errors, at gc)."""
        self._backend.shutdown()


def pick_backend(dataset, given: dict) -> Backend:
    """The backend of a loader over ``dataset`` made with the keyword arguments ``given`` (the
    table of kinds: :mod:`feedgpu.loader.backend`); its ``dataset`` is what the loader shows
    as its own (a pipeline with the ``loader``/``output`` sections given, the pipeline DALI runs
    for a torchvision dataset). Raises :class:`~feedgpu.errors.ConfigError` for the arguments it
    refuses (see :meth:`LoaderOptions.resolve <feedgpu.loader.options.LoaderOptions.resolve>`)."""
    sections = {k: given[k] for k in ("loader", "output") if given[k] is not None}
    own_order = given["sampler"] is None and given["batch_sampler"] is None
    if isinstance(dataset, Pipeline):
        dataset = dataset.replace(**sections) if sections else dataset
        return PipelineBackend(dataset, LoaderOptions.resolve(dataset, given, own_order), given)
    if sections:
        raise ConfigError("loader=/output= settings objects go with a feedgpu Pipeline; a torch Dataset takes "
                          "torch's keywords (batch_size=, shuffle=, num_workers=, ...)")
    if isinstance(dataset, tud.IterableDataset):  # run as torch runs it (feedgpu.exec.iterable)
        return IterableBackend(dataset, given)
    pipe = dali_pipeline(dataset, given["engine"], given["compile"], given["collate_fn"], given["batch_size"] is None)
    if pipe is not None:
        return TorchvisionDaliBackend(pipe, LoaderOptions.resolve(pipe, given, own_order), given, origin=dataset)
    compiled, why = backend_for(dataset, given["compile"])
    options = LoaderOptions.resolve(dataset, given, own_order)
    if compiled is not None:
        return TorchvisionDatasetBackend(dataset, options, given, compiled, given["compile"])
    return DatasetBackend(dataset, options, given, why)


def _mirror(loader):
    """A function writing the backend's live values onto ``loader``'s torch attributes (held weakly:
    the loader holds its backend)."""
    ref = weakref.ref(loader)

    def write(**values) -> None:
        me = ref()
        if me is not None:
            for name, value in values.items():
                setattr(me, name, value)
    return write


#: the read-ahead of a loader that cannot have one (an IterableDataset): attaching raises
_NO_READ_AHEAD = ReadAhead()
