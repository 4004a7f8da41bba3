"""Cache settings: where, how compressed, how large."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

CODECS = ("none", "zstd")
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


def parse_compression(value: str) -> tuple[str, int]:
    """``"zstd:3"`` -> ``("zstd", 3)``; ``"zstd"`` -> level 1; ``"none"`` -> ``("none", 0)``.
    zstd levels 1-22 are accepted. Raises :class:`ConfigError`."""
    codec, _, level = str(value).partition(":")
    codec = codec.strip().lower()
    if codec not in CODECS:
        raise ConfigError(f"cache compression {value!r}: codec must be one of {list(CODECS)}")
    if codec == "none":
        if level:
            raise ConfigError(f"cache compression {value!r}: 'none' takes no level")
        return "none", 0
    try:
        lvl = int(level) if level else 1
    except ValueError:
        raise ConfigError(f"cache compression {value!r}: the level must be an integer") from None
    if not 1 <= lvl <= 22:
        raise ConfigError(f"cache compression {value!r}: zstd level must be in 1..22")
    return codec, lvl


def default_cache_root() -> Path:
    from ..sample_data import default_cache_dir

    return default_cache_dir() / "cache"


@dataclass(frozen=True)
class CacheSettings:
    """Args:
        dir: cache root (default ``<user cache dir>/feedgpu/cache``, or ``$FEEDGPU_CACHE_DIR/cache``).
        compression: ``"none"`` (raw pixels with an xxh3-64 per sample) or ``"zstd:N"`` (per
            sample, with zstd's frame checksum). Default ``"none"``: the fastest to fill and to
            read (``bench/results/cache_epochs_uint8.md``); ``"zstd:1"`` stores about 2/3 of the
            bytes (``bench/results/cache_formats.md``) at several times the CPU per sample.
        max_size: size budget of the whole cache root (``"20GiB"``); least recently used
            entries of other pipelines are evicted first; ``None``: no limit.
        part_bytes: target size of one part file (default 64 MiB).
    """

    dir: Path
    compression: str = "none"
    max_size: int | None = None
    part_bytes: int = 64 << 20

    @classmethod
    def make(cls, value) -> "CacheSettings | None":
        """From ``None``/``False`` (off), ``True`` (defaults), a path, a mapping or settings."""
        if value is None or value is False:
            return None
        if isinstance(value, CacheSettings):
            return value
        if value is True:
            value = {}
        if isinstance(value, (str, os.PathLike)):
            value = {"dir": value}
        if not isinstance(value, dict):
            raise ConfigError(f"cache: expected True, a directory or a mapping, got {value!r}")
        d = dict(value)
        d.pop("enabled", None)
        unknown = set(d) - {"dir", "compression", "max_size", "part_bytes"}
        if unknown:
            raise ConfigError(f"cache: unknown keys {sorted(unknown)}; allowed: compression, dir, max_size, part_bytes")
        root = Path(d["dir"]).expanduser() if d.get("dir") else default_cache_root()
        compression = d.get("compression") or cls.compression
        parse_compression(compression)
        return cls(root, compression, parse_size(d.get("max_size")), parse_size(d.get("part_bytes")) or 64 << 20)
