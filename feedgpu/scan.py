"""Find bad samples before training: read and fully decode every sample of a source.

:func:`scan_source` runs the real :class:`~feedgpu.stages.Decode` stage (header checks, the
pixel limit, then every pixel) on each sample, in forked worker processes, and returns a
:class:`ScanReport`: the bad samples by reason, each named as the loader names it (a path,
``shard.tar:member`` or ``file.parquet#row``). Records the source left out while indexing
(zero-byte files, missing or invalid labels, duplicate tar keys, truncated shards, dangling links:
:attr:`~feedgpu.sources.base.Source.rejected`) are listed too, with index -1.

A report can be written as a quarantine file (:meth:`ScanReport.write_quarantine`, JSON) and
added to a pipeline's cache entry (:func:`quarantine_in_cache`): the loader then skips those
samples without reading them (reason as found here, counted in ``loader.stats()["skipped"]``).
"""
from __future__ import annotations

import json
import os
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .errors import ConfigError, SampleError, SourceError
from .sources import Source, open_source
from .stages.decode import Decode

QUARANTINE_FORMAT = "feedgpu.quarantine/1"
TASKS_PER_WORKER = 2   # chunks queued per scan worker: one running, one ready


@dataclass(frozen=True)
class BadSample:
    """``index``: position in the source (-1: left out while indexing); ``key``: where it came
    from; ``reason``: the loader's skip reason; ``detail``: the decoder's message."""

    index: int
    key: str
    reason: str
    detail: str = ""


@dataclass
class ScanReport:
    """What :func:`scan_source` found. ``samples``: samples in the index; ``bad``: sorted by
    index (indexing rejects first); ``seconds``: wall time of the scan."""

    source: str
    format: str
    fingerprint: str
    samples: int
    bad: list[BadSample] = field(default_factory=list)
    seconds: float = 0.0
    max_pixels: int = 0

    def by_reason(self) -> dict[str, list[BadSample]]:
        out: dict[str, list[BadSample]] = defaultdict(list)
        for b in self.bad:
            out[b.reason].append(b)
        return dict(sorted(out.items(), key=lambda kv: (-len(kv[1]), kv[0])))

    def as_dict(self) -> dict:
        return {"source": self.source, "format": self.format, "fingerprint": self.fingerprint,
                "samples": self.samples, "bad_total": len(self.bad), "seconds": round(self.seconds, 3),
                "max_pixels": self.max_pixels,
                "by_reason": {r: len(v) for r, v in self.by_reason().items()},
                "bad": [asdict(b) for b in self.bad]}

    def text(self, show: int = 20) -> str:
        """A human report: totals, then each reason with up to ``show`` sample names."""
        lines = [f"scanned {self.samples} samples ({self.source}) in {self.seconds:.1f} s: "
                 f"{len(self.bad)} bad" + (" (none)" if not self.bad else "")]
        for reason, items in self.by_reason().items():
            lines.append(f"  {reason}: {len(items)}")
            for b in items[:show]:
                lines.append(f"    {b.key}" + (f"  ({b.detail})" if b.detail else ""))
            if len(items) > show:
                lines.append(f"    ... and {len(items) - show} more")
        return "\n".join(lines)

    def write_quarantine(self, path: str | os.PathLike) -> Path:
        """Write ``{format, fingerprint, source, samples: [{index, key, reason}]}`` as JSON
        (mode 0644, replaced atomically)."""
        from .cache.manifest import write_atomic

        doc = {"format": QUARANTINE_FORMAT, "fingerprint": self.fingerprint, "source": self.source,
               "samples": [{"index": b.index, "key": b.key, "reason": b.reason} for b in self.bad]}
        path = Path(path)
        write_atomic(path, json.dumps(doc, indent=1).encode())
        return path


def guess_format(path: str | os.PathLike) -> str:
    """The format of ``path``: ``tar`` / ``parquet`` for such a file; for a directory ``folder``
    when it holds sub-folders (ImageFolder) or image files (a flat folder: every image is read,
    unlabeled), else ``tar`` or ``parquet`` when it holds such files. So one ``.tar`` among the
    images or class folders of a download does not turn a scan into a scan of that file only.
    A URL, or an index file (``_index.json``), is ``tar`` / ``parquet`` by its suffix or by the
    index's kind. Raises :class:`ConfigError` when ``path`` does not exist."""
    from .remote.index import index_kind, is_index
    from .remote.urls import is_url

    if is_index(path):
        return index_kind(os.fspath(path))
    if is_url(path):
        for fmt in ("tar", "parquet"):
            if os.fspath(path).rstrip("/").endswith("." + fmt):
                return fmt
        raise ConfigError(f"{path}: give --format tar or parquet for this URL (or its _index.json)")
    p = Path(path)
    from .sources.extensions import IMAGE_EXTENSIONS, PARQUET_EXTENSIONS, TAR_EXTENSIONS

    if p.is_file():   # endings in any case
        if p.name.lower().endswith(TAR_EXTENSIONS):
            return "tar"
        if p.name.lower().endswith(PARQUET_EXTENSIONS):
            return "parquet"
        raise ConfigError(f"{path}: give a directory, a .tar shard or a .parquet file (or --format)")
    if not p.is_dir():
        raise ConfigError(f"{path}: no such file or directory")
    visible = [e for e in p.iterdir() if not e.name.startswith(".")]
    if any(e.is_dir() for e in visible) or any(e.name.lower().endswith(IMAGE_EXTENSIONS) for e in visible):
        return "folder"
    if any(e.name.lower().endswith(TAR_EXTENSIONS) for e in visible):
        return "tar"
    if any(e.name.lower().endswith(PARQUET_EXTENSIONS) for e in visible):
        return "parquet"
    return "folder"


def _open_folder(data):
    """A folder with class sub-folders and no image files of its own as ImageFolder, else (a
    flat folder, or images beside sub-folders) every image under it, unlabeled: image files in
    the root of an ImageFolder are not samples, but a scan reads every file."""
    from .sources.dir_entries import is_dir, list_dir
    from .sources.extensions import IMAGE_EXTENSIONS
    from .sources.folder import FolderSource

    entries = [e for e in list_dir(str(data)) if not e.name.startswith(".")]
    loose = any(not is_dir(e) and e.name.lower().endswith(IMAGE_EXTENSIONS) for e in entries)
    if any(is_dir(e) for e in entries) and not loose:
        return FolderSource(data)
    return FolderSource(data, flat=True)


def check_one(source: Source, decode: Decode, index: int) -> BadSample | None:
    """Read and decode sample ``index``; None when it is good. Never raises for bad data: an
    unexpected exception is reported with reason ``"error"``."""
    try:
        rec = source.read(index)
        decode.apply(rec.payload)
    except SampleError as e:
        return BadSample(index, source.key(index), e.reason, e.detail)
    except OSError as e:
        return BadSample(index, source.key(index), "unreadable", str(e))
    except Exception as e:  # noqa: BLE001 - a scan reports every failure, it never stops on one
        return BadSample(index, source.key(index), "error", f"{type(e).__name__}: {e}")
    return None


def check_chunk(source: Source, decode: Decode, indices) -> tuple[int, list[BadSample]]:
    """``(samples checked, the bad ones)`` of the samples ``indices`` (ints)."""
    return len(indices), [b for b in (check_one(source, decode, int(i)) for i in indices) if b is not None]


class ChunkCheck:
    """What a scan worker runs for a task: :func:`check_chunk` of the task's indices (the source
    and the decode stage are inherited by the forked workers)."""

    def __init__(self, source: Source, decode: Decode):
        self.source, self.decode = source, decode

    def __call__(self, task) -> tuple[int, list[BadSample]]:
        return check_chunk(self.source, self.decode, task.indices)


def _pooled(source: Source, decode: Decode, spans: list, workers: int):
    """``(done, found)`` per span, in the order they finish, from forked worker processes
    (:class:`~feedgpu.exec.pool.process_pool.ProcessPool`: a worker that dies is replaced and its
    chunk checked again); a worker's exception is raised here."""
    from .exec.contract import Task
    from .exec.pool.errors import unpack_exception
    from .exec.pool.process_pool import ProcessPool

    pool = ProcessPool(ChunkCheck(source, decode), workers, name="feedgpu-scan", context="fork")
    try:
        todo = iter(enumerate(spans))
        inflight = 0
        for seq, (lo, hi) in todo:
            pool.submit(Task(0, seq, indices=np.arange(lo, hi)))
            inflight += 1
            if inflight == TASKS_PER_WORKER * workers:
                break
        while inflight:
            tag, seq, _, ok, payload = pool.get()
            if not ok:
                where = "while starting" if seq < 0 else f"while scanning samples {spans[seq][0]}..{spans[seq][1] - 1}"
                raise unpack_exception(payload, where)
            inflight -= 1
            for nxt, (lo, hi) in todo:
                pool.submit(Task(0, nxt, indices=np.arange(lo, hi)))
                inflight += 1
                break
            yield payload
    finally:
        pool.close()


def scan_source(source: Source, decode: Decode | None = None, workers: int | None = None,
                chunk: int = 64, progress: bool = True) -> ScanReport:
    """Decode every sample of ``source``.

    Args:
        source: an opened source.
        decode: the decode stage to run (default ``Decode()``; its ``max_pixels`` is the pixel
            limit).
        workers: forked processes (default ``os.cpu_count()``; 0 runs in this process).
        chunk: samples per task.
        progress: show a tqdm progress bar on stderr.

    Returns a :class:`ScanReport`. Memory per worker is bounded by one decoded image (the pixel
    limit is checked from the header before decoding).
    """
    decode = decode or Decode()
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    n = len(source)
    t0 = time.perf_counter()
    details = getattr(source, "rejected_details", {})
    bad = [BadSample(-1, key, reason, details.get(key, "")) for key, reason in source.rejected]
    spans = [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, unit="img", desc="scan", dynamic_ncols=True, leave=False)
    try:
        if workers == 0 or len(spans) <= 1:
            results = (check_chunk(source, decode, range(lo, hi)) for lo, hi in spans)
        else:
            results = _pooled(source, decode, spans, min(workers, len(spans)))
        try:
            for done, found in results:
                bad.extend(found)
                if bar is not None:
                    bar.update(done)
        finally:
            results.close()
    finally:
        if bar is not None:
            bar.close()
    bad.sort(key=lambda b: (b.index, b.key))
    return ScanReport(source=source.describe(), format=source.format, fingerprint=source.identity(),
                      samples=n, bad=bad, seconds=time.perf_counter() - t0, max_pixels=decode.max_pixels)


class NothingLeft(Source):
    """A source whose every record was left out while indexing (every image of a shard a
    duplicate key, every file empty ...): no samples, and its ``rejected`` from the
    :class:`SourceError` the source raised, so a scan names them (exit status 1, not 2)."""

    def __init__(self, fmt: str, data, error: SourceError):
        super().__init__()
        self.format, self.data, self.message = fmt, str(data), str(error)
        self.rejected = list(error.rejected)
        self.rejected_details = dict(getattr(error, "rejected_details", {}))
        self.labels = np.zeros(0, np.int64)
        self.classes = []

    def _digest(self, h) -> None:
        h.update(self.data.encode("utf-8", "surrogateescape"))
        for key, reason in self.rejected:
            h.update(f"{key}\0{reason}\0".encode("utf-8", "surrogateescape"))

    def describe(self) -> str:
        return f"{self.format} source, 0 samples: {self.message}"


def open_for_scan(data: str, fmt: str | None = None, overrides: dict | None = None,
                  max_pixels: int | None = None):
    """``(source, decode, pipeline or None)`` for a dataset path or a pipeline YAML file.

    A ``.yaml``/``.yml`` file is a pipeline: its source and its decode stage are used
    (``overrides`` as in ``Pipeline.from_yaml``). Else ``data`` is opened as ``fmt`` (default:
    :func:`guess_format`). ``max_pixels`` overrides the decode stage's pixel limit."""
    pipeline = None
    if str(data).endswith((".yaml", ".yml")):
        from .pipeline import Pipeline

        pipeline = Pipeline.from_yaml(data, **(overrides or {}))
        with warnings.catch_warnings():  # samples left out while indexing are in the report
            warnings.simplefilter("ignore")
            source = pipeline.source
        first = pipeline.stages[0]
        decode = first if isinstance(first, Decode) else Decode()
    else:
        if overrides:
            raise ConfigError("--set applies to a pipeline file; give DATA as a .yaml pipeline")
        with warnings.catch_warnings():  # samples left out while indexing are in the report
            warnings.simplefilter("ignore")
            fmt = fmt or guess_format(data)
            try:
                source = _open_folder(data) if fmt == "folder" and os.path.isdir(data) else open_source(fmt, data)
            except SourceError as e:
                if not getattr(e, "rejected", None):
                    raise
                source = NothingLeft(fmt, data, e)   # every record left out: report them, not an error
        decode = Decode()
    if max_pixels is not None:
        decode = Decode(decode.exif_orientation, max_pixels, decode.background, decode.reduce)
    return source, decode, pipeline


def quarantine_in_cache(report: ScanReport, pipeline, cache=None) -> Path:
    """Add the report's bad samples (those with an index) to ``pipeline``'s cache entry, so the
    loader skips them without reading them. ``cache``: cache settings overriding the pipeline's
    (a directory, True or a mapping). Returns the entry directory. Raises :class:`ConfigError`
    when the pipeline has no cache or nothing cacheable."""
    from .cache import CacheSettings, open_entry

    settings = CacheSettings.make(cache) if cache is not None else pipeline.cache
    if settings is None:
        raise ConfigError("the pipeline has no cache: enable cache in the pipeline file or give --cache-dir")
    plan = pipeline.plan("cpu")
    entry = open_entry(settings, pipeline.source, pipeline.stages, plan)
    if entry is None:
        raise ConfigError("the pipeline has no cacheable stage prefix; nothing to quarantine in")
    if report.fingerprint != pipeline.source.identity():
        raise ConfigError("the scan report is for another dataset than the pipeline's source")
    try:
        for b in report.bad:
            if b.index >= 0:
                entry.quarantine(b.index, b.key, b.reason)
        return entry.dir
    finally:
        entry.close()   # the flush policy's end event: the quarantined samples are listed
