"""A worker's result channel: one message per result, the file descriptors of its shared-memory
tensors passed with it.

torch's tensor reductions (``torch.multiprocessing``, ``file_descriptor`` sharing strategy) send
a CPU tensor's shared-memory storage as a ``DupFd``: the receiver connects to the sender's
resource-sharer thread, both sides authenticate (an HMAC challenge each way), and the descriptor
comes over that connection, once per storage, so a batch of images and labels costs two
connections and a wake-up of a thread in the worker. A :class:`Channel` is a Unix stream socket
instead of a pipe: the sender pickles a message with :class:`_FdPickler`, which records the
descriptors of the storages it meets, and sends the pickle and those descriptors in one
``sendmsg`` (``SCM_RIGHTS``); the receiver rebuilds each storage with torch's own
``rebuild_storage_fd`` from the descriptor that came with the message. Tensors are shared exactly
as torch shares them (same mapping, same cache of storages already received), without the
per-storage round trip.

What stays torch's: the ``file_system`` strategy, empty storages, and storages beyond
:data:`MAX_FDS` in one message, which take torch's reductions unchanged.

Wire format: ``<QI`` header (pickle length in bytes, number of descriptors), then the pickle
(protocol of ``ForkingPickler``); the descriptors ride on the header's first byte.
"""
from __future__ import annotations

import array
import io
import os
import pickle
import socket
import struct
import threading
from multiprocessing.reduction import ForkingPickler

_HEAD = struct.Struct("<QI")
MAX_FDS = 64           # descriptors per message; further storages go through torch's resource sharer
_FD_SIZE = array.array("i").itemsize
_local = threading.local()   # the descriptors of the message being unpickled, in this thread


def _torch_reductions():
    try:
        import torch
        import torch.multiprocessing as tmp
        from torch.multiprocessing import reductions
    except ImportError:  # pragma: no cover - feedgpu imports without torch only in tools
        return None
    return torch, tmp, reductions


class _FdPickler(ForkingPickler):
    """``ForkingPickler`` whose CPU storages carry an index into the message's descriptors."""

    def __init__(self, file):
        super().__init__(file)
        self.fds: list[int] = []
        tr = _torch_reductions()
        if tr is not None:
            self.dispatch_table[tr[0].UntypedStorage] = self._reduce_storage

    def _reduce_storage(self, storage):
        torch, tmp, reductions = _torch_reductions()
        if (storage.device.type != "cpu" or tmp.get_sharing_strategy() != "file_descriptor"
                or storage.size() == 0 or len(self.fds) >= MAX_FDS):
            return reductions.reduce_storage(storage)
        fd, size = storage._share_fd_cpu_()   # the storage keeps owning fd; sendmsg passes a copy
        reductions.shared_cache[reductions.fd_id(fd)] = reductions.StorageWeakRef(storage)
        self.fds.append(fd)
        return (_rebuild_storage, (type(storage), len(self.fds) - 1, size))


class _Held:
    """A received descriptor in the shape torch's ``rebuild_storage_fd`` takes (``detach()``)."""

    def __init__(self, fd: int):
        self.fd = fd

    def detach(self) -> int:
        return self.fd


def _rebuild_storage(cls, index: int, size: int):
    """Unpickling: the storage whose descriptor is ``index`` in the message being read (torch's
    ``rebuild_storage_fd`` maps it, or finds it in its cache, and closes the descriptor)."""
    fds = _local.fds
    fd, fds[index] = fds[index], -1
    if fd < 0:
        raise pickle.UnpicklingError(f"descriptor {index} of the message is used twice")
    return _torch_reductions()[2].rebuild_storage_fd(cls, _Held(fd), size)


class Channel:
    """One end of a connected ``AF_UNIX`` stream socket carrying pickled messages (see the module
    doc). ``send(obj)``, ``recv() -> obj``, ``poll(timeout) -> bool``, ``fileno()`` (for
    ``multiprocessing.connection.wait``), ``close()``. Picklable while a spawn or forkserver
    process starts (the socket is duplicated for the child).

    ``recv`` raises ``EOFError`` when the other end closed (also in the middle of a message: a
    sender that died while writing), :class:`~feedgpu.errors.WorkerError` when the descriptors could
    not all be received (the process ran out of descriptors: ``ulimit -n``)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    @staticmethod
    def pair() -> tuple["Channel", "Channel"]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return Channel(a), Channel(b)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def poll(self, timeout: float | None = 0.0) -> bool:
        import multiprocessing.connection as mpc

        return bool(mpc.wait([self.sock], timeout))

    def send(self, obj) -> None:
        """Pickle ``obj`` (may raise what pickling raises, before anything is written) and write
        it with its descriptors."""
        buf = io.BytesIO()
        p = _FdPickler(buf)
        p.dump(obj)
        blob = buf.getbuffer()
        head = _HEAD.pack(len(blob), len(p.fds))
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", p.fds))] if p.fds else []
        sent = self.sock.sendmsg([head, blob], anc)
        if sent < len(head):   # interrupted early: the descriptors went with the first byte
            self.sock.sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < len(blob):
            self.sock.sendall(blob[sent - len(head):])
        del p, buf, blob   # the storages (and their descriptors) may go now: the kernel holds copies

    def _read_message(self) -> tuple[memoryview, list[int]]:
        head, anc, flags, _ = self.sock.recvmsg(_HEAD.size, socket.CMSG_SPACE(MAX_FDS * _FD_SIZE))
        fds: list[int] = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(data[:len(data) - len(data) % _FD_SIZE])
                fds.extend(a)
        try:
            if not head:
                raise EOFError("the channel's other end is closed")
            if len(head) < _HEAD.size:
                head += self._exact(_HEAD.size - len(head))
            size, nfds = _HEAD.unpack(head)
            blob = self._exact(size)
            if len(fds) != nfds or flags & socket.MSG_CTRUNC:
                from . import fd_limit

                raise fd_limit.error(OSError(f"a worker's batch came with {len(fds)} of its {nfds} shared-memory "
                                             "file descriptors"))
        except BaseException:
            _close_all(fds)
            raise
        return blob, fds

    def _exact(self, n: int) -> memoryview:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError(f"the channel closed in the middle of a message ({got} of {n} bytes)")
            got += k
        return view

    def recv(self):
        """The next message, unpickled (its storages rebuilt from the descriptors it brought)."""
        blob, fds = self._read_message()
        _local.fds = fds
        try:
            return pickle.loads(blob)
        finally:
            _local.fds = None
            _close_all(fds)   # any the pickle did not take

    def skip(self) -> None:
        """Read the next message and drop it, unpickled (raises ``EOFError`` as :meth:`recv`)."""
        _, fds = self._read_message()
        _close_all(fds)


def _close_all(fds: list[int]) -> None:
    for i, fd in enumerate(fds):
        if fd >= 0:
            fds[i] = -1
            try:
                os.close(fd)
            except OSError:
                pass
