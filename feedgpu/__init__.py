"""feedgpu: feed GPUs from PyTorch without CPU data stalls.

``import feedgpu`` needs neither a GPU nor NVIDIA DALI; nothing here touches CUDA.
"""
from ._version import __version__
from .errors import (CacheFullError, ConfigError, DecodeError, DownloadError, FeedgpuError, IteratorSuperseded,
                     LoaderTimeout, RemoteChangedError, RemoteError, SampleError, ShardFetchError, SharedMemoryError,
                     SkipBudgetExceeded, SourceError, StageError, StateError, TooManyOpenFiles, UploadError,
                     WorkerError)
from .exec.memory_budget import MemoryBudgetWarning
from .exec.memory_watch import CopyOnReadWarning
from .exec.work import Batch
from .imaging import pil_build
from .loader import DataLoader
from .metrics import SkippedSampleWarning
from .pipeline import Pipeline
from .sources import DatasetSource, FolderSource, TarShardSource

__all__ = [
    "Batch", "CacheFullError", "ConfigError", "CopyOnReadWarning", "DataLoader", "DatasetSource",
    "DecodeError", "DownloadError", "FeedgpuError", "FolderSource", "IteratorSuperseded",
    "LoaderTimeout", "MemoryBudgetWarning", "ParquetSource", "Pipeline", "RemoteChangedError",
    "RemoteError", "SampleError", "ShardFetchError", "SharedMemoryError", "SkipBudgetExceeded",
    "SkippedSampleWarning", "SourceError", "StageError", "StateError", "TarShardSource",
    "TooManyOpenFiles", "UploadError", "WorkerError", "pil_build",
]


def __getattr__(name: str):
    # ParquetSource imports pyarrow, which a folder or tar pipeline does not need at start-up
    if name == "ParquetSource":
        from .sources.parquet import ParquetSource

        return ParquetSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
