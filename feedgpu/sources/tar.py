"""WebDataset-style tar shards: ``<key>.jpg`` (or png/webp/...) + ``<key>.cls`` per sample.

Shards are indexed once (member headers only) into arrays of shard id, byte offset and size;
samples are then read with ``os.pread`` straight from the shard, so nothing is ever extracted:
member names with absolute paths or ``..`` are only keys, never file-system paths. Symbolic and
hard link members are left out while indexing (reason ``"link member, not followed"``), so a
link never makes feedgpu read another member or a file outside the shard. Member names that are
not UTF-8 are kept byte-exact (surrogate escapes) in keys.
"""
from __future__ import annotations

import os
import tarfile

import numpy as np

from ..errors import SourceError
from .base import Record, Source, StringTable, class_names, expand_paths

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff", "gif")
LABEL_SUFFIXES = ("cls", "label", "cls.txt")


def _split_member(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the base name."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


class TarShardSource(Source):
    """Samples from uncompressed tar shards in WebDataset layout.

    Args:
        shards: a directory holding ``*.tar``, a glob, a path, or a list of these.

    A sample's image is its member with an image extension (``jpg``, ``png`` ...); a sample
    with none, but with a member whose name ends in one (``name.v2.jpg``: key ``name``,
    extension ``v2.jpg``), uses that member. Labels come from the ``.cls`` member (an integer as text); a sample without one gets -1.
    Zero-byte image members are left out while indexing (reason ``"empty"``). Raises
    :class:`SourceError` for missing or compressed shards (random access needs plain tar).
    """

    format = "tar"

    def __init__(self, shards):
        super().__init__()
        self.shards = expand_paths(shards, ".tar")
        if not self.shards:
            raise SourceError(f"tar source: no shards match {shards!r}")
        keys: list[str] = []
        shard_ids: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        labels: list[int] = []
        for sid, path in enumerate(self.shards):
            if not os.path.isfile(path):
                raise SourceError(f"tar source: {path} is not a file")
            try:
                tf = tarfile.open(path, mode="r:")
            except tarfile.ReadError as e:
                raise SourceError(f"tar source: {path} is not an uncompressed tar ({e}); "
                                  "random access needs plain .tar shards") from e
            groups: dict[str, dict] = {}
            order: list[str] = []
            with tf, open(path, "rb") as raw:
                for m in tf:
                    if m.issym() or m.islnk():
                        self.rejected.append((f"{path}:{m.name}", "link member, not followed"))
                        continue
                    if not m.isfile():
                        continue
                    key, ext = _split_member(m.name)
                    g = groups.get(key)
                    if g is None:
                        g = groups[key] = {}
                        order.append(key)
                    if ext in IMAGE_SUFFIXES and "image" not in g:
                        g["image"] = (m.offset_data, m.size, m.name)
                    elif ext.rpartition(".")[2] in IMAGE_SUFFIXES and "other" not in g:
                        g["other"] = (m.offset_data, m.size, m.name)  # "a.b.jpg": key "a", ext "b.jpg"
                    elif ext in LABEL_SUFFIXES:
                        raw.seek(m.offset_data)
                        g["label"] = raw.read(min(m.size, 64))
            for key in order:
                g = groups[key]
                if "image" not in g and "other" not in g:
                    continue
                off, size, name = g.get("image") or g["other"]
                where = f"{path}:{name}"
                if size == 0:
                    self.rejected.append((where, "empty"))
                    continue
                label = -1
                if "label" in g:
                    try:
                        label = int(g["label"].decode("ascii", "replace").strip())
                    except ValueError:
                        self.rejected.append((where, "bad label"))
                        continue
                keys.append(name)
                shard_ids.append(sid)
                offsets.append(off)
                sizes.append(size)
                labels.append(label)
        if not keys:
            raise SourceError(f"tar source: no image members in {len(self.shards)} shard(s)")
        self._warn_rejected()
        self.members = StringTable(keys)
        self.shard_ids = np.asarray(shard_ids, dtype=np.int32)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = class_names(self.shards[0], self.labels)
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        """Pickled (to a Ray worker) without this process's file descriptors."""
        state = self.__dict__.copy()
        state.update(_fds={}, _pid=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    def _fd(self, sid: int) -> int:
        if self._pid != os.getpid():  # forked: file offsets are shared, descriptors are not ours
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(sid)
        if fd is None:
            fd = self._fds[sid] = os.open(self.shards[sid], os.O_RDONLY)
        return fd

    def key(self, index: int) -> str:
        return f"{self.shards[self.shard_ids[index]]}:{self.members[index]}"

    def read(self, index: int) -> Record:
        sid = int(self.shard_ids[index])
        data = os.pread(self._fd(sid), int(self.sizes[index]), int(self.offsets[index]))
        return Record(data, int(self.labels[index]), self.key(index))

    def _digest(self, h) -> None:
        for p in self.shards:
            st = os.stat(p)
            h.update(f"{os.path.abspath(p)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        self.members.digest(h)
        h.update(self.offsets.tobytes())

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass
