"""ImageFolder-style directory: ``root/<class>/<image>``, classes sorted by name."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import SourceError
from .base import Record, Source, StringTable

#: File endings indexed by default (torchvision's IMG_EXTENSIONS without the rare ones).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".gif")


class FolderSource(Source):
    """Images under ``root/<class name>/...`` (sub-folders of a class are searched too).

    Args:
        root: dataset directory.
        extensions: file endings to index, case-insensitive.

    Empty files are found here, while indexing, and left out of the index with reason
    ``"empty"`` (listed in :attr:`rejected`). Raises :class:`SourceError` when ``root`` is
    missing or holds no image.
    """

    format = "folder"

    def __init__(self, root: str | os.PathLike, extensions: tuple[str, ...] = IMAGE_EXTENSIONS):
        super().__init__()
        self.root = Path(root)
        if not self.root.is_dir():
            raise SourceError(f"folder source: {self.root} is not a directory")
        exts = tuple(e.lower() for e in extensions)
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not self.classes:
            raise SourceError(f"folder source: {self.root} has no class sub-folders (ImageFolder layout)")
        rel: list[str] = []
        labels: list[int] = []
        sizes: list[int] = []
        mtimes: list[int] = []
        for label, cls in enumerate(self.classes):
            for dirpath, dirnames, filenames in os.walk(self.root / cls, followlinks=False):
                dirnames.sort()
                for name in sorted(filenames):
                    if not name.lower().endswith(exts):
                        continue
                    path = os.path.join(dirpath, name)
                    st = os.stat(path)
                    r = os.path.relpath(path, self.root)
                    if st.st_size == 0:
                        self.rejected.append((path, "empty"))
                        continue
                    rel.append(r)
                    labels.append(label)
                    sizes.append(st.st_size)
                    mtimes.append(st.st_mtime_ns)
        if not rel:
            raise SourceError(f"folder source: no images with endings {exts} under {self.root}")
        self._warn_rejected()
        self.paths = StringTable(rel)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.mtimes = np.asarray(mtimes, dtype=np.int64)

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
