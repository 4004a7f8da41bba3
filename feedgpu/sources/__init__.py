"""Data sources: random access by index to raw records."""
from .base import Record, Source
from .dataset import DatasetSource
from .folder import FolderSource
from .parquet import ParquetSource
from .tar import TarShardSource

__all__ = ["DatasetSource", "FolderSource", "ParquetSource", "Record", "Source", "TarShardSource", "open_source"]


def open_source(format: str, path=None, **options) -> Source:
    """Open a source by format name: ``folder``, ``tar`` or ``parquet``."""
    if format == "folder":
        return FolderSource(path, **options)
    if format == "tar":
        return TarShardSource(path, **options)
    if format == "parquet":
        return ParquetSource(path, **options)
    raise ValueError(f"unknown source format {format!r}; allowed: folder, tar, parquet")
