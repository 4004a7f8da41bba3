"""Indexes built ahead of training, for data feedgpu did not write (``feedgpu index``).

* Tar shards: :func:`index_shards` writes the member table (:mod:`.tar.table`) beside every local
  shard that has no valid one, as :func:`~feedgpu.sources.tar.local.write_tables` writes it for
  ``feedgpu convert --to tar``, so a source opening the shards on a new machine or with a new
  cache dir takes the tables instead of reading every member header. A shard whose table holds
  (:func:`~feedgpu.sources.tar.table.load_table`) is left alone (``force`` rewrites it). A shard
  that cannot be indexed (missing, unreadable, not a plain tar) or is damaged (its index holds a
  ``"truncated shard"`` or ``"corrupt shard"`` record: a shard still being copied looks the same)
  gets no table and is named with its reason; the others are indexed all the same. Tables are
  written to a temporary file and renamed (:func:`~feedgpu.sources.tar.index.write`), so a table
  is whole or absent.
* An ImageFolder: :func:`index_folder` opens a :class:`~feedgpu.sources.folder.FolderSource`
  with the arguments the pipeline's ``source:`` section gives it (``index_dir``,
  ``stat_files``), which saves its index where the next source opened on that root looks for it
  (:mod:`.folder_index`). A tree changed within :data:`~feedgpu.sources.folder_index.RACY_NS`
  of the walk is not saved by the source; it is walked again once that window has passed.
* Parquet needs nothing: a Parquet source reads the files' footers (:func:`path_kind` says
  ``"parquet"``).
"""
from __future__ import annotations

import glob
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SourceError
from ..remote.urls import is_url
from . import folder_index
from .base import expand_paths
from .folder import FolderSource, saved_index_file
from .tar import local as tar_local
from .tar.members import part_arrays
from .tar.table import load_table, table_path, write_table

__all__ = ["DAMAGE_REASONS", "FolderReport", "TarReport", "index_folder", "index_shards", "path_kind"]

#: Rejected-record reasons that mark a shard as damaged: it gets no member table.
DAMAGE_REASONS = ("truncated shard", "corrupt shard")


def path_kind(path) -> str:
    """``"tar"``, ``"folder"`` or ``"parquet"`` for a command-line path: a glob (by its ending:
    ``.parquet``, else tar shards), a directory (holding ``*.tar``: shards; else ``*.parquet``:
    Parquet; else an ImageFolder) or a file (``.parquet``, else a tar shard). Raises
    :class:`~feedgpu.errors.SourceError` for a path that does not exist and for a URL."""
    p = os.fspath(path)
    if is_url(p):
        raise SourceError(f"index: {p} is a URL: a tar source read from URLs takes its member tables from the "
                          "_index.json feedgpu convert writes beside the shards; index local shards")
    if any(c in p for c in "*?["):
        return "parquet" if p.lower().endswith(".parquet") else "tar"
    if os.path.isdir(p):
        if glob.glob(os.path.join(glob.escape(p), "*.tar")):
            return "tar"
        return "parquet" if glob.glob(os.path.join(glob.escape(p), "*.parquet")) else "folder"
    if not os.path.exists(p):
        raise SourceError(f"index: {p} does not exist")
    return "parquet" if p.lower().endswith(".parquet") else "tar"


@dataclass
class TarReport:
    """What :func:`index_shards` did. ``indexed``: shards given a table; ``up_to_date``: shards
    whose table held; ``replaced``: ``[(shard, why its table did not hold)]`` (stale, corrupt or of
    another feedgpu version; each also in ``indexed``); ``failed``: ``[(shard or folder,
    reason)]``, nothing written for them;
    ``samples``: samples in the indexed and up-to-date shards (int); ``rejected``: ``{reason:
    records}`` those shards leave out; ``seconds``: wall time (float)."""
    indexed: list = field(default_factory=list)
    up_to_date: list = field(default_factory=list)
    replaced: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    samples: int = 0
    rejected: dict = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"indexed": len(self.indexed), "up_to_date": len(self.up_to_date),
                "replaced": [list(r) for r in self.replaced], "samples": self.samples,
                "rejected": dict(self.rejected), "failed": [list(f) for f in self.failed],
                "seconds": round(self.seconds, 3), "tables": [str(table_path(s)) for s in self.indexed]}

    def line(self) -> str:
        rej = ", ".join(f"{n} {r}" for r, n in sorted(self.rejected.items()))
        return (f"tar: {len(self.indexed)} shard(s) indexed"
                + (f" ({len(self.replaced)} replacing a table that did not hold)" if self.replaced else "")
                + f", {len(self.up_to_date)} up to date, {self.samples} "
                f"samples, {sum(self.rejected.values())} rejected record(s){' (' + rej + ')' if rej else ''}, "
                f"{len(self.failed)} failed, {self.seconds:.2f} s")


def _writable(folder: str) -> str | None:
    """None when a file can be created in ``folder``, else why not (the folder named)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".probe", dir=folder)
    except OSError as e:
        return f"cannot write member tables in the folder {folder} ({e.strerror or e})"
    os.close(fd)
    os.unlink(tmp)
    return None


def _counts(part: dict) -> tuple[int, int, bool, Counter]:
    """``(images, images without a label, labeled, {reason: records})`` of a shard's part."""
    part = part_arrays(part)
    labels = np.asarray(part["labels"])
    return (len(labels), int((labels == -2).sum()), bool(part.get("labeled", (labels >= 0).any())),
            Counter(r for _, r, _ in part.get("rejected", ())))


def _one_shard(shard: str, force: bool):
    """``(status, counts | reason, why a table there did not hold | None)`` of one shard; status
    ``"up to date"``, ``"indexed"`` or ``"failed"``."""
    problem = None
    try:
        if not force:
            part, problem, _ = load_table(shard)
            if part is not None:
                return "up to date", _counts(part), None
        part, st, content, made = tar_local.index_for_table(shard)
        damage = [f"{r}: {d}" for _, r, d in part.get("rejected", ()) if r in DAMAGE_REASONS]
        if damage:
            return "failed", "; ".join(damage), None
        if write_table(shard, part, st, content, made) is None:
            return "failed", "it changed while it was indexed", None
        return "indexed", _counts(part), problem
    except SourceError as e:
        return "failed", str(e), None
    except OSError as e:
        return "failed", f"{type(e).__name__}: {e.strerror or e}", None


def index_shards(shards, threads: int | None = None, force: bool = False) -> TarReport:
    """Write the member table beside every local tar shard of ``shards`` (a path, directory,
    glob or a list of these, expanded as :class:`~feedgpu.sources.tar.TarShardSource` expands
    them) that has no valid one (all of them with ``force``); ``threads``: shards indexed at once
    (default :data:`~feedgpu.sources.tar.local.INDEX_THREADS`). Failures are in the report, not
    raised (module docstring); images without a label count as ``"missing label"`` where other
    shards have labels, as the source counts them. Raises :class:`~feedgpu.errors.SourceError`
    when nothing matches ``shards``."""
    start = time.perf_counter()
    paths = expand_paths(shards, ".tar")
    if not paths:
        raise SourceError(f"index: no tar shards match {shards!r}")
    report = TarReport()
    blocked: dict[str, str | None] = {}
    todo = []
    for p in paths:
        folder = os.path.dirname(os.path.abspath(p))
        if folder not in blocked:
            blocked[folder] = _writable(folder) if os.path.isdir(folder) else None
        if blocked[folder] is None:
            todo.append(p)
    for folder, why in blocked.items():
        if why is not None:
            n = sum(os.path.dirname(os.path.abspath(p)) == folder for p in paths)
            report.failed.append((folder, f"{why}: {n} shard(s) there not indexed"))
    images = unlabeled = 0
    labeled = False
    rejected: Counter = Counter()
    results = tar_local.ordered_map(lambda s: (s, *_one_shard(s, force)), todo, threads)
    for shard, status, got, problem in results:
        if status == "failed":
            report.failed.append((shard, got))
            continue
        if problem is not None:
            report.replaced.append((shard, problem))
        (report.indexed if status == "indexed" else report.up_to_date).append(shard)
        n, none, lab, rej = got
        images, unlabeled, labeled = images + n, unlabeled + none, labeled or lab
        rejected.update(rej)
    if labeled and unlabeled:
        rejected["missing label"] += unlabeled
    report.samples = images - (unlabeled if labeled else 0)
    report.rejected = dict(rejected)
    report.seconds = time.perf_counter() - start
    return report


@dataclass
class FolderReport:
    """What :func:`index_folder` did: ``root``; ``index_file``: the saved index (Path);
    ``up_to_date``: it was already there and current; ``files``, ``classes``: int; ``rejected``:
    ``{reason: records}`` left out while indexing; ``seconds``: wall time (float)."""
    root: str
    index_file: Path
    up_to_date: bool
    files: int
    classes: int
    rejected: dict
    seconds: float

    def as_dict(self) -> dict:
        return {"root": self.root, "index_file": str(self.index_file), "up_to_date": self.up_to_date,
                "files": self.files, "classes": self.classes, "rejected": dict(self.rejected),
                "seconds": round(self.seconds, 3)}

    def line(self) -> str:
        rej = sum(self.rejected.values())
        return (f"folder {self.root}: {'up to date' if self.up_to_date else 'indexed'}, {self.files} files, "
                f"{self.classes} classes, {rej} rejected, {self.seconds:.2f} s -> {self.index_file}")


def index_folder(root, index_dir=None, stat_files: bool | str = "auto", force: bool = False) -> FolderReport:
    """Build and save the index a :class:`~feedgpu.sources.folder.FolderSource` opened as
    ``FolderSource(root, stat_files=stat_files, index_dir=index_dir)`` (a pipeline's ``source:``
    section) looks for, unless a current one is saved (``force``: build it again). ``index_dir``:
    None for feedgpu's cache dir, as the source. Raises :class:`~feedgpu.errors.SourceError` when
    the source cannot be opened (its own errors), the index folder cannot be written (named), or
    the tree keeps changing so that no index is saved."""
    if index_dir is False:
        raise SourceError("index: index_dir=False keeps no saved index: there is nothing to build")
    start = time.perf_counter()
    root_s = str(Path(root))
    file = saved_index_file(root_s, index_dir, stat_files=stat_files)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SourceError(f"index: cannot create the folder index directory {file.parent} ({e.strerror or e})") \
            from None
    why = _writable(str(file.parent))
    if why is not None:
        raise SourceError(f"index: {why.replace('member tables', 'the folder index')}")
    if force:
        folder_index.discard(file)
    src = None
    for attempt in range(2):
        src = FolderSource(root_s, stat_files=stat_files, index_dir=index_dir)
        if src.from_saved_index or folder_index.load(file, root_s, file.stem) is not None:
            break
        if attempt == 0:   # the walk saw folders changed within the racy window: wait it out
            time.sleep(folder_index.RACY_NS / 1e9)
    else:
        raise SourceError(f"index: the index of {root_s} was not saved to {file}: its folders changed within "
                          f"{folder_index.RACY_NS / 1e9:.0f} s of each walk; run it again once nothing writes there")
    return FolderReport(root_s, file, src.from_saved_index, len(src), len(src.classes),
                        dict(Counter(r for _, r in src.rejected)), time.perf_counter() - start)
