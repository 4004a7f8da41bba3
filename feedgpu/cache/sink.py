"""The file object part files are written through: at most ``WRITE_CHUNK`` bytes per ``write()``.

The kernel sizes the page-cache folios of a buffered write by the length of the write, up to
2 MiB. On a VM whose balloon driver reports free memory to the host (free page reporting, done in
free blocks of 2 MiB and more), 2 MiB folios are taken from memory the host has taken back, and
each 4 KiB of it costs a host fault on first touch; folios of 1 MiB or less come from smaller free
blocks, which are never reported. Writing a record batch's ~8 MiB of pixels in 1 MiB pieces keeps
the part file out of reported memory (``bench/results/cache_epochs_uint8.md``, "What filling
costs"); elsewhere it costs a few more system calls per batch.
"""
from __future__ import annotations

import os

WRITE_CHUNK = 1 << 20


class ChunkedFile:
    """A write-only file over ``fd`` for ``pa.ipc.new_file``: writes of ``gather`` bytes or more
    (the record batches' buffers, which pyarrow hands over without copying) go to the kernel in
    pieces of at most ``chunk`` bytes; smaller ones (the IPC framing, the small columns) are
    gathered first. Closing it closes ``fd``."""

    def __init__(self, fd: int, chunk: int = WRITE_CHUNK, gather: int = 64 << 10):
        self.fd, self.chunk, self.gather = fd, max(1, int(chunk)), gather
        self._pending = bytearray()
        self._pos = 0
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
        while mv.nbytes:
            mv = mv[os.write(self.fd, mv[:self.chunk]):]

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
