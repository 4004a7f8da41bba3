"""Part files: Arrow IPC files of cached samples, one row per sample.

Columns: ``index`` int64 (position in the source), ``key`` string, ``label`` int64,
``height``/``width`` int32, ``check`` uint64 and ``data`` large_binary: the uint8 HWC pixels
(``height * width * 3`` bytes), raw or one zstd frame per sample (so any row is read alone,
from a memory map).

Integrity (:mod:`.checks`):

* each row's stored bytes have their xxh3-64 in ``check``; raw rows are verified against it when
  read, zstd frames by zstd's content checksum (and against ``check`` by ``feedgpu cache verify``);
* the small columns (index, label, height, width, check) and the row lengths are covered by
  ``meta_xxh3`` in the manifest, verified when a part is opened;
* the part as a whole by ``content_xxh3`` in the manifest (meta checksum, codec, keys), verified
  by ``feedgpu cache verify`` together with every row; a file Arrow cannot parse is corrupt.

Parts are written to a temporary file and renamed without fsync: after a power loss a part may
be incomplete, and the checks above find it and drop it; it is never served.

Writing costs one copy per row into a reused batch buffer (no per-batch allocation, so no fresh
pages to fault in) and the file write, in pieces of at most 256 KiB (:mod:`.sink`); nothing is read
back.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pyarrow as pa
import zstandard

from .checks import META_COLUMNS, CorruptPart, CorruptRow, checksum, content_checksum, meta_checksum
from .settings import CODECS
from .sink import WRITE_CHUNK, ChunkedFile

__all__ = ["Part", "PartWriter", "RowBuffer", "RowEncoder", "SCHEMA"]

SCHEMA = pa.schema([("index", pa.int64()), ("key", pa.string()), ("label", pa.int64()),
                    ("height", pa.int32()), ("width", pa.int32()), ("check", pa.uint64()),
                    ("data", pa.large_binary())])


class RowEncoder:
    """One row's stored bytes: a zstd frame (``codec="zstd"``) or the raw pixels."""

    def __init__(self, codec: str, level: int):
        self.codec, self.level = codec, level
        self._z = zstandard.ZstdCompressor(level=level, write_checksum=True) if codec == "zstd" else None

    def encode(self, arr: np.ndarray):
        """``(data, check)`` for a uint8 array: the stored bytes (a zstd frame, or a view of the
        raw bytes: no copy) and their xxh3-64."""
        data = memoryview(np.ascontiguousarray(arr)).cast("B")
        if self._z is not None:
            data = self._z.compress(data)
        return data, checksum(data)

    def metadata(self) -> dict:
        """The part file's schema metadata: codec and level."""
        return {b"codec": self.codec.encode(), b"level": str(self.level).encode()}


class RowBuffer:
    """The rows of the next record batch. The stored bytes are copied into one reused uint8
    buffer (grown when a row does not fit, never shrunk), so filling allocates nothing per batch.

    Args:
        capacity: initial size of the data buffer in bytes.
    """

    def __init__(self, capacity: int = 8 << 20):
        self._data = np.empty(max(1, int(capacity)), np.uint8)
        self.clear()

    def clear(self) -> None:
        self.index: list[int] = []
        self.key: list[str] = []
        self.label: list[int] = []
        self.height: list[int] = []
        self.width: list[int] = []
        self.check: list[int] = []
        self._offsets = [0]
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.index)

    def add(self, index: int, key: str, label: int, height: int, width: int, check: int, data) -> None:
        """Append one row; ``data`` (bytes-like, any length) is copied into the buffer."""
        src = np.frombuffer(data, np.uint8)
        end = self.nbytes + src.size
        if end > self._data.size:
            grown = np.empty(max(end, 2 * self._data.size), np.uint8)
            grown[:self.nbytes] = self._data[:self.nbytes]
            self._data = grown
        self._data[self.nbytes:end] = src
        self.nbytes = end
        self._offsets.append(end)
        self.index.append(index)
        self.key.append(key)
        self.label.append(label)
        self.height.append(height)
        self.width.append(width)
        self.check.append(check)

    def record_batch(self) -> pa.RecordBatch:
        """The rows as a record batch whose ``data`` column is a view of the buffer: valid until
        the next :meth:`add` or :meth:`clear`. Built from buffers: ``pa.array`` on lists or numpy
        arrays imports pandas (a noticeable start-up cost in each worker that has not yet)."""
        n = len(self.index)
        keys = [k.encode() for k in self.key]
        key_offsets = np.zeros(n + 1, np.int32)
        np.cumsum([len(k) for k in keys], out=key_offsets[1:])
        cols = [_numeric(self.index, pa.int64(), np.int64),
                pa.StringArray.from_buffers(n, pa.py_buffer(key_offsets), pa.py_buffer(b"".join(keys))),
                _numeric(self.label, pa.int64(), np.int64), _numeric(self.height, pa.int32(), np.int32),
                _numeric(self.width, pa.int32(), np.int32), _numeric(self.check, pa.uint64(), np.uint64),
                pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(np.asarray(self._offsets, np.int64)),
                                                             pa.py_buffer(self._data[:self.nbytes])])]
        return pa.RecordBatch.from_arrays(cols, schema=SCHEMA)

    def lengths(self) -> list[int]:
        o = self._offsets
        return [o[i + 1] - o[i] for i in range(len(o) - 1)]


def _numeric(values: list, type_: pa.DataType, dtype) -> pa.Array:
    a = np.asarray(values, dtype)
    return pa.Array.from_buffers(type_, len(a), [None, pa.py_buffer(a)])


def _column(table: pa.Table, name: str, dtype) -> np.ndarray:
    """A fixed-width column without nulls as a numpy array, read from its buffers (``to_numpy``
    imports pandas; one chunk is a zero-copy view of the memory map)."""
    dtype = np.dtype(dtype)
    parts = []
    for chunk in table.column(name).chunks:
        if not len(chunk):
            continue
        if chunk.null_count:
            raise CorruptPart(f"column {name!r} has nulls")
        try:
            parts.append(np.frombuffer(chunk.buffers()[1], dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize))
        except (TypeError, ValueError):  # no data buffer, or a short one
            raise CorruptPart(f"column {name!r} is shorter than its rows") from None
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _offsets(chunk: pa.Array, dtype, path: str):
    """``(offsets, values buffer)`` of a binary/string chunk; raises :class:`CorruptPart` when the
    offsets run backwards or outside the values."""
    _, offs, values = chunk.buffers()
    if not len(chunk):
        return np.zeros(1, np.int64), values
    if chunk.null_count:
        raise CorruptPart(f"{path}: a binary column has nulls")
    itemsize = np.dtype(dtype).itemsize
    try:
        o = np.frombuffer(offs, dtype, count=len(chunk) + 1, offset=chunk.offset * itemsize).astype(np.int64)
    except (TypeError, ValueError):  # no offsets buffer, or a short one
        raise CorruptPart(f"{path}: row offsets missing") from None
    size = values.size if values is not None else 0
    if np.any(o[1:] < o[:-1]) or o[0] < 0 or o[-1] > size:
        raise CorruptPart(f"{path}: row offsets outside the data")
    return o, values


class PartWriter:
    """Streams record batches into ``dir/.name.tmp``, at most ``write_chunk`` bytes per
    ``write()`` (see :mod:`.sink`); :meth:`close` renames it to ``name`` and returns the manifest
    entry ``{name, rows, bytes, content_xxh3, meta_xxh3}`` (:mod:`.checks`), computed from the
    rows written, without reading the file back."""

    def __init__(self, directory, name: str, encoder: RowEncoder, write_chunk: int = WRITE_CHUNK):
        self.dir, self.name = str(directory), name
        self.tmp = os.path.join(self.dir, f".{name}.tmp")
        self._sink = ChunkedFile(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), write_chunk)
        self._writer = pa.ipc.new_file(self._sink, SCHEMA.with_metadata(encoder.metadata()))
        self._codec = (encoder.codec, encoder.level)
        self.rows = 0
        self.bytes = 0
        self._meta: dict[str, list[int]] = {c: [] for c in META_COLUMNS}
        self._keys: list[str] = []

    def write(self, rows: RowBuffer) -> None:
        """Write the buffered rows as one record batch (the buffer may be cleared afterwards)."""
        self._writer.write_batch(rows.record_batch())
        for c in META_COLUMNS[:-1]:
            self._meta[c].extend(getattr(rows, c))
        self._meta["length"].extend(rows.lengths())
        self._keys.extend(rows.key)
        self.rows += len(rows)
        self.bytes += rows.nbytes

    def close(self) -> dict:
        self._writer.close()
        self._sink.close()
        size = os.path.getsize(self.tmp)
        os.replace(self.tmp, os.path.join(self.dir, self.name))
        meta = meta_checksum(self._meta)
        keys = [k.encode() for k in self._keys]
        content = content_checksum(meta, *self._codec, [len(k) for k in keys], b"".join(keys))
        return {"name": self.name, "rows": self.rows, "bytes": size, "content_xxh3": content, "meta_xxh3": meta}

    def abort(self) -> None:
        """Drop the temporary file (after a failed write: what is left to write is discarded)."""
        try:
            with contextlib.suppress(Exception):
                self._writer.close()
            with contextlib.suppress(OSError):
                self._sink.close()  # closes the descriptor even when the last write fails
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


class Part:
    """A memory-mapped part: rows are read without copying the file.

    Raises :class:`CorruptPart` when the file is not a part file Arrow can read (columns, codec),
    its row offsets point outside the data or, with ``meta_check``, the small columns differ from
    it, and ``OSError`` for a missing file."""

    def __init__(self, path: str, meta_check: int | None = None):
        self.path = path
        mm = pa.memory_map(path, "r")
        try:
            table = pa.ipc.open_file(mm).read_all()
        except (pa.ArrowException, ValueError) as e:  # truncated, or framing Arrow refuses
            raise CorruptPart(f"{path}: not readable as an Arrow file ({e})") from None
        if not table.schema.equals(SCHEMA):
            raise CorruptPart(f"{path}: unexpected columns {table.schema.names}")
        meta = table.schema.metadata or {}
        self.codec = meta.get(b"codec", b"none").decode("utf-8", "replace")
        self.level = meta.get(b"level", b"0").decode("utf-8", "replace")
        if self.codec not in CODECS:
            raise CorruptPart(f"{path}: unknown codec {self.codec!r}")
        self._table = table
        self.index = _column(table, "index", np.int64)
        self.labels = _column(table, "label", np.int64)
        self.height = _column(table, "height", np.int32)
        self.width = _column(table, "width", np.int32)
        self.check = _column(table, "check", np.uint64)
        # Each row as (data buffer, start, end): a slice of the memory map, no Arrow scalar per read.
        self._bufs, which, starts, ends = [], [], [], []
        for k, chunk in enumerate(table.column("data").chunks):  # combine_chunks() would copy
            o, values = _offsets(chunk, np.int64, path)
            self._bufs.append(memoryview(values) if values is not None else memoryview(b""))
            which.append(np.full(len(chunk), k, np.int64))
            starts.append(o[:-1])
            ends.append(o[1:])
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
        self._which, self._start, self._end = (cat(which).tolist(), cat(starts).tolist(), cat(ends).tolist())
        if meta_check is not None and self.meta_checksum() != meta_check:
            raise CorruptPart(f"{path}: index/label/size columns do not match their checksum")
        self._hw = list(zip(self.height.tolist(), self.width.tolist()))
        self._checks = self.check.tolist()
        self._dz = zstandard.ZstdDecompressor() if self.codec == "zstd" else None

    def meta_checksum(self) -> int:
        """:func:`~.checks.meta_checksum` of this file's small columns and row lengths."""
        length = np.asarray(self._end, np.int64) - np.asarray(self._start, np.int64)
        return meta_checksum({"index": self.index, "label": self.labels, "height": self.height,
                              "width": self.width, "check": self.check, "length": length})

    def content_checksum(self) -> int:
        """:func:`~.checks.content_checksum` of this file's values (for ``content_xxh3``)."""
        lengths, blobs = [], []
        for chunk in self._table.column("key").chunks:
            o, values = _offsets(chunk, np.int32, self.path)
            lengths.append(np.diff(o))
            blobs.append(memoryview(values)[o[0]:o[-1]] if values is not None and len(chunk) else b"")
        key_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        return content_checksum(self.meta_checksum(), self.codec, self.level, key_lengths, b"".join(blobs))

    def verify_row(self, row: int) -> None:
        """Check the row's stored bytes against ``check`` and that they decode to its shape (zstd:
        with the frame's own checksum); raises :class:`CorruptRow`."""
        if checksum(self.raw(row)) != self._checks[row]:
            raise CorruptRow(f"{self.path} row {row}: checksum mismatch")
        self.pixels(row)

    def __len__(self) -> int:
        return len(self.index)

    def raw(self, row: int) -> memoryview:
        """The row's stored bytes (a view of the memory map), unverified."""
        return self._bufs[self._which[row]][self._start[row]:self._end[row]]

    def pixels(self, row: int) -> np.ndarray:
        """The row's uint8 HWC image (for raw rows a read-only view of the memory map); raises
        :class:`CorruptRow`."""
        h, w = self._hw[row]
        buf = self.raw(row)
        n = h * w * 3
        if self._dz is not None:
            try:
                out = self._dz.decompress(buf, max_output_size=n)
            except zstandard.ZstdError as e:
                raise CorruptRow(f"{self.path} row {row}: {e}") from None
        else:
            out = buf
            if checksum(out) != self._checks[row]:
                raise CorruptRow(f"{self.path} row {row}: checksum mismatch")
        if len(out) != n:
            raise CorruptRow(f"{self.path} row {row}: {len(out)} bytes for a {h}x{w}x3 image")
        return np.frombuffer(out, np.uint8).reshape(h, w, 3)
