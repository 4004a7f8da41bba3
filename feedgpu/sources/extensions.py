"""The file endings feedgpu's sources read, in one place, and the listing of a folder given as a
tar or Parquet source.

Endings are matched case-insensitively everywhere (``.JPG``, ``.Tar``, ``.PARQUET``).

* Images (:data:`IMAGE_EXTENSIONS`): the files a folder source indexes, the image members of a
  tar shard (``<key>.<ext>``), the files ``feedgpu convert`` writes into tar shards.
* Tar shards (:data:`TAR_EXTENSIONS`): plain tar, in the folder itself (shards in its
  sub-folders are named in the warning, not read). Compressed shards
  (:data:`COMPRESSED_TAR_EXTENSIONS`) cannot be read by random access: a folder holding them is
  refused, naming them.
* Parquet files (:data:`PARQUET_EXTENSIONS`), in the folder and its sub-folders, as pyarrow's
  datasets find them.

A folder's other files are left out with one warning naming them, except the ones that are
feedgpu's or the writers' own (names starting with ``"_"`` or ``"."``, as pyarrow's datasets skip
them: ``_classes.txt``, ``_index.json``, ``_SUCCESS``, ``.part-0.parquet.crc``; tar member tables
``*.feedgpu-index``).
"""
from __future__ import annotations

import os
import warnings

from ..errors import SourceError

#: Image file endings (torchvision's IMG_EXTENSIONS without the rare ones).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".gif")
#: The same without the dot: the image fields of a tar sample (``<key>.jpg``).
IMAGE_FIELDS = tuple(e[1:] for e in IMAGE_EXTENSIONS)
TAR_EXTENSIONS = (".tar",)
COMPRESSED_TAR_EXTENSIONS = (".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tbz2", ".tar.xz", ".txz", ".tar.zst",
                             ".tzst", ".tar.lz4")
PARQUET_EXTENSIONS = (".parquet", ".parq", ".pq")
#: Files beside shards that belong to feedgpu (member tables), left out without a word.
COMPANION_SUFFIXES = (".feedgpu-index",)


def is_image(name: str) -> bool:
    """Whether a file name ends with one of :data:`IMAGE_EXTENSIONS`, in any case."""
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _quiet(name: str) -> bool:
    return name[:1] in ("_", ".") or name.lower().endswith(COMPANION_SUFFIXES)


def _names(paths: list[str], listed: int = 10) -> str:
    paths = sorted(paths)
    return ", ".join(paths[:listed]) + (" ..." if len(paths) > listed else "")


def list_folder(folder: str, kind: str) -> list[str]:
    """The files of ``folder`` a ``kind`` source (``"tar"`` or ``"parquet"``) reads, sorted by
    their path relative to the folder: ``*.tar`` in the folder (not hidden); ``*.parquet``,
    ``*.parq``, ``*.pq`` in it and its sub-folders (names starting with ``"."`` or ``"_"`` left
    out, files and folders, as pyarrow's datasets do). Endings in any case.

    Warns once, naming them, about the other files left out (and a tar folder's shards in
    sub-folders, which are not read: a ``train/`` beside a ``val/`` is another split). Raises :class:`SourceError` naming
    the compressed tar shards a tar folder holds (random access needs plain tar)."""
    exts = TAR_EXTENSIONS if kind == "tar" else PARQUET_EXTENSIONS
    found, compressed, other, nested = [], [], [], []
    seen: set = set()   # folders walked, by (device, inode): a link back up is not followed again
    for top, dirs, files in os.walk(folder, followlinks=kind == "parquet"):
        try:
            st = os.stat(top)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = sorted(d for d in dirs if not _quiet(d))
        for name in files:
            path = os.path.join(top, name)
            low = name.lower()
            if top != folder and kind == "tar":   # shards in sub-folders: named, not read
                if low.endswith(exts + COMPRESSED_TAR_EXTENSIONS) and not _quiet(name):
                    nested.append(path)
            elif low.endswith(exts) and not name.startswith("." if kind == "tar" else (".", "_")):
                found.append(path)
            elif kind == "tar" and low.endswith(COMPRESSED_TAR_EXTENSIONS):
                compressed.append(path)
            elif not _quiet(name) and not (kind == "parquet" and low.endswith(exts)):
                other.append(path)
    if compressed:
        compressed.sort()
        raise SourceError(f"tar source: {len(compressed)} compressed shard(s) in {folder}, which cannot be read "
                          f"by random access: {', '.join(compressed[:10])}" + (" ..." if len(compressed) > 10 else "")
                          + "; decompress them to plain .tar shards (gunzip, bunzip2, xz -d, zstd -d, "
                          "lz4 -d) in a folder without them, or name the plain shards by a glob or a list")
    parts = []
    if other:
        what = "tar shards (.tar)" if kind == "tar" else f"Parquet files ({', '.join(PARQUET_EXTENSIONS)})"
        parts.append(f"{len(other)} file(s) that are not {what}: {_names(other)}")
    if nested:
        parts.append(f"{len(nested)} shard(s) in sub-folders (give the sub-folder, a glob or a list to read "
                     f"them): {_names(nested)}")
    if parts:
        warnings.warn(f"feedgpu: {kind} source {folder}: left out " + "; ".join(parts), stacklevel=4)
    return sorted(found, key=lambda p: os.path.relpath(p, folder).split(os.sep))
