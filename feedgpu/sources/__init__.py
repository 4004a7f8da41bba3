"""Data sources: random access by index to raw records."""
from .base import Record, Source
from .class_names import ClassNames
from .dataset import DatasetSource
from .folder import FolderSource
from .tar import TarShardSource

__all__ = ["ClassNames", "DatasetSource", "FolderSource", "ParquetSource", "Record", "Source", "TarShardSource", "open_source"]


#: Options of the tar and Parquet sources for URLs (the shard cache and the store's options).
REMOTE_OPTIONS = ("cache_dir", "cache_budget", "storage_options")
#: Options of the tar and Parquet sources for URLs with a default that is not None.
REMOTE_DEFAULTS = {"max_bad_files": 0, "verify": "identity"}


def open_source(format: str, path=None, **options) -> Source:
    """Open a source by format name: ``folder``, ``tar`` or ``parquet``.

    For ``tar`` and ``parquet``, ``path`` may be URLs (``s3://``, ``gs://``, ``http(s)://``,
    ``file://``) or an index file, read through the node-local shard cache: ``cache_dir``
    (default ``<user cache dir>/feedgpu/shards``), ``cache_budget`` (bytes or ``"200GiB"``,
    default no limit), ``storage_options`` (passed to the store's fsspec filesystem;
    credentials come the store's standard way), ``max_bad_files`` (files that may be unreadable
    at open, default 0) and ``verify`` (``"identity"`` or ``"content"``). Raises
    :class:`~feedgpu.errors.ConfigError` when these are given to a folder source."""
    if format == "folder":
        given = [k for k in REMOTE_OPTIONS if options.pop(k, None) is not None]
        given += [k for k, v in REMOTE_DEFAULTS.items() if options.pop(k, v) != v]
        if given:
            from ..errors import ConfigError

            raise ConfigError(f"source: {', '.join(given)} apply to tar and parquet sources read from URLs, "
                              "not to a folder")
        return FolderSource(path, **options)
    if format == "tar":
        return TarShardSource(path, **options)
    if format == "parquet":
        from .parquet import ParquetSource

        return ParquetSource(path, **options)
    raise ValueError(f"unknown source format {format!r}; allowed: folder, tar, parquet")


def __getattr__(name: str):
    # imported on first use: it imports pyarrow, which folder and tar sources do not need
    if name == "ParquetSource":
        from .parquet import ParquetSource

        return ParquetSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
