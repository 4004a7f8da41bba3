"""ImageFolder-style directory: ``root/<class>/<image>``, classes sorted by name.

The rules, and where they differ from ``torchvision.datasets.ImageFolder``:

* Classes are the sub-folders of ``root`` (symbolic links to folders included), sorted by name,
  as torchvision's ``find_classes``; files in ``root`` itself belong to no class and are not
  indexed (as in torchvision).
* Hidden entries (names starting with ``"."``: ``.ipynb_checkpoints``, ``.git``, macOS ``._x.jpg``
  files) are left out, at every level. torchvision makes a hidden folder a class (``.git`` sorts
  first, so every label after it moves by one; it then fails when the folder holds no image):
  feedgpu warns once, naming each hidden folder that holds images, so labels never move silently.
* A class folder with no image file raises :class:`SourceError` naming it, as torchvision does
  (``FileNotFoundError: Found no valid file for the classes ...``); ``allow_empty=True`` keeps it
  as a class without samples (its label stays reserved, as torchvision's ``allow_empty``).
* Sub-folders, and symbolic links to folders, are followed (torchvision: ``os.walk(...,
  followlinks=True)``), each real folder once: a link back to a folder above it is left out with
  reason ``"symlink loop"``, a second path to a folder already indexed, or a link from one class
  into another class's folder, with ``"duplicate folder"`` (torchvision would loop, or index the
  files twice, once under the wrong class).
* A folder that cannot be listed (permissions) raises :class:`SourceError` naming it
  (``os.walk``, as torchvision uses it, skips it silently).
* Files whose endings are not image endings (:data:`~feedgpu.sources.extensions.IMAGE_EXTENSIONS`,
  any case, or ``extensions``) are left out with one warning naming the first of them (torchvision
  skips them silently; a folder of ``.heic`` photos would lose them without a word).
* Image files that cannot be indexed are left out, each named in :attr:`rejected`: a zero-byte
  file (``"empty"``), a link to nothing (``"dangling link"``) or to itself (``"symlink loop"``),
  something that is not a regular file, such as a FIFO (``"not a regular file"``), a file
  ``stat`` fails on (``"unreadable"``). torchvision indexes them and fails when they are read.
  With ``stat_files=False`` regular files are not ``stat``-ed while indexing (their type comes
  from the folder listing): a zero-byte one is then counted as ``"empty"`` when it is read. The
  default, ``"auto"``, stats them when the listing holds at most
  :data:`~feedgpu.sources.file_stats.AUTO_MAX` image files and lists only above that.

The index (paths relative to ``root`` as one UTF-8 blob with int64 offsets, int64 labels, sizes
and mtimes) is numpy buffers only, so forked workers share it without copy-on-read growth. It is
saved beside feedgpu's cache and used again while the tree is unchanged (what "unchanged" means,
and what a file rewritten in place does: :mod:`feedgpu.sources.folder_index`).
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
import warnings
from array import array
from pathlib import Path

import numpy as np

from ..errors import SourceError
from . import file_stats
from . import folder_index as _index
from .base import Record, Source, StringTable, file_hash
from .dir_entries import dir_id as _dir_id, is_dir as _is_dir, list_dir as _list, name_of as _name
from .extensions import IMAGE_EXTENSIONS

_LISTED = 10   # files with other endings named in the warning
from .folder_index import saved_index_file



class FolderSource(Source):
    """Images under ``root/<class name>/...`` (sub-folders of a class are searched too; rules
    in the module docstring).

    Args:
        root: dataset directory.
        extensions: file endings to index, case-insensitive.
        allow_empty: keep class folders without images as classes (default False: raise).
        flat: index the image files of ``root`` and its sub-folders as one unlabeled set (label
            -1, no classes), as ``feedgpu scan`` reads a folder without class sub-folders.
        stat_files: True: ``stat`` each image file while indexing, so zero-byte files
            are index-time rejects (``"empty"``) and sizes and mtimes are known. ``"auto"``
            (default): True for a listing of at most :data:`~feedgpu.sources.file_stats.AUTO_MAX`
            image files, False above (logged at INFO). False lists the
            folders only (file types from the listing; links and entries of unknown type are
            still ``stat``-ed and rejected as above): a zero-byte file is then a counted skip
            with reason ``"empty"`` when it is read, as in a Parquet source, and sizes and
            mtimes are read on first use of :attr:`sizes`, :attr:`mtimes` or :meth:`identity`.
        index_dir: where the saved index lives (:mod:`feedgpu.sources.folder_index`); None: the
            ``folder-index`` folder of feedgpu's cache dir; False: neither read nor write one.

    Attributes:
        paths: :class:`StringTable` of the files' paths relative to ``root`` (one UTF-8 blob and
            int64 offsets).
        labels: int64 array, one per file.
        sizes, mtimes: int64 arrays (bytes, ns), one per file, as on disk when first used: from
            the walk, else (``stat_files=False``, or an index read from a saved file) from a
            ``stat`` of every file at first access. -1 for a file gone since indexing.
        from_saved_index: True when the index was read from a saved file (no walk).

    Records left out while indexing are in :attr:`rejected` (reasons in the module docstring)
    and warned about once each. Raises :class:`SourceError` when ``root`` is missing, has no
    class sub-folders, a class folder holds no image (unless ``allow_empty``), a folder cannot
    be listed, or no image is left.
    """

    format = "folder"

    def __init__(self, root: str | os.PathLike, extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
                 allow_empty: bool = False, flat: bool = False, stat_files: bool | str = "auto",
                 index_dir: str | os.PathLike | bool | None = None):
        super().__init__()
        self.root = Path(root)
        if not self.root.is_dir():
            raise SourceError(f"folder source: {self.root} is not a directory")
        self._exts = tuple(e.lower() for e in extensions)
        if stat_files not in (True, False, "auto"):
            raise ValueError(f"folder source: stat_files must be True, False or 'auto', not {stat_files!r}")
        self._stat_files = stat_files
        self._hidden: list[str] = []       # hidden folders holding images, for one warning
        self._other: list = [0, []]        # files with other endings: how many, the first few (relative)
        self._index_file: Path | None = None
        self._sizes = self._mtimes = self._stamps = None  # None: not read yet (see the sizes property)
        self._stats_fresh = False
        root_s = str(self.root)
        key = ""
        if index_dir is not False:
            self._index_file = saved_index_file(root_s, index_dir, self._exts, allow_empty, flat, stat_files)
            key = self._index_file.stem
            saved = _index.load(self._index_file, root_s, key)
            if saved is not None:
                self._open_saved(*saved)
                return
        start = _index.now_ns()
        self._build(allow_empty, flat)
        if self._index_file is not None:
            self._save(key, start)
        for name in ("_visited", "_dirs", "_links", "_chunks", "_class_dirs", "_hidden_rel", "_pending"):
            delattr(self, name)   # the walk's bookkeeping: not kept (nor pickled to workers)
        self._warn_index(stacklevel=3)

    # -- sizes and mtimes -------------------------------------------------------------------------
    @property
    def sizes(self) -> np.ndarray:
        if not self._stats_fresh:
            self._refresh_stats()
        return self._sizes

    @property
    def mtimes(self) -> np.ndarray:
        if not self._stats_fresh:
            self._refresh_stats()
        return self._mtimes

    @property
    def stamps(self) -> np.ndarray:
        """Each file's :func:`~feedgpu.sources.file_stats.change_stamp` (device, inode,
        ``st_ctime_ns``; int64), read with :attr:`sizes`."""
        if not self._stats_fresh:
            self._refresh_stats()
        return self._stamps

    def _refresh_stats(self) -> None:
        """``stat`` every file; when they differ from what the saved index holds, remove the
        saved file, so the next run indexes afresh."""
        sizes, mtimes, _, stamps = file_stats.stat_paths(self._prefix(), self.paths.blob, self.paths.offsets)
        if self._sizes is not None and not (np.array_equal(sizes, self._sizes)
                                            and np.array_equal(mtimes, self._mtimes)):
            if self._index_file is not None and self.from_saved_index:
                _index.discard(self._index_file)
        self._sizes, self._mtimes, self._stamps = sizes, mtimes, stamps
        self._stats_fresh = True

    # -- a saved index --------------------------------------------------------------------------
    def _save(self, key: str, start: int) -> None:
        root_s = str(self.root)
        keys = [k for k, _ in self.rejected] + self._links
        meta = {"key": key, "classes": self.classes, "hidden": self._hidden_rel, "other": self._other,
                "rejected": [[_rel(k, root_s), r] for k, r in self.rejected],
                "details": {_rel(k, root_s): d for k, d in self.rejected_details.items()},
                "dirs": self._dirs, "watch": [[_rel(k, root_s), _index.file_sig(k)] for k in keys]}
        empty = np.zeros(0, np.int64)
        arrays = {"offsets": self.paths.offsets, "blob": self.paths.blob, "labels": self.labels,
                  "sizes": self._sizes if self._sizes is not None else empty,
                  "mtimes": self._mtimes if self._mtimes is not None else empty}
        try:
            _index.save(self._index_file, meta, arrays, start)
        except OSError as e:
            warnings.warn(f"feedgpu: could not save the folder index to {self._index_file} ({e}); "
                          "the next run indexes the folder again", stacklevel=4)

    def _open_saved(self, meta: dict, arrays: dict) -> None:
        root_s = str(self.root)
        self.from_saved_index = True
        self.classes = list(meta["classes"])
        self._hidden = [os.path.join(root_s, h) for h in meta["hidden"]]
        self._other = meta.get("other", [0, []])
        for rel, reason in meta["rejected"]:
            self.reject(os.path.join(root_s, rel), reason, meta["details"].get(rel, ""))
        self.paths = StringTable.__new__(StringTable)
        self.paths.offsets, self.paths.blob = arrays["offsets"], arrays["blob"]
        self.labels = arrays["labels"]
        if len(arrays["sizes"]) == len(self.labels):   # checked against the disk on first use
            self._sizes, self._mtimes = arrays["sizes"], arrays["mtimes"]
        self._warn_index(stacklevel=4)

    def _warn_index(self, stacklevel: int) -> None:
        self._warn_hidden(stacklevel + 1)
        self._warn_rejected()
        n, first = self._other
        if n:
            warnings.warn(f"feedgpu: folder source {self.root}: left out {n} file(s) whose endings are not among "
                          f"{', '.join(self._exts)} (any case): {', '.join(first)}" + (" ..." if n > len(first) else "")
                          + "; pass extensions= to read other endings", stacklevel=stacklevel)

    def _warn_hidden(self, stacklevel: int) -> None:
        if self._hidden:
            more = len(self._hidden) - 20
            warnings.warn(f"feedgpu: left out hidden folder(s) holding images and hidden image file(s), "
                          f"{len(self._hidden)} in all: {', '.join(self._hidden[:20])}"
                          + (f" and {more} more" if more > 0 else "")
                          + " (torchvision's ImageFolder indexes them: a hidden folder under the root becomes a "
                          "class, moving the labels after it)", stacklevel=stacklevel)

    # -- a walk ---------------------------------------------------------------------------------
    def _build(self, allow_empty: bool, flat: bool) -> None:
        self.from_saved_index = False
        root_s = str(self.root)
        self._visited: dict[tuple[int, int], str] = {}
        self._dirs: list[list] = []        # [rel, dev, ino, mtime_ns] of every folder walked
        self._links: list[str] = []        # indexed files that are symbolic links
        # the index as it grows, in buffers that grow in place (no per-folder copies kept)
        self._chunks = (bytearray(), array("q"), array("q"))  # paths, lengths, labels
        self._n = 0
        self._pending: list[tuple] = []    # one class's folders, walked, until put in order
        listed = _list(root_s)
        top = [e for e in listed if _is_dir(e)]
        loose = [e.path for e in listed if not flat and not e.name.startswith(".") and not _is_dir(e)
                 and e.name.lower().endswith(self._exts)]
        if loose and top:
            warnings.warn(f"feedgpu: {len(loose)} image file(s) in the dataset root {self.root} belong to no class "
                          f"and are not indexed (as in torchvision's ImageFolder): {', '.join(loose[:5])}"
                          + (" ..." if len(loose) > 5 else ""), stacklevel=4)
        self.classes = [e.name for e in top if not e.name.startswith(".")]
        self._hidden_rel: list[str] = []
        for e in top:
            if e.name.startswith("."):
                self._note_dir(e.path, e.name)
                if self._has_images(e.path):
                    self._hidden.append(e.path)
                    self._hidden_rel.append(e.name)
        if not self.classes and not flat:
            raise SourceError(f"folder source: {self.root} has no class sub-folders (ImageFolder layout)")
        empty: list[str] = []
        root_id = self._note_dir(root_s, "")
        # a class's folders are its own: a link from inside another class to one is not followed
        self._class_dirs = {} if flat else {_dir_id(os.path.join(root_s, c)): c for c in self.classes}
        if flat:
            self.classes = []
            self._walk(root_s, root_id, set(), -1)
            self._flush_pending()
        for label, cls in enumerate(self.classes):
            before = self._n + len(self.rejected)
            top_dir = os.path.join(root_s, cls)
            self._walk(top_dir, _dir_id(top_dir), {root_id}, label, is_class=True)
            self._flush_pending()
            if self._n + len(self.rejected) == before:
                empty.append(cls)
        if empty and not allow_empty:
            raise SourceError(f"folder source: no images (endings {', '.join(self._exts)}) in the class "
                              f"folder(s) {', '.join(empty)} under {self.root}; remove them, or pass "
                              "allow_empty=True to keep them as classes without samples")
        blob, lens, labels = self._chunks
        self.paths = StringTable.__new__(StringTable)
        self.paths.offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(lens, np.int64), out=self.paths.offsets[1:])
        self.paths.blob = np.frombuffer(blob, dtype=np.uint8)
        self.labels = np.frombuffer(labels, np.int64)
        if self._stat_files == "auto":
            self._stat_files = self._n <= file_stats.AUTO_MAX
            if not self._stat_files:
                file_stats.log.info("folder source %s: %d image files, more than %d: listed, not stat-ed "
                                    "(stat_files='auto'); a zero-byte file is counted as 'empty' when read "
                                    "(stat_files=True finds them now)", self.root, self._n, file_stats.AUTO_MAX)
        if self._stat_files:
            self._stat_indexed()   # leaves out the files found empty, gone or not regular
        if not self._n:
            self._warn_hidden(stacklevel=5)
            raise self._nothing_left(f"folder source: no images with endings {self._exts} under {self.root}"
                                      + (f" ({len(self.rejected)} left out while indexing)" if self.rejected else ""))

    def _stat_indexed(self) -> None:
        """``stat`` every listed file (in forked processes when there are many,
        :mod:`.file_stats`): sizes and mtimes, and each file found empty, gone or not a regular
        file is left out, with the reason a ``stat`` in the walk gives (:meth:`_classify`)."""
        sizes, mtimes, kinds, stamps = file_stats.stat_paths(self._prefix(), self.paths.blob, self.paths.offsets)
        bad = (kinds != 0) | (sizes == 0)
        if bad.any():
            for i in np.flatnonzero(bad).tolist():
                path, kind = self.key(i), int(kinds[i])
                if kind == 0:
                    self.reject(path, "empty")
                elif kind == file_stats.NOT_REGULAR:
                    self.reject(path, "not a regular file")
                else:
                    self._reject_stat_error(path, OSError(kind, os.strerror(kind), path))
            keep = ~bad
            lens = np.diff(self.paths.offsets)
            self.paths.blob = self.paths.blob[np.repeat(keep, lens)]
            self.paths.offsets = np.zeros(int(keep.sum()) + 1, np.int64)
            np.cumsum(lens[keep], out=self.paths.offsets[1:])
            self.labels, sizes, mtimes, stamps = self.labels[keep], sizes[keep], mtimes[keep], stamps[keep]
            self._n = len(self.labels)
        self._sizes, self._mtimes, self._stamps = sizes, mtimes, stamps
        self._stats_fresh = True

    def _prefix(self) -> bytes:
        return os.fsencode(str(self.root)) + os.sep.encode()

    def _flush_pending(self) -> None:
        """Append the walked folders of one class in torchvision's order: ``sorted(os.walk(...))``
        sorts by folder path, so ``sub-a/`` comes before ``sub/deep/`` ("-" sorts before "/"),
        which a depth-first walk does not give; each folder's files are sorted by name."""
        c = self._chunks
        for _, text, lens, label in sorted(self._pending, key=lambda t: t[0]):
            c[0].extend(text.encode("utf-8", "surrogateescape"))
            c[1].frombytes(lens.tobytes())
            c[2].frombytes(np.full(len(lens), label, np.int64).tobytes())
        self._pending = []

    def _note_other(self, paths: list[str]) -> None:
        if paths:
            self._other[0] += len(paths)
            self._other[1].extend(_rel(p, str(self.root)) for p in paths[:_LISTED - len(self._other[1])])

    def _note_hidden(self, path: str) -> None:
        self._hidden.append(path)
        self._hidden_rel.append(path[len(str(self.root)) + 1:])

    def _note_dir(self, top: str, rel: str):
        """``top``'s ``(dev, ino)``; its mtime is noted for the saved index's check (None if stat fails)."""
        sig = _index.dir_sig(top)
        if sig is None:
            return None
        self._dirs.append([rel, *sig])
        return sig[0], sig[1]

    def _walk(self, top: str, ident, ancestors: set, label: int, is_class: bool = False) -> None:
        """Index ``top``'s image files (sorted), then its sub-folders (sorted, depth first)."""
        if ident is not None:
            if ident in ancestors:
                self.reject(top, "symlink loop", "a link to a folder above it")
                return
            if not is_class and ident in self._class_dirs:
                self.reject(top, "duplicate folder", f"the class folder {self._class_dirs[ident]!r}: its images "
                            "keep their own class")
                return
            if ident in self._visited:
                self.reject(top, "duplicate folder", f"the same folder as {self._visited[ident]}, indexed once")
                return
            self._visited[ident] = top
        root_s = str(self.root)
        rel = top[len(root_s) + 1:] if top != root_s else ""
        if rel:
            self._note_dir(top, rel)
        exts = self._exts
        subdirs, names = [], []
        entries = _list(top, sort=False)
        # regular files by the listing's file type (a syscall only where it gives none), not
        # stat-ed here (:meth:`_stat_indexed` does, after the walk); the rest (folders, links,
        # other types) go through the loop below
        try:
            files = [e for e in entries if e.is_file(follow_symlinks=False) and e.name.lower().endswith(exts)]
            self._note_other([e.path for e in entries if e.name[0] != "." and e.is_file(follow_symlinks=False)
                              and not e.name.lower().endswith(exts)])
            names = [e.name for e in files if e.name[0] != "."]
            for e in files:
                if e.name[0] == ".":
                    self._note_hidden(e.path)
            entries = sorted((e for e in entries if not e.is_file(follow_symlinks=False)), key=_name)
        except OSError:
            names = []
            entries.sort(key=_name)
        for e in entries:
            name = e.name
            if name[:1] == ".":
                if (_is_dir(e) and self._has_images(e.path)) or name.lower().endswith(exts):
                    self._note_hidden(e.path)   # torchvision indexes these: named in one warning
                continue
            if _is_dir(e):
                subdirs.append(e)
                continue
            if not name.lower().endswith(exts):
                self._note_other([e.path])
                continue
            if not e.is_symlink():
                if e.is_file(follow_symlinks=False):
                    names.append(name)
                else:
                    self._classify(e)
                continue
            if self._classify(e) is None:
                continue
            self._links.append(e.path)
            names.append(name)
        if names:
            names.sort()
            prefix = rel + os.sep if rel else ""
            text = prefix + prefix.join(names) if prefix else "".join(names)
            if text.isascii():   # one byte per character
                lens = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
            else:
                lens = np.fromiter((len(n.encode("utf-8", "surrogateescape")) for n in names),
                                   dtype=np.int64, count=len(names))
            lens += len(prefix.encode("utf-8", "surrogateescape"))
            self._pending.append((top, text, lens, label))
            self._n += len(names)
        inner = ancestors | {ident}
        for e in subdirs:
            self._walk(e.path, _dir_id(e.path), inner, label)

    def _classify(self, e):
        """The followed ``stat`` of an image file worth indexing, else None (it is rejected)."""
        path = e.path
        try:
            st = e.stat()
        except OSError as err:
            self._reject_stat_error(path, err)
            return None
        if not stat.S_ISREG(st.st_mode):
            self.reject(path, "not a regular file")
            return None
        if st.st_size == 0:
            self.reject(path, "empty")
            return None
        return st

    def _reject_stat_error(self, path: str, err: OSError) -> None:
        if err.errno == errno.ELOOP:
            self.reject(path, "symlink loop", str(err))
        elif err.errno == errno.ENOENT and os.path.islink(path):
            self.reject(path, "dangling link", f"links to {os.readlink(path)!r}, which does not exist")
        else:
            self.reject(path, "unreadable", str(err))

    def _has_images(self, top: str, look: int = 10_000) -> bool:
        """Whether a hidden folder holds image files (for the warning), looking at up to ``look``
        names (a ``.git`` folder can hold many)."""
        for _, _, files in os.walk(top):
            if any(f.lower().endswith(self._exts) for f in files):
                return True
            look -= len(files) + 1
            if look <= 0:
                return False
        return False

    def key(self, index: int) -> str:
        return os.path.join(str(self.root), self.paths[index])

    def local_file(self, index: int) -> tuple[str, int]:
        return self.key(index), int(self.labels[index])

    def read(self, index: int) -> Record:
        path = self.key(index)
        with open(path, "rb") as f:
            data = f.read()
        return Record(data, int(self.labels[index]), path)

    def order_identity(self) -> str:
        """Paths and labels only (see :meth:`Source.order_identity`): the contents' sizes and
        mtimes belong to the cache's fingerprint, not to a loader state's."""
        h = hashlib.blake2b(digest_size=16)
        h.update(b"folder-order")
        self.paths.digest(h)
        h.update(self.labels.tobytes())
        return h.hexdigest()

    def _digest(self, h) -> None:
        """Paths, labels, and each file's size, mtime and change stamp (device, inode,
        ``st_ctime_ns``), ``stat``-ed afresh on a source opened from a saved index."""
        self.paths.digest(h)
        h.update(self.sizes.tobytes())
        h.update(self.mtimes.tobytes())
        h.update(self.stamps.tobytes())
        h.update(self.labels.tobytes())

    def _content_digest(self, h) -> None:
        """Paths, labels and the xxh3-128 of every file's bytes (each file read whole)."""
        self.paths.digest(h)
        h.update(self.labels.tobytes())
        h.update("\0".join(file_hash(self.key(i)) for i in range(len(self))).encode())


def _rel(key: str, root: str) -> str:
    return key[len(root) + 1:] if key.startswith(root + os.sep) else os.path.relpath(key, root)
