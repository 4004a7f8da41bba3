"""A pipeline: a source, its stages, and how to batch and deliver them."""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from . import config as cfg
from .errors import ConfigError
from .balancer.autoscale import fixed_workers
from .balancer import start_workers
from .exec.plan import Plan, make_plan
from .exec.executors import check_executor
from .cache.settings import CacheSettings
from .host import cpu_cores
from .exec.engines import EngineSettings
from .exec.executors import ExecutorSettings
from .settings import LoaderSettings, OutputSettings, SourceSettings
from .settings_base import field_names
from .sources import DatasetSource, Source, open_source
from .stages import Normalize, Stage, stage_classes

#: the keyword arguments of :class:`Pipeline` that are fields of its :class:`LoaderSettings`
LOADER_KEYS = tuple(field_names(LoaderSettings))


#: paths one of which exists wherever a GPU driver torch can use is loaded (NVIDIA, WSL, ROCm)
_GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd")


def _gpu_driver_present() -> bool:
    """False when no GPU driver is visible, so torch cannot see a CUDA device (answered without
    importing torch); True when one is, or on a system where these paths say nothing."""
    import sys

    if not sys.platform.startswith("linux"):
        return sys.platform != "darwin"
    return any(os.path.exists(p) for p in _GPU_DRIVER_PATHS)


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when torch sees a GPU, else ``"cpu"``; others unchanged. Where
    no GPU driver is present the answer is ``"cpu"`` without importing torch."""
    if device == "auto":
        import sys

        if "torch" not in sys.modules and not _gpu_driver_present():
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def device_label(device: str) -> str:
    """Where batches go, as the command line shows it: ``device`` resolved, with the setting it
    came from when that was ``auto`` (``"cpu (output.device auto)"``)."""
    dev = resolve_device(device)
    return dev if dev == device else f"{dev} (output.device {device})"


def _section(cls, value, key: str):
    """``value`` (None, an instance of ``cls`` or a mapping of its fields) as a ``cls``."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise ConfigError(f"{key}: expected {cls.__name__} or a mapping of its keys, got {value!r}")


def _loader(loader, given: dict) -> LoaderSettings:
    """The loader settings from ``loader=`` and the loader keywords ``given``."""
    loader = _section(LoaderSettings, loader, "loader")
    if loader is None:
        return LoaderSettings(**given)
    clash = [f"{k}={v!r} (loader.{k} is {getattr(loader, k)!r})" for k, v in given.items() if v != getattr(loader, k)]
    if clash:
        raise ConfigError(f"Pipeline: {', '.join(clash)}: give each setting once, as a keyword or in loader=")
    return loader


def _output(output, device, stages) -> OutputSettings:
    """The output settings from ``output=``, ``device=`` and what the stages make: the fields a
    stage takes from the output section (normalize's dtype and layout), else uint8 NHWC."""
    made = {"dtype": "uint8", "layout": "NHWC"}
    for s in stages:
        made.update({k: getattr(s, k) for k in getattr(type(s), "from_output", ())})
    output = _section(OutputSettings, output, "output")
    if output is None:
        return OutputSettings(device="auto" if device is None else device, **made)
    if device is not None and device != output.device:
        raise ConfigError(f"Pipeline: device={device!r} (output.device is {output.device!r}): give each setting "
                          "once, as a keyword or in output=")
    wrong = [f"output.{k} is {getattr(output, k)!r} but the stages make {v!r}" for k, v in made.items()
             if getattr(output, k) != v]
    if wrong:
        raise ConfigError(f"Pipeline: {'; '.join(wrong)} (the dtype and layout come from a normalize stage; "
                          "without one batches are uint8 NHWC)")
    return output


class _Setting:
    """A read-only attribute of a :class:`Pipeline` read from one of its settings objects."""

    def __init__(self, section: str):
        self.section = section

    def __set_name__(self, owner, name: str) -> None:
        self.key = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return getattr(getattr(obj, self.section), self.key)


class Pipeline:
    """Source + stages + settings; what :class:`feedgpu.DataLoader` runs.

    Args:
        source: a :class:`~feedgpu.sources.Source`, a map-style torch Dataset, or
            :class:`~feedgpu.settings.SourceSettings` (or a mapping of its keys,
            ``{"format": "folder"|"tar"|"parquet", "path": ..., ...}``), opened on first use.
        stages: stage objects in order, starting with :class:`~feedgpu.stages.Decode`.
        loader: :class:`~feedgpu.settings.LoaderSettings` (or a mapping of its keys): batch size,
            shuffle, workers, prefetch, seed, skip budget, worker memory ... (defaults and bounds
            there).
        output: :class:`~feedgpu.settings.OutputSettings`: ``device``, and the ``dtype`` and
            ``layout`` the stages make (default: those of the stages, on ``device="auto"``).
        cache: cache the output of the leading deterministic stages (decode, resize ...) on local
            disk: ``None``/``False`` (off, default), ``True``, a directory, a mapping
            ``{dir, compression, max_size}`` or :class:`~feedgpu.cache.CacheSettings`.
        engine: ``"python"`` (default), ``"dali"``, a mapping or
            :class:`~feedgpu.exec.engines.EngineSettings`.
        executor: ``"local"`` (default: worker processes on this machine), ``"ray"``, a mapping or
            :class:`~feedgpu.exec.executors.ExecutorSettings`: also run the stages on a Ray
            cluster.
        name: label in reports.
        definition: the YAML definition it was made from (set by :meth:`from_config`).
        device: where batches are delivered (``output.device``): ``"cpu"``, ``"cuda"``,
            ``"cuda:N"`` or ``"auto"``.
        **loader_keys: the fields of :class:`~feedgpu.settings.LoaderSettings` as keywords
            (``batch_size=64, num_workers=0``), when ``loader`` is not given.

    The settings are read back as attributes (``pipeline.batch_size``, ``.seed``, ``.device``,
    ``.cache``, ``.engine``, ...; ``shuffle`` is a bool, ``shard_window`` None unless
    ``shuffle="shards"``). A pipeline is not changed after it is made: :meth:`replace` makes
    another one.

    Raises :class:`ConfigError` for invalid settings (naming the key, ``loader.batch_size: ...``),
    and for a keyword that contradicts a settings object given with it; ``TypeError`` for an
    unknown keyword.
    """

    batch_size = _Setting("loader")
    drop_last = _Setting("loader")
    num_workers = _Setting("loader")
    prefetch_factor = _Setting("loader")
    persistent_workers = _Setting("loader")
    seed = _Setting("loader")
    on_error = _Setting("loader")
    max_skipped = _Setting("loader")
    timeout = _Setting("loader")
    worker_memory = _Setting("loader")
    device = _Setting("output")

    def __init__(self, source: Any, stages: list[Stage], *, loader: LoaderSettings | dict | None = None,
                 output: OutputSettings | dict | None = None, cache=None, engine=None, executor=None,
                 name: str = "pipeline", definition: dict | None = None, device: str | None = None, **loader_keys):
        unknown = sorted(set(loader_keys) - set(LOADER_KEYS))
        if unknown:
            raise TypeError(f"Pipeline() got unexpected keyword arguments {unknown}; the loader's keys are "
                            f"{', '.join(LOADER_KEYS)}")
        self._source = SourceSettings(**source) if isinstance(source, dict) else source
        self._source_settings = self._source if isinstance(self._source, SourceSettings) else None
        self.stages = list(stages)
        self.loader = _loader(loader, loader_keys)
        self.output = _output(output, device, self.stages)
        self.name, self.definition = name, definition
        self.cache = CacheSettings.make(cache)
        self.engine = EngineSettings.make(engine)
        self.executor = ExecutorSettings.make(executor)
        check_executor(self.executor, self.engine, self.cache)
        # validate the stage list now, not at the first batch (the DALI engine: e.g. a python
        # stage is refused here); the plan is kept for a loader on the CPU
        self.plan("cpu")

    @property
    def shuffle(self) -> bool:
        """Whether each epoch is reshuffled (``loader.shuffle`` True or ``"shards"``)."""
        return bool(self.loader.shuffle)

    @property
    def shard_window(self) -> int | None:
        """Shards open at a time with ``shuffle="shards"``, else None."""
        return self.loader.shard_window if self.loader.shuffle == "shards" else None

    @property
    def source_settings(self) -> SourceSettings | None:
        """The source's settings when it was given as settings or a mapping (None for a source
        object or a torch Dataset)."""
        return self._source_settings

    def replace(self, **changes) -> "Pipeline":
        """A new pipeline with ``changes`` (this one is not changed; the opened source and the
        stages are shared): a section as the constructor takes it (``engine="dali"``,
        ``cache=False``, ``loader=LoaderSettings(...)``), ``stages``, ``source``, ``name``, or
        fields of the loader and output settings (``batch_size=64``, ``device="cpu"``), which
        replace those fields (``dataclasses.replace``). Validated as the constructor validates:
        raises :class:`ConfigError` naming the key."""
        loader_keys = {k: changes.pop(k) for k in list(changes) if k in LOADER_KEYS}
        loader = _section(LoaderSettings, changes.pop("loader", self.loader), "loader")
        if loader_keys:
            loader = dataclasses.replace(loader, **loader_keys)
        device = changes.pop("device", None)
        output = _section(OutputSettings, changes.pop("output", None if "stages" in changes else self.output),
                          "output")
        if output is not None and device is not None:
            output, device = dataclasses.replace(output, device=device), None
        elif output is None and device is None:
            device = self.output.device   # new stages: their dtype and layout, on this device
        kw = dict(source=self._source, stages=self.stages, cache=self.cache, engine=self.engine,
                  executor=self.executor, name=self.name, definition=self.definition)
        unknown = sorted(set(changes) - set(kw))
        if unknown:
            raise TypeError(f"Pipeline.replace() got unexpected keyword arguments {unknown}")
        kw.update(changes)
        new = type(self)(loader=loader, output=output, device=device, **kw)
        if "source" not in changes:  # the same source, maybe opened already
            new._source_settings = self._source_settings
        return new

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
        output_keys = field_names(OutputSettings)
        stages: list[Stage] = []
        for i, s in enumerate(c.stages):
            stage_cls = classes[s.op]
            params = s.model_dump(exclude={"op"})
            for key in stage_cls.from_output:
                if key not in output_keys:
                    raise ConfigError(f"{where}: stages[{i}] ({s.op}): the stage takes {key!r} from the output "
                                      f"section, which has no such key (it has {', '.join(output_keys)})")
                params[key] = getattr(c.output, key)
            try:
                stages.append(stage_cls(**params))
            except (ConfigError, ValueError, TypeError) as e:
                raise ConfigError(f"{where}: stages[{i}] ({s.op}): {e}") from None
        return cls(c.source, stages, loader=c.loader, output=c.output, cache=c.cache.settings(), engine=c.engine,
                   executor=c.executor, name=c.name, definition=c.model_dump(mode="json"))

    @classmethod
    def from_torchvision(cls, dataset, **overrides) -> "Pipeline":
        """The feedgpu pipeline of a torchvision ``ImageFolder``/``DatasetFolder`` (also in
        ``Subset``) and its transforms, to go on from (:func:`feedgpu.torchvision.pipeline_yaml`
        writes it as YAML). ``overrides`` as for :meth:`from_yaml`. What a pipeline cannot express
        (a Subset's indices, ``target_transform``, transforms without a stage) is left out with a
        ``UserWarning`` listing it. Raises ``ValueError`` for a dataset feedgpu does not compile."""
        from .torchvision.pipeline_out import pipeline_config

        data, left_out = pipeline_config(dataset)
        if left_out:
            warnings.warn("Pipeline.from_torchvision left out: " + "; ".join(left_out), UserWarning, stacklevel=2)
        return cls.from_config(cfg.merge(data, overrides), where=f"{type(dataset).__name__} (torchvision)")

    # -- source ---------------------------------------------------------------------------
    @property
    def source(self) -> Source:
        """The opened source (opened on first access when given as settings or a mapping)."""
        if isinstance(self._source, SourceSettings):
            spec = dataclasses.asdict(self._source)
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
            if fmt == "parquet" and spec.pop("index_dir") is not None:
                raise ConfigError("source.index_dir applies to folder and tar sources (a parquet source keeps no index)")
            self._source = open_source(fmt, path, **spec)
        elif not isinstance(self._source, Source):
            self._source = DatasetSource(self._source)
        return self._source

    def source_label(self) -> str:
        s = self._source
        if isinstance(s, SourceSettings):
            return f"{s.format} at {s.path or '(path not set)'}"
        return s.describe() if isinstance(s, Source) else f"torch Dataset {type(s).__name__}"

    # -- planning ---------------------------------------------------------------------------
    def plan(self, device: str | None = None) -> Plan:
        """Where each stage runs for output ``device`` (default: the pipeline's). With the DALI
        engine on the GPU, the whole pipeline runs there (normalize included).

        Made once per device: later calls return the same :class:`Plan` while the stage objects,
        the engine and executor settings and the worker count are the ones it was made from (a
        stage list or a section assigned anew is planned again). Raises :class:`ConfigError`
        for stages that cannot run (see :func:`~feedgpu.exec.plan.make_plan`)."""
        dev = resolve_device(device or self.device)
        settings, stages = (self.engine, self.executor, self.num_workers), tuple(self.stages)
        plans = self.__dict__.setdefault("_plans", {})
        kept = plans.get(dev)
        if (kept is not None and kept[0] == settings and len(kept[1]) == len(stages)
                and all(a is b for a, b in zip(kept[1], stages))):
            return kept[2]
        plan = self._make_plan(dev)
        plans[dev] = (settings, stages, plan)
        return plan

    def _make_plan(self, dev: str) -> Plan:
        if self.engine.name != "dali":
            if self.executor.remote:
                from .imaging import pil_label

                where = f"cpu pool + Ray {self.executor.address or '(ray.init default)'}"
                return make_plan(self.stages, dev, pool_where=f"{where} ({pil_label()})",
                                 batch_where=f"{where} (numpy)")
            return make_plan(self.stages, dev)
        from .exec.dali.graph import check_dali_plan

        dd = self.engine.dali_device(dev)
        threads = self.engine.threads or max(1, fixed_workers(self.num_workers))
        count = f"{threads} thread{'' if threads == 1 else 's'}"
        if self.num_workers == "auto" and not self.engine.threads:   # the balancer sizes them
            count = f"threads balanced, from {start_workers(cpu_cores())}"
        where = (f"dali gpu (mixed decode, hw_decoder_load {self.engine.hw_decoder_load})" if dd == "gpu"
                 else f"dali cpu ({count})")
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
        rows = ([("stage", "kind", "runs on", "deterministic", "output per sample")]
                + plan.describe(self.batch_size, self.cache if cached else False))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"pipeline {self.name!r}: {self.source_label()}"]
        for k, r in enumerate(rows):
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
            if k == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        if any(r[3] == "no (seeded)" for r in rows):
            lines.append("  (seeded: a random stage draws from (seed, epoch, sample index): the same seed gives the "
                         "same batches, whichever worker runs it)")
        o = plan.out_spec
        lines.append(f"batch: images {o.dtype} {'N' + o.layout} [{self.batch_size}, "
                     f"{', '.join(str(d) for d in o.shape)}] + labels int64 [{self.batch_size}] on "
                     f"{device_label(device or self.device)}")
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
        state.pop("_plans", None)       # planned again where needed
        return state

    def __bool__(self) -> bool:
        # always true: ``if pipeline`` must not open (and index) the source through __len__
        return True

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, {self.source_label()}, {len(self.stages)} stages, batch_size={self.batch_size})"
