"""A cache entry (one fingerprint's directory) as the loader uses it, and the cache root.

Layout: ``<root>/<fingerprint>/manifest.json``, ``part-*.arrow``, ``.lock``, ``last_used``.

Every process that runs stages (workers, ``num_workers=0``, ``feedgpu cache build``) reads rows
through the entry's index and adds the samples it computed as new part files; parts are written
to a temporary name and renamed, then listed in the manifest under its lock. Several processes
may fill one entry at once: a sample computed twice is stored twice and read once, nothing is
corrupted. A part that fails to open or a row that fails its checksum is dropped and recomputed.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
import uuid
import warnings
from pathlib import Path

import numpy as np

from . import manifest as mf
from .checks import CorruptPart, CorruptRow
from .flush import FlushPolicy
from .parts import Part, PartWriter, RowBuffer, RowEncoder
from .settings import CacheSettings, parse_compression

log = logging.getLogger("feedgpu.cache")
STRAY_AGE_S = 3600
BATCH_BYTES = 8 << 20   # rows are streamed to the part file in record batches of about this size
INUSE = ".inuse"


class CacheEntry:
    """Read and fill one entry.

    Args:
        settings: root, compression, budget.
        fingerprint: the entry's key (:func:`~feedgpu.cache.fingerprint.fingerprint`).
        n: samples in the source.
        meta: description stored in a new manifest (source, stages).

    When the rows this process adds become readable to others is decided by ``policy`` (a
    :class:`~feedgpu.cache.flush.FlushPolicy`); callers send it events, not :meth:`flush`.
    """

    def __init__(self, settings: CacheSettings, fingerprint: str, n: int, meta: dict | None = None):
        self.settings, self.fingerprint, self.n = settings, fingerprint, n
        self.dir = Path(settings.dir) / fingerprint
        mf.makedirs(self.dir)  # every created directory 0o755 & ~umask, never world-writable
        self._init = mf.new_manifest(fingerprint, settings.compression, n, meta or {})
        self.part_of = np.full(n, -1, np.int32)
        self.row_of = np.zeros(n, np.int32)
        self.quarantined: dict[int, tuple[str, str]] = {}
        self.parts: list[Part] = []
        self._loaded: set[str] = set()
        self._mtime = None
        self._encoder = RowEncoder(*parse_compression(settings.compression))
        self._pid = os.getpid()
        self._reset_buffer()
        self.policy = FlushPolicy(self, settings.part_bytes)
        self.full = False       # over the budget, or the entry vanished: stop adding
        (self.dir / "last_used").touch(mode=0o644)
        # A shared lock on .inuse for as long as this entry is open (inherited by forked workers):
        # eviction and `cache clear` skip entries someone holds.
        self._inuse = os.open(self.dir / INUSE, os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(self._inuse, fcntl.LOCK_SH)
        self.refresh()

    def close(self) -> None:
        """Release the entry (its in-use lock); buffered rows are published first (the
        policy's ``end`` event)."""
        if getattr(self, "_inuse", None) is None:
            return
        if self._pid == os.getpid():
            self.policy.end()
        os.close(self._inuse)
        self._inuse = None

    def __del__(self):
        with contextlib.suppress(Exception):
            if getattr(self, "_inuse", None) is not None:
                os.close(self._inuse)

    # -- reading ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Pick up parts and quarantined samples other processes added (cheap when unchanged)."""
        try:
            mtime = os.stat(self.dir / mf.MANIFEST).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._mtime:
            return
        m = mf.read(self.dir)
        if m is None or m["fingerprint"] != self.fingerprint:
            return
        self._mtime = mtime
        listed = {p["name"] for p in m["parts"]}
        for pid, part in enumerate(self.parts):  # dropped by another process (a bad row, verify)
            name = os.path.basename(part.path)
            if name in self._loaded and name not in listed:
                self._loaded.discard(name)
                self.part_of[self.part_of == pid] = -1
        bad = []
        for p in m["parts"]:
            if p["name"] in self._loaded:
                continue
            try:
                part = Part(str(self.dir / p["name"]), p.get("meta_xxh3"))
            except (OSError, ValueError, CorruptPart) as e:  # missing, truncated or damaged
                log.warning("cache part %s is unreadable (%s); dropped, its samples are recomputed", p["name"], e)
                bad.append(p["name"])
                continue
            if len(part) != p["rows"] or np.any((part.index < 0) | (part.index >= self.n)):
                bad.append(p["name"])
                continue
            pid = len(self.parts)
            self.parts.append(part)
            self._loaded.add(p["name"])
            new = self.part_of[part.index] < 0
            self.part_of[part.index[new]] = pid
            self.row_of[part.index[new]] = np.flatnonzero(new)
        for q in m["quarantine"]:
            self.quarantined[int(q["index"])] = (q["key"], q["reason"])
        if bad:
            mf.update(self.dir, self._init, drop_parts=bad)

    def get(self, index: int) -> np.ndarray | None:
        """Cached uint8 HWC pixels of sample ``index``, or None (not cached, or corrupt: then the
        part is dropped and the sample recomputed)."""
        pid = self.part_of[index]
        if pid < 0:
            return None
        part = self.parts[pid]
        try:
            return part.pixels(int(self.row_of[index]))
        except CorruptRow as e:
            warnings.warn(f"feedgpu cache: {e}; the part is dropped and its samples recomputed", stacklevel=2)
            self._drop(pid)
            return None

    def label(self, index: int) -> int:
        """The cached label (covered by the part's meta checksum)."""
        pid = self.part_of[index]
        return int(self.parts[pid].labels[self.row_of[index]])

    def _drop(self, pid: int) -> None:
        name = os.path.basename(self.parts[pid].path)
        self.part_of[self.part_of == pid] = -1
        mf.update(self.dir, self._init, drop_parts=[name])

    @property
    def cached(self) -> int:
        return int(np.count_nonzero(self.part_of >= 0))

    @property
    def complete(self) -> bool:
        return self.cached + len(self.quarantined) >= self.n

    # -- filling ------------------------------------------------------------------------------
    def _reset_buffer(self) -> None:
        self._rows = RowBuffer(min(BATCH_BYTES, self.settings.part_bytes) + (1 << 20))
        self._buffered: set[int] = set()
        self._quarantine: list[dict] = []
        self._part: PartWriter | None = None

    def _own(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's buffer is not ours to write
            self._pid = os.getpid()
            self._reset_buffer()

    def put(self, index: int, key: str, label: int, pixels: np.ndarray) -> None:
        """Add a computed sample (uint8 HWC ``pixels``). Rows stream to the open part file in
        record batches of about ``BATCH_BYTES``; the part becomes readable when the
        :class:`~feedgpu.cache.flush.FlushPolicy` publishes it (at ``part_bytes``, at an epoch
        change, when the worker pauses or stops)."""
        self._own()
        if self.full or self.part_of[index] >= 0 or index in self._buffered:
            return
        data, check = self._encoder.encode(pixels)
        self._rows.add(index, key, label, pixels.shape[0], pixels.shape[1], check, data)
        self._buffered.add(index)
        if self._rows.nbytes >= min(BATCH_BYTES, self.settings.part_bytes):
            self._write_batch()
            self.policy.row_added()

    @property
    def open_part_bytes(self) -> int:
        """Bytes of rows this process has written to its open, unpublished part."""
        return self._part.bytes if self._part is not None else 0

    def quarantine(self, index: int, key: str, reason: str) -> None:
        """Record a sample that cannot be decoded; later epochs skip it without reading it."""
        self._own()
        if index not in self.quarantined:
            self.quarantined[index] = (key, reason)
            self._quarantine.append({"index": index, "key": key, "reason": reason})

    def _write_batch(self) -> None:
        if not len(self._rows):
            return
        try:
            if self._part is None:
                self._part = PartWriter(self.dir, f"part-{uuid.uuid4().hex}.arrow", self._encoder)
            self._part.write(self._rows)
        except OSError as e:
            self._give_up(e)
        self._rows.clear()

    def flush(self) -> bool:
        """Publish: close the current part (renamed into place) and list it, with new
        quarantined samples, in the manifest; True when something was listed. Called by
        ``policy``. A failure (the entry deleted or the disk full) stops caching with a
        warning; training goes on."""
        self._own()
        if self.full:
            return False
        self._write_batch()
        add = []
        part, self._part = self._part, None
        try:
            if part is not None:
                add.append(part.close())
            if add or self._quarantine:
                mf.update(self.dir, self._init, add_parts=add, add_quarantine=self._quarantine)
        except OSError as e:
            self._give_up(e)
            return False
        listed = bool(add or self._quarantine)
        self._quarantine = []
        self._buffered.clear()
        if add:
            self._enforce_budget()
        return listed

    def _give_up(self, error: OSError) -> None:
        if self._part is not None:
            with contextlib.suppress(OSError):
                self._part.abort()
            self._part = None
        self.full = True
        warnings.warn(f"feedgpu cache: cannot write to {self.dir} ({error}); caching stops for this run",
                      stacklevel=3)

    def _enforce_budget(self) -> None:
        budget = self.settings.max_size
        if budget is None:
            return
        evict_lru(Path(self.settings.dir), budget, keep=self.fingerprint)
        if entry_bytes(self.dir) > budget and not self.full:
            self.full = True
            warnings.warn(f"feedgpu cache: entry {self.fingerprint} reached the budget of {budget} bytes; "
                          "samples beyond it are not cached", stacklevel=2)


# -- the cache root --------------------------------------------------------------------------------
def entry_bytes(entry: Path) -> int:
    return sum(f.stat().st_size for f in entry.iterdir() if f.is_file())


def entries(root: Path) -> list[dict]:
    """Each entry: fingerprint, bytes, parts, rows, samples, quarantined, last used, manifest."""
    out = []
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not d.is_dir():
            continue
        m = mf.read(d)
        lu = d / "last_used"
        out.append({"fingerprint": d.name, "path": str(d), "bytes": entry_bytes(d),
                    "parts": len(m["parts"]) if m else 0, "rows": sum(p["rows"] for p in m["parts"]) if m else 0,
                    "samples": m["samples"] if m else None, "quarantined": len(m["quarantine"]) if m else 0,
                    "compression": m["compression"] if m else None,
                    "last_used": lu.stat().st_mtime if lu.exists() else 0.0, "manifest": m is not None})
    return out


@contextlib.contextmanager
def _unused(entry: Path):
    """Yields True while holding ``entry`` exclusively, False when a process has it open."""
    try:
        fd = os.open(entry / INUSE, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _remove(entry: Path) -> bool:
    """Delete an entry unless a process has it open; True when deleted."""
    with _unused(entry) as free:
        if not free:
            log.info("cache entry %s is in use; not removed", entry.name)
            return False
        with mf.locked(entry):
            shutil.rmtree(entry, ignore_errors=True)
        return True


def evict_lru(root: Path, budget: int, keep: str | None = None) -> list[str]:
    """Remove least recently used entries (never ``keep``, nor one a process has open) until the
    root fits ``budget``."""
    es = entries(root)
    total = sum(e["bytes"] for e in es)
    removed = []
    for e in sorted(es, key=lambda e: e["last_used"]):
        if total <= budget:
            break
        if e["fingerprint"] == keep or not _remove(Path(e["path"])):
            continue
        total -= e["bytes"]
        removed.append(e["fingerprint"])
        log.info("evicted cache entry %s (%d bytes)", e["fingerprint"], e["bytes"])
    return removed


def verify(entry: Path, repair: bool = True) -> dict:
    """Check every part (:func:`verify_part`); drop bad parts (``repair``) so they are rebuilt.
    Returns ``{"parts", "rows", "bad_parts": [(name, why)], "stray_files"}``."""
    m = mf.read(entry)
    if m is None:
        return {"parts": 0, "rows": 0, "bad_parts": [("manifest.json", "missing or unreadable")], "stray_files": []}
    bad = []
    rows = 0
    for p in m["parts"]:
        why = verify_part(entry / p["name"], p)
        if why is None:
            rows += p["rows"]
        else:
            bad.append((p["name"], why))
    listed = {p["name"] for p in m["parts"]}
    old = time.time() - STRAY_AGE_S  # younger ones may be a writer's, between rename and listing
    stray = [f.name for f in entry.iterdir() if f.name.endswith((".arrow", ".tmp")) and f.name not in listed
             and f.stat().st_mtime < old]
    if repair and bad:
        mf.update(entry, m, drop_parts=[b[0] for b in bad])
    if repair:
        for name in stray:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry / name)
    return {"parts": len(m["parts"]), "rows": rows, "bad_parts": bad, "stray_files": stray}


def verify_part(path: Path, listed: dict) -> str | None:
    """Why the part file at ``path`` does not match its manifest entry ``listed``, or None: Arrow
    cannot read it, its small columns differ from ``meta_xxh3``, its checksum (meta, codec, keys)
    from ``content_xxh3``, its row count from ``rows``, or a row's stored bytes from their
    ``check`` or its shape."""
    try:
        part = Part(str(path), listed.get("meta_xxh3"))
        if part.content_checksum() != listed.get("content_xxh3"):
            return "checksum mismatch"
        if len(part) != listed.get("rows"):
            return f"{len(part)} rows, the manifest lists {listed.get('rows')}"
        for r in range(len(part)):
            part.verify_row(r)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError, CorruptRow, CorruptPart) as e:
        return str(e).replace(str(path), "", 1).lstrip(": ")
    return None


def clear(root: Path, fingerprint: str | None = None) -> tuple[int, int]:
    """Delete one entry or all; returns ``(removed, skipped because in use)``."""
    removed = busy = 0
    for e in entries(root):
        if fingerprint is None or e["fingerprint"] == fingerprint:
            if _remove(Path(e["path"])):
                removed += 1
            else:
                busy += 1
    return removed, busy


def touch(entry: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(entry / "last_used", (time.time(), time.time()))
