"""Typed errors raised by feedgpu.

Every error a user can meet derives from :class:`FeedgpuError`, so ``except FeedgpuError``
catches all of them. Errors about one sample carry its ``key`` (where it came from: a path,
``shard.tar:member`` or ``file.parquet#row``) and a short ``reason`` that is also the counter
name in ``loader.stats()["skipped"]``.
"""
from __future__ import annotations


class FeedgpuError(Exception):
    """Base class of every feedgpu error."""


class ConfigError(FeedgpuError, ValueError):
    """A pipeline definition or a DataLoader argument is invalid.

    The message names the offending key (as a path such as ``stages[1].scale``) and, where the
    set is finite, the allowed values.
    """


class ArgumentTypeError(ConfigError, TypeError):
    """A DataLoader argument of the wrong type, where torch's DataLoader raises ``TypeError``."""


class SourceError(FeedgpuError):
    """A data source cannot be opened or indexed (missing path, no samples, unreadable shard)."""


class ShardFetchError(SourceError):
    """A shard could not be fetched (its download failed, timed out, or the read-ahead was
    closed while a reader waited for it).

    Attributes:
        shard: the shard's name (a path or URL, or its id when it has no name).
        reason: what went wrong, in words (the fetcher's error as text).
    """

    def __init__(self, shard: str, reason: str):
        self.shard = shard
        self.reason = reason
        super().__init__(f"shard {shard}: {reason}")

    def __reduce__(self):
        return (type(self), (self.shard, self.reason))


class SampleError(FeedgpuError):
    """One sample cannot be read or decoded.

    Attributes:
        key: where the sample came from (path, ``shard.tar:member``, ``file.parquet#row``).
        reason: short machine-readable reason, e.g. ``"empty"``, ``"truncated"``,
            ``"not an image"``, ``"too many pixels"``, ``"corrupt"``.
    """

    def __init__(self, key: str, reason: str, detail: str = ""):
        self.key = key
        self.reason = reason
        self.detail = detail
        msg = f"{key}: {reason}" + (f" ({detail})" if detail else "")
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.key, self.reason, self.detail))


class DecodeError(SampleError):
    """The sample's bytes are not a decodable image (empty, truncated, not an image, too large)."""


class StageError(FeedgpuError):
    """A stage failed on a sample for a reason other than bad input (a bug in a user stage,
    an output of the wrong shape or dtype). Names the stage and the sample."""


class WorkerError(FeedgpuError, RuntimeError):
    """A worker process failed or died; the message carries the worker's traceback.

    A worker that died begins its message as torch's does: ``DataLoader worker (pid N) is killed
    by signal: Killed.`` or ``DataLoader worker (pid N) exited unexpectedly with exit code C``."""


class TooManyOpenFiles(WorkerError):
    """The process ran out of file descriptors while batches travelled from the workers; the
    message names ``ulimit -n`` and ``torch.multiprocessing.set_sharing_strategy``, as torch's
    ``RuntimeError`` does (:mod:`feedgpu.exec.pool.fd_limit`)."""


class SkipBudgetExceeded(FeedgpuError):
    """More samples were skipped than ``max_skipped`` allows, or one batch used up its spares.

    Attributes (empty when raised for a batch's spares):
        counts: ``{reason: samples skipped}`` over the epoch so far.
        keys: ``[(key, reason)]`` of the first skipped samples (up to 20).
        limit: the number of skips the epoch allowed.
    """

    def __init__(self, message: str, counts: dict | None = None, keys: list | None = None,
                 limit: int | None = None):
        super().__init__(message)
        self.counts = dict(counts or {})
        self.keys = list(keys or [])
        self.limit = limit

    def __reduce__(self):
        return (type(self), (self.args[0], self.counts, self.keys, self.limit))


class SharedMemoryError(FeedgpuError, MemoryError):
    """Not enough shared memory: for the batch buffers of a pipeline (anonymous shared mappings,
    limited by RAM and the container's memory limit, not by ``/dev/shm``), or for a worker to send
    a torch Dataset's batch back (torch's shared-memory files in ``/dev/shm``)."""


class LoaderTimeout(FeedgpuError, RuntimeError, TimeoutError):
    """No batch arrived within the DataLoader's ``timeout`` seconds.

    A ``RuntimeError`` whose message begins ``DataLoader timed out after N seconds``, as
    ``torch.utils.data.DataLoader`` raises it (code that catches torch's error catches this one),
    followed by feedgpu's detail (the stage and sample each busy worker is on)."""


class IteratorSuperseded(FeedgpuError, RuntimeError):
    """``next()`` on an iterator of a :class:`~feedgpu.DataLoader` after a newer ``iter(loader)``
    stopped it: a feedgpu loader runs one iteration at a time (its position is its
    ``state_dict()``), where torch's allows several. Raised instead of a silent end of the epoch."""


class StateError(FeedgpuError, ValueError):
    """A ``state_dict`` does not match this loader (other dataset, batch size or world size)."""


class TableDataError(FeedgpuError, ValueError):
    """Table values a feature pipeline refuses rather than turn into a wrong number: NaN left in a
    dense feature, a value outside a vocabulary with ``on_oov: raise``, a missing label with
    ``if_missing: raise``. The message names the column and how many rows are affected."""


class RemoteError(FeedgpuError):
    """Base class of the errors about data read from a URL (:mod:`feedgpu.remote`). The message
    names the URL."""


class DownloadError(RemoteError):
    """A remote file could not be downloaded (or asked about) after every retry (network errors,
    a truncated response, a size or checksum that does not match, a 404). A source turns it
    into a skipped sample of reason ``"bad shard"`` (counted in the skip budget) for every record
    of that file, unless the loader's read-ahead met it first and the skip budget cannot hold
    the whole file (then it ends the epoch).

    Attributes:
        url: the file.
        attempts: downloads tried.
        kind: the fault, as :func:`feedgpu.remote.faults.classify` names it (``"refused"``,
            ``"dns"``, ``"timeout"``, ``"not found"``, ``"http 503"``, ``"checksum"`` ...).
    """

    def __init__(self, message: str, url: str = "", attempts: int = 0, kind: str = ""):
        super().__init__(message)
        self.url, self.attempts, self.kind = url, attempts, kind

    def __reduce__(self):
        return (type(self), (self.args[0], self.url, self.attempts, self.kind))


class RemoteChangedError(RemoteError):
    """A remote file's size or ETag (or modification time, where the store has no ETag) differs
    from what the source was indexed on: its index (member offsets, row groups) no longer
    describes it, so it is never read; open the source again."""


class CacheFullError(RemoteError):
    """The shard cache cannot hold a file: its budget is smaller than the file, the files in use
    leave no room, or the disk is full (``ENOSPC``). Nothing half-written is left in the cache."""


class UploadError(RemoteError):
    """Some files of a converted dataset could not be uploaded to the URL. The index file is
    uploaded last, so a dataset read through its index never names a missing shard.

    Attributes:
        uploaded: URLs written; failed: ``[(URL, error)]``.
    """

    def __init__(self, message: str, uploaded: list | None = None, failed: list | None = None):
        super().__init__(message)
        self.uploaded, self.failed = list(uploaded or []), list(failed or [])

    def __reduce__(self):
        return (type(self), (self.args[0], self.uploaded, self.failed))


class BenchUsageError(ConfigError):
    """``feedgpu bench``'s options do not fit the pipeline, the data or the machine (a stage the
    torch baseline or DALI cannot run, an epoch shorter than the warm-up, no CUDA device for
    ``--device cuda``...). The command line reports it as a usage error (exit code 2)."""


class BenchRunError(FeedgpuError, RuntimeError):
    """A loader under ``feedgpu bench`` stopped giving batches (an epoch without one). The command
    line reports it as an error (exit code 1)."""
