"""Rows of one or many Parquet files, read by global row index, one row group at a time.

The index is built from the files' footers only: row counts per row group (numpy arrays) give
each row group's first global row; a batch's rows are located with ``np.searchsorted`` and
gathered from the decoded row groups they fall in. Decoded row groups (projected columns only)
are kept per process in an LRU cache bounded in bytes (``cache_bytes``, default 1 GiB), so a
shuffled epoch decodes each row group about once per worker while the table fits.
"""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import ConfigError, SourceError
from ..sources.extensions import list_folder
from .columns import Dictionary, StrColumn

#: Column kinds: "float" (float64, NaN = missing), "int" (int64, no missing), "str" (StrColumn).
KINDS = ("float", "int", "str")


class SchemaError(ConfigError):
    """A column has a type a stage cannot use (names the column, its type and the file)."""


def column_kind(t: pa.DataType, has_nulls: bool) -> str | None:
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return "float" if has_nulls else "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or (
            pa.types.is_dictionary(t) and (pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type))):
        return "str"
    return None


def to_column(arr, kind: str, dictionary: Dictionary | None = None):
    """A pyarrow (chunked) array as a batch column of ``kind``."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if kind == "str":
        enc = arr if pa.types.is_dictionary(arr.type) else pc.dictionary_encode(arr)
        local = dictionary.codes_of(enc.dictionary.to_pylist())
        idx = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        remap = np.append(local, np.int32(-1))  # index -1 -> the appended -1
        return StrColumn(remap[idx], dictionary)
    if kind == "float":
        return arr.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
    return arr.cast(pa.int64()).to_numpy(zero_copy_only=False)


class TableSource:
    """Many Parquet files with the same columns, as one table of rows.

    Args:
        paths: files, directories (their ``*.parquet``, sorted) or glob patterns, in order.
        columns: columns to read (projection); ``None`` reads every column.
        cache_bytes: per-process budget of decoded row groups (default 1 GiB).

    Raises :class:`SourceError` when no file matches or files disagree on a column's type, and
    :class:`ConfigError` naming the column and file when a projected column is missing or of a
    type no stage reads (only numbers, booleans and strings are read).
    """

    def __init__(self, paths, columns: list[str] | None = None, cache_bytes: int = 1 << 30):
        self.paths = _expand(paths)
        self.cache_bytes = int(cache_bytes)
        schema, counts, file_of, rg_of = None, [], [], []
        nulls: dict[str, int] = {}
        for fi, p in enumerate(self.paths):
            try:
                md = pq.ParquetFile(p).metadata
            except (OSError, pa.ArrowException) as e:
                raise SourceError(f"{p}: not a readable Parquet file ({e})") from e
            s = md.schema.to_arrow_schema()
            cols = list(s.names) if columns is None else list(columns)
            for c in cols:
                if c not in s.names:
                    raise ConfigError(f"column {c!r} is not in {p} (its columns: {', '.join(s.names)})")
            if schema is None:
                schema = pa.schema([s.field(c) for c in cols])
            for c in cols:
                if not s.field(c).type.equals(schema.field(c).type):
                    raise SourceError(f"{p}: column {c!r} is {s.field(c).type}, but {schema.field(c).type} "
                                      f"in {self.paths[0]}")
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                counts.append(rg.num_rows)
                file_of.append(fi)
                rg_of.append(g)
                for c in cols:
                    st = rg.column(s.get_field_index(c)).statistics
                    n = st.null_count if st is not None and st.has_null_count else rg.num_rows  # unknown: assume some
                    nulls[c] = nulls.get(c, 0) + int(n)
        self.schema = schema
        self.columns = list(schema.names)
        self.kinds: dict[str, str] = {}
        for c in self.columns:
            k = column_kind(schema.field(c).type, nulls[c] > 0)
            if k is None:
                raise SchemaError(f"column {c!r} of {self.paths[0]} is {schema.field(c).type}: only numbers, booleans "
                                  "and strings can be read; leave it out of the projection")
            self.kinds[c] = k
        self.counts = np.asarray(counts, np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.file_of, self.rg_of = np.asarray(file_of), np.asarray(rg_of)
        self.dictionaries = {c: Dictionary() for c in self.columns if self.kinds[c] == "str"}
        self._cache: OrderedDict = OrderedDict()
        self._cached_bytes = 0
        self._files: dict = {}
        self._pid = os.getpid()
        self.row_groups_read = 0

    def __len__(self) -> int:
        return int(self.starts[-1])

    def identity(self) -> str:
        """Paths, sizes, mtimes and the projection, hashed (changes when a file changes)."""
        h = hashlib.blake2b(digest_size=16)
        for p in self.paths:
            st = os.stat(p)
            h.update(f"{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        h.update(",".join(self.columns).encode())
        return "parquet-table:" + h.hexdigest()

    def _file(self, fi: int) -> pq.ParquetFile:
        if self._pid != os.getpid():  # forked: file handles are not shared
            self._files, self._pid = {}, os.getpid()
        f = self._files.get(fi)
        if f is None:
            f = self._files[fi] = pq.ParquetFile(self.paths[fi])
        return f

    def row_group(self, g: int) -> dict:
        """Decoded columns of row group ``g`` (global numbering), from the cache when there."""
        hit = self._cache.get(g)
        if hit is not None:
            self._cache.move_to_end(g)
            return hit
        t = self._file(int(self.file_of[g])).read_row_group(int(self.rg_of[g]), columns=self.columns, use_threads=False)
        cols = {c: to_column(t.column(c), self.kinds[c], self.dictionaries.get(c)) for c in self.columns}
        self.row_groups_read += 1
        size = sum((v.codes if isinstance(v, StrColumn) else v).nbytes for v in cols.values())
        self._cache[g] = cols
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= sum((v.codes if isinstance(v, StrColumn) else v).nbytes for v in old.values())
        return cols

    def take(self, indices: np.ndarray, columns: list[str] | None = None) -> dict:
        """Columns (default: all projected) of the rows ``indices`` (global, any order), in that order.

        Raises :class:`IndexError` for an index outside ``[0, len)``."""
        indices = np.asarray(indices, np.int64)
        n = len(self)
        if len(indices) and (indices.min() < 0 or indices.max() >= n):
            raise IndexError(f"row index out of range [0, {n})")
        columns = self.columns if columns is None else columns
        gs = np.searchsorted(self.starts, indices, side="right") - 1
        out: dict = {}
        groups = np.unique(gs)
        for c in columns:
            k = self.kinds[c]
            out[c] = np.empty(len(indices), np.float64 if k == "float" else np.int64 if k == "int" else np.int32)
        for g in groups.tolist():
            sel = np.nonzero(gs == g)[0] if len(groups) > 1 else slice(None)
            local = indices[sel] - self.starts[g]
            rg = self.row_group(g)
            for c in columns:
                v = rg[c]
                out[c][sel] = (v.codes if isinstance(v, StrColumn) else v)[local]
        for c in columns:
            if self.kinds[c] == "str":
                out[c] = StrColumn(out[c], self.dictionaries[c])
        return out

    def read_all(self, columns: list[str] | None = None) -> dict:
        return self.take(np.arange(len(self)), columns)


def _expand(paths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        p = str(p)
        if any(ch in p for ch in "*?["):
            import glob

            out += sorted(glob.glob(p))
        elif Path(p).is_dir():   # as the image Parquet source: endings in any case, sub-folders
            out += list_folder(p, "parquet")
        elif Path(p).exists():
            out.append(p)
        else:
            raise SourceError(f"{p}: no such file or directory")
    if not out:
        raise SourceError(f"no Parquet files in {paths}")
    return out
