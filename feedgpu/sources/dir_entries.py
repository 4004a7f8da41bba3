"""Listing folders for the folder source: entries, whether an entry is a folder, a folder's
identity."""
from __future__ import annotations

import operator
import os

from ..errors import SourceError

name_of = operator.attrgetter("name")


def list_dir(top: str, sort: bool = True) -> list:
    """``top``'s entries (``os.DirEntry``, sorted by name); :class:`SourceError` when it cannot be listed."""
    try:
        with os.scandir(top) as it:
            return sorted(it, key=name_of) if sort else list(it)
    except OSError as e:
        raise SourceError(f"folder source: cannot list the folder {top}: {e.strerror or e}; "
                          "its images would be missing from the dataset") from None


def is_dir(entry) -> bool:
    """Whether an entry is a folder, following symbolic links (False for a link loop)."""
    try:
        return entry.is_dir()   # follows symbolic links
    except OSError:             # a link loop: not a folder (indexed, or rejected, as a file)
        return False


def dir_id(path: str):
    """``(st_dev, st_ino)`` of a folder, None when ``stat`` fails."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
