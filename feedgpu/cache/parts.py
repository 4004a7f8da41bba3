"""Part files: Arrow IPC files of cached samples, one row per sample.

Columns: ``index`` int64 (position in the source), ``key`` string, ``label`` int64,
``height``/``width`` int32, ``check`` uint32 and ``data`` large_binary: the uint8 HWC pixels,
raw or one zstd frame per sample (so any row is read alone, from a memory map). Every row is
verified when read: zstd frames carry zstd's own content checksum (``check`` is 0), raw rows a
CRC32 in ``check``. The codec and level are in the schema metadata.
"""
from __future__ import annotations

import hashlib
import zlib

import numpy as np
import pyarrow as pa
import zstandard

SCHEMA = pa.schema([("index", pa.int64()), ("key", pa.string()), ("label", pa.int64()),
                    ("height", pa.int32()), ("width", pa.int32()), ("check", pa.uint32()),
                    ("data", pa.large_binary())])


class CorruptRow(Exception):
    """A cached row failed its checksum or does not decompress to its shape."""


class RowEncoder:
    def __init__(self, codec: str, level: int):
        self.codec, self.level = codec, level
        self._z = zstandard.ZstdCompressor(level=level, write_checksum=True) if codec == "zstd" else None

    def encode(self, arr: np.ndarray) -> tuple[bytes, int]:
        raw = memoryview(np.ascontiguousarray(arr)).cast("B")
        if self._z is not None:
            return self._z.compress(raw), 0
        return bytes(raw), zlib.crc32(raw)

    def metadata(self) -> dict:
        return {b"codec": self.codec.encode(), b"level": str(self.level).encode()}


def part_bytes(rows: dict, encoder: RowEncoder) -> tuple[bytes, str]:
    """Serialize buffered rows (a dict of column lists) to an Arrow IPC file in memory; returns
    the bytes and their blake2b digest (the part's checksum in the manifest)."""
    table = pa.table({name: pa.array(rows[name], type=SCHEMA.field(name).type) for name in SCHEMA.names},
                     schema=SCHEMA.with_metadata(encoder.metadata()))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    buf = sink.getvalue().to_pybytes()
    return buf, hashlib.blake2b(buf, digest_size=16).hexdigest()


class Part:
    """A memory-mapped part: rows are read without copying the file."""

    def __init__(self, path: str):
        self.path = path
        mm = pa.memory_map(path, "r")
        table = pa.ipc.open_file(mm).read_all()
        meta = table.schema.metadata or {}
        self.codec = meta.get(b"codec", b"none").decode()
        self.index = table.column("index").to_numpy()
        self.height = table.column("height").to_numpy()
        self.width = table.column("width").to_numpy()
        self.check = table.column("check").to_numpy()
        data = table.column("data")  # combine_chunks() copies even one chunk out of the memory map
        self.data = data.chunk(0) if data.num_chunks == 1 else data.combine_chunks()
        self.keys = table.column("key")
        self.labels = table.column("label").to_numpy()
        self._dz = zstandard.ZstdDecompressor() if self.codec == "zstd" else None

    def __len__(self) -> int:
        return len(self.index)

    def pixels(self, row: int) -> np.ndarray:
        """The row's uint8 HWC image; raises :class:`CorruptRow`."""
        h, w = int(self.height[row]), int(self.width[row])
        buf = self.data[row].as_buffer()
        n = h * w * 3
        if self._dz is not None:
            try:
                out = self._dz.decompress(buf, max_output_size=n)
            except zstandard.ZstdError as e:
                raise CorruptRow(f"{self.path} row {row}: {e}") from None
        else:
            out = buf
            if zlib.crc32(out) != int(self.check[row]):
                raise CorruptRow(f"{self.path} row {row}: CRC32 mismatch")
        if len(out) != n:
            raise CorruptRow(f"{self.path} row {row}: {len(out)} bytes for a {h}x{w}x3 image")
        return np.frombuffer(out, np.uint8).reshape(h, w, 3)


def file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
