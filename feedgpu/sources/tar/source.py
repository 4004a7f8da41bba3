"""WebDataset-style tar shards: ``<key>.jpg`` (or png/webp/...) + ``<key>.cls`` per sample.

Shards are indexed once (member headers only: numpy for plain shards, :mod:`.scan`, else
:mod:`tarfile`, :mod:`.walk`, the same index; several local shards at once in threads,
:mod:`.local`) into arrays of shard id, byte offset and size, saved per local shard
(:mod:`.index`); a local shard with a member table beside it (``<shard>.feedgpu-index``,
which ``feedgpu convert`` writes: :mod:`.table`) is not indexed while the table matches it.
Samples are read with ``os.pread`` from the shard, never extracted: member names with absolute
paths or ``..`` are only keys, never file-system paths. Symbolic and
hard link members are left out while indexing (reason ``"link member, not followed"``), so a
link never makes feedgpu read another member or a file outside the shard; FIFO and device
entries likewise (``"not a regular file"``). Non-UTF-8 member names stay byte-exact in keys.

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

import hashlib
import os
import warnings
from functools import partial

import numpy as np

from ...errors import DownloadError, SampleError, SourceError
from . import index as _saved
from ..base import CLASS_NAMES_FILE, Record, Source, StringTable, class_names, class_names_from_text, expand_paths, \
    file_hash, index_array, missing_files, release_freed_memory
from ..file_stats import change_stamp
from .local import local_part, ordered_map
from .members import LABEL_SUFFIXES, OTHER_LABEL_FIELDS, part_arrays
from .walk import index_with_tarfile

#: Remote shards a process keeps open (pinned in the shard cache) at once; the least recently
#: read is closed first, so a dataset larger than the cache's budget can be read.
MAX_OPEN_REMOTE = 8


class TarShardSource(Source):
    """Samples from uncompressed tar shards in WebDataset layout (key rule in the module
    docstring).

    Args:
        shards: a directory holding ``*.tar`` (any case; its other files, and shards in its
            sub-folders, named in one warning; compressed shards in it raise :class:`SourceError`
            naming them: :mod:`feedgpu.sources.extensions`), a glob, a path, or a list of these; or URLs
            (``s3://``, ``gs://``, ``http(s)://``, ``file://``: a glob or folder where the store
            lists, a list of URLs, or the index file ``feedgpu convert`` writes, ``_index.json``).
        cache_dir, cache_budget, storage_options, cache: for URLs, the node-local shard cache
            (:class:`~feedgpu.remote.cache.ShardCache`: its folder, default
            ``<user cache dir>/feedgpu/shards``; its disk budget, bytes or ``"200GiB"``, default
            none; fsspec options of the store) or a cache to share.
        index_dir: where local shards' saved indexes live (:mod:`feedgpu.sources.tar.index`);
            None: the ``tar-index`` folder of feedgpu's cache dir; False: neither read nor write one.
        max_bad_files: URLs only: shards that may be unreadable at open (int >= 0, default 0;
            None: any); each is then left out as ``"bad shard"`` (one entry per file), named.
        verify: URLs only: the shard cache's change check, ``"identity"`` (default) or
            ``"content"`` (see :class:`~feedgpu.remote.cache.ShardCache`); ignored with ``cache``.

    Attributes:
        saved_shards: how many shards were read from a saved index (int);
            ``from_saved_index``: True when every shard was; ``table_shards``: how many from the
            member table beside them (:mod:`feedgpu.sources.tar.table`; a table that is corrupt,
            of another feedgpu version or older than its shard is not used, one warning names them).

    URLs: shards are read from local copies in the shard cache, downloaded whole when first
    read (with an index file, whose member table is the index, no shard is needed to open the
    source; without one, each shard is downloaded while indexing). Shards that cannot be read
    at open (after the cache's retries: refused, DNS, 404, 5xx, not a tar, an HTML page) raise
    one :class:`SourceError` naming each URL and cause, unless ``max_bad_files`` allows them
    (then each is left out as ``"bad shard"``, one entry per file); one that fails when read
    makes each of its samples a skipped sample of reason ``"bad shard"``, counted in the
    loader's skip budget (the loader's read-ahead ends the epoch instead when the budget cannot
    hold the whole shard). A shard changed on the store since the source was opened raises
    :class:`~feedgpu.errors.RemoteChangedError` when read. Keys and fingerprints use the URLs.

    Labels come from the ``.cls`` member (a non-negative integer as text); a source with no
    label member but ``.json``/``.txt``/... members is unlabeled, with one warning saying so.
    Records left out while indexing are in :attr:`rejected` with their reasons (module
    docstring), and warned about once each. Raises :class:`SourceError` for missing, compressed or unreadable shards
    (random access needs plain tar) and when no sample is left.
    """

    format = "tar"

    def __init__(self, shards, *, cache_dir=None, cache_budget=None, storage_options=None, cache=None,
                 index_dir=None, max_bad_files: int | None = 0, verify: str = "identity"):
        super().__init__()
        self._remote = None
        from ...remote.index import is_index
        from ...remote.urls import has_url

        if has_url(shards) or is_index(shards):
            from ...remote.files import RemoteFiles, make_cache

            self._remote = RemoteFiles(shards, ".tar", "tar",
                                       make_cache(cache, cache_dir, cache_budget, storage_options, verify),
                                       max_bad_files)
            self.shards = self._remote.urls
        else:
            self.shards = expand_paths(shards, ".tar")
            missing_files(self.shards, "tar source", shards)
        if not self.shards:
            raise SourceError(f"tar source: no shards match {shards!r}")
        self._index_dir = None if self._remote is not None or index_dir is False else \
            _saved.index_dir(index_dir)
        self.saved_shards = self.table_shards = 0
        parts = []                 # per shard: its id and its part's arrays (labels -2: no label yet)
        labeled, other_labels = False, 0   # other: members that may hold a label feedgpu does not read (.json)
        problems: list[str] = []   # member tables beside shards that were not used, and why
        for sid, path, part in self._parts():
            if part is None:
                continue
            for key, reason, detail in part.get("rejected", ()):
                self.reject(key, reason, detail)
            part = part_arrays(part)
            parts.append((sid, part))
            labeled = labeled or part.get("labeled", bool((part["labels"] >= 0).any()))
            other_labels += part.get("other", 0)
            if part.get("_table_problem"):
                problems.append(part["_table_problem"])
        if self._remote is not None:
            self._remote.check_open()   # files that cannot be read: one error naming each, or "bad shard"s
        if problems:
            warnings.warn(f"feedgpu: did not use the member tables beside {len(problems)} shard(s), indexed them "
                          f"afresh: {'; '.join(problems[:3])}" + (" ..." if len(problems) > 3 else ""), stacklevel=2)
        self.from_saved_index = bool(parts) and self.saved_shards == len(self.shards)
        def cat(name, dt):   # in the parts' own (narrow) dtypes
            return np.concatenate([p[name] for _, p in parts]) if parts else np.zeros(0, dt)

        lens, labels = cat("lens", np.int64).astype(np.int64), cat("labels", np.int64)
        counts = [len(p["lens"]) for _, p in parts]
        keep = labels != -2 if labeled else np.ones(len(labels), bool)
        if not keep.all():
            ends = np.cumsum(lens)
            blob, firsts = cat("blob", np.uint8), np.cumsum([0] + counts)
            for i in np.flatnonzero(~keep):
                sid = parts[int(np.searchsorted(firsts, i, side="right")) - 1][0]
                name = blob[ends[i] - lens[i]:ends[i]].tobytes().decode("utf-8", "surrogateescape")
                self.reject(f"{self.shards[sid]}:{name}", "missing label",
                            "no .cls member for this image, and other samples have one")
        self._warn_rejected()
        if not labeled and other_labels:
            warnings.warn(f"feedgpu: tar source {self.shards[0]}{' ...' if len(self.shards) > 1 else ''} has no "
                          f"label member ({', '.join('.' + x for x in LABEL_SUFFIXES)}), so every label is -1 "
                          f"(unlabeled); {other_labels} member(s) are {'/'.join('.' + x for x in OTHER_LABEL_FIELDS)}, "
                          "which feedgpu does not read labels from", stacklevel=2)
        if not keep.any():
            raise self._nothing_left(f"tar source: no samples left in {len(self.shards)} shard(s)"
                                      + (f" ({len(self.rejected)} left out while indexing)" if self.rejected else ""))
        blob = cat("blob", np.uint8)
        if not keep.all():
            blob = blob[np.repeat(keep, lens)]
        shard_ids = np.repeat(np.array([sid for sid, _ in parts], dtype=np.int64), counts)
        sel = slice(None) if keep.all() else keep
        self._store(StringTable.from_blob(blob, lens[sel]), shard_ids[sel], cat("offsets", np.int64)[sel],
                    cat("sizes", np.int64)[sel], labels[sel])
        parts.clear()
        del blob, lens, labels, shard_ids, keep, sel
        self.classes = (class_names(self.shards[0], self.labels) if self._remote is None else
                        class_names_from_text(self._remote.text_beside(CLASS_NAMES_FILE), self.labels))
        release_freed_memory()
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def _store(self, keys, shard_ids, offsets, sizes, labels) -> None:
        """The index arrays (``keys``: the image members' names, a :class:`StringTable` or strings), each in the narrowest dtype its values fit (:func:`index_array`:
        uint32 offsets and sizes in shards under 4 GiB), int64 labels (-2, no label, becomes -1).
        Samples come shard after shard, so a sample's shard is found from each shard's first
        sample (one int64 per shard) instead of an id per sample; ids out of that order are kept
        as an array."""
        self.members = keys if isinstance(keys, StringTable) else StringTable(keys)
        ids = index_array(shard_ids)
        if ids.size == 0 or bool((ids[1:] >= ids[:-1]).all()):
            self._shard_starts = np.searchsorted(ids, np.arange(int(ids.max(initial=0)) + 2)).astype(np.int64)
            self._shard_ids = None
        else:
            self._shard_starts, self._shard_ids = None, ids
        self.offsets = index_array(offsets)
        self.sizes = index_array(sizes)
        self.labels = np.maximum(np.asarray(labels, dtype=np.int64), -1)

    def _parts(self):
        """``(shard id, name, part | None)`` per shard, in order: a local shard's part from its saved
        index, the member table beside it, or indexed (:func:`~feedgpu.sources.tar.local.local_part`,
        several shards at once); a remote one's from the index file, the shard cache's saved index
        or the downloaded shard (None: it could not be downloaded)."""
        if self._remote is None:
            for sid, got in enumerate(ordered_map(partial(local_part, index_dir=self._index_dir), self.shards)):
                for note in got.notes:
                    warnings.warn(note, stacklevel=3)
                self.saved_shards += got.how == "saved"
                self.table_shards += got.how == "table"
                yield sid, self.shards[sid], dict(got.part, _table_problem=got.table_problem)
            return
        for sid, path, local in self._locals():
            if local is None or isinstance(local, dict):   # the index file's member table, or the cache's
                yield sid, path, local
                continue
            try:
                if self._remote.is_html(local):
                    raise SourceError("an HTML page")
                part = index_with_tarfile(path, local)
            except SourceError as e:   # not a tar (an HTML page?): named with the others
                why = self._remote.unreadable(path, local, e)
                self._remote.fail(path, why)
                self.reject(path, "bad shard", why)
                yield sid, path, None
                continue
            self._remote.cache.save_index(self._remote.files[sid].identity, "tar", part)
            yield sid, path, part

    def _locals(self):
        """``(shard id, URL, local path | member table | None)`` per remote shard: downloaded (up
        to the cache's ``max_downloads`` ahead, pinned until indexed) unless the index file holds
        its member table; one that cannot be downloaded is left out as ``"bad shard"`` (None)."""
        from ...remote.files import cause_of

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
            if f.identity is None:   # the store could not be reached for it: one file, named
                self.reject(f.url, "bad shard", f.error)
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
                self._remote.fail(f.url, cause_of(e))
                self.reject(f.url, "bad shard", str(e))
            finally:
                cache.unpin(f.url)

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

    @property
    def shard_ids(self) -> np.ndarray:
        """Each sample's shard (made on request: the index holds each shard's first sample)."""
        starts = self._shard_starts
        return self._shard_ids if self._shard_ids is not None else np.repeat(
            index_array(np.arange(len(starts) - 1)), np.diff(starts))

    def _shard_of(self, index: int) -> int:
        ids = self._shard_ids
        return int(ids[index]) if ids is not None else int(np.searchsorted(self._shard_starts, index, side="right")) - 1

    def key(self, index: int) -> str:
        return f"{self.shards[self._shard_of(index)]}:{self.members[index]}"

    def shard_of(self) -> np.ndarray:
        """The shard of each sample: its index in :attr:`shards` (int32, as :attr:`shard_ids`)."""
        return self.shard_ids

    def shard_names(self) -> list[str]:
        """The shards' paths, index = shard id."""
        return list(self.shards)

    def read(self, index: int) -> Record:
        sid = self._shard_of(index)
        data = os.pread(self._fd(sid, index), int(self.sizes[index]), int(self.offsets[index]))
        return Record(data, int(self.labels[index]), self.key(index))

    def _digest(self, h, stamps: bool = True) -> None:
        """Each shard's path, size and mtime, with ``stamps`` its change stamp too (device,
        inode, ``st_ctime_ns``: :func:`~feedgpu.sources.file_stats.change_stamp`); URLs: URL,
        size and ETag; the members' names and offsets."""
        if self._remote is not None:   # URL, size and ETag: the same on a machine with a new cache
            self._remote.digest(h)
        for p in self.shards if self._remote is None else ():
            st = os.stat(p)
            h.update(f"{os.path.abspath(p)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            if stamps:
                h.update(f"{change_stamp(st)}\0".encode())
        self._digest_index(h)

    def _digest_index(self, h) -> None:
        self.members.digest(h)
        h.update(self.offsets.astype(np.int64, copy=False).tobytes())   # as int64: fingerprints stay

    def _content_digest(self, h) -> None:
        """Each shard's path and the xxh3-128 of its bytes (URLs: URL, size and ETag), the
        members' names and offsets, and the labels."""
        if self._remote is not None:
            self._remote.digest(h)
        for p in self.shards if self._remote is None else ():
            h.update(f"{os.path.abspath(p)}\0{file_hash(p)}\0".encode())
        self._digest_index(h)
        h.update(self.labels.tobytes())

    def order_identity(self) -> str:
        """The shards' paths, sizes and mtimes, members and offsets (no change stamps: a loader
        state resumes on a copy of the shards that kept their mtimes)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.format.encode())
        self._digest(h, stamps=False)
        return h.hexdigest()

    def __del__(self):
        remote = getattr(self, "_remote", None)
        for sid, fd in getattr(self, "_fds", {}).items():
            try:
                os.close(fd)
            except OSError:
                pass
            if remote is not None and self._pid == os.getpid():
                remote.cache.unpin(self.shards[sid])
