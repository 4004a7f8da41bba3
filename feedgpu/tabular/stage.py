"""The contract of a feature stage (:class:`ColumnStage`) and the column helpers and hashes the
stages share. The stages themselves: :mod:`feedgpu.tabular.numeric` and
:mod:`feedgpu.tabular.categorical`; :mod:`feedgpu.tabular.ops` lists them all.
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..errors import ConfigError, TableDataError
from .columns import StrColumn
from .source import SchemaError

__all__ = ["ColumnStage", "KNUTH", "TWO32", "f32", "fit_values", "int_col", "mult_hash", "string_hash"]

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


class ColumnStage:
    """A feature stage: reads the columns ``inputs`` of a batch's column dict, writes ``outputs``.

    Named as the image stages' contract (:class:`feedgpu.stages.base.Stage`) names the same
    things: ``name`` is the stage's ``op`` in a pipeline file, ``has_dali`` whether it runs in
    the DALI graph (``False``: on the CPU before it, in both engines). Unlike an image stage it
    works on a whole batch of columns, in place.

    ``fit(cols)`` returns its statistics as a JSON-able dict (``None`` without statistics),
    ``load(state)`` sets them, ``apply(cols)`` runs it on the CPU (numpy, in place on the dict),
    ``dali(node)`` builds it from DALI operators. ``out_kind`` is ``"float"`` (float32 outputs)
    or ``"cat"`` (int64 indices, ``cardinality`` the table size)."""

    name = ""
    has_dali = True
    needs_fit = False
    out_kind = "float"  # or "cat"
    cardinality: int | None = None

    def __init__(self, inputs: list[str], outputs: list[str]):
        self.inputs, self.outputs = inputs, outputs
        self.state: dict | None = None

    def config(self) -> dict:
        return {"op": self.name, "inputs": self.inputs, "outputs": self.outputs}

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
        return f"{self.name}({', '.join(self.inputs)})"
