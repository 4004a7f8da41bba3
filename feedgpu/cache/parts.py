"""Part files: Arrow IPC files of cached samples, one row per sample.

Columns: ``index`` int64 (position in the source), ``key`` string, ``label`` int64,
``height``/``width`` int32, ``check`` uint64 and ``data`` large_binary: the uint8 HWC pixels
(``height * width * 3`` bytes), raw or one zstd frame per sample (so any row is read alone,
from a memory map).

Integrity (checksums are xxh3-64 from the ``xxhash`` package, as ints):

* each row's pixels are verified when read: zstd frames carry zstd's content checksum, raw rows
  the xxh3-64 of their bytes in ``check``;
* the small columns (index, label, height, width, check) and the row lengths are covered by
  ``meta_xxh3`` in the manifest, verified when a part is opened;
* the whole file by ``file_xxh3``, verified by ``feedgpu cache verify``.

Parts are written to a temporary file and renamed without fsync: after a power loss a part may
be incomplete, and the checks above find it and drop it; it is never served.

Writing costs one copy per row into a reused batch buffer (no per-batch allocation, so no fresh
pages to fault in), the file write, and one hash pass over the written file.
"""
from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np
import pyarrow as pa
import xxhash
import zstandard

from .sink import WRITE_CHUNK, ChunkedFile

SCHEMA = pa.schema([("index", pa.int64()), ("key", pa.string()), ("label", pa.int64()),
                    ("height", pa.int32()), ("width", pa.int32()), ("check", pa.uint64()),
                    ("data", pa.large_binary())])
META_COLUMNS = ("index", "label", "height", "width", "check", "length")
_META_DTYPES = ("<i8", "<i8", "<i4", "<i4", "<u8", "<i8")

checksum = xxhash.xxh3_64_intdigest
"""xxh3-64 of a bytes-like object, as an int (unsigned 64 bit)."""


class CorruptRow(Exception):
    """A cached row failed its checksum or does not decompress to its shape."""


class CorruptPart(Exception):
    """A part's small columns do not match the checksum in the manifest, or its row offsets
    point outside its data."""


def meta_checksum(columns: dict) -> int:
    """xxh3-64 of the index/label/height/width/check columns and the row lengths in bytes
    (``length``), each as a little-endian array, in that order."""
    h = xxhash.xxh3_64()
    for name, dtype in zip(META_COLUMNS, _META_DTYPES):
        h.update(np.ascontiguousarray(columns[name], dtype=dtype))
    return h.intdigest()


def file_checksum(path: str) -> int:
    """xxh3-64 of a whole file, read through a populated read-only memory map (no copy)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return checksum(b"")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ) as m:
            return checksum(m)


class RowEncoder:
    """One row's stored bytes: a zstd frame (``codec="zstd"``) or the raw pixels."""

    def __init__(self, codec: str, level: int):
        self.codec, self.level = codec, level
        self._z = zstandard.ZstdCompressor(level=level, write_checksum=True) if codec == "zstd" else None

    def encode(self, arr: np.ndarray):
        """``(data, check)`` for a uint8 array: a zstd frame (check 0: the frame has its own
        checksum) or a view of the raw bytes (no copy) and their xxh3-64."""
        raw = memoryview(np.ascontiguousarray(arr)).cast("B")
        if self._z is not None:
            return self._z.compress(raw), 0
        return raw, checksum(raw)

    def metadata(self) -> dict:
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
        arrays imports pandas (~0.25 s in each worker that has not yet)."""
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
        parts.append(np.frombuffer(chunk.buffers()[1], dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


class PartWriter:
    """Streams record batches into ``dir/.name.tmp``, at most ``write_chunk`` bytes per
    ``write()`` (see :mod:`.sink`); :meth:`close` renames it to ``name`` and returns the manifest
    entry ``{name, rows, bytes, file_xxh3, meta_xxh3}``."""

    def __init__(self, directory, name: str, encoder: RowEncoder, write_chunk: int = WRITE_CHUNK):
        self.dir, self.name = str(directory), name
        self.tmp = os.path.join(self.dir, f".{name}.tmp")
        self._sink = ChunkedFile(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), write_chunk)
        self._writer = pa.ipc.new_file(self._sink, SCHEMA.with_metadata(encoder.metadata()))
        self.rows = 0
        self.bytes = 0
        self._meta: dict[str, list[int]] = {c: [] for c in META_COLUMNS}

    def write(self, rows: RowBuffer) -> None:
        """Write the buffered rows as one record batch (the buffer may be cleared afterwards)."""
        self._writer.write_batch(rows.record_batch())
        for c in META_COLUMNS[:-1]:
            self._meta[c].extend(getattr(rows, c))
        self._meta["length"].extend(rows.lengths())
        self.rows += len(rows)
        self.bytes += rows.nbytes

    def close(self) -> dict:
        self._writer.close()
        self._sink.close()
        digest = file_checksum(self.tmp)
        size = os.path.getsize(self.tmp)
        os.replace(self.tmp, os.path.join(self.dir, self.name))
        return {"name": self.name, "rows": self.rows, "bytes": size, "file_xxh3": digest,
                "meta_xxh3": meta_checksum(self._meta)}

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

    Raises :class:`CorruptPart` when the row offsets point outside the data or, with
    ``meta_check``, the small columns differ from it, and ``OSError``/``ValueError`` for a
    missing or truncated file."""

    def __init__(self, path: str, meta_check: int | None = None):
        self.path = path
        mm = pa.memory_map(path, "r")
        table = pa.ipc.open_file(mm).read_all()
        meta = table.schema.metadata or {}
        self.codec = meta.get(b"codec", b"none").decode()
        self.index = _column(table, "index", np.int64)
        self.labels = _column(table, "label", np.int64)
        self.height = _column(table, "height", np.int32)
        self.width = _column(table, "width", np.int32)
        self.check = _column(table, "check", np.uint64)
        # Each row as (data buffer, start, end): a slice of the memory map, no Arrow scalar per read.
        self._bufs, which, starts, ends = [], [], [], []
        for k, chunk in enumerate(table.column("data").chunks):  # combine_chunks() would copy
            _, offs, values = chunk.buffers()
            o = np.frombuffer(offs, np.int64, count=len(chunk) + 1, offset=chunk.offset * 8) if len(chunk) else \
                np.zeros(1, np.int64)
            size = values.size if values is not None else 0
            if np.any(o[1:] < o[:-1]) or (len(o) and (o[0] < 0 or o[-1] > size)):
                raise CorruptPart(f"{path}: row offsets outside the data")
            self._bufs.append(memoryview(values) if values is not None else memoryview(b""))
            which.append(np.full(len(chunk), k, np.int64))
            starts.append(o[:-1])
            ends.append(o[1:])
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
        self._which, self._start, self._end = (cat(which).tolist(), cat(starts).tolist(), cat(ends).tolist())
        if meta_check is not None:
            length = np.asarray(self._end, np.int64) - np.asarray(self._start, np.int64)
            if meta_checksum({"index": self.index, "label": self.labels, "height": self.height,
                              "width": self.width, "check": self.check, "length": length}) != meta_check:
                raise CorruptPart(f"{path}: index/label/size columns do not match their checksum")
        self._hw = list(zip(self.height.tolist(), self.width.tolist()))
        self._checks = self.check.tolist()
        self.keys = table.column("key")
        self._dz = zstandard.ZstdDecompressor() if self.codec == "zstd" else None

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
