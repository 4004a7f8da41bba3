"""The class names of a source whose labels are integers (tar shards, Parquet files).

A label is any int64 in ``[0, 2**63 - 1]``, so the names are never made for every integer from
0 to the largest label: :class:`ClassNames` holds the labels that occur (one sorted int64 array,
memory and time in proportion to the samples) and gives a label's name when it is asked for.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np


class ClassNames(Sequence):
    """Class names indexed by label, made on request.

    Args:
        labels: the source's labels (int64 array; -1, no label, is not a class).
        names: the names given beside the data (:data:`~feedgpu.sources.base.CLASS_NAMES_FILE`,
            one per label from 0), or None: a label's name is the label as text (``"7"``).

    ``classes[label]`` is the name of ``label`` (``str``; negative indexes count from the end,
    slices give lists), for every label in ``[0, size)``. ``len(classes)`` is :attr:`size`, the
    largest label + 1 (as torchvision's ``classes``: index = label), or the number of names given
    when that is more; Python cannot take ``len()`` of more than ``sys.maxsize`` items, so for a
    source holding the label ``2**63 - 1`` ``len()`` raises :class:`OverflowError` and
    :attr:`size` is the number. :attr:`present` is the sorted labels that occur (int64 array),
    :meth:`occurring` their names. Iterating goes through every label from 0: use
    :meth:`occurring` for sparse labels. Equal to any sequence of the same names
    (``classes == ["0", "1"]``). ``named`` is True when the names came from a names file.
    """

    def __init__(self, labels: np.ndarray, names: list[str] | None = None):
        labels = np.asarray(labels, dtype=np.int64)
        self.present = np.unique(labels[labels >= 0])
        largest = int(self.present[-1]) + 1 if len(self.present) else 0
        self.named = names is not None
        self._names = list(names) if names is not None else None
        self.size = max(largest, len(self._names)) if self._names is not None else largest

    def __len__(self) -> int:
        if self.size > sys.maxsize:
            raise OverflowError(f"{self.size} class names (the largest label is {self.size - 1}) do not fit "
                                "len(); use classes.size, or classes.present for the labels that occur")
        return self.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        i = int(i)
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"class index {i} out of range [0, {self.size})")
        if self._names is not None and i < len(self._names):
            return self._names[i]
        return str(i)

    def occurring(self) -> list[str]:
        """The names of the labels that occur, in label order (one per entry of :attr:`present`)."""
        return [self[int(c)] for c in self.present]

    def __contains__(self, name) -> bool:
        if self._names is not None and name in self._names:
            return True
        if not isinstance(name, str) or not name.isascii() or not name.isdigit() or str(int(name)) != name:
            return False
        i = int(name)
        return i < self.size and (self._names is None or i >= len(self._names))

    def __eq__(self, other) -> bool:
        if isinstance(other, ClassNames):   # past both name lists, both give the label as text
            named = max(len(self._names or ()), len(other._names or ()))
            return self.size == other.size and all(self[i] == other[i] for i in range(min(named, self.size)))
        if isinstance(other, (list, tuple)):
            return self.size == len(other) and all(self[i] == o for i, o in enumerate(other))
        return NotImplemented

    __hash__ = None   # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(repr(self[int(c)]) for c in self.present[:5])
        more = " ..." if len(self.present) > 5 else ""
        return f"ClassNames(size={self.size}, labels present {len(self.present)}: [{shown}{more}])"
