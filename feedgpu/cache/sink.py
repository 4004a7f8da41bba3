"""The file object part files are written through: pieces of at most ``WRITE_CHUNK`` bytes, each
within one ``WRITE_CHUNK``-aligned stretch of the file.

The kernel sizes the page-cache folios of a buffered write by the length and file offset of the
write, up to 2 MiB. On a VM whose balloon driver reports free memory to the host (free page
reporting, done in free blocks of 2 MiB and more), a 2 MiB folio is taken from memory the host
has taken back, and each 4 KiB of it costs a host fault when first written. Smaller folios are
taken from free blocks of their own size first, which the guest never reports: the smaller the
folio, the more such memory there is to draw from (1 MiB folios ran out of it after a few
hundred MiB on the benchmark VM, 256 KiB ones did not). Elsewhere the pieces cost a few more
system calls per record batch. Measured in ``bench/results/cache_epochs_uint8.md`` ("What
filling costs").
"""
from __future__ import annotations

import os

WRITE_CHUNK = 256 << 10


class ChunkedFile:
    """A write-only file over ``fd`` for ``pa.ipc.new_file``: writes of ``gather`` bytes or more
    (the record batches' buffers, which pyarrow hands over without copying) go to the kernel in
    pieces that never cross a multiple of ``chunk`` in the file; smaller ones (the IPC framing,
    the small columns) are gathered first. Closing it closes ``fd``."""

    def __init__(self, fd: int, chunk: int = WRITE_CHUNK, gather: int = 64 << 10):
        self.fd, self.chunk, self.gather = fd, max(1, int(chunk)), gather
        self._pending = bytearray()
        self._pos = 0        # bytes taken (what tell() reports)
        self._written = 0    # bytes handed to the kernel
        self.closed = False

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        if n < self.gather:
            self._pending += mv
            if len(self._pending) >= self.gather:
                self._drain()
        else:
            self._drain()
            self._write_all(mv)
        self._pos += n
        return n

    def _drain(self) -> None:
        if self._pending:
            self._write_all(memoryview(self._pending))
            self._pending = bytearray()

    def _write_all(self, mv: memoryview) -> None:
        pos = self._written
        while mv.nbytes:
            k = os.write(self.fd, mv[:self.chunk - pos % self.chunk])
            mv = mv[k:]
            pos += k
        self._written = pos

    def tell(self) -> int:
        return self._pos

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._drain()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._drain()
        finally:
            self.closed = True
            os.close(self.fd)
