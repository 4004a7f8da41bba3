"""feedgpu: feed GPUs from PyTorch without CPU data stalls.

``import feedgpu`` needs neither a GPU nor NVIDIA DALI; nothing here touches CUDA.
"""
from .errors import (ConfigError, DecodeError, FeedgpuError, IteratorSuperseded, LoaderTimeout, SampleError,
                     SkipBudgetExceeded, SharedMemoryError, SourceError, StageError, StateError, WorkerError)
from .exec.work import Batch
from .imaging import pil_build
from .loader import DataLoader
from .metrics import SkippedSampleWarning
from .pipeline import Pipeline
from .sources import DatasetSource, FolderSource, ParquetSource, TarShardSource

from ._version import __version__

__all__ = [
    "Batch", "ConfigError", "DataLoader", "DatasetSource", "DecodeError", "FeedgpuError", "FolderSource",
    "IteratorSuperseded", "LoaderTimeout", "ParquetSource", "Pipeline", "SampleError", "SharedMemoryError",
    "SkipBudgetExceeded", "SkippedSampleWarning", "SourceError", "StageError", "StateError", "TarShardSource",
    "WorkerError", "pil_build",
]
