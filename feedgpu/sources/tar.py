"""WebDataset-style tar shards: ``<key>.jpg`` (or png/webp/...) + ``<key>.cls`` per sample.

Shards are indexed once (member headers only) into arrays of shard id, byte offset and size;
samples are then read with ``os.pread`` straight from the shard, so nothing is ever extracted:
member names with absolute paths or ``..`` are only keys, never file-system paths. Symbolic and
hard link members are left out while indexing (reason ``"link member, not followed"``), so a
link never makes feedgpu read another member or a file outside the shard; FIFO and device
entries likewise (``"not a regular file"``). Member names that are
not UTF-8 are kept byte-exact (surrogate escapes) in keys.

The key rule. Members are grouped as WebDataset groups them (``webdataset.tariterators.
base_plus_ext``): the group key is the member name up to the first dot of its base name, the
rest is the member's *field* (lower-cased), so ``a/img.v2.0001.jpg`` is key ``a/img``, field
``v2.0001.jpg``. A field whose last part is an image extension is an image; its *qualifier* is
the part before (``""`` for ``jpg``, ``"v2.0001"`` for ``v2.0001.jpg``). A label field is
``cls``, ``label`` or ``cls.txt``, with a qualifier in front the same way (``v2.0001.cls``).
Each image of a group is one sample, labelled by the label with its own qualifier, else by the
group's unqualified label. So shards written the WebDataset way (``img_0001.jpg`` +
``img_0001.cls``) and shards whose names keep dots (``img.v2.0001.jpg`` + ``img.v2.0001.cls``)
read the same. :func:`feedgpu.convert.folder_to_tar` writes keys without dots, which every
WebDataset reader groups the same way.

Records that cannot be delivered are left out while indexing, each named in
:attr:`~feedgpu.sources.base.Source.rejected` (``shard.tar:member``) with its reason:

* ``"duplicate key"``: two images of one qualifier in a group (``x.jpg`` and ``x.png``, or one
  name twice), or two labels for one image: every image of that key is left out (which label is
  meant cannot be told);
* ``"extra image in sample"``: a qualified image (``x.seg.png``) beside the group's own ``x.jpg``
  with no label of its own: a second field of the WebDataset sample, not a sample;
* ``"missing label"``: an image with no label, in a source where other samples have labels (a
  source with no label member at all is unlabeled: every label is -1);
* ``"bad label"``: a label that is not a non-negative integer below 2**63; ``"no image"``: a group, or a
  qualified label, without an image; ``"empty"``: a zero-byte image; ``"no key"``: an image
  whose base name starts with a dot (``.x.jpg``), which has no WebDataset key;
* ``"truncated"``: an image (or its label) whose data the shard's end cuts, or the last image
  before a shard's damage when it has no label (its label member may be what was lost); ``"truncated
  shard"``: a shard that ends inside a header, inside member data or without its end-of-archive
  marker (the samples after the cut are lost: the entry names the shard and the byte);
  ``"corrupt shard"``: an unreadable header in the middle of a shard (indexing stops there), or
  data after its end-of-archive marker (``cat a.tar b.tar``: the second archive is not indexed).
"""
from __future__ import annotations

import os
import tarfile
import warnings
from typing import NamedTuple

import numpy as np

from ..errors import DownloadError, SampleError, SourceError
from .base import CLASS_NAMES_FILE, Record, Source, StringTable, class_names, class_names_from_text, expand_paths

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff", "gif")
LABEL_SUFFIXES = ("cls.txt", "cls", "label")
_OTHER_LABEL_FIELDS = ("json", "txt", "id", "class", "target")   # WebDataset fields some writers label with
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")
_LABEL_BYTES = 64
_MAX_LABEL = np.iinfo(np.int64).max   # labels are held as int64
#: Remote shards a process keeps open (pinned in the shard cache) at once; the least recently
#: read is closed first, so a dataset larger than the cache's budget can be read.
MAX_OPEN_REMOTE = 8


def split_member(name: str) -> tuple[str | None, str]:
    """WebDataset's rule: ``(key, field)`` with the key up to the first dot of the base name and
    the field after it, lower-cased; ``(None, "")`` for a base name without a dot or starting
    with one (WebDataset skips such members)."""
    head, slash, base = name.rpartition("/")
    stem, dot, field = base.partition(".")
    if not dot or not stem:
        return None, ""
    return head + slash + stem, field.lower()


def _kind(field: str) -> tuple[str | None, str]:
    """``("label" | "image" | None, qualifier)`` of a member's field."""
    for suffix in LABEL_SUFFIXES:
        if field == suffix:
            return "label", ""
        if field.endswith("." + suffix):
            return "label", field[:-len(suffix) - 1]
    qual, _, last = field.rpartition(".")
    if last in IMAGE_SUFFIXES:
        return "image", qual
    return None, ""


class _Member(NamedTuple):
    name: str
    offset: int
    size: int
    cut: bool          # the shard ends inside its data


class TarShardSource(Source):
    """Samples from uncompressed tar shards in WebDataset layout (key rule in the module
    docstring).

    Args:
        shards: a directory holding ``*.tar``, a glob, a path, or a list of these; or URLs
            (``s3://``, ``gs://``, ``http(s)://``, ``file://``: a glob or folder where the store
            lists, a list of URLs, or the index file ``feedgpu convert`` writes, ``_index.json``).
        cache_dir, cache_budget, storage_options, cache: for URLs, the node-local shard cache
            (:class:`~feedgpu.remote.cache.ShardCache`: its folder, default
            ``<user cache dir>/feedgpu/shards``; its disk budget, bytes or ``"200GiB"``, default
            none; fsspec options of the store) or a cache to share.

    URLs: shards are read from local copies in the shard cache, downloaded whole when first
    read (with an index file, whose member table is the index, no shard is needed to open the
    source; without one, each shard is downloaded while indexing). A shard that cannot be
    downloaded after the cache's retries is left out while indexing as ``"bad shard"``, named
    (its records, named, when the index file lists them); one that fails when read makes each
    of its samples a skipped sample of reason ``"bad shard"``, counted in the loader's skip
    budget. A shard changed on the store since the source was opened raises
    :class:`~feedgpu.errors.RemoteChangedError` when read. Keys and fingerprints use the URLs.

    Labels come from the ``.cls`` member (a non-negative integer as text); a source with no
    label member but ``.json``/``.txt``/... members is unlabeled, with one warning saying so.
    Records left out while indexing are in :attr:`rejected` with their reasons (module
    docstring), and warned about once each. Raises :class:`SourceError` for missing, compressed or unreadable shards
    (random access needs plain tar) and when no sample is left.
    """

    format = "tar"

    def __init__(self, shards, *, cache_dir=None, cache_budget=None, storage_options=None, cache=None):
        super().__init__()
        self._remote = None
        from ..remote.index import is_index
        from ..remote.urls import has_url

        if has_url(shards) or is_index(shards):
            from ..remote.files import RemoteFiles, make_cache

            self._remote = RemoteFiles(shards, ".tar", "tar",
                                       make_cache(cache, cache_dir, cache_budget, storage_options))
            self.shards = self._remote.urls
        else:
            self.shards = expand_paths(shards, ".tar")
        if not self.shards:
            raise SourceError(f"tar source: no shards match {shards!r}")
        keys: list[str] = []
        shard_ids: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        labels: list[int] = []     # -2: no label (decided once every shard is indexed)
        labeled = False
        other_labels = 0           # members that may hold a label feedgpu does not read (.json ...)
        for sid, path, local in self._locals():
            if local is None:
                continue
            if isinstance(local, dict):   # the index file's member table, or one the shard cache kept
                part = local
                for key, reason, detail in part.get("rejected", ()):
                    self.reject(key, reason, detail)
            else:
                part = self._index_shard(path, local)
                if self._remote is not None:
                    f = self._remote.files[sid]
                    self._remote.cache.save_index(f.identity, "tar", part)
            keys.extend(part["members"])
            shard_ids.extend([sid] * len(part["members"]))
            offsets.extend(part["offsets"])
            sizes.extend(part["sizes"])
            labels.extend(part["labels"])
            labeled = labeled or part.get("labeled", any(lab >= 0 for lab in part["labels"]))
            other_labels += part.get("other", 0)
        keep = []
        for i, label in enumerate(labels):
            if label != -2:
                keep.append(i)
            elif labeled:
                self.reject(f"{self.shards[shard_ids[i]]}:{keys[i]}", "missing label",
                            "no .cls member for this image, and other samples have one")
            else:
                keep.append(i)
        self._warn_rejected()
        if not labeled and other_labels:
            warnings.warn(f"feedgpu: tar source {self.shards[0]}{' ...' if len(self.shards) > 1 else ''} has no "
                          f"label member ({', '.join('.' + x for x in LABEL_SUFFIXES)}), so every label is -1 "
                          f"(unlabeled); {other_labels} member(s) are {'/'.join('.' + x for x in _OTHER_LABEL_FIELDS)}, "
                          "which feedgpu does not read labels from", stacklevel=2)
        if not keep:
            raise self._nothing_left(f"tar source: no samples left in {len(self.shards)} shard(s)"
                                      + (f" ({len(self.rejected)} left out while indexing)" if self.rejected else ""))
        self.members = StringTable([keys[i] for i in keep])
        self.shard_ids = np.asarray([shard_ids[i] for i in keep], dtype=np.int32)
        self.offsets = np.asarray([offsets[i] for i in keep], dtype=np.int64)
        self.sizes = np.asarray([sizes[i] for i in keep], dtype=np.int64)
        self.labels = np.maximum(np.asarray([labels[i] for i in keep], dtype=np.int64), -1)
        self.classes = (class_names(self.shards[0], self.labels) if self._remote is None else
                        class_names_from_text(self._remote.text_beside(CLASS_NAMES_FILE), self.labels))
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def _index_shard(self, path: str, local: str) -> dict:
        """One shard's samples (``members``, ``offsets``, ``sizes``, ``labels``: -2 for none),
        whether it has label members (``labeled``), its ``other`` label-like members and the
        records it ``rejected`` (``[key, reason, detail]``, also added to :attr:`rejected`)."""
        members, offsets, sizes, labels = [], [], [], []
        labeled, other_labels, first = False, 0, len(self.rejected)
        groups: dict[str, dict] = {}
        self._cut = False
        last = None
        with open(local, "rb") as raw:
            for m in self._members(path, raw, local):
                key, field = split_member(m.name)
                if key is None:
                    if m.name.lower().endswith(tuple("." + e for e in IMAGE_SUFFIXES)):
                        self.reject(f"{path}:{m.name}", "no key", "its base name starts with a dot: "
                                    "WebDataset readers skip it too")
                    continue
                kind, qual = _kind(field)
                if kind is None:
                    other_labels += field in _OTHER_LABEL_FIELDS
                    continue
                g = last = groups.setdefault(key, {"image": {}, "label": {}, "first": m.name})
                g[kind].setdefault(qual, []).append(m)
                if kind == "label":
                    labeled = True
            for g in groups.values():
                for m, label in self._samples(path, raw, g, self._cut and g is last):
                    members.append(m.name)
                    offsets.append(m.offset)
                    sizes.append(m.size)
                    labels.append(label)
        rejected = [[k, r, self.rejected_details.get(k, "")] for k, r in self.rejected[first:]]
        return {"members": members, "offsets": offsets, "sizes": sizes, "labels": labels,
                "labeled": labeled, "other": other_labels, "rejected": rejected}

    def _locals(self):
        """``(shard id, name, local path | member table | None)`` per shard: a local shard is
        its own path; a remote one is downloaded (up to the cache's ``max_downloads`` ahead,
        pinned until indexed) unless the index file holds its member table; one that cannot be
        downloaded is left out as ``"bad shard"`` (None)."""
        if self._remote is None:
            yield from ((sid, p, p) for sid, p in enumerate(self.shards))
            return
        files, cache = self._remote.files, self._remote.cache
        ahead: dict = {}
        window = cache.max_downloads   # shards pinned ahead: within the budget
        if cache.budget_bytes is not None:
            biggest = max((f.identity.size for f in files if f.identity is not None), default=1)
            window = max(1, min(window, cache.budget_bytes // max(1, biggest)))

        def submit(j):
            f = files[j]
            if f.samples is None and f.identity is not None and j not in ahead \
                    and cache.load_index(f.identity, "tar") is None:
                cache.pin(f.url)
                ahead[j] = cache.fetch_async(f.url, f.identity, f.sha256)

        for sid, f in enumerate(files):
            for j in range(sid, min(len(files), sid + window)):
                submit(j)
            if f.identity is None:   # the store could not be reached for it
                names = [f"{f.url}:{m}" for m in f.samples["members"]] if f.samples else [f.url]
                for name in names:
                    self.reject(name, "bad shard", f.error)
                continue
            if f.samples is not None:
                yield sid, f.url, f.samples
                continue
            saved = cache.load_index(f.identity, "tar")   # indexed on an earlier run: no download
            if saved is not None:
                ahead.pop(sid, None)
                yield sid, f.url, saved
                continue
            try:
                yield sid, f.url, ahead.pop(sid).result()
            except DownloadError as e:
                self.reject(f.url, "bad shard", str(e))
            finally:
                cache.unpin(f.url)

    # -- indexing ----------------------------------------------------------------------------
    def _members(self, path: str, raw, local: str):
        """The regular-file members of one shard (named ``path``, read from ``local``), in order;
        what the shard's end or a bad header cuts off is recorded as a ``"truncated shard"`` /
        ``"corrupt shard"`` entry."""
        if not os.path.isfile(local):
            raise SourceError(f"tar source: {path} is not a file")
        size = os.fstat(raw.fileno()).st_size
        magic = raw.read(6)
        if size == 0:
            self.reject(path, "truncated shard", "zero-byte shard")
            return
        if magic.startswith(_COMPRESSED):
            raise SourceError(f"tar source: {path} is compressed; random access needs plain, "
                              "uncompressed .tar shards")
        try:
            tf = tarfile.open(local, mode="r:")
        except tarfile.ReadError as e:
            if size < tarfile.BLOCKSIZE:
                self.reject(path, "truncated shard", f"{size} bytes: cut inside the first header")
                return
            raise SourceError(f"tar source: {path} is not an uncompressed tar ({e}); "
                              "random access needs plain .tar shards") from e
        with tf:
            error = None
            try:
                for m in tf:
                    if m.issym() or m.islnk():
                        self.reject(f"{path}:{m.name}", "link member, not followed")
                        continue
                    if m.isfile():
                        yield _Member(m.name, m.offset_data, m.size, m.offset_data + m.size > size)
                    elif not m.isdir() and split_member(m.name)[0] is not None:
                        self.reject(f"{path}:{m.name}", "not a regular file")   # a FIFO or device entry
            except tarfile.ReadError as e:   # the shard ends inside a member's data
                error = str(e)
            end = tf.offset
        if error is not None:
            self._cut = True   # the shard's last group may have lost members
            self.reject(path, "truncated shard", f"{error}: the shard ends at byte {size}, inside a member's "
                        "data; members after it are lost")
            return
        raw.seek(end)
        block = raw.read(tarfile.BLOCKSIZE)
        if not block:
            self._cut = True   # the shard's last group may have lost members
            self.reject(path, "truncated shard", f"no end-of-archive marker after byte {end}: the shard "
                        "was cut at a block boundary; members after it are lost")
        elif len(block) < tarfile.BLOCKSIZE:
            self._cut = True   # the shard's last group may have lost members
            self.reject(path, "truncated shard", f"cut inside a header at byte {end} (shard size {size}); "
                        "members after it are lost")
        elif block.count(0) != tarfile.BLOCKSIZE:
            self._cut = True   # the shard's last group may have lost members
            self.reject(path, "corrupt shard", f"unreadable header at byte {end}; members after it are not "
                        "indexed")
        else:
            while True:   # the end marker and padding: zeros to the end, unless an archive was appended
                chunk = raw.read(1 << 20)
                if not chunk:
                    break
                if chunk.count(0) != len(chunk):
                    self.reject(path, "corrupt shard", f"data after the end-of-archive marker at byte {end} (an "
                                "archive appended to this one?); members there are not indexed")
                    break

    def _samples(self, path: str, raw, g: dict, cut: bool = False):
        """``(image member, label)`` of one key group (label -2: none); the rest is rejected.
        ``cut``: the group is the last before a shard's damage, so an image without a label may
        have lost it there (rejected as ``"truncated"``, never delivered unlabeled)."""
        images, labels = g["image"], g["label"]
        used: set[str] = set()
        if not images:
            self.reject(f"{path}:{g['first']}", "no image", "no image member has this key")
            return
        for qual, found in images.items():
            if qual and "" in images and qual not in labels:
                for m in found:
                    self.reject(f"{path}:{m.name}", "extra image in sample",
                                f"a second image field of the sample {images[''][0].name!r}")
                continue
            lab_q = qual if qual in labels else ""
            labs = labels.get(lab_q, [])
            used.add(lab_q)
            if len(found) > 1 or len(labs) > 1:
                names = [m.name for m in found] + [m.name for m in labs]
                for m in found:
                    self.reject(f"{path}:{m.name}", "duplicate key",
                                f"{len(found)} image(s) and {len(labs)} label(s) share it: {names}")
                continue
            m = found[0]
            if m.cut or (labs and labs[0].cut):
                self.reject(f"{path}:{m.name}", "truncated", "the shard ends inside "
                            + ("its data" if m.cut else f"its label {labs[0].name!r}"))
                continue
            if m.size == 0:
                self.reject(f"{path}:{m.name}", "empty")
                continue
            if cut and not labs:
                self.reject(f"{path}:{m.name}", "truncated", "the last sample before the shard's damage, "
                            "without a label: its label member may be lost there")
                continue
            label = -2
            if labs:
                label = _read_label(raw, labs[0])
                if label is None:
                    self.reject(f"{path}:{m.name}", "bad label",
                                f"{labs[0].name!r} does not hold a non-negative integer below 2**63")
                    continue
            yield m, label
        for qual, labs in labels.items():
            if qual not in used and qual not in images:
                for m in labs:
                    self.reject(f"{path}:{m.name}", "no image", "a label without its image")

    @property
    def remote(self):
        """The :class:`~feedgpu.remote.files.RemoteFiles` of a source read from URLs (its
        ``cache``, and ``fetch_async(i)`` to fetch shard ``i`` ahead), else None."""
        return self._remote

    def __getstate__(self) -> dict:
        """Pickled (to a Ray worker) without this process's file descriptors."""
        state = self.__dict__.copy()
        state.update(_fds={}, _pid=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    def _fd(self, sid: int, index: int) -> int:
        if self._pid != os.getpid():  # forked: file offsets are shared, descriptors are not ours
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(sid)
        if fd is None:
            if self._remote is None:
                fd = self._fds[sid] = os.open(self.shards[sid], os.O_RDONLY)
                return fd
            while len(self._fds) >= MAX_OPEN_REMOTE:   # the oldest open shard may be evicted again
                old = next(iter(self._fds))
                os.close(self._fds.pop(old))
                self._remote.cache.unpin(self.shards[old])
            try:
                fd = self._remote.open_local(sid, lambda p: os.open(p, os.O_RDONLY))
            except DownloadError as e:
                raise SampleError(self.key(index), "bad shard", str(e)) from None
            self._fds[sid] = fd
        elif self._remote is not None:
            self._fds[sid] = self._fds.pop(sid)   # most recently used last
        return fd

    def key(self, index: int) -> str:
        return f"{self.shards[self.shard_ids[index]]}:{self.members[index]}"

    def shard_of(self) -> np.ndarray:
        """The shard of each sample: its index in :attr:`shards` (int32, the index's own array)."""
        return self.shard_ids

    def shard_names(self) -> list[str]:
        """The shards' paths, index = shard id."""
        return list(self.shards)

    def read(self, index: int) -> Record:
        sid = int(self.shard_ids[index])
        data = os.pread(self._fd(sid, index), int(self.sizes[index]), int(self.offsets[index]))
        return Record(data, int(self.labels[index]), self.key(index))

    def _digest(self, h) -> None:
        if self._remote is not None:   # URL, size and ETag: the same on a machine with a new cache
            self._remote.digest(h)
        for p in self.shards if self._remote is None else ():
            st = os.stat(p)
            h.update(f"{os.path.abspath(p)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        self.members.digest(h)
        h.update(self.offsets.tobytes())

    def __del__(self):
        remote = getattr(self, "_remote", None)
        for sid, fd in getattr(self, "_fds", {}).items():
            try:
                os.close(fd)
            except OSError:
                pass
            if remote is not None and self._pid == os.getpid():
                remote.cache.unpin(self.shards[sid])


def _read_label(raw, m: _Member) -> int | None:
    """The integer a label member holds (ASCII digits, blanks around), or None."""
    if m.size > _LABEL_BYTES:
        return None
    raw.seek(m.offset)
    text = raw.read(m.size).decode("ascii", "replace").strip()
    if not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= _MAX_LABEL else None
