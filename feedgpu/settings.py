"""One settings object per section of a pipeline: defaults and bounds written once.

Each class is frozen and validated when it is made (:mod:`feedgpu.settings_base`): a bad value
raises :class:`~feedgpu.errors.ConfigError` naming the key, also from
``dataclasses.replace(settings, field=value)``, which is how settings are changed. The YAML
schema (:mod:`feedgpu.config`) is made of these classes, and :class:`~feedgpu.Pipeline` holds one
of each:

=============  ==========================================  =======================
YAML section   class                                       ``Pipeline`` attribute
=============  ==========================================  =======================
``source``     :class:`SourceSettings`                     ``source_settings``
``loader``     :class:`LoaderSettings`                     ``loader``
``output``     :class:`OutputSettings`                     ``output``
``cache``      :class:`~feedgpu.cache.CacheSettings`       ``cache`` (None: off)
``engine``     :class:`~feedgpu.exec.engines.EngineSettings`     ``engine``
``executor``   :class:`~feedgpu.exec.executors.ExecutorSettings` ``executor``
=============  ==========================================  =======================
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator

from .cache.settings import CacheSection, parse_size
from .errors import ArgumentTypeError, ConfigError
from .exec.engines import EngineSettings
from .exec.executors import ExecutorSettings
from .settings_base import settings_class

__all__ = ["LoaderSettings", "OutputSettings", "SECTIONS", "SourceSettings", "TORCH_DEFAULTS", "max_skipped_problem",
           "parse_worker_memory"]


def max_skipped_problem(value) -> str | None:
    """What is wrong with ``value`` as a ``max_skipped`` (float in [0, 1], int >= 0 or None), or
    None when it is valid."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a share in [0, 1] (float), a count >= 0 (int) or None, got {value!r}"
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        return f"a share must be in [0, 1], got {value!r} (use an int for a count)"
    if isinstance(value, int) and value < 0:
        return f"a count must be >= 0, got {value!r}"
    return None


def parse_worker_memory(value) -> int | None:
    """``worker_memory`` as bytes: an int, a string with a unit (``"512MiB"``, ``"2GB"``), or
    ``None``/``"auto"`` for the machine's default (returns None). Raises :class:`ConfigError`
    for anything else or a budget under 1 MiB."""
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"worker_memory must be bytes (int), a size such as '2GiB', or 'auto'; got {value!r}")
    try:
        n = parse_size(value)
    except ConfigError:
        raise ConfigError(f"worker_memory {value!r}: expected a size such as 512MiB or 2GB, or 'auto'") from None
    if n < 1 << 20:
        raise ConfigError(f"worker_memory {value!r} is under 1 MiB: a worker cannot run in it")
    return n


@settings_class("loader")
class LoaderSettings:
    """The ``loader:`` section: how a pipeline's samples are batched and delivered.

    Args:
        batch_size (int): samples per batch, >= 1 (default 256).
        shuffle (bool | "shards"): reshuffle every epoch (default True); ``"shards"``: reshuffle
            with about ``shard_window`` shards open at a time (:mod:`feedgpu.order.shard_shuffle`; for
            shards fetched from the network).
        shard_window (int): shards open at a time with ``shuffle="shards"``, >= 1 (default 8;
            not used otherwise).
        drop_last (bool): drop each epoch's incomplete tail (default False; see
            :mod:`feedgpu.order.sharded`).
        num_workers (int | "auto"): worker processes, >= 0 (0: in the main process), or
            ``"auto"`` (default): the throughput balancer sizes the pool while it runs.
        prefetch_factor (int): batches in flight per worker, >= 1 (default 2).
        persistent_workers (bool): keep worker processes between epochs (default True: a new
            worker pays its page faults on the shared batch buffers again, at every epoch).
        seed (int): base seed of shuffling and random stages (default 0).
        on_error ("skip" | "raise"): ``"skip"`` bad samples (counted, named, replaced; default)
            or ``"raise"`` them.
        max_skipped (float | int | None): skip budget per epoch and rank: a share in [0, 1] of
            the epoch's samples (default 0.01), an int count >= 0, or None (no limit); booleans
            are refused. See :mod:`feedgpu.loader.skips`.
        timeout (float): seconds to wait for a batch before :class:`~feedgpu.errors.LoaderTimeout`,
            >= 0 (default 0: forever).
        worker_memory (int | str): bytes each worker may hold (its own memory and its batches in
            flight), an int >= 1 MiB or a size such as ``"2GiB"`` (kept as given); ``"auto"``
            (default): a share of the memory available divided by the workers
            (:mod:`feedgpu.exec.memory_budget`).

    Raises :class:`~feedgpu.errors.ConfigError` naming the key (``loader.batch_size: ...``).
    """

    batch_size: Annotated[int, Field(gt=0)] = 256
    shuffle: Union[bool, Literal["shards"]] = True
    shard_window: Annotated[int, Field(ge=1, strict=True)] = 8
    drop_last: bool = False
    num_workers: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = "auto"
    prefetch_factor: Annotated[int, Field(gt=0)] = 2
    persistent_workers: bool = True
    seed: int = 0
    on_error: Literal["skip", "raise"] = "skip"
    max_skipped: Union[int, float, None] = 0.01
    timeout: Annotated[float, Field(ge=0)] = 0.0
    worker_memory: Union[int, str] = "auto"

    @field_validator("num_workers", "batch_size", "prefetch_factor", mode="before")
    @classmethod
    def _no_bool(cls, v):
        if isinstance(v, bool):  # True would read as 1
            raise ValueError(f"expected an int, got {v!r}")
        return v

    @field_validator("max_skipped", mode="plain")
    @classmethod
    def _max_skipped(cls, v):
        problem = max_skipped_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("worker_memory", mode="plain")
    @classmethod
    def _worker_memory(cls, v):
        try:
            parse_worker_memory(v)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return v

    @classmethod
    def from_torch(cls, given: dict[str, Any], base: "LoaderSettings", remote: bool = False) -> "LoaderSettings":
        """``base`` (a pipeline's ``loader:`` section, or :data:`TORCH_DEFAULTS`) with the keywords
        of ``torch.utils.data.DataLoader`` that were given (``given``: name -> value, only those
        passed; ``prefetch_factor=None`` counts as not passed, as in torch).

        Checked here, in torch's words and in torch's order: ``batch_size``, ``drop_last``,
        ``num_workers``, ``prefetch_factor`` (only with workers; 0 is refused: no batch would ever
        be asked for), ``persistent_workers`` (only with workers), ``timeout``. Without a given
        ``persistent_workers``, workers persist as ``base`` says when there are workers (or
        ``remote`` ones). Raises :class:`ArgumentTypeError` (a ``TypeError``) where torch raises
        ``TypeError``, :class:`ConfigError` (a ``ValueError``) otherwise."""
        g = {k: v for k, v in given.items() if not (k == "prefetch_factor" and v is None)}
        bs = g.get("batch_size", base.batch_size)
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ConfigError(f"batch_size should be a positive integer value, but got batch_size={bs}")
        if "drop_last" in g and not isinstance(g["drop_last"], bool):
            raise ConfigError(f"drop_last should be a boolean value, but got drop_last={g['drop_last']}")
        nw = g.get("num_workers", base.num_workers)
        if nw != "auto" and (isinstance(nw, bool) or not isinstance(nw, int)):
            raise ArgumentTypeError(f"num_workers must be an int >= 0 or 'auto', got {nw!r}")
        if nw != "auto" and nw < 0:
            raise ConfigError("num_workers option should be non-negative; use num_workers=0 to disable "
                              "multiprocessing.")
        workers = nw == "auto" or nw > 0
        pf = g.get("prefetch_factor")
        if not workers and pf is not None:
            raise ConfigError("prefetch_factor option could only be specified in multiprocessing.let num_workers "
                              "> 0 to enable multiprocessing, otherwise set prefetch_factor to None.")
        if g.get("persistent_workers") is True and not workers:
            raise ConfigError("persistent_workers option needs num_workers > 0")
        if pf is not None and (isinstance(pf, bool) or not isinstance(pf, int)):
            raise ArgumentTypeError(f"prefetch_factor must be an int, got {pf!r}")
        if pf is not None and pf < 0:
            raise ConfigError("prefetch_factor option should be non-negative")
        if pf == 0:  # torch's loader would wait for ever: no batch is ever asked for
            raise ConfigError("prefetch_factor=0 asks the workers for no batch; give prefetch_factor >= 1")
        t = g.get("timeout", base.timeout)
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise ArgumentTypeError(f"timeout must be a number of seconds, got {t!r}")
        if t < 0:
            raise ConfigError("timeout option should be non-negative")
        if "persistent_workers" not in g:
            g["persistent_workers"] = bool(base.persistent_workers and (workers or remote))
        g["timeout"] = float(t)
        if "shuffle" in g:
            g["shuffle"] = bool(g["shuffle"])   # torch reads its truth value
        return dataclasses.replace(base, **g)

    @classmethod
    def torch_keywords(cls, given: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
        """The keywords ``names`` of ``torch.utils.data.DataLoader`` resolved as torch resolves them,
        for a loader that passes them on as they are (an ``IterableDataset``'s runner,
        :func:`feedgpu.exec.iterable.runner.runner_for_loader`, which takes ``batch_size=None``):
        the value in ``given`` (name -> value, only the keywords passed) where there is one, else
        torch's default (:data:`TORCH_DEFAULTS`). Values are not checked here (:meth:`from_torch`
        checks them). Raises ``AttributeError`` for a name that is not a field of
        :class:`LoaderSettings`."""
        return {k: given[k] if k in given else getattr(TORCH_DEFAULTS, k) for k in names}


#: ``torch.utils.data.DataLoader``'s defaults, as the loader settings of a torch Dataset (the only
#: place they are written): one sample per batch, in order, in the main process, errors raised
TORCH_DEFAULTS = LoaderSettings(batch_size=1, shuffle=False, drop_last=False, num_workers=0, prefetch_factor=2,
                                persistent_workers=False, seed=0, on_error="raise", max_skipped=None, timeout=0.0)


@settings_class("output")
class OutputSettings:
    """The ``output:`` section: where and how batches are delivered.

    Args:
        device (str): ``"auto"`` (default: ``"cuda"`` when torch sees a GPU, else ``"cpu"``),
            ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype (str): the images' dtype, ``"float32"`` (default), ``"float16"`` (both made by a
            normalize stage, which takes it from here) or ``"uint8"`` (no normalize stage).
        layout (str): ``"NCHW"`` (default) or ``"NHWC"``; uint8 output is NHWC.

    Raises :class:`~feedgpu.errors.ConfigError` naming the key (``output.device: ...``).
    """

    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")] = "auto"
    dtype: Literal["float32", "float16", "uint8"] = "float32"
    layout: Literal["NCHW", "NHWC"] = "NCHW"


@settings_class("source")
class SourceSettings:
    """The ``source:`` section: what the samples are read from (opened on first use).

    Args:
        format (str): ``"folder"``, ``"tar"`` or ``"parquet"`` (required).
        path (str | list[str] | None): a folder, shard files or URLs, or an index file (default
            None: to be given later, e.g. ``--data``).
        image_column, label_column (str): parquet only: the columns holding the encoded images
            (default ``"image"``) and the labels (default ``"label"``; None: no labels).
        stat_files (bool | "auto"): folder only: stat each image file while indexing (True), or
            list the folders only (False: zero-byte files are then counted as "empty" when read);
            default ``"auto"``: True up to 250,000 image files, False above
            (:data:`feedgpu.sources.file_stats.AUTO_MAX`).
        index_dir (str | bool | None): folder and tar only: where the saved index lives (default
            None: feedgpu's cache dir; False: neither read nor write one; see
            :class:`~feedgpu.sources.FolderSource`).
        cache_dir (str | None), cache_budget (int > 0 | str | None), storage_options (dict | None):
            tar and parquet sources read from URLs (s3://, gs://, http(s)://, file://, or an index
            file): the node-local shard cache's folder and disk budget (``"200GiB"``), and options
            passed to the store's fsspec filesystem (credentials come the store's standard way,
            never here). See :func:`feedgpu.sources.open_source`.
        max_bad_files (int >= 0 | None): tar and parquet sources read from URLs: files that may
            be unreadable at open (default 0: one error naming each; None: any, each left out
            as "bad shard").
        verify ("identity" | "content"): tar and parquet sources read from URLs: how the shard
            cache sees a changed file (default "identity": size and ETag or Last-Modified, and
            the index file's SHA-256; "content": also downloads each cached file again once per
            run, replacing the cached copy, so bytes changed behind unchanged headers are read).

    Raises :class:`~feedgpu.errors.ConfigError` naming the key (``source.format: ...``).
    """

    format: Literal["folder", "tar", "parquet"]
    path: Union[str, list[str], None] = None
    image_column: str = "image"
    label_column: Union[str, None] = "label"
    stat_files: Union[bool, Literal["auto"]] = "auto"
    index_dir: Union[str, bool, None] = None
    cache_dir: Union[str, None] = None
    cache_budget: Union[Annotated[int, Field(gt=0, strict=True)], str, None] = None
    storage_options: Union[dict, None] = None
    max_bad_files: Union[Annotated[int, Field(ge=0, strict=True)], None] = 0
    verify: Literal["identity", "content"] = "identity"


#: ``{YAML section: its settings class}`` (``cache``: the section with ``enabled``)
SECTIONS = {"source": SourceSettings, "loader": LoaderSettings, "output": OutputSettings, "cache": CacheSection,
            "engine": EngineSettings, "executor": ExecutorSettings}
