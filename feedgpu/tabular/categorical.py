"""Categorical feature stages: categorify (a fitted vocabulary), hash, cross and one-hot. Results
are int64 indices, 0 for a missing value (see :mod:`feedgpu.tabular.ops`).
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError, TableDataError
from .columns import DictMap, StrColumn
from .source import SchemaError
from .stage import KNUTH, TWO32, ColumnStage, int_col, mult_hash, string_hash

__all__ = ["Categorify", "Cross", "Hash", "OneHot"]

class Categorify(ColumnStage):
    """Vocabulary index: 0 missing, 1 out of vocabulary, 2.. the fit pass's values seen at least
    ``min_count`` times (at most ``max_size`` of them), most frequent first, ties by value.
    ``on_oov``: ``"index"`` (default, maps to 1 and counts it in ``oov``) or ``"raise"``
    (:class:`TableDataError`). Strings or integers. int64."""

    name, needs_fit, out_kind = "categorify", True, "cat"

    def __init__(self, column: str, out: str, min_count: int = 1, max_size: int | None = None, on_oov: str = "index"):
        super().__init__([column], [out])
        self.min_count, self.max_size, self.on_oov = int(min_count), max_size, on_oov
        self.oov = 0

    def config(self):
        return {**super().config(), "min_count": self.min_count, "max_size": self.max_size}

    def fit(self, cols):
        v = cols.get(self.inputs[0])
        if v is None:
            raise ConfigError(f"{self.label}: column {self.inputs[0]!r} is not in the batch")
        if isinstance(v, StrColumn):
            cnt = np.bincount(v.codes[v.codes >= 0], minlength=len(v.dictionary))
            vals = np.asarray(v.dictionary.values, dtype=object)
            keep = np.nonzero(cnt >= self.min_count)[0]
            order = sorted(keep.tolist(), key=lambda i: (-cnt[i], vals[i]))
            vocab, kind = [vals[i] for i in order], "str"
            counts = [int(cnt[i]) for i in order]
        else:
            x = int_col(cols, self.inputs[0], self.label)
            u, cnt = np.unique(x, return_counts=True)
            keep = cnt >= self.min_count
            u, cnt = u[keep], cnt[keep]
            order = np.lexsort((u, -cnt))
            vocab, kind, counts = u[order].tolist(), "int", cnt[order].tolist()
        if self.max_size is not None:
            vocab, counts = vocab[:self.max_size], counts[:self.max_size]
        return {"kind": kind, "vocab": vocab, "counts": counts}

    def load(self, state):
        super().load(state)
        self.cardinality = len(state["vocab"]) + 2
        if state["kind"] == "str":
            index = {s: i + 2 for i, s in enumerate(state["vocab"])}
            self._map = DictMap(lambda s: index.get(s, 1), 0)
        else:
            v = np.asarray(state["vocab"], np.int64)
            self._order = np.argsort(v)
            self._sorted = v[self._order]

    def apply(self, cols):
        v = cols.get(self.inputs[0])
        if v is None:
            raise ConfigError(f"{self.label}: column {self.inputs[0]!r} is not in the batch")
        if self.state["kind"] == "str":
            if not isinstance(v, StrColumn):
                raise SchemaError(f"{self.label}: the vocabulary holds strings but {self.inputs[0]!r} is numeric")
            out = self._map.apply(v)
        else:
            x = int_col(cols, self.inputs[0], self.label)
            out = self.map_ints(x)
        self.check_oov(out)
        cols[self.outputs[0]] = out

    def map_ints(self, x):
        s = self._sorted
        if not len(s):
            return np.ones(len(x), np.int64)
        pos = np.minimum(np.searchsorted(s, x), len(s) - 1)
        return np.where(s[pos] == x, self._order[pos] + 2, 1).astype(np.int64)

    def check_oov(self, out: np.ndarray) -> None:
        n = int(np.count_nonzero(out == 1))
        self.oov += n
        if n and self.on_oov == "raise":
            raise TableDataError(f"{self.label}: {n} values outside the vocabulary (on_oov: raise)")

    @property
    def has_dali(self):  # integers go through lookup_table only when they are small non-negative keys
        return self.state is None or self.state["kind"] == "str" or (
            not self.state["vocab"] or (min(self.state["vocab"]) >= 0 and max(self.state["vocab"]) < 65536))

    def lookup(self, dict_len: int | None):
        """(keys, values) for ``fn.lookup_table``: string columns are fed as ``codes + 1``."""
        if self.state["kind"] == "str":
            return None
        keys = self.state["vocab"]
        return keys, list(range(2, len(keys) + 2))

    def dali(self, node):
        from nvidia.dali import fn, types

        if self.state["kind"] == "str":
            return {self.outputs[0]: node.lookup(self.inputs[0], self._map)}
        keys, vals = self.lookup(None)
        x = node(self.inputs[0])
        return {self.outputs[0]: fn.lookup_table(x, keys=keys, values=vals, default_value=1, dtype=types.INT64)
                if keys else x * 0 + 1}


class Hash(ColumnStage):
    """Hash buckets: 0 missing, else 1..``buckets`` (``cardinality = buckets + 1``). Strings:
    :func:`string_hash`; integers (``0 <= x < 2^31``, else :class:`SchemaError`): :func:`mult_hash`. int64."""

    name, out_kind = "hash", "cat"

    def __init__(self, column: str, out: str, buckets: int):
        super().__init__([column], [out])
        self.buckets = int(buckets)
        self.cardinality = self.buckets + 1
        self._map = DictMap(lambda s: string_hash(s, self.buckets), 0)

    def config(self):
        return {**super().config(), "buckets": self.buckets}

    def apply(self, cols):
        v = cols.get(self.inputs[0])
        if isinstance(v, StrColumn):
            cols[self.outputs[0]] = self._map.apply(v)
            return
        x = int_col(cols, self.inputs[0], self.label)
        self.check_ints(x)
        cols[self.outputs[0]] = mult_hash(x, self.buckets)

    def check_ints(self, x) -> None:
        x = int_col({self.inputs[0]: x}, self.inputs[0], self.label)
        if len(x) and (x.min() < 0 or x.max() >= 1 << 31):
            raise SchemaError(f"{self.label}: integers to hash must be in [0, 2^31)")

    def dali(self, node):
        from nvidia.dali import types

        if node.is_str(self.inputs[0]):
            return {self.outputs[0]: node.lookup(self.inputs[0], self._map)}
        x = node(self.inputs[0])
        k, m = types.Constant(KNUTH, dtype=types.INT64), types.Constant(TWO32, dtype=types.INT64)
        return {self.outputs[0]: ((x * k) % m * types.Constant(self.buckets, dtype=types.INT64)) // m + 1}


class Cross(ColumnStage):
    """Crossed feature of categorical outputs ``a, b, ...`` (each with a cardinality): 0 if any
    input is 0, else :func:`mult_hash` of the mixed-radix key ``(a * card_b + b) ...`` into
    ``buckets``. int64; ``cardinality = buckets + 1``."""

    name, out_kind = "cross", "cat"

    def __init__(self, columns: list[str], out: str, buckets: int, cards: list[int]):
        super().__init__(list(columns), [out])
        self.buckets, self.cards = int(buckets), [int(c) for c in cards]
        self.cardinality = self.buckets + 1
        if float(np.prod(self.cards, dtype=np.float64)) >= 2 ** 31:
            raise ConfigError(f"{self.label}: the product of the inputs' cardinalities must be below 2^31")

    def config(self):
        return {**super().config(), "buckets": self.buckets}

    def apply(self, cols):
        key = np.zeros(len(cols[self.inputs[0]]), np.int64)
        nz = np.ones(len(key), bool)
        for c, card in zip(self.inputs, self.cards):
            x = int_col(cols, c, self.label)
            key = key * card + x
            nz &= x != 0
        cols[self.outputs[0]] = np.where(nz, mult_hash(key, self.buckets), 0)

    def dali(self, node):
        from nvidia.dali import fn, types

        key, nz = None, None
        for c, card in zip(self.inputs, self.cards):
            x = node(c)
            key = x if key is None else key * types.Constant(card, dtype=types.INT64) + x
            z = fn.cast(x != 0, dtype=types.INT64)
            nz = z if nz is None else nz * z
        k, m = types.Constant(KNUTH, dtype=types.INT64), types.Constant(TWO32, dtype=types.INT64)
        h = ((key * k) % m * types.Constant(self.buckets, dtype=types.INT64)) // m + 1
        return {self.outputs[0]: h * nz}


class OneHot(ColumnStage):
    """One-hot float32 ``[N, cardinality]`` block of a categorical output (index 0, missing, has
    its own column). Goes into ``dense`` as ``cardinality`` columns."""

    name = "one_hot"

    def __init__(self, column: str, out: str, cardinality: int):
        super().__init__([column], [out])
        self.width = int(cardinality)

    def apply(self, cols):
        x = int_col(cols, self.inputs[0], self.label)
        out = np.zeros((len(x), self.width), np.float32)
        out[np.arange(len(x)), x] = 1.0
        cols[self.outputs[0]] = out

    def dali(self, node):
        from nvidia.dali import fn, types

        return {self.outputs[0]: fn.one_hot(fn.cast(node(self.inputs[0]), dtype=types.INT32), num_classes=self.width,
                                            axis=-1, dtype=types.FLOAT)}
