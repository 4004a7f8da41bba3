"""feedgpu: feed GPUs from PyTorch without CPU data stalls.

``import feedgpu`` needs neither a GPU nor NVIDIA DALI; nothing here touches CUDA. The public
names below are imported on first use (:pep:`562`), so ``import feedgpu`` and the command line's
help and listings do not pay for torch: ``feedgpu.DataLoader`` imports the loader (and torch)
the first time it is read. The subpackages :mod:`feedgpu.torchvision` and
:mod:`feedgpu.integrations` are reachable as attributes the same way.
"""
import importlib

from ._version import __version__
from .errors import (CacheFullError, ConfigError, DecodeError, DownloadError, FeedgpuError, IteratorSuperseded,
                     LoaderTimeout, RemoteChangedError, RemoteError, SampleError, ShardFetchError, SharedMemoryError,
                     SkipBudgetExceeded, SourceError, StageError, StateError, TooManyOpenFiles, UploadError,
                     WorkerError)

__all__ = [
    "Batch", "CacheFullError", "ConfigError", "CopyOnReadWarning", "DataLoader", "DatasetSource",
    "DecodeError", "DownloadError", "FeedgpuError", "FolderSource", "IteratorSuperseded",
    "LoaderTimeout", "MemoryBudgetWarning", "ParquetSource", "Pipeline", "RemoteChangedError",
    "RemoteError", "SampleError", "ShardFetchError", "SharedMemoryError", "SkipBudgetExceeded",
    "SkippedSampleWarning", "SourceError", "StageError", "StateError", "TarShardSource",
    "TooManyOpenFiles", "UploadError", "WorkerError", "pil_build",
]

#: public name -> the module that defines it, imported when the name is first read
_LAZY = {
    "Batch": ".exec.work", "CopyOnReadWarning": ".exec.memory_watch", "DataLoader": ".loader.front",
    "DatasetSource": ".sources", "FolderSource": ".sources", "MemoryBudgetWarning": ".exec.memory_budget",
    "ParquetSource": ".sources.parquet", "Pipeline": ".pipeline", "SkippedSampleWarning": ".metrics",
    "TarShardSource": ".sources", "pil_build": ".imaging",
}


#: subpackages reachable as attributes (``feedgpu.torchvision.pipeline_yaml``), imported when first
#: read; ``import feedgpu`` imports neither (nor torchvision: feedgpu.torchvision never imports it)
_SUBPACKAGES = ("integrations", "torchvision")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)   # the import sets the attribute too
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # read once: later reads find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))
