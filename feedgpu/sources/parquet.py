"""Parquet files with an image-bytes column and a label column.

The index is three arrays (file id, row group, row within the group). Reads go by row group
through a small per-process LRU cache, so a batch that touches a row group reads it once.
Shuffled access over a dataset much larger than the cache reads each row group often: write
such datasets with small row groups (``feedgpu convert`` uses ~8 MiB).

Memory: ``cache_bytes`` is sized by the loader's per-worker memory budget unless given
(:mod:`feedgpu.exec.memory_budget`), and bounds what a process's reads of a source hold at once:
the row groups cached, the one being read and the reader's buffers
(:mod:`feedgpu.sources.parquet_parts`). A row group whose image column is over
``max(1 MiB, cache_bytes / 4)`` (uncompressed, from the file's metadata) is read in slices of that
size, each streamed in pieces of about 1 MiB, whatever the row-group size; a page is read whole
(pyarrow writes up to 1024 values to a page unless told otherwise, so 1024 images of 2 MB make one
2 GB page; ``feedgpu convert`` writes pages of ~1 MiB). Shuffled reads of such groups cost a
re-read from the group's start per slice missed. A ``binary`` column of more than 2 GiB comes
from Arrow as several chunks, read as they are (joining them would overflow ``binary``'s 32-bit
offsets); ``large_binary`` columns are read the same way. Files are read through 1 MiB buffers,
not memory-mapped and not pre-buffered: a mapped file's pages count in the reading process's
unique memory for as long as they stay mapped, and a pre-buffered read holds a row group's whole
column chunk, slices or not.
"""
from __future__ import annotations

import hashlib
import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import DownloadError, SampleError, SourceError
from .base import CLASS_NAMES_FILE, Record, Source, class_names, class_names_from_text, expand_paths, file_hash, \
    index_array, missing_files, release_freed_memory
from .file_stats import change_stamp
from .parquet_parts import RowGroupParts, release

_NULL = np.iinfo(np.int64).min   # a null label while indexing
_HUGE = _NULL + 1                 # a uint64 label that int64 cannot hold
_CORRUPT = _NULL + 2              # a label in a row group whose label column cannot be read
_READ_BUFFER = 1 << 20            # bytes per read of a column chunk (see the module docstring)
_MAX_OPEN_REMOTE = 8              # remote files a process keeps open (pinned in the shard cache)


def _int64_labels(col: pa.ChunkedArray) -> np.ndarray:
    """A label column as int64, nulls as ``_NULL`` and uint64 values over int64's range as
    ``_HUGE`` (both left out while indexing)."""
    huge = None
    if pa.types.is_uint64(col.type):
        huge = np.asarray(pc.fill_null(pc.greater(col, pa.scalar(np.iinfo(np.int64).max, pa.uint64())), False))
        col = pc.if_else(huge, pa.scalar(0, pa.uint64()), col)
    lab = np.asarray(pc.fill_null(col.cast(pa.int64()), _NULL), dtype=np.int64).copy()
    if huge is not None:
        lab[huge] = _HUGE
    return lab


class ParquetSource(Source):
    """Samples from Parquet files.

    Args:
        files: a directory (its ``*.parquet``, ``*.parq``, ``*.pq`` in any case, in it and its
            sub-folders, as pyarrow's datasets find them; other files named in one warning:
            :mod:`feedgpu.sources.extensions`), a glob, a path or a list of these.
        image_column: binary / large_binary column with encoded image bytes (default ``"image"``).
        label_column: integer column (default ``"label"``); ``None`` for unlabeled data (-1).
        cache_bytes: bytes a process's reads may hold (row groups cached, the one being read,
            the reader's buffers); default (None): sized by the
            loader's memory budget (:meth:`fit_memory`), 256 MiB outside a loader. A value given
            here is kept.
        cache_dir, cache_budget, storage_options, cache: for URLs, the node-local shard cache, as
            for :class:`~feedgpu.sources.tar.TarShardSource`.

    URLs (``s3://``, ``gs://``, ``http(s)://``, ``file://``; a glob or folder where the store
    lists, a list, or the index file ``feedgpu convert`` writes): indexing reads each file's
    footer and label column by ranged reads, without downloading its images; a file is
    downloaded whole into the shard cache when its first image is read (one download per node,
    then read as a local file: a file is the unit the cache verifies, locks and evicts).
    Files that cannot be read at open (after the shard cache's retries: refused, DNS, 404, 5xx,
    not Parquet, an HTML page, a server without byte ranges) raise one :class:`SourceError`
    naming each URL and cause, unless ``max_bad_files`` (int >= 0, default 0; None: any) allows
    them: then each is left out as ``"bad shard"`` (one entry per file), named. A file that
    cannot be downloaded when read makes each of its rows a skipped sample of reason
    ``"bad shard"`` (the loader's read-ahead ends the epoch instead when the skip budget cannot
    hold the whole file); one changed since indexing raises
    :class:`~feedgpu.errors.RemoteChangedError`. ``verify``: the shard cache's change check
    (:class:`~feedgpu.remote.cache.ShardCache`).

    Raises :class:`SourceError` when a file or column is missing or has the wrong type, a file
    is not Parquet, or no row is left; a file cut before its footer (it starts as Parquet, or is
    empty) is left out as ``"truncated file"`` (its rows cannot be counted), and the rows of a row
    group whose label column cannot be read (a damaged page) as ``"corrupt file"``. Null or zero-length images are reported when read (reason ``"empty"``). Labels
    are read while indexing: a null label is left out with reason ``"missing label"``, a label
    below -1 or (uint64) over 2**63 - 1 with ``"bad label"``; -1 is the documented "no label" value, kept only in a source
    where no row has a label (an unlabeled source), else left out as ``"missing label"`` too.
    Rows left out are in :attr:`rejected`, named ``file.parquet#row``.
    """

    format = "parquet"

    def __init__(self, files, image_column: str = "image", label_column: str | None = "label",
                 cache_bytes: int | None = None, *, cache_dir=None, cache_budget=None, storage_options=None,
                 cache=None, max_bad_files: int | None = 0, verify: str = "identity"):
        super().__init__()
        self._remote = None
        from ..remote.index import is_index
        from ..remote.urls import has_url

        if has_url(files) or is_index(files):
            from ..remote.files import RemoteFiles, make_cache

            self._remote = RemoteFiles(files, ".parquet", "parquet",
                                       make_cache(cache, cache_dir, cache_budget, storage_options, verify),
                                       max_bad_files)
            self.files = self._remote.urls
        else:
            self.files = expand_paths(files, ".parquet")
            missing_files(self.files, "parquet source", files)
        if not self.files:
            raise SourceError(f"parquet source: no files match {files!r}")
        self.image_column = image_column
        self.label_column = label_column
        self._cache_given = cache_bytes is not None
        self._parts = RowGroupParts(image_column, int(cache_bytes) if cache_bytes is not None else 256 << 20)
        fids, rgs, rows, labels = [], [], [], []
        self._meta = []
        self._corrupt: dict = {}   # (file, row group) -> why its labels cannot be read
        self._rg_starts = []  # per file: first row (in the file) of each row group, for keys
        for fid, path in enumerate(self.files):
            remote = self._remote.files[fid] if self._remote is not None else None
            if remote is None and not os.path.isfile(path):
                raise SourceError(f"parquet source: {path} is not a file")
            pf, error = None, None
            if remote is not None and remote.identity is None:   # the store could not be reached for it
                error = remote.error
            elif remote is None:
                try:
                    pf = pq.ParquetFile(path)
                except (pa.ArrowException, OSError) as e:
                    self._unreadable(path, e, fid)   # a cut file: rejected; not Parquet at all: SourceError
            else:
                pf, error = self._remote_footer(fid, path)
            if error is not None:   # a remote file that cannot be read: named at the end of the loop
                self.reject(path, "bad shard", error)
            if pf is None:
                self._meta.append((path, -1, "", "") if error is not None else self._file_meta(fid))
                self._rg_starts.append(np.zeros(1, np.int64))
                continue
            schema = pf.schema_arrow
            for col, want in ((image_column, "binary"), (label_column, "integer")):
                if col is None:
                    continue
                if col not in schema.names:
                    raise SourceError(f"parquet source: {path} has no column {col!r} (columns: {schema.names})")
                t = schema.field(col).type
                ok = (pa.types.is_binary(t) or pa.types.is_large_binary(t)) if want == "binary" \
                    else pa.types.is_integer(t)
                if not ok:
                    raise SourceError(f"parquet source: column {col!r} in {path} is {t}, expected {want}")
            self._meta.append(self._file_meta(fid))
            self._rg_starts.append(np.cumsum([0] + [pf.metadata.row_group(rg).num_rows
                                                    for rg in range(pf.num_row_groups)], dtype=np.int64))
            for rg in range(pf.num_row_groups):
                n = pf.metadata.row_group(rg).num_rows
                # Only labels are read here: image bytes stay on disk, so an empty image is
                # found when it is read (reason "empty"), not while indexing.
                if label_column:
                    try:
                        lab = _int64_labels(self._labels(pf, rg, fid))
                    except (pa.ArrowException, OSError) as e:   # a damaged page: its rows, named
                        lab = np.full(n, _CORRUPT, np.int64)
                        self._corrupt[(fid, rg)] = " ".join(str(e).split())
                else:
                    lab = np.full(n, -1, np.int64)
                fids.append(np.full(n, fid, np.int32))
                rgs.append(np.full(n, rg, np.int32))
                rows.append(np.arange(n, dtype=np.int32))
                labels.append(lab)
        if self._remote is not None:
            self._remote.check_open()   # files that cannot be read: one error naming each, or "bad shard"s
        file_ids = np.concatenate(fids) if fids else np.zeros(0, np.int32)
        row_groups = np.concatenate(rgs) if rgs else np.zeros(0, np.int32)
        rows_ = np.concatenate(rows) if rows else np.zeros(0, np.int32)
        labels_ = np.concatenate(labels) if labels else np.zeros(0, np.int64)
        labeled = bool((labels_ >= 0).any())
        bad = (labels_ == _NULL) | (labels_ < -1) | ((labels_ == -1) & labeled)
        self.file_ids, self.row_groups, self.rows = file_ids, row_groups, rows_
        for i in np.flatnonzero(bad).tolist():
            v = int(labels_[i])
            if v == _CORRUPT:
                why = self._corrupt[(int(file_ids[i]), int(row_groups[i]))]
                self.reject(self.key(i), "corrupt file", f"its row group's label column cannot be read: {why}")
                continue
            reason = "bad label" if _NULL < v < -1 else "missing label"
            self.reject(self.key(i), reason, "null label" if v == _NULL
                        else "label over 2**63 - 1 (labels are int64)" if v == _HUGE else f"label {v}")
        keep = ~bad   # ids in the narrowest dtype they fit (index_array): 16 bytes a row with the label
        self.file_ids, self.row_groups, self.rows = (index_array(a[keep]) for a in (file_ids, row_groups, rows_))
        self.labels = labels_[keep]
        del file_ids, row_groups, rows_, labels_, fids, rgs, rows, labels
        release()   # the label columns read while indexing
        release_freed_memory()
        self._warn_rejected()
        if len(self.labels) == 0:
            raise self._nothing_left(f"parquet source: no rows left in {len(self.files)} file(s)"
                                      + (f" ({len(self.rejected)} left out while indexing)" if self.rejected else ""))
        self.classes = (class_names(self.files[0], self.labels) if self._remote is None else
                        class_names_from_text(self._remote.text_beside(CLASS_NAMES_FILE), self.labels))
        self._files: dict = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def fit_memory(self, cache_bytes: int) -> None:
        """The cache (and so the slice size, a quarter of it) from the loader's memory budget,
        unless ``cache_bytes`` was given; takes effect in processes that have read nothing yet."""
        if not self._cache_given and int(cache_bytes) != self.cache_bytes:
            self._parts.resize(max(1 << 20, int(cache_bytes)))

    @property
    def cache_bytes(self) -> int:
        """Bytes the row groups read in one process may hold (:mod:`feedgpu.sources.parquet_parts`)."""
        return self._parts.cache_bytes

    def _file_meta(self, fid: int) -> tuple:
        """What the fingerprint holds of a file: path, size, mtime and change stamp (device,
        inode, ``st_ctime_ns``: :func:`~feedgpu.sources.file_stats.change_stamp`); for a URL: URL,
        size, ETag (or the store's modification time), never a local path, and no stamp."""
        if self._remote is not None:
            ident = self._remote.files[fid].identity
            return (ident.url, ident.size, ident.etag or ident.mtime, "")
        st = os.stat(self.files[fid])
        return (os.path.abspath(self.files[fid]), st.st_size, st.st_mtime_ns, change_stamp(st))

    def _remote_footer(self, fid: int, url: str):
        """``(ParquetFile over ranged reads, None)`` of remote file ``fid``, or ``(None, why)``:
        network faults retried with the shard cache's policy; a file that is not Parquet (an
        HTML page?), or a server without byte ranges, named; a file cut before its footer is
        rejected as ``"truncated file"`` (``(None, None)``)."""
        from ..remote.faults import classify
        from ..remote.files import cause_of

        def attempt():
            try:
                return pq.ParquetFile(self._remote.open(fid)), None
            except (pa.ArrowException, OSError) as e:
                if classify(e).kind != "error":   # the network's fault: retried
                    raise
                return None, e
        try:
            pf, error = self._remote.cache.retrying(url, attempt)
        except DownloadError as e:
            self._remote.fail(url, cause_of(e))
            return None, cause_of(e)
        if error is None:
            return pf, None
        try:
            head = self._remote.cache.retrying(url, lambda: self._remote.open(fid).read(512))
        except DownloadError:
            head = b""
        if head[:4] in (b"PAR1", b""):
            self.reject(url, "truncated file", f"{error}; its rows are lost (Parquet's index is at the end of the file)")
            return None, None
        why = self._remote.unreadable(url, head, error)
        why = why if why != " ".join(str(error).split()) else f"not a Parquet file ({why})"
        self._remote.fail(url, why)
        return None, why

    def _labels(self, pf, rg: int, fid: int) -> pa.ChunkedArray:
        """Row group ``rg``'s label column; for a URL, network faults retried (a damaged page raises)."""
        read = lambda: pf.read_row_group(rg, columns=[self.label_column]).column(0)   # noqa: E731
        if self._remote is None:
            return read()
        from ..remote.faults import classify

        def attempt():
            try:
                return read(), None
            except (pa.ArrowException, OSError) as e:
                if classify(e).kind != "error":
                    raise
                return None, e
        col, error = self._remote.cache.retrying(self.files[fid], attempt)
        if error is not None:
            raise error
        return col

    def _unreadable(self, path: str, error: Exception, fid: int) -> None:
        """A file pyarrow cannot open: one that starts as Parquet (``PAR1``) or is empty was cut
        before its footer, where Parquet keeps its index, so all its rows are lost: rejected as
        ``"truncated file"``, named. Anything else raises :class:`SourceError`."""
        with open(path, "rb") as f:
            head = f.read(4)
        if head in (b"PAR1", b""):
            self.reject(path, "truncated file", f"{error}; its rows are lost (Parquet's index is at the "
                        "end of the file)")
            return
        raise SourceError(f"parquet source: {path} is not a Parquet file ({error})") from None

    @property
    def remote(self):
        """The :class:`~feedgpu.remote.files.RemoteFiles` of a source read from URLs (its
        ``cache``, and ``fetch_async(i)`` to fetch file ``i`` ahead), else None."""
        return self._remote

    def __getstate__(self) -> dict:
        """Pickled (to a Ray worker) without this process's open files, cached row groups and lock."""
        state = self.__dict__.copy()
        state.update(_parts=self._parts.fresh(), _files={}, _pid=None, _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        if "_parts" not in state:   # pickled before the parts had a class of their own
            state["_parts"] = RowGroupParts(state["image_column"], state.pop("cache_bytes", 256 << 20))
        self.__dict__.update(state)
        self._pid, self._lock = os.getpid(), threading.Lock()

    def key(self, index: int) -> str:
        """``file.parquet#row``: the row's number in its file (counted over all row groups)."""
        fid, rg, r = int(self.file_ids[index]), int(self.row_groups[index]), int(self.rows[index])
        return f"{self.files[fid]}#{int(self._rg_starts[fid][rg]) + r}"

    def shard_of(self) -> np.ndarray:
        """The shard of each row: its file's index in :attr:`files` (int32; a file is the unit
        a shard cache downloads)."""
        return self.file_ids

    def shard_names(self) -> list[str]:
        """The files' paths, index = shard id."""
        return list(self.files)

    def _rows_of(self, fid: int, rg: int, r: int):
        """``(column part, row in it)`` for row ``r`` of row group ``rg``."""
        with self._lock:  # the DALI engine reads from a helper thread too
            if self._pid != os.getpid():
                self._files, self._pid = {}, os.getpid()
                self._parts.clear()
            pf = self._files.get(fid)
            if pf is None and self._remote is None:
                pf = self._files[fid] = pq.ParquetFile(self.files[fid], buffer_size=_READ_BUFFER,
                                                                 pre_buffer=False)
            elif pf is None:
                while len(self._files) >= _MAX_OPEN_REMOTE:   # the oldest may be evicted again
                    old = next(iter(self._files))
                    del self._files[old]
                    self._remote.cache.unpin(self.files[old])
                pf = self._files[fid] = self._remote.open_local(fid, 
                                                                 lambda p: pq.ParquetFile(p, buffer_size=_READ_BUFFER,
                                                                                          pre_buffer=False))
            elif self._remote is not None:
                self._files[fid] = self._files.pop(fid)   # most recently used last
            return self._parts.get(pf, fid, rg, r, self.files[fid])

    def read(self, index: int) -> Record:
        fid, rg, r = int(self.file_ids[index]), int(self.row_groups[index]), int(self.rows[index])
        try:
            part, at = self._rows_of(fid, rg, r)
        except DownloadError as e:
            raise SampleError(self.key(index), "bad shard", str(e)) from None
        value = part[at]
        data = memoryview(value.as_buffer()) if value.is_valid else b""
        return Record(data, int(self.labels[index]), self.key(index))

    def _digest(self, h, stamps: bool = True) -> None:
        """Each file's path, size and mtime (URLs: URL, size, ETag), with ``stamps`` its change
        stamp, as the source was opened; the image and label columns."""
        for p, size, mtime, stamp in self._meta:
            h.update(f"{p}\0{size}\0{mtime}\0{self.image_column}\0{self.label_column}\0".encode())
            if stamps:
                h.update(f"{stamp}\0".encode())

    def _content_digest(self, h) -> None:
        """Each file's path and the xxh3-128 of its bytes (URLs: URL, size, ETag), the columns."""
        for fid, (p, size, mtime, _) in enumerate(self._meta):
            what = f"{size}\0{mtime}" if self._remote is not None else file_hash(self.files[fid])
            h.update(f"{p}\0{what}\0{self.image_column}\0{self.label_column}\0".encode())

    def order_identity(self) -> str:
        """The files' paths, sizes and mtimes and the columns (no change stamps: a loader state
        resumes on a copy of the files that kept their mtimes)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.format.encode())
        self._digest(h, stamps=False)
        return h.hexdigest()
