"""An entry's manifest: what parts it holds, with checksums, and which samples are quarantined.

``manifest.json`` is only replaced whole (temporary file, fsync, rename) while holding an
exclusive ``flock`` on ``.lock`` in the entry, so DDP ranks and concurrent jobs can add parts
to one entry without losing each other's updates. Files are created with mode 0644 (never
world-writable) and hold JSON only (no pickle).
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import time
from pathlib import Path

from .fingerprint import CACHE_FORMAT

MANIFEST = "manifest.json"


def makedirs(path: Path, mode: int = 0o755) -> None:
    """``mkdir -p`` that gives every directory it creates ``mode`` masked by the umask but never
    group- or world-writable (``Path.mkdir(parents=True)`` makes the parents ``0o777 & ~umask``)."""
    path = Path(path)
    if path.is_dir():
        return
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode & 0o755)
        except FileExistsError:
            continue
        if d.stat().st_mode & 0o022:  # a umask of 0 leaves mode as given; never g+w or o+w
            os.chmod(d, d.stat().st_mode & 0o755)


@contextlib.contextmanager
def locked(entry: Path, exclusive: bool = True):
    """Hold ``entry/.lock`` (exclusive for writers, shared for readers)."""
    makedirs(entry)
    fd = os.open(entry / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def new_manifest(fingerprint: str, compression: str, n: int, meta: dict) -> dict:
    from .._version import __version__

    now = time.time()
    return {"format": CACHE_FORMAT, "feedgpu_version": __version__, "fingerprint": fingerprint,
            "compression": compression, "samples": n, "created": now, "updated": now,
            "schema": {"dtype": "uint8", "layout": "HWC", "channels": 3}, "meta": meta,
            "parts": [], "quarantine": []}


def read(entry: Path) -> dict | None:
    """The manifest, or None when the entry has none yet (or an unreadable one)."""
    try:
        with open(entry / MANIFEST, "rb") as f:
            m = json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None
    return m if m.get("format") == CACHE_FORMAT else None


def update(entry: Path, init: dict, add_parts=(), add_quarantine=(), drop_parts=()) -> dict:
    """Add/drop parts and quarantined samples under the entry's lock; returns the new manifest."""
    with locked(entry):
        m = read(entry)
        if m is None or m.get("fingerprint") != init.get("fingerprint"):  # missing, or not this entry's
            m = copy.deepcopy(init)
        names = {p["name"] for p in m["parts"]}
        m["parts"] = [p for p in m["parts"] if p["name"] not in set(drop_parts)]
        m["parts"] += [p for p in add_parts if p["name"] not in names]
        seen = {q["index"] for q in m["quarantine"]}
        m["quarantine"] += [q for q in add_quarantine if q["index"] not in seen]
        m["updated"] = time.time()
        write_atomic(entry / MANIFEST, json.dumps(m, indent=1).encode())
        for name in drop_parts:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry / name)
    return m
