"""The checksums of part files (xxh3-64 from the ``xxhash`` package, as ints) and the errors
raised when they do not match.

* ``check`` (a column): the xxh3-64 of each row's stored bytes (the raw pixels, or the zstd frame).
* ``meta_xxh3`` (manifest): the small columns and the row lengths, verified when a part is opened.
* ``content_xxh3`` (manifest): the part's checksum, over its meta checksum, codec and keys. It
  covers every value in the file (each row's stored bytes through ``check``), and is computed
  from what the writer already holds, without reading the file back.
"""
from __future__ import annotations

import numpy as np
import xxhash

checksum = xxhash.xxh3_64_intdigest
"""xxh3-64 of a bytes-like object, as an int (unsigned 64 bit)."""

META_COLUMNS = ("index", "label", "height", "width", "check", "length")
_META_DTYPES = ("<i8", "<i8", "<i4", "<i4", "<u8", "<i8")


class CorruptRow(Exception):
    """A cached row failed its checksum or does not decompress to its shape."""


class CorruptPart(Exception):
    """A part file that is not what its manifest entry says: columns or codec unknown, small
    columns or keys not matching their checksums, or row offsets outside the data."""


def meta_checksum(columns: dict) -> int:
    """xxh3-64 of the index/label/height/width/check columns and the row lengths in bytes
    (``length``), each as a little-endian array, in that order."""
    h = xxhash.xxh3_64()
    for name, dtype in zip(META_COLUMNS, _META_DTYPES):
        h.update(np.ascontiguousarray(columns[name], dtype=dtype))
    return h.intdigest()


def content_checksum(meta_xxh3: int, codec: str, level: int | str, key_lengths, key_bytes) -> int:
    """xxh3-64 of the meta checksum (8 bytes, little-endian), ``"<codec>:<level>\\n"``, the keys'
    lengths in bytes (int64, little-endian) and the keys' UTF-8 bytes, in that order."""
    h = xxhash.xxh3_64()
    h.update(int(meta_xxh3).to_bytes(8, "little"))
    h.update(f"{codec}:{level}\n".encode())
    h.update(np.ascontiguousarray(key_lengths, dtype="<i8"))
    h.update(key_bytes)
    return h.intdigest()
