"""Cache settings: where, how compressed, how large."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Union

from pydantic import Field, field_validator

from ..errors import ConfigError
from ..settings_base import settings_class

#: The codecs a cache part's rows are stored with (``compression``; a part read back must name one).
CODECS = ("none", "zstd")
#: The cache's fingerprint modes (``CacheSettings.fingerprint``): what a source's files are
#: checked by, their ``stat`` or their bytes.
FINGERPRINTS = ("metadata", "content")
#: the compressions :func:`parse_compression` accepts, for messages
ALLOWED_COMPRESSION = "none, zstd, zstd:1 ... zstd:22"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str | None) -> int | None:
    """``"512MiB"``, ``"20GB"``, ``1048576`` -> bytes; ``None`` -> no limit."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cache size {value!r}: expected a number with a unit such as 512MiB or 20GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _compression(value) -> tuple[str, int] | str:
    """``(codec, level)``, or what is wrong with ``value``."""
    codec, _, level = str(value).partition(":")
    codec = codec.strip().lower()
    if codec not in CODECS:
        return f"codec must be one of {list(CODECS)}"
    if codec == "none":
        return "'none' takes no level" if level else ("none", 0)
    try:
        lvl = int(level) if level else 1
    except ValueError:
        return "the level must be an integer"
    if not 1 <= lvl <= 22:
        return "zstd level must be in 1..22"
    return codec, lvl


def parse_compression(value: str) -> tuple[str, int]:
    """``"zstd:3"`` -> ``("zstd", 3)``; ``"zstd"`` -> level 1; ``"none"`` -> ``("none", 0)``.
    zstd levels 1-22 are accepted (the codec case-insensitively). Raises :class:`ConfigError`."""
    parsed = _compression(value)
    if isinstance(parsed, str):
        raise ConfigError(f"cache compression {value!r}: {parsed}")
    return parsed


def default_cache_root() -> Path:
    from ..host import default_cache_dir

    return default_cache_dir() / "cache"


@settings_class("cache")
class CacheSettings:
    """Where the pixel cache lives, how it is compressed and how large it may grow.

    Args:
        dir (Path): cache root; default (``None``) ``<user cache dir>/feedgpu/cache``, or
            ``$FEEDGPU_CACHE_DIR/cache``, read when the settings are made; ``~`` is expanded.
        compression (str): ``"none"`` (default: raw pixels with an xxh3-64 per sample) or
            ``"zstd"``/``"zstd:N"``, N in 1..22 (default level 1; per sample, with zstd's frame
            checksum). ``"none"`` is the fastest to fill and to read
            (``bench/results/cache_epochs_uint8.md``); ``"zstd:1"`` stores about 2/3 of the bytes
            (``bench/results/cache_formats.md``) at several times the CPU per sample.
        max_size (int | None): size budget of the whole cache root in bytes (> 0; a size string
            such as ``"20GiB"`` is converted); least recently used entries of other pipelines are
            evicted first; ``None`` (default): no limit.
        part_bytes (int): target size of one part file in bytes (> 0, or a size string; default
            64 MiB).
        fingerprint (str): what ties an entry to the source's files (:data:`FINGERPRINTS`).
            ``"metadata"`` (default): each local file's path, size, mtime, device, inode and
            ``st_ctime_ns``, from one ``stat`` per file, nothing read; a rewrite that keeps the
            size and sets the mtime back is caught by its new ctime (or inode), as is a ``chmod``
            or a copy (which then rebuilds the entry). ``"content"``: the paths and the xxh3-128
            of each file's bytes, read whole when the loader opens the entry: for files whose
            metadata cannot be trusted (copied between machines, restored from backups), an
            entry is used wherever the bytes are the same. URLs: URL, size and ETag in both.

    Raises :class:`ConfigError` naming the key (``cache.compression: ...``) for a bad value or
    an unknown key. :attr:`codec` is the parsed compression.
    """

    dir: Annotated[Path, Field(validate_default=True)] = None  # type: ignore[assignment]  # None: the default root
    compression: str = "none"
    max_size: Union[Annotated[int, Field(gt=0)], None] = None
    part_bytes: Annotated[int, Field(gt=0)] = 64 << 20
    fingerprint: str = "metadata"

    @field_validator("fingerprint", mode="plain")
    @classmethod
    def _fingerprint(cls, v):
        if v not in FINGERPRINTS:
            raise ValueError(f"got {v!r}; allowed: {', '.join(FINGERPRINTS)}")
        return v

    @field_validator("dir", mode="before")
    @classmethod
    def _dir(cls, v):
        return default_cache_root() if v is None or v == "" else Path(v).expanduser()

    @field_validator("compression", mode="plain")
    @classmethod
    def _compression(cls, v):
        parsed = _compression(v) if isinstance(v, str) else "expected a string"
        if isinstance(parsed, str):
            raise ValueError(f"got {v!r}; allowed: {ALLOWED_COMPRESSION} ({parsed})")
        return v

    @field_validator("max_size", "part_bytes", mode="before")
    @classmethod
    def _size(cls, v):
        if isinstance(v, bool):
            raise ValueError(f"expected bytes (int) or a size such as 20GiB, got {v!r}")
        try:
            return parse_size(v)
        except ConfigError as e:
            raise ValueError(str(e)) from None

    @property
    def codec(self) -> tuple[str, int]:
        """The compression as ``(codec, level)`` (see :func:`parse_compression`)."""
        return parse_compression(self.compression)

    @classmethod
    def make(cls, value) -> "CacheSettings | None":
        """From ``None``/``False`` (off), ``True`` (defaults), a path, a mapping of the fields
        (with ``enabled``: off when false, as in YAML) or settings.

        Raises :class:`ConfigError` for another type or a bad field."""
        if value is None or value is False:
            return None
        if isinstance(value, CacheSettings):
            return value.settings() if isinstance(value, CacheSection) else value
        if value is True:
            value = {}
        if isinstance(value, (str, os.PathLike)):
            value = {"dir": value}
        if not isinstance(value, dict):
            raise ConfigError(f"cache: expected True, a directory or a mapping, got {value!r}")
        return CacheSection(**{"enabled": True, **value}).settings()


@settings_class("cache")
class CacheSection(CacheSettings):
    """The YAML ``cache:`` section: :class:`CacheSettings` and ``enabled``.

    Args:
        enabled (bool): cache the pipeline's deterministic prefix (default False: no cache).
    """

    enabled: bool = False

    def settings(self) -> CacheSettings | None:
        """The cache's settings, or None when it is not enabled."""
        if not self.enabled:
            return None
        return CacheSettings(self.dir, self.compression, self.max_size, self.part_bytes, self.fingerprint)
