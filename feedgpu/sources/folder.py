"""ImageFolder-style directory: ``root/<class>/<image>``, classes sorted by name.

The rules, and where they differ from ``torchvision.datasets.ImageFolder``:

* Classes are the sub-folders of ``root`` (symbolic links to folders included), sorted by name,
  as torchvision's ``find_classes``; files in ``root`` itself belong to no class and are not
  indexed (as in torchvision), with one warning naming the image files among them.
* Hidden entries (names starting with ``"."``: ``.ipynb_checkpoints``, ``.git``, macOS ``._x.jpg``
  files) are left out, at every level. torchvision makes a hidden folder a class (``.git`` sorts
  first, so every label after it moves by one; it then fails when the folder holds no image), and
  indexes hidden files and the images of hidden folders inside a class: feedgpu warns once,
  naming each hidden folder that holds images and each hidden image file (the first 20), so
  neither labels nor samples change silently.
* A class folder with no image file raises :class:`SourceError` naming it, as torchvision does
  (``FileNotFoundError: Found no valid file for the classes ...``); ``allow_empty=True`` keeps it
  as a class without samples (its label stays reserved, as torchvision's ``allow_empty``).
* Samples of a class are in torchvision's order (``sorted(os.walk(...))``: by folder path, then
  file name). Sub-folders, and symbolic links to folders, are followed (torchvision: ``os.walk(...,
  followlinks=True)``), each real folder once: a link back to a folder above it is left out with
  reason ``"symlink loop"``, a second path to a folder already indexed, or a link from one class
  into another class's folder, with ``"duplicate folder"`` (torchvision would loop, or index the
  files twice, once under the wrong class).
* A folder that cannot be listed (permissions) raises :class:`SourceError` naming it
  (``os.walk``, as torchvision uses it, skips it silently).
* Image files that cannot be indexed are left out, each named in :attr:`rejected`: a zero-byte
  file (``"empty"``), a link to nothing (``"dangling link"``) or to itself (``"symlink loop"``),
  something that is not a regular file, such as a FIFO (``"not a regular file"``), a file
  ``stat`` fails on (``"unreadable"``). torchvision indexes them and fails when they are read.
"""
from __future__ import annotations

import errno
import os
import stat
import warnings
from pathlib import Path

import numpy as np

from ..errors import SourceError
from .base import Record, Source, StringTable

#: File endings indexed by default (torchvision's IMG_EXTENSIONS without the rare ones).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".gif")


class FolderSource(Source):
    """Images under ``root/<class name>/...`` (sub-folders of a class are searched too; rules
    in the module docstring).

    Args:
        root: dataset directory.
        extensions: file endings to index, case-insensitive.
        allow_empty: keep class folders without images as classes (default False: raise).
        flat: index the image files of ``root`` and its sub-folders as one unlabeled set (label
            -1, no classes), as ``feedgpu scan`` reads a folder without class sub-folders.

    Records left out while indexing are in :attr:`rejected` (reasons in the module docstring)
    and warned about once each. Raises :class:`SourceError` when ``root`` is missing, has no
    class sub-folders, a class folder holds no image (unless ``allow_empty``), a folder cannot
    be listed, or no image is left.
    """

    format = "folder"

    def __init__(self, root: str | os.PathLike, extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
                 allow_empty: bool = False, flat: bool = False):
        super().__init__()
        self.root = Path(root)
        if not self.root.is_dir():
            raise SourceError(f"folder source: {self.root} is not a directory")
        self._exts = tuple(e.lower() for e in extensions)
        self._hidden: list[str] = []       # hidden folders holding images, for one warning
        self._visited: dict[tuple[int, int], str] = {}
        listed = _list(str(self.root))
        top = [e for e in listed if _is_dir(e)]
        loose = [e.path for e in listed if not flat and not e.name.startswith(".") and not _is_dir(e)
                 and e.name.lower().endswith(self._exts)]
        if loose and top:
            warnings.warn(f"feedgpu: {len(loose)} image file(s) in the dataset root {self.root} belong to no class "
                          f"and are not indexed (as in torchvision's ImageFolder): {', '.join(loose[:5])}"
                          + (" ..." if len(loose) > 5 else ""), stacklevel=2)
        self.classes = [e.name for e in top if not e.name.startswith(".")]
        for e in top:
            if e.name.startswith(".") and self._has_images(e.path):
                self._hidden.append(e.path)
        if not self.classes and not flat:
            raise SourceError(f"folder source: {self.root} has no class sub-folders (ImageFolder layout)")
        rel: list[str] = []
        labels: list[int] = []
        sizes: list[int] = []
        mtimes: list[int] = []
        empty: list[str] = []
        root_id = _dir_id(str(self.root))
        # a class's folders are its own: a link from inside another class to one is not followed
        self._class_dirs = {} if flat else {_dir_id(os.path.join(str(self.root), c)): c for c in self.classes}
        if flat:
            self.classes = []
            self._walk(str(self.root), root_id, set(), -1, rel, labels, sizes, mtimes)
            _torchvision_order(rel, sizes, mtimes, 0)
        for label, cls in enumerate(self.classes):
            before = len(rel) + len(self.rejected)
            start = len(rel)
            top_dir = os.path.join(str(self.root), cls)
            self._walk(top_dir, _dir_id(top_dir), {root_id}, label, rel, labels, sizes, mtimes, is_class=True)
            _torchvision_order(rel, sizes, mtimes, start)
            if len(rel) + len(self.rejected) == before:
                empty.append(cls)
        if empty and not allow_empty:
            raise SourceError(f"folder source: no images (endings {', '.join(self._exts)}) in the class "
                              f"folder(s) {', '.join(empty)} under {self.root}; remove them, or pass "
                              "allow_empty=True to keep them as classes without samples")
        if self._hidden:
            more = len(self._hidden) - 20
            warnings.warn(f"feedgpu: left out hidden folder(s) holding images and hidden image file(s), "
                          f"{len(self._hidden)} in all: {', '.join(self._hidden[:20])}" + (f" and {more} more" if more > 0 else "")
                          + " (torchvision's ImageFolder indexes them: a hidden folder under the root becomes a "
                          "class, moving the labels after it)", stacklevel=2)
        if not rel:
            raise self._nothing_left(f"folder source: no images with endings {self._exts} under {self.root}"
                                      + (f" ({len(self.rejected)} left out while indexing)" if self.rejected else ""))
        self._warn_rejected()
        self.paths = StringTable(rel)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.mtimes = np.asarray(mtimes, dtype=np.int64)

    def _walk(self, top: str, ident, ancestors: set, label: int, rel, labels, sizes, mtimes,
              is_class: bool = False) -> None:
        """Index ``top``'s image files, then its sub-folders (depth first); the caller puts them in
        torchvision's order (:func:`_torchvision_order`)."""
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
        entries = _list(top)
        subdirs = []
        for e in entries:
            if e.name.startswith("."):
                if _is_dir(e) and self._has_images(e.path) or e.name.lower().endswith(self._exts):
                    self._hidden.append(e.path)
                continue
            if _is_dir(e):
                subdirs.append(e)
                continue
            if not e.name.lower().endswith(self._exts):
                continue
            path = e.path
            try:
                st = os.stat(path)
            except OSError as err:
                if err.errno == errno.ELOOP:
                    self.reject(path, "symlink loop", str(err))
                elif err.errno == errno.ENOENT and os.path.islink(path):
                    self.reject(path, "dangling link", f"links to {os.readlink(path)!r}, which does not exist")
                else:
                    self.reject(path, "unreadable", str(err))
                continue
            if not stat.S_ISREG(st.st_mode):
                self.reject(path, "not a regular file")
                continue
            if st.st_size == 0:
                self.reject(path, "empty")
                continue
            rel.append(os.path.relpath(path, self.root))
            labels.append(label)
            sizes.append(st.st_size)
            mtimes.append(st.st_mtime_ns)
        inner = ancestors | {ident}
        for e in subdirs:
            self._walk(e.path, _dir_id(e.path), inner, label, rel, labels, sizes, mtimes)

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

    def _digest(self, h) -> None:
        self.paths.digest(h)
        h.update(self.sizes.tobytes())
        h.update(self.mtimes.tobytes())
        h.update(self.labels.tobytes())


def _torchvision_order(rel: list, sizes: list, mtimes: list, start: int) -> None:
    """Put ``rel[start:]`` (one class's files, with their sizes and mtimes) in torchvision's order:
    ``sorted(os.walk(...))`` sorts by folder path, then file name, so ``sub-a/x.jpg`` comes before
    ``sub/deep/y.jpg`` ("-" sorts before "/"), which a depth-first walk does not give."""
    order = sorted(range(start, len(rel)), key=lambda i: os.path.split(rel[i]))
    if order != list(range(start, len(rel))):
        for seq in (rel, sizes, mtimes):
            seq[start:] = [seq[i] for i in order]


def _list(top: str) -> list:
    """``top``'s entries sorted by name; :class:`SourceError` when it cannot be listed."""
    try:
        with os.scandir(top) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise SourceError(f"folder source: cannot list the folder {top}: {e.strerror or e}; "
                          "its images would be missing from the dataset") from None


def _is_dir(entry) -> bool:
    try:
        return entry.is_dir()   # follows symbolic links
    except OSError:             # a link loop: not a folder (indexed, or rejected, as a file)
        return False


def _dir_id(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
