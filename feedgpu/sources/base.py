"""The source contract: random access by index to raw records.

A source holds its index in numpy arrays (never one Python object per sample), so worker
processes forked from the loader share it without copy-on-read growth.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import SourceError
from .class_names import ClassNames
from .extensions import list_folder


@dataclass(frozen=True)
class Record:
    """One raw sample as a source returns it.

    Attributes:
        payload: encoded image bytes (``bytes`` / ``memoryview``), or for a torch Dataset source
            whatever the dataset returned as the sample (PIL image, HWC uint8 array, tensor).
        label: integer class index (-1 when the source has no labels).
        key: where the sample came from, for messages and skip reports.
    """

    payload: Any
    label: int
    key: str


def expand_paths(spec, suffix: str) -> list[str]:
    """A directory (the files :func:`~feedgpu.sources.extensions.list_folder` gives for the
    ``suffix``, ``".tar"`` or ``".parquet"``: endings in any case, Parquet sub-folders, the rest
    named in one warning, compressed tar shards refused), a glob pattern, a brace pattern (:func:`braces`:
    each path it names, in its order), one path, or a list of those; sorted within each item. A
    file named twice (overlapping items, a link to a file already named) is kept once, where it
    first comes, with one warning naming the repeats: its records would otherwise be delivered
    twice an epoch."""
    paths = _expand(spec, suffix)
    seen: dict = {}
    out, repeats = [], []
    for p in paths:
        try:
            st = os.stat(p)
            ident = (st.st_dev, st.st_ino)
        except OSError:   # missing: the source says so
            ident = ("missing", os.path.abspath(p))
        if ident in seen:
            repeats.append(f"{p} (same file as {seen[ident]})")
            continue
        seen[ident] = p
        out.append(p)
    if repeats:
        warnings.warn(f"feedgpu: {len(repeats)} file(s) named more than once, read once: "
                      + ", ".join(repeats[:5]) + (" ..." if len(repeats) > 5 else ""), stacklevel=3)
    return out


def missing_files(paths: list[str], what: str, spec) -> None:
    """Raise :class:`SourceError` naming the ``paths`` that do not exist (each was named, by a
    path or a brace pattern: leaving it out would lose its records without a word)."""
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise SourceError(f"{what}: {len(missing)} of the {len(paths)} file(s) {spec!r} names do not exist: "
                          + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))


def braces(spec: str) -> list[str]:
    """Bash-style brace patterns in a path or URL, expanded in their order, as WebDataset and
    the shell write shard sets (``train-{000000..000146}.tar``, ``{train,val}/x.tar``):
    :mod:`braceexpand`. A path that exists as written, or holds no pattern, is itself."""
    if "{" not in spec or "}" not in spec or os.path.exists(spec):
        return [spec]
    from braceexpand import braceexpand

    return list(braceexpand(spec))


def _expand(spec, suffix: str) -> list[str]:
    if isinstance(spec, (list, tuple)):
        return [p for s in spec for p in _expand(s, suffix)]
    spec = os.fspath(spec)
    expanded = braces(spec)
    if expanded != [spec]:
        return [p for s in expanded for p in _expand(s, suffix)]
    if os.path.isdir(spec):   # endings in any case; the rest named in one warning
        return list_folder(spec, "tar" if suffix == ".tar" else "parquet")
    if any(c in spec for c in "*?["):
        return sorted(glob.glob(spec))
    return [spec]


#: A converted dataset's class names, one per line in label order, beside its shards or files
#: (written by :mod:`feedgpu.convert`; tar shards and Parquet files have no place of their own).
CLASS_NAMES_FILE = "_classes.txt"  # a leading "_": pyarrow's dataset readers skip it


_NAME_CHARS = {"%25": "%", "%0A": "\n", "%0D": "\r"}
_NAME_ESCAPES = re.compile("%25|%0A|%0D")


def encode_class_name(name: str) -> str:
    """A class name as one line of :data:`CLASS_NAMES_FILE`: ``%``, newline and carriage return
    written ``%25``, ``%0A``, ``%0D`` (folder names may hold them)."""
    return name.replace("%", "%25").replace("\n", "%0A").replace("\r", "%0D")


def class_names(first_file, labels: np.ndarray) -> ClassNames:
    """Class names for ``labels`` (:class:`~feedgpu.sources.class_names.ClassNames`, made from the
    labels that occur, never one name per integer up to the largest): the
    :data:`CLASS_NAMES_FILE` beside ``first_file`` when it names every label, else the labels as
    strings (size 0 without labels). Bytes that are not UTF-8 come back as surrogate escapes, as
    Python gives such folder names."""
    path = os.path.join(os.path.dirname(os.path.abspath(first_file)), CLASS_NAMES_FILE)
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            text = f.read()
    except OSError:
        text = ""
    return class_names_from_text(text, labels)


def class_names_from_text(text: str, labels: np.ndarray) -> ClassNames:
    """Class names for ``labels`` from the text of a :data:`CLASS_NAMES_FILE` (``""``: none), as
    :func:`class_names` reads it."""
    n = int(labels.max()) + 1 if len(labels) and labels.max() >= 0 else 0
    # one name a line, "\n" only ("\r", "\x0b", "\u2028" ... may be in a name); %25, %0A and %0D
    # stand for "%", a newline and a carriage return (encode_class_name)
    names = [_NAME_ESCAPES.sub(lambda m: _NAME_CHARS[m.group()], line.removesuffix("\r"))
             for line in (text[:-1] if text.endswith("\n") else text).split("\n")] if text else []
    return ClassNames(labels, names if n and len(names) >= n else None)


def file_hash(path) -> str:
    """xxh3-128 (hex) of a file's bytes, read in 8 MiB chunks."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def index_dtype(largest: int) -> np.dtype:
    """The narrowest of uint16, uint32 and int64 that holds every value in ``[0, largest]``:
    the dtype of an index array of ids, offsets or sizes (memory per sample)."""
    largest = int(largest)
    if largest < 1 << 16:
        return np.dtype(np.uint16)
    if largest < 1 << 32:
        return np.dtype(np.uint32)
    return np.dtype(np.int64)


def index_array(values) -> np.ndarray:
    """``values`` (non-negative ints) as an array of :func:`index_dtype` of their maximum."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        a = values   # no int64 copy of a large array
    else:
        a = np.asarray(values, dtype=np.int64)
    return a.astype(index_dtype(int(a.max()) if a.size else 0))


def release_freed_memory() -> None:
    """Give the C heap's freed pages back to the system (glibc ``malloc_trim``; nothing elsewhere).
    An index built from many per-shard pieces frees more memory than it keeps, and without this
    the freed pages stay in the process's RSS, and in every forked worker's."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


class StringTable:
    """Many strings in two arrays: one UTF-8 byte blob and offsets into it (no per-item objects).
    The offsets are uint32 while the blob is under 4 GiB (:func:`index_dtype`), else int64."""

    def __init__(self, items: Sequence[str]):
        encoded = [s.encode("utf-8", "surrogateescape") for s in items]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        if encoded:
            np.cumsum([len(b) for b in encoded], out=offsets[1:])
        self.offsets = offsets.astype(np.uint32 if offsets[-1] < 1 << 32 else np.int64)
        self.blob = np.frombuffer(b"".join(encoded), dtype=np.uint8) if encoded else np.zeros(0, np.uint8)

    @classmethod
    def from_blob(cls, blob: np.ndarray, lens: np.ndarray) -> "StringTable":
        """A table from the strings' UTF-8 bytes end to end (uint8) and their lengths in bytes."""
        t = cls.__new__(cls)
        offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        t.offsets = offsets.astype(np.uint32 if offsets[-1] < 1 << 32 else np.int64)
        t.blob = np.ascontiguousarray(blob, dtype=np.uint8)
        return t

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.blob[a:b].tobytes().decode("utf-8", "surrogateescape")

    def take(self, keep: np.ndarray) -> "StringTable":
        return StringTable([self[int(i)] for i in keep])

    def digest(self, h) -> None:
        h.update(self.offsets.astype(np.int64, copy=False).tobytes())   # as int64: fingerprints stay
        h.update(self.blob.tobytes())


class Source:
    """Base class of sources. Subclasses fill ``labels`` (int64 array), ``classes`` and
    implement :meth:`read` and :meth:`key`.

    Attributes:
        labels: int64 array, one label per sample (-1 if unknown).
        classes: class names, index = label (a list, or for integer labels a
            :class:`~feedgpu.sources.class_names.ClassNames` made from the labels that occur).
        rejected: ``[(key, reason)]`` of records left out while indexing (for example empty
            files), each named; :attr:`index_skips` groups them by reason.
        rejected_details: ``{key: detail}`` for the rejected records that have a longer message.

    The conservation rule every source holds: each record is in the index exactly once, with the
    label the data gives it, or it is in :attr:`rejected` under a reason, named (a path,
    ``shard.tar:member`` or ``file.parquet#row``). A label that is missing or invalid is a
    rejected record, never a value.
    """

    format: str = "base"
    labels: np.ndarray
    classes: Sequence[str]
    #: the :class:`~feedgpu.remote.files.RemoteFiles` of a source read from URLs (tar shards and
    #: Parquet files can be), else None
    remote = None

    def __init__(self) -> None:
        self.rejected: list[tuple[str, str]] = []
        self.rejected_details: dict[str, str] = {}

    def reject(self, key: str, reason: str, detail: str = "") -> None:
        """Record a record left out while indexing (see :attr:`rejected`)."""
        self.rejected.append((key, reason))
        if detail:
            self.rejected_details[key] = detail

    def _nothing_left(self, message: str) -> SourceError:
        """The :class:`SourceError` for a source whose every record was left out while indexing,
        carrying ``rejected`` and ``rejected_details`` (so ``feedgpu scan`` can list them)."""
        err = SourceError(message)
        err.rejected = list(self.rejected)
        err.rejected_details = dict(self.rejected_details)
        return err

    @property
    def index_skips(self) -> dict[str, list[str]]:
        """``{reason: [key, ...]}`` of the records left out while indexing, in index order: what a
        loader adds to its ``stats()["skipped"]`` counts (one per record, once per source)."""
        out: dict[str, list[str]] = {}
        for key, reason in self.rejected:
            out.setdefault(reason, []).append(key)
        return out

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, index: int) -> Record:  # pragma: no cover - abstract
        raise NotImplementedError

    def key(self, index: int) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def fit_memory(self, cache_bytes: int) -> None:
        """Size this source's per-process read cache to ``cache_bytes`` (called by the loader
        from its memory budget before its workers start, see :mod:`feedgpu.exec.memory_budget`).
        Sources without such a cache ignore it."""

    def local_file(self, index: int) -> tuple[str, int] | None:
        """``(path, label)`` when the sample is a whole local file another reader may open
        itself (the DALI engine's ``fn.io.file.read``), else None."""
        return None

    def shard_of(self) -> np.ndarray:
        """The shard of each sample (int32 array, one entry per sample, ids in
        ``[0, len(shard_names()))``): the unit a shard-aware shuffle keeps together and a shard
        cache fetches (:mod:`feedgpu.order.shard_shuffle`). One shard (all zeros) unless the source has
        files of many samples (tar shards, Parquet files)."""
        return np.zeros(len(self), np.int32)

    def shard_names(self) -> list[str]:
        """One name per shard (a path or URL for sources of files), index = shard id."""
        return [f"{self.format} source"]

    def shard_sizes(self) -> np.ndarray:
        """Samples in each shard (int64, one entry per shard of :meth:`shard_names`; 0 for a
        shard whose records were all left out while indexing)."""
        return np.bincount(self.shard_of(), minlength=len(self.shard_names())).astype(np.int64)

    def identity(self, content: bool = False) -> str:
        """A stable hex digest of what the source holds (for state and cache fingerprints).

        ``content=False`` (metadata): what the file system gives without reading the data: for
        local files their paths, sizes, mtimes (ns), devices, inodes and ``st_ctime_ns`` (the
        kernel sets it on every write, so a rewrite that keeps the size and sets the mtime back,
        in place or by renaming a new file over the old, changes it); for URLs the URL, size and
        ETag. ``content=True``: the paths and the xxh3-128 of every local file's bytes (each file
        read whole; for URLs their ETags, as above): the same digest wherever the same bytes are at
        the same paths (a folder source's paths are relative to its root), whatever the files'
        metadata."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.format.encode())
        if content:
            h.update(b"\0content")
            self._content_digest(h)
        else:
            self._digest(h)
        return h.hexdigest()

    def _digest(self, h) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _content_digest(self, h) -> None:
        """What ``identity(content=True)`` hashes; sources without files of their own: :meth:`_digest`."""
        self._digest(h)

    def order_identity(self) -> str:
        """A digest of which records the source holds, in which order, with which labels: what a
        loader state needs to be resumed on (``identity()`` by default; a folder source skips
        the sizes and mtimes, so a state loads without a stat of every file)."""
        return self.identity()

    def _warn_rejected(self, listed: int = 20) -> None:
        """One warning per record left out while indexing, for the first ``listed``; then one
        warning with the count of the rest by reason (:attr:`rejected` names them all)."""
        for key, reason in self.rejected[:listed]:
            detail = self.rejected_details.get(key)
            warnings.warn(f"feedgpu: skipped {key} while indexing: {reason}" + (f" ({detail})" if detail else ""),
                          stacklevel=3)
        rest = self.rejected[listed:]
        if rest:
            counts: dict[str, int] = {}
            for _, reason in rest:
                counts[reason] = counts.get(reason, 0) + 1
            warnings.warn(f"feedgpu: skipped {len(rest)} more records while indexing ("
                          + ", ".join(f"{r}: {c}" for r, c in counts.items())
                          + "); source.rejected lists them all, `feedgpu scan` reports them", stacklevel=3)

    def describe(self) -> str:
        c = self.classes
        if isinstance(c, ClassNames) and not c.named and len(c.present) != c.size:   # sparse integer labels
            return f"{self.format} source, {len(self)} samples, {len(c.present)} distinct labels (largest {c.size - 1})"
        return f"{self.format} source, {len(self)} samples, {c.size if isinstance(c, ClassNames) else len(c)} classes"
