"""The row groups a Parquet source has read in one process: an LRU cache of parts (a row group's
image column whole, or a slice of it), bounded by ``cache_bytes`` while it reads, not only after.

What a process holds for its reads is the parts cached, the part being read, the live reader's
buffers (its read buffer, a page) and the scratch of the batch Arrow is decoding. Each is bounded:

* a row group whose image column is over the slice budget (``max(1 MiB, cache_bytes / 4)``,
  uncompressed, from the file's metadata) is read in slices of that size; later slices of one
  group continue the same reader, an earlier one restarts it;
* a part is streamed in pieces of about :data:`READ_PIECE` bytes, each kept as a chunk of its own:
  Arrow builds a batch's binary column in a buffer it doubles and copies as it grows, so a part
  read as one batch peaks at about three times its size;
* before a read, least recently used parts are dropped until those kept, the part coming and the
  reader's buffers (measured when a reader starts, :attr:`RowGroupParts.reader_bytes`) fit
  ``cache_bytes``;
* Arrow's allocator (mimalloc or jemalloc) keeps memory freed unless told: it is told to return
  it after each piece and each drop.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pyarrow as pa

from ..errors import SourceError

#: bytes of image column per batch a part is read in
READ_PIECE = 1 << 20
#: what a live reader holds until one is measured (its 1 MiB read buffer, a page, levels)
READER_BYTES = 4 << 20


def release() -> None:
    """Hand the memory Arrow's allocator holds freed back to the system (it keeps it unless told:
    its pages stay in the process's unique memory)."""
    pa.default_memory_pool().release_unused()


class Chunks:
    """A row group's image column as Arrow gives it: one array, or several chunks (pieces, or a
    ``binary`` column over 2 GiB); ``[r]`` finds row ``r`` without joining the chunks."""

    __slots__ = ("chunks", "starts", "nbytes")

    def __init__(self, col: pa.ChunkedArray):
        self.chunks = [c for c in col.chunks if len(c)] or [pa.array([], col.type)]
        self.starts = np.cumsum([0] + [len(c) for c in self.chunks[:-1]], dtype=np.int64)
        self.nbytes = col.nbytes

    def __getitem__(self, r: int):
        k = int(np.searchsorted(self.starts, r, side="right")) - 1 if len(self.chunks) > 1 else 0
        return self.chunks[k][r - int(self.starts[k])]


class RowGroupParts:
    """The parts of one source's row groups a process holds (see the module docstring).

    Args:
        image_column: the column read.
        cache_bytes: bytes the parts, the part being read and the reader's buffers may hold
            together (at least one part is always kept).

    Attributes:
        entries: ``(file, row group, slice or -1) -> Chunks``, least recently used first.
        cached: bytes of ``entries``.
        slicing: ``(file, row group) -> rows per slice`` (0: read whole).
        reader_bytes: bytes the last reader started held beyond its first part.
    """

    def __init__(self, image_column: str, cache_bytes: int):
        self.image_column = image_column
        self.cache_bytes = int(cache_bytes)
        self.slicing: dict = {}
        self._pieces: dict = {}
        self.clear()

    def clear(self) -> None:
        """Forget what this process read (a forked child, a pickled copy)."""
        self.entries: OrderedDict = OrderedDict()
        self.cached = 0
        self.reader_bytes = READER_BYTES
        self._live = None     # [(file, row group), batch iterator, rows it gave]

    def resize(self, cache_bytes: int) -> None:
        self.cache_bytes = int(cache_bytes)
        self.slicing, self._pieces = {}, {}

    def fresh(self) -> "RowGroupParts":
        """A copy holding nothing read, with the same settings."""
        return RowGroupParts(self.image_column, self.cache_bytes)

    def get(self, pf, fid: int, rg: int, r: int, name: str):
        """``(part, row in it)`` for row ``r`` of row group ``rg`` of ``pf`` (file ``fid``,
        ``name`` in errors)."""
        k, piece = self._slice_rows(pf, fid, rg)
        if k == 0:
            return self._cached_part((fid, rg, -1), self._image_bytes(pf, rg),
                                     lambda: self._read_whole(pf, rg, piece)), r
        s, at = divmod(r, k)
        n = pf.metadata.row_group(rg).num_rows
        expect = self._image_bytes(pf, rg) * min(k, n - s * k) // max(1, n)
        return self._cached_part((fid, rg, s), expect,
                                 lambda: self._read_slice(pf, fid, rg, s, k, piece, name)), at

    def _image_bytes(self, pf, rg: int) -> int:
        """Uncompressed bytes of row group ``rg``'s image column (the file's metadata)."""
        md = pf.metadata.row_group(rg)
        return next((md.column(j).total_uncompressed_size for j in range(md.num_columns)
                     if md.column(j).path_in_schema == self.image_column), 0)

    def _slice_rows(self, pf, fid: int, rg: int) -> tuple[int, int]:
        """``(rows per slice, rows per piece)`` of a row group: 0 rows per slice (read whole)
        unless its image column is over the slice budget; a slice is a whole number of pieces."""
        key = (fid, rg)
        k = self.slicing.get(key)
        if k is None or key not in self._pieces:
            n = pf.metadata.row_group(rg).num_rows
            size = self._image_bytes(pf, rg)
            budget = max(1 << 20, self.cache_bytes // 4)
            piece = n if size <= READ_PIECE else max(1, int(n * READ_PIECE // size))
            k = 0 if size <= budget else max(1, int(n * budget // size))
            if k:
                piece = min(piece, k)
                k -= k % piece
            self.slicing[key] = k
            self._pieces[key] = max(1, piece)
        return k, self._pieces[key]

    def _read_whole(self, pf, rg: int, piece: int) -> pa.ChunkedArray:
        """Row group ``rg``'s image column, streamed in pieces of ``piece`` rows."""
        chunks = []
        for b in pf.iter_batches(batch_size=piece, row_groups=[rg], columns=[self.image_column], use_threads=False):
            chunks.append(b.column(0))
            release()
        return pa.chunked_array(chunks, pf.schema_arrow.field(self.image_column).type)

    def _read_slice(self, pf, fid: int, rg: int, s: int, k: int, piece: int, name: str) -> pa.ChunkedArray:
        """Rows ``[s*k, (s+1)*k)`` of the row group, streamed with ``iter_batches`` in pieces of
        ``piece`` rows by the live reader (a new one when the group differs or the slice is
        behind it; closed after the group's last slice). A new reader's buffers (what Arrow's
        pool holds after its first slice, beyond the slice) are measured into
        :attr:`reader_bytes`."""
        live, start = self._live, None
        if live is None or live[0] != (fid, rg) or live[2] > s * k:
            self._live = live = None     # the old reader's buffers go first
            release()
            start = pa.total_allocated_bytes()
            live = [(fid, rg), pf.iter_batches(batch_size=piece, row_groups=[rg], columns=[self.image_column],
                                               use_threads=False), 0]
        self._live = live
        n = pf.metadata.row_group(rg).num_rows
        first, want = s * k, min(k, n - s * k)
        chunks = []
        for batch in live[1]:
            at = live[2]
            live[2] += len(batch)
            if live[2] <= first:             # an earlier slice's piece: passed over
                continue
            if at < first or live[2] - first > want:   # a piece across the slice's edges: read whole
                self.slicing[(fid, rg)] = 0
                self._live = None
                del chunks, batch
                return self._read_whole(pf, rg, piece).slice(first, k)
            chunks.append(batch.column(0))
            del batch
            release()                        # the piece's scratch
            if live[2] - first == want:
                part = pa.chunked_array(chunks, chunks[0].type)
                if start is not None:
                    self.reader_bytes = max(0, pa.total_allocated_bytes() - start - part.nbytes)
                if live[2] >= n:
                    self._live = None        # the group's last slice: the reader's buffers go
                return part
        raise SourceError(f"parquet source: {name} row group {rg} ended before slice {s}")

    def _cached_part(self, key, expect: int, read) -> Chunks:
        """The part at ``key``, read with ``read()`` on a miss, after dropping the least recently
        used parts until those kept, the ``expect`` bytes coming and the reader's buffers fit
        ``cache_bytes``."""
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            return hit
        if self._evict(self.cache_bytes - expect - self.reader_bytes, keep=0):
            release()
        col = Chunks(read())
        self.entries[key] = col
        self.cached += col.nbytes
        if self._evict(self.cache_bytes - (self.reader_bytes if self._live is not None else 0), keep=1):
            release()
        return col

    def _evict(self, room: int, keep: int) -> bool:
        """Drop least recently used parts until they hold at most ``room`` bytes or ``keep`` are
        left; True when one was dropped."""
        dropped = False
        while self.cached > room and len(self.entries) > keep:
            self.cached -= self.entries.popitem(last=False)[1].nbytes
            dropped = True
        return dropped
