"""Numeric feature stages: fill missing values, standardize, min-max, log1p, clip, bucketize,
and the label. Float results are float32 (see :mod:`feedgpu.tabular.ops` for the conventions
both engines share).
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import ConfigError, TableDataError
from .columns import StrColumn
from .source import SchemaError
from .stage import ColumnStage, f32, fit_values

__all__ = ["Bucketize", "Clip", "Fill", "Label", "Log1p", "MinMax", "Standardize"]

class Fill(ColumnStage):
    """Missing values (NaN) -> ``mean``/``median`` of the fit pass or ``constant``; with
    ``indicator`` also ``<column>_missing`` (float32 1.0 where the value was missing). CPU only
    (DALI has no select operator)."""

    name, has_dali = "fill", False

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


class _Affine(ColumnStage):
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

    name, needs_fit = "standardize", True

    def fit(self, cols):
        x = fit_values(cols, self.inputs[0], self.label)
        sd = float(np.std(x))
        return {"mean": float(np.mean(x)), "std": sd if sd > 0 else 1.0}

    def _k(self):
        return np.float32(self.state["mean"]), np.float32(self.state["std"])


class MinMax(_Affine):
    """``(x - min) / (max - min)`` with the fit pass's min and max (a zero range counts as 1). float32."""

    name, needs_fit = "minmax", True

    def fit(self, cols):
        x = fit_values(cols, self.inputs[0], self.label)
        return {"min": float(x.min()), "max": float(x.max())}

    def _k(self):
        lo, hi = self.state["min"], self.state["max"]
        return np.float32(lo), np.float32(hi - lo if hi > lo else 1.0)


class Log1p(ColumnStage):
    """``log(1 + x)``; values below -1 give NaN (caught by the pipeline's NaN check). float32."""

    name = "log1p"

    def __init__(self, column: str):
        super().__init__([column], [column])

    def apply(self, cols):
        with np.errstate(invalid="ignore", divide="ignore"):
            cols[self.outputs[0]] = np.log1p(f32(cols, self.inputs[0], self.label))

    def dali(self, node):
        import nvidia.dali.math as dmath

        return {self.outputs[0]: dmath.log(node(self.inputs[0]) + 1.0)}


class Clip(ColumnStage):
    """``min(max(x, lo), hi)``; either bound may be omitted; NaN stays NaN. float32."""

    name = "clip"

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


class Bucketize(ColumnStage):
    """Bucket index of each value: 0 for NaN, else ``1 + #{boundaries <= x}`` (so
    ``cardinality = len(boundaries) + 2``). ``boundaries`` are given, or with ``quantiles: n``
    the fit pass's ``n``-quantiles (``np.quantile`` of the non-NaN values, linear interpolation,
    duplicates merged).
    int64."""

    name, out_kind = "bucketize", "cat"

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


_EXPR = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:(>=|<=|==|!=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))?\s*$")


class Label(ColumnStage):
    """``expr``: ``column`` or ``column OP number`` (OP one of ``> >= < <= == !=``), as float32
    (default) or int64. A missing (NaN) input raises :class:`TableDataError` unless
    ``if_missing`` gives the label to use. CPU in both engines."""

    name, has_dali = "label", False

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
