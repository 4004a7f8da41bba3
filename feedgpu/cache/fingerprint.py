"""What a cache entry's contents depend on, as one hex digest.

fingerprint = blake2b(cache format + feedgpu version + source identity + each cached stage's
name, version and parameters, in order). The source identity
(:meth:`feedgpu.sources.base.Source.identity`) is, in the cache's ``fingerprint="metadata"``
mode, each local file's path, size, mtime, device, inode and ``st_ctime_ns``; in
``fingerprint="content"`` mode the paths and the xxh3-128 of each file's bytes. The decode settings (EXIF
orientation, pixel limit, background) are the decode stage's parameters, so they are in it.
"""
from __future__ import annotations

import hashlib
import inspect
import json

from ..stages.base import Stage
from ..stages.custom import PythonStage

CACHE_FORMAT = "feedgpu.cache/3"
"""Bumped whenever the files' layout changes (2: xxh3-64 checksums, ``check`` uint64; 3: ``check``
also for zstd rows, the manifest's ``content_xxh3`` instead of a checksum of the file's bytes):
the fingerprint includes it, so a cache written in another format is rebuilt, never misread."""


class NotFingerprintable(Exception):
    """A stage's output cannot be keyed (a lambda or a function defined inside another)."""


def stage_key(stage: Stage) -> dict:
    d = {"name": stage.name, "version": stage.version, "config": stage.config()}
    if isinstance(stage, PythonStage):
        fn = stage.fn
        qual = getattr(fn, "__qualname__", "")
        if "<lambda>" in qual or "<locals>" in qual or not getattr(fn, "__module__", None):
            raise NotFingerprintable(
                f"python stage {stage.label!r} is a lambda or a local function: its code cannot be "
                "fingerprinted; make it a module-level function")
        try:
            d["source"] = hashlib.blake2b(inspect.getsource(fn).encode(), digest_size=16).hexdigest()
        except (OSError, TypeError):
            d["source"] = None  # compiled code: the qualified name and version must do
    return d


def fingerprint(source_identity: str, stages: list[Stage]) -> str:
    """Raises :class:`NotFingerprintable` for stages whose code cannot be keyed."""
    from .._version import __version__

    payload = {"format": CACHE_FORMAT, "feedgpu": __version__, "source": source_identity,
               "stages": [stage_key(s) for s in stages]}
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=16).hexdigest()
