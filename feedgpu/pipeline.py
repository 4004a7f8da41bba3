"""A pipeline: a source, its stages, and how to batch and deliver them."""
from __future__ import annotations

import os
from typing import Any

from . import config as cfg
from .errors import ConfigError
from .exec.autoscale import fixed_workers
from .exec.plan import Plan, make_plan
from .cache.settings import CacheSettings
from .exec.engines import EngineSettings
from .exec.executors import ExecutorSettings, check_executor
from .skips import DEFAULT_MAX_SKIPPED, check_max_skipped
from .sources import DatasetSource, Source, open_source
from .stages import Normalize, Stage, stage_classes

ON_ERROR = ("skip", "raise")


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when torch sees a GPU, else ``"cpu"``; others unchanged."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class Pipeline:
    """Source + stages + batching settings; what :class:`feedgpu.DataLoader` runs.

    Args:
        source: a :class:`~feedgpu.sources.Source`, a map-style torch Dataset, or a mapping
            ``{"format": "folder"|"tar"|"parquet", "path": ..., ...}`` opened on first use.
        stages: stage objects in order, starting with :class:`~feedgpu.stages.Decode`.
        batch_size: samples per batch (default 256).
        shuffle: reshuffle every epoch (default True); ``"shards"``: reshuffle with about
            ``shard_window`` shards open at a time (:mod:`feedgpu.shard_order`; for shards
            fetched from the network), then :attr:`shuffle` is True.
        shard_window: shards open at a time with ``shuffle="shards"`` (int >= 1, default 8;
            ignored otherwise); :attr:`shard_window` is None without ``shuffle="shards"``.
        drop_last: drop each epoch's incomplete tail (default False; see :mod:`feedgpu.sampling`).
        num_workers: worker processes, 0 to run in the main process, or ``"auto"`` (default):
            the throughput balancer sizes the pool while it runs (see :class:`~feedgpu.DataLoader`).
        prefetch_factor: batches in flight per worker (default 2).
        persistent_workers: keep worker processes between epochs (default True: a new worker
            pays its page faults on the shared batch buffers again, ~0.3 ms per float32 sample).
        seed: base seed of shuffling and random stages (default 0).
        on_error: ``"skip"`` bad samples (counted, named, replaced) or ``"raise"`` them.
        max_skipped: skip budget per epoch and rank: a share in ``[0, 1]`` of the epoch's samples
            (default ``0.01``), an int count, or ``None`` (no limit); see :mod:`feedgpu.skips`.
        timeout: seconds to wait for a batch before :class:`LoaderTimeout` (0: forever).
        device: where batches are delivered: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``.
        cache: cache the output of the leading deterministic stages (decode, resize ...) on local
            disk: ``None``/``False`` (off, default), ``True``, a directory, a mapping
            ``{dir, compression, max_size}`` or :class:`~feedgpu.cache.CacheSettings`.
        engine: ``"python"`` (default), ``"dali"`` or a mapping ``{name, device, threads,
            hw_decoder_load, window_decode}`` (see :class:`~feedgpu.exec.engines.EngineSettings`).
        executor: ``"local"`` (default: worker processes on this machine), ``"ray"`` or a mapping
            ``{name, address, remote_workers, max_remote_workers, cpus_per_worker,
            max_local_workers}``: also run the stages on a Ray cluster (see
            :class:`~feedgpu.exec.executors.ExecutorSettings`).
        name: label in reports.

    Raises :class:`ConfigError` for invalid settings.
    """

    def __init__(self, source: Any, stages: list[Stage], *, batch_size: int = 256, shuffle: bool | str = True,
                 shard_window: int = 8, drop_last: bool = False, num_workers: int | str = "auto",
                 prefetch_factor: int = 2, persistent_workers: bool = True, seed: int = 0,
                 on_error: str = "skip", timeout: float = 0.0, device: str = "auto", cache=None, engine=None,
                 executor=None, name: str = "pipeline", definition: dict | None = None, max_skipped=DEFAULT_MAX_SKIPPED):
        if on_error not in ON_ERROR:
            raise ConfigError(f"on_error {on_error!r} is not one of {list(ON_ERROR)}")
        if num_workers != "auto" and (isinstance(num_workers, bool) or not isinstance(num_workers, int)
                                      or num_workers < 0):
            raise ConfigError(f"num_workers must be an int >= 0 or 'auto', got {num_workers!r}")
        if batch_size < 1 or prefetch_factor < 1:
            raise ConfigError("batch_size and prefetch_factor must be >= 1")
        if isinstance(shuffle, str) and shuffle != "shards":
            raise ConfigError(f"shuffle must be True, False or 'shards', got {shuffle!r}")
        if shuffle == "shards" and (isinstance(shard_window, bool) or not isinstance(shard_window, int)
                                    or shard_window < 1):
            raise ConfigError(f"shard_window must be an int >= 1, got {shard_window!r}")
        self._source = source
        self.stages = list(stages)
        self.batch_size, self.shuffle, self.drop_last = int(batch_size), bool(shuffle), bool(drop_last)
        self.shard_window = int(shard_window) if shuffle == "shards" else None
        self.num_workers, self.prefetch_factor = num_workers, int(prefetch_factor)
        self.persistent_workers = bool(persistent_workers)
        self.seed, self.on_error, self.timeout = int(seed), on_error, float(timeout)
        self.max_skipped = check_max_skipped(max_skipped)
        self.device, self.name, self.definition = device, name, definition
        self.cache = CacheSettings.make(cache)
        self.engine = EngineSettings.make(engine)
        self.executor = ExecutorSettings.make(executor)
        check_executor(self.executor, self.engine, self.cache)
        plan = make_plan(self.stages, "cpu")  # validate the stage list now, not at the first batch
        if self.engine.name == "dali":
            from .exec.dali_engine import check_dali_plan

            check_dali_plan(plan)  # e.g. a python stage: refused here, not at the first batch

    # -- construction from YAML -------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides) -> "Pipeline":
        """Load a pipeline file; ``overrides`` replace keys (nested mappings merge; dotted keys
        such as ``**{"loader.batch_size": 64}`` reach inside). Raises :class:`ConfigError` naming
        the key path and allowed values."""
        data = cfg.merge(cfg.load_yaml(path), overrides)
        return cls.from_config(data, where=str(path))

    @classmethod
    def from_config(cls, data: dict, where: str = "pipeline") -> "Pipeline":
        classes = stage_classes()
        c = cfg.validate(data, where, classes)
        stages: list[Stage] = []
        for i, s in enumerate(c.stages):
            stage_cls = classes[s.op]
            params = s.model_dump(exclude={"op"})
            for key in stage_cls.from_output:
                if key not in type(c.output).model_fields:
                    raise ConfigError(f"{where}: stages[{i}] ({s.op}): the stage takes {key!r} from the output "
                                      f"section, which has no such key (it has {', '.join(type(c.output).model_fields)})")
                params[key] = getattr(c.output, key)
            try:
                stages.append(stage_cls(**params))
            except (ConfigError, ValueError, TypeError) as e:
                raise ConfigError(f"{where}: stages[{i}] ({s.op}): {e}") from None
        src = c.source.model_dump()
        cache = c.cache.model_dump() if c.cache.enabled else None
        return cls(src, stages, batch_size=c.loader.batch_size, shuffle=c.loader.shuffle,
                   shard_window=c.loader.shard_window, drop_last=c.loader.drop_last, num_workers=c.loader.num_workers,
                   prefetch_factor=c.loader.prefetch_factor, persistent_workers=c.loader.persistent_workers,
                   seed=c.loader.seed, on_error=c.loader.on_error, max_skipped=c.loader.max_skipped,
                   timeout=c.loader.timeout, device=c.output.device, cache=cache,
                   engine=c.engine.model_dump(), name=c.name,
                   executor=c.executor.model_dump(),
                   definition=c.model_dump())

    # -- source ---------------------------------------------------------------------------
    @property
    def source(self) -> Source:
        """The opened source (opened on first access when given as a mapping)."""
        if isinstance(self._source, dict):
            spec = dict(self._source)
            fmt, path = spec.pop("format"), spec.pop("path", None)
            if path is None:
                raise ConfigError("source.path is not set; pass --data PATH to feedgpu bench / pipeline explain, "
                                  "--set source.path=PATH to feedgpu scan / cache build, or source={'path': ...} "
                                  "to Pipeline.from_yaml")
            if fmt != "parquet":
                spec.pop("image_column", None)
                spec.pop("label_column", None)
            if fmt != "folder":
                spec.pop("stat_files", None)
            self._source = open_source(fmt, path, **spec)
        elif not isinstance(self._source, Source):
            self._source = DatasetSource(self._source)
        return self._source

    def source_label(self) -> str:
        s = self._source
        if isinstance(s, dict):
            return f"{s['format']} at {s.get('path') or '(path not set)'}"
        return s.describe() if isinstance(s, Source) else f"torch Dataset {type(s).__name__}"

    # -- planning ---------------------------------------------------------------------------
    def plan(self, device: str | None = None) -> Plan:
        """Where each stage runs for output ``device``. With the DALI engine on the GPU, the
        whole pipeline runs there (normalize included)."""
        dev = resolve_device(device or self.device)
        if self.engine.name != "dali":
            if self.executor.remote:
                from .imaging import pil_label

                where = f"cpu pool + Ray {self.executor.address or '(ray.init default)'} ({pil_label()})"
                return make_plan(self.stages, dev, pool_where=where)
            return make_plan(self.stages, dev)
        from .exec.dali_engine import check_dali_plan

        dd = self.engine.dali_device(dev)
        threads = self.engine.threads or max(1, fixed_workers(self.num_workers))
        where = (f"dali gpu (mixed decode, hw_decoder_load {self.engine.hw_decoder_load})" if dd == "gpu"
                 else f"dali cpu ({threads} thread{'' if threads == 1 else 's'})")
        plan = make_plan(self.stages, dev, pool_where=where, batch_on_device=None if dd == "cpu" else False)
        check_dali_plan(plan)
        return plan

    @property
    def output_dtype(self) -> str:
        last = self.stages[-1]
        return last.dtype if isinstance(last, Normalize) else "uint8"

    def explain(self, device: str | None = None) -> str:
        """A table of stages, where each runs and the output spec after it."""
        dev = resolve_device(device or self.device)
        plan = self.plan(dev)
        cached = self.cache is not None and plan.cache_prefix > 0
        rows = [("stage", "runs on", "deterministic", "output per sample")] + plan.describe(self.batch_size, cached)
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"pipeline {self.name!r}: {self.source_label()}"]
        for k, r in enumerate(rows):
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
            if k == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        o = plan.out_spec
        lines.append(f"batch: images {o.dtype} {'N' + o.layout} [{self.batch_size}, "
                     f"{', '.join(str(d) for d in o.shape)}] + labels int64 [{self.batch_size}] on {dev}")
        shuffle = f"shards (window {self.shard_window})" if self.shard_window else self.shuffle
        lines.append(f"loader: {self.num_workers} workers, prefetch {self.prefetch_factor} per worker, "
                     f"shuffle={shuffle}, drop_last={self.drop_last}, seed={self.seed}, on_error={self.on_error}, "
                     f"max_skipped={self.max_skipped}")
        if self.cache is not None:
            lines.append(f"cache: {self.cache.dir} ({self.cache.compression}"
                         + (f", budget {self.cache.max_size} bytes)" if self.cache.max_size else ")")
                         + ("" if cached else " - nothing to cache: no deterministic stage before the first random one"))
        if plan.batch_on_device:
            lines.append(f"note: images cross to {dev} as uint8 NHWC from pinned memory; "
                         f"{plan.batch_stage.name} runs there (4x fewer bytes than float32)")
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        """Sample ``index`` through the stages on the CPU: ``(image, label)``, the image a tensor
        in the pipeline's per-sample output (e.g. float32 CHW), the label an int.

        This makes a pipeline a map-style torch Dataset for code that builds its own
        ``torch.utils.data.DataLoader`` around ``loader.dataset`` (``accelerate``'s ``prepare()``
        does): the samples are right and sharded by that loader's sampler, but feedgpu's pool,
        shared-memory batches and balancer are not used (a warning says so once per process).
        Random stages draw per sample from ``(seed, epoch, index)``: the epoch is the one given to
        :meth:`set_epoch`, else a fresh draw from torch's RNG per call (as torchvision transforms
        draw). A bad sample raises :class:`~feedgpu.errors.SampleError` (no skip here)."""
        import warnings

        import numpy as np
        import torch

        from .exec.assemble import Assembler
        from .exec.work import PipelineWork

        work = self.__dict__.get("_per_sample")
        if work is None or work[0] != os.getpid():
            warnings.warn(f"{self.name}: a Pipeline indexed sample by sample (a torch DataLoader built around "
                          "it, e.g. by accelerate's prepare()): feedgpu's worker pool, shared-memory batches and "
                          "balancer are not used; iterate a feedgpu.DataLoader instead (it shards by "
                          "torch.distributed's rank itself)", stacklevel=2)
            plan = self.plan("cpu")
            work = (os.getpid(), PipelineWork(Assembler(self.source, plan, self.seed, "raise"), 1, 0))
            self.__dict__["_per_sample"] = work
        epoch = self.__dict__.get("_epoch")
        if epoch is None:
            epoch = int(torch.randint(0, 2**31 - 1, ()).item())
        batch, _ = work[1].run_inline(0, epoch, np.asarray([int(index)], np.int64), np.zeros(0, np.int64))
        return batch.images[0], int(batch.labels[0])

    def set_epoch(self, epoch: int) -> None:
        """The epoch random stages draw for in :meth:`__getitem__` (a feedgpu.DataLoader has its
        own)."""
        self.__dict__["_epoch"] = int(epoch)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_per_sample", None)  # rebuilt in the process that indexes it
        return state

    def __bool__(self) -> bool:
        # always true: ``if pipeline`` must not open (and index) the source through __len__
        return True

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, {self.source_label()}, {len(self.stages)} stages, batch_size={self.batch_size})"
