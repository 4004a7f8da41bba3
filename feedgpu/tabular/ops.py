"""Feature stages: batch transforms over a dict of columns, one definition for both engines.

Each stage reads ``inputs`` and writes ``outputs`` of the column dict (see
:mod:`feedgpu.tabular.columns`). ``fit(cols)`` returns the stage's statistics as a JSON-able
dict (stages without statistics return ``None``); ``load(state)`` sets them; ``apply(cols)`` is
the CPU engine (numpy, vectorised per batch); ``dali(node)`` builds the same computation from
``nvidia.dali`` operators where DALI has them (``node(name)`` gives a column's DataNode); stages
with ``dali_ok = False`` run on the CPU before the DALI graph in both engines.

Floating results are ``float32``: the CPU engine computes in float32 with the same float32
constants as DALI, so both engines agree within ``atol=rtol=1e-5`` (log1p: DALI computes
``log(x + 1)``). Categorical results are ``int64`` indices with a shared convention
(as in NVTabular's Categorify): **0 = missing value**, and for ``categorify`` **1 = out of
vocabulary**, vocabulary entries from 2; ``cardinality`` is the embedding table size.
"""
from __future__ import annotations

import hashlib
import re

import numpy as np

from ..errors import ConfigError, TableDataError
from .columns import DictMap, StrColumn
from .source import SchemaError

#: Knuth's multiplicative hashing constant (TAOCP vol. 3, 6.4), 2^32 / golden ratio.
KNUTH = 2654435761
TWO32 = 1 << 32


def f32(cols: dict, c: str, stage: str) -> np.ndarray:
    v = cols.get(c)
    if v is None:
        raise ConfigError(f"{stage}: column {c!r} is not in the batch (columns: {', '.join(sorted(cols))})")
    if isinstance(v, StrColumn):
        raise SchemaError(f"{stage}: column {c!r} holds strings; this stage needs numbers")
    return v.astype(np.float32, copy=False)


def int_col(cols: dict, c: str, stage: str) -> np.ndarray:
    v = cols.get(c)
    if v is None:
        raise ConfigError(f"{stage}: column {c!r} is not in the batch (columns: {', '.join(sorted(cols))})")
    if isinstance(v, StrColumn) or v.dtype.kind != "i":
        raise SchemaError(f"{stage}: column {c!r} must hold integers without missing values (it is "
                          f"{'strings' if isinstance(v, StrColumn) else v.dtype})")
    return v


def fit_values(cols: dict, c: str, stage: str) -> np.ndarray:
    """float64 values of ``c`` without NaN, for a fit; :class:`TableDataError` if none is left."""
    x = f32(cols, c, stage).astype(np.float64)
    x = x[~np.isnan(x)]
    if not len(x):
        raise TableDataError(f"{stage}: every value of {c!r} is missing in the fit rows: nothing to fit")
    return x


def mult_hash(key: np.ndarray, buckets: int) -> np.ndarray:
    """``1 + ((key * KNUTH) mod 2^32) * buckets // 2^32`` for ``0 <= key < 2^31``: int64 only,
    without overflow, so DALI's integer arithmetic gives the same buckets (range reduction by a
    multiply-high, Lemire 2019)."""
    return ((key * KNUTH) % TWO32 * buckets) // TWO32 + 1


def string_hash(s: str, buckets: int) -> int:
    """Stable across processes and runs: blake2b-64 of the UTF-8 bytes, mod ``buckets``, plus 1."""
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") % buckets + 1


class Stage:
    op = ""
    dali_ok = True
    needs_fit = False
    out_kind = "float"  # or "cat"
    cardinality: int | None = None

    def __init__(self, inputs: list[str], outputs: list[str]):
        self.inputs, self.outputs = inputs, outputs
        self.state: dict | None = None

    def config(self) -> dict:
        return {"op": self.op, "inputs": self.inputs, "outputs": self.outputs}

    def fit(self, cols: dict):
        return None

    def load(self, state) -> None:
        self.state = state

    def apply(self, cols: dict) -> None:
        raise NotImplementedError

    def dali(self, node) -> dict:
        raise NotImplementedError

    @property
    def label(self) -> str:
        return f"{self.op}({', '.join(self.inputs)})"


class Fill(Stage):
    """Missing values (NaN) -> ``mean``/``median`` of the fit pass or ``constant``; with
    ``indicator`` also ``<column>_missing`` (float32 1.0 where the value was missing). CPU only
    (DALI has no select operator)."""

    op, dali_ok = "fill", False

    def __init__(self, column: str, strategy: str = "median", value: float = 0.0, indicator: bool = True):
        super().__init__([column], [column] + ([f"{column}_missing"] if indicator else []))
        self.strategy, self.value, self.indicator = strategy, float(value), indicator
        self.needs_fit = strategy in ("mean", "median")

    def config(self) -> dict:
        return {**super().config(), "strategy": self.strategy, "value": self.value}

    def fit(self, cols):
        x = fit_values(cols, self.inputs[0], self.label)
        return {"value": float(np.mean(x) if self.strategy == "mean" else np.median(x))}

    def apply(self, cols):
        c = self.inputs[0]
        x = f32(cols, c, self.label)
        miss = np.isnan(x)
        fill = np.float32(self.state["value"] if self.needs_fit else self.value)
        cols[c] = np.where(miss, fill, x)
        if self.indicator:
            cols[f"{c}_missing"] = miss.astype(np.float32)


class _Affine(Stage):
    """``(x - shift) / scale`` of one column with constants from the fit pass (:meth:`_k`). float32."""

    def __init__(self, column: str):
        super().__init__([column], [column])

    def _k(self) -> tuple[np.float32, np.float32]:  # pragma: no cover - abstract
        raise NotImplementedError

    def apply(self, cols):
        shift, scale = self._k()
        cols[self.outputs[0]] = (f32(cols, self.inputs[0], self.label) - shift) / scale

    def dali(self, node):
        shift, scale = self._k()
        return {self.outputs[0]: (node(self.inputs[0]) - float(shift)) / float(scale)}


class Standardize(_Affine):
    """``(x - mean) / std`` with the fit pass's mean and standard deviation (population, NaN
    ignored; a zero std counts as 1). float32."""

    op, needs_fit = "standardize", True

    def fit(self, cols):
        x = fit_values(cols, self.inputs[0], self.label)
        sd = float(np.std(x))
        return {"mean": float(np.mean(x)), "std": sd if sd > 0 else 1.0}

    def _k(self):
        return np.float32(self.state["mean"]), np.float32(self.state["std"])


class MinMax(_Affine):
    """``(x - min) / (max - min)`` with the fit pass's min and max (a zero range counts as 1). float32."""

    op, needs_fit = "minmax", True

    def fit(self, cols):
        x = fit_values(cols, self.inputs[0], self.label)
        return {"min": float(x.min()), "max": float(x.max())}

    def _k(self):
        lo, hi = self.state["min"], self.state["max"]
        return np.float32(lo), np.float32(hi - lo if hi > lo else 1.0)


class Log1p(Stage):
    """``log(1 + x)``; values below -1 give NaN (caught by the pipeline's NaN check). float32."""

    op = "log1p"

    def __init__(self, column: str):
        super().__init__([column], [column])

    def apply(self, cols):
        with np.errstate(invalid="ignore", divide="ignore"):
            cols[self.outputs[0]] = np.log1p(f32(cols, self.inputs[0], self.label))

    def dali(self, node):
        import nvidia.dali.math as dmath

        return {self.outputs[0]: dmath.log(node(self.inputs[0]) + 1.0)}


class Clip(Stage):
    """``min(max(x, lo), hi)``; either bound may be omitted; NaN stays NaN. float32."""

    op = "clip"

    def __init__(self, column: str, min: float | None = None, max: float | None = None):
        super().__init__([column], [column])
        if min is None and max is None:
            raise ConfigError(f"clip({column}): give min, max or both")
        self.lo = np.float32(-np.inf if min is None else min)
        self.hi = np.float32(np.inf if max is None else max)

    def config(self):
        return {**super().config(), "min": float(self.lo), "max": float(self.hi)}

    def apply(self, cols):
        cols[self.outputs[0]] = np.clip(f32(cols, self.inputs[0], self.label), self.lo, self.hi)

    def dali(self, node):
        import nvidia.dali.math as dmath

        return {self.outputs[0]: dmath.clamp(node(self.inputs[0]), float(self.lo), float(self.hi))}


class Bucketize(Stage):
    """Bucket index of each value: 0 for NaN, else ``1 + #{boundaries <= x}`` (so
    ``cardinality = len(boundaries) + 2``). ``boundaries`` are given, or with ``quantiles: n``
    the fit pass's ``n``-quantiles (``np.quantile`` of the non-NaN values, linear interpolation,
    duplicates merged).
    int64."""

    op, out_kind = "bucketize", "cat"

    def __init__(self, column: str, out: str, boundaries=None, quantiles: int | None = None):
        super().__init__([column], [out])
        if (boundaries is None) == (quantiles is None):
            raise ConfigError(f"bucketize({column}): give exactly one of boundaries or quantiles")
        self.quantiles = quantiles
        self.needs_fit = quantiles is not None
        if boundaries is not None:
            self._set(boundaries)

    def _set(self, b):
        b = np.asarray(b, np.float32)
        if len(b) > 1 and np.any(np.diff(b) <= 0):
            raise ConfigError(f"{self.label}: boundaries must be strictly increasing, got {b.tolist()}")
        self.boundaries = b
        self.cardinality = len(b) + 2

    def config(self):
        return {**super().config(), "quantiles": self.quantiles,
                "boundaries": None if self.quantiles else self.boundaries.tolist()}

    def fit(self, cols):
        x = fit_values(cols, self.inputs[0], self.label)
        q = np.quantile(x, np.linspace(0, 1, self.quantiles + 1)[1:-1])
        return {"boundaries": np.unique(q.astype(np.float32)).astype(float).tolist()}

    def load(self, state):
        super().load(state)
        if state is not None:
            self._set(state["boundaries"])

    def apply(self, cols):
        x = f32(cols, self.inputs[0], self.label)
        b = np.searchsorted(self.boundaries, x, side="right").astype(np.int64) + 1
        b[np.isnan(x)] = 0
        cols[self.outputs[0]] = b

    def dali(self, node):
        from nvidia.dali import fn, types

        x = node(self.inputs[0])
        acc = fn.cast(x == x, dtype=types.INT64)  # 0 for NaN
        out = acc
        for v in self.boundaries.tolist():
            out = out + fn.cast(x >= v, dtype=types.INT64)
        return {self.outputs[0]: out * acc}


class Categorify(Stage):
    """Vocabulary index: 0 missing, 1 out of vocabulary, 2.. the fit pass's values seen at least
    ``min_count`` times (at most ``max_size`` of them), most frequent first, ties by value.
    ``on_oov``: ``"index"`` (default, maps to 1 and counts it in ``oov``) or ``"raise"``
    (:class:`TableDataError`). Strings or integers. int64."""

    op, needs_fit, out_kind = "categorify", True, "cat"

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
    def dali_ok(self):  # integers go through lookup_table only when they are small non-negative keys
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


class Hash(Stage):
    """Hash buckets: 0 missing, else 1..``buckets`` (``cardinality = buckets + 1``). Strings:
    :func:`string_hash`; integers (``0 <= x < 2^31``, else :class:`SchemaError`): :func:`mult_hash`. int64."""

    op, out_kind = "hash", "cat"

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


class Cross(Stage):
    """Crossed feature of categorical outputs ``a, b, ...`` (each with a cardinality): 0 if any
    input is 0, else :func:`mult_hash` of the mixed-radix key ``(a * card_b + b) ...`` into
    ``buckets``. int64; ``cardinality = buckets + 1``."""

    op, out_kind = "cross", "cat"

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


class OneHot(Stage):
    """One-hot float32 ``[N, cardinality]`` block of a categorical output (index 0, missing, has
    its own column). Goes into ``dense`` as ``cardinality`` columns."""

    op = "one_hot"

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


_EXPR = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:(>=|<=|==|!=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))?\s*$")


class Label(Stage):
    """``expr``: ``column`` or ``column OP number`` (OP one of ``> >= < <= == !=``), as float32
    (default) or int64. A missing (NaN) input raises :class:`TableDataError` unless
    ``if_missing`` gives the label to use. CPU in both engines."""

    op, dali_ok = "label", False

    def __init__(self, expr: str, out: str = "label", dtype: str = "float32", if_missing="raise"):
        m = _EXPR.match(expr)
        if not m:
            raise ConfigError(f"label expr {expr!r}: expected 'column' or 'column OP number' with OP in > >= < <= == !=")
        self.col, self.cmp, self.num = m.group(1), m.group(2), m.group(3)
        super().__init__([self.col], [out])
        if dtype not in ("float32", "int64"):
            raise ConfigError(f"label dtype {dtype!r}: allowed float32, int64")
        self.expr, self.dtype, self.if_missing = expr, dtype, if_missing

    def config(self):
        return {**super().config(), "expr": self.expr, "dtype": self.dtype, "if_missing": self.if_missing}

    def apply(self, cols):
        v = cols.get(self.col)
        if v is None:
            raise ConfigError(f"label: column {self.col!r} is not in the batch")
        if isinstance(v, StrColumn):
            raise SchemaError(f"label: column {self.col!r} holds strings")
        x = v.astype(np.float64, copy=False)
        miss = np.isnan(x)
        if self.cmp is None:
            y = x
        else:
            t = float(self.num)
            with np.errstate(invalid="ignore"):
                y = {">": x > t, ">=": x >= t, "<": x < t, "<=": x <= t, "==": x == t, "!=": x != t}[self.cmp]
        y = y.astype(self.dtype)
        if miss.any():
            if self.if_missing == "raise":
                raise TableDataError(f"label {self.expr!r}: {int(miss.sum())} rows have no {self.col} "
                                     "(set if_missing to the label to use)")
            y[miss] = float(self.if_missing)
        cols[self.outputs[0]] = y
