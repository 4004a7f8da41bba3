"""What this process may use on its host: the cores it may run on and the directory where feedgpu
keeps its files (indexes, the pixel cache, downloaded shards, sample data).

Both are read from the operating system and the environment at each call, so a test or a
launcher that changes them (CPU affinity, ``$FEEDGPU_CACHE_DIR``) is followed.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_cores", "default_cache_dir"]


def cpu_cores() -> int:
    """Cores this process may run on (its CPU affinity; the machine's count where the platform
    has no affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def default_cache_dir() -> Path:
    """``$FEEDGPU_CACHE_DIR``, else the user's cache directory for feedgpu (``platformdirs``;
    ``~/.cache/feedgpu`` on Linux). Not created here."""
    from platformdirs import user_cache_dir

    return Path(os.environ.get("FEEDGPU_CACHE_DIR") or user_cache_dir("feedgpu"))
