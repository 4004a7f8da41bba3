"""How a column of a batch is held between stages.

* numeric columns: 1-D numpy arrays; ``float64`` (missing values are NaN) for floating columns
  and for integer columns that have missing values anywhere in the source (decided from the
  Parquet statistics), ``int64`` otherwise; stages that compute in floating point work in
  ``float32`` (the precision of DALI's arithmetic, so both engines agree).
* string columns: :class:`StrColumn`, ``codes`` (``int32``, -1 = missing) into a
  :class:`Dictionary` that only grows, so a mapping computed for its first ``k`` values stays
  valid (stages cache per-dictionary mappings and extend them).
"""
from __future__ import annotations

import numpy as np


class Dictionary:
    """Distinct strings of one column, in order of first sight (per process)."""

    def __init__(self, values=()):
        self.values: list[str] = []
        self._index: dict[str, int] = {}
        for v in values:
            self.code(v)

    def __len__(self) -> int:
        return len(self.values)

    def code(self, v: str) -> int:
        c = self._index.get(v)
        if c is None:
            c = self._index[v] = len(self.values)
            self.values.append(v)
        return c

    def codes_of(self, values) -> np.ndarray:
        """``int32`` codes of ``values`` (a sequence of str or None; None -> -1), adding new ones."""
        return np.fromiter((-1 if v is None else self.code(v) for v in values), np.int32, len(values))


class StrColumn:
    """A string column of a batch: ``codes`` (int32 [N], -1 = missing) into ``dictionary``."""

    __slots__ = ("codes", "dictionary")

    def __init__(self, codes: np.ndarray, dictionary: Dictionary):
        self.codes, self.dictionary = codes, dictionary

    def __len__(self) -> int:
        return len(self.codes)

    def take(self, idx) -> "StrColumn":
        return StrColumn(self.codes[idx], self.dictionary)

    def to_list(self) -> list:
        vals = self.dictionary.values
        return [None if c < 0 else vals[c] for c in self.codes.tolist()]


class DictMap:
    """A per-dictionary mapping ``f(value) -> int`` extended as the dictionary grows.

    ``table(d)`` is an int64 array of ``len(d) + 1`` entries: entry 0 is for missing values
    (``missing``), entry ``c + 1`` for code ``c``; so ``table[codes + 1]`` maps a column."""

    def __init__(self, fn, missing: int):
        self.fn, self.missing = fn, missing
        self._tables: dict[int, np.ndarray] = {}

    def table(self, d: Dictionary) -> np.ndarray:
        hit = self._tables.get(id(d))  # (dictionary, table): holding d keeps its id from being reused
        t = hit[1] if hit is not None else None
        if t is None or len(t) < len(d) + 1:
            old = t if t is not None else np.array([self.missing], np.int64)
            new = np.fromiter((self.fn(v) for v in d.values[len(old) - 1:]), np.int64)
            t = np.concatenate([old, new])
            self._tables[id(d)] = (d, t)
        return t

    def apply(self, col: StrColumn) -> np.ndarray:
        return self.table(col.dictionary)[col.codes.astype(np.int64) + 1]
