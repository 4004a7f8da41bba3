"""feedgpu: feed GPUs from PyTorch without CPU data stalls.

``import feedgpu`` needs neither a GPU nor NVIDIA DALI; nothing here touches CUDA.
"""
from .errors import (ConfigError, DecodeError, FeedgpuError, IteratorSuperseded, LoaderTimeout, SampleError,
                     SkipBudgetExceeded, SharedMemoryError, SourceError, StageError, StateError, WorkerError)
from .exec.memory_budget import MemoryBudgetWarning
from .exec.memory_watch import CopyOnReadWarning
from .exec.work import Batch
from .imaging import pil_build
from .loader import DataLoader
from .metrics import SkippedSampleWarning
from .pipeline import Pipeline
from .sources import DatasetSource, FolderSource, ParquetSource, TarShardSource

__version__ = "0.1.0"

__all__ = [
    "Batch", "ConfigError", "CopyOnReadWarning", "DataLoader", "DatasetSource", "DecodeError", "FeedgpuError", "FolderSource",
    "IteratorSuperseded", "LoaderTimeout", "MemoryBudgetWarning", "ParquetSource", "Pipeline", "SampleError", "SkipBudgetExceeded", "SkippedSampleWarning",
    "SharedMemoryError", "SourceError", "StageError", "StateError", "TarShardSource", "WorkerError", "pil_build",
]
