"""Lookup joins of a batch with a small dimension table held in memory (a left join).

The dimension table is read once at pipeline build. Each key column is factorized on the
dimension side (``np.unique``); a batch's key values are mapped to those codes (strings through a
per-dictionary table, integers with ``np.searchsorted``), combined into one int64 key (mixed
radix) and found among the dimension's sorted keys with ``np.searchsorted``.

Rows without a match (or with a missing key value) get NaN in numeric columns and a missing
value in string columns; with ``indicator`` a ``<prefix>matched`` column (float32 0/1) says which
rows matched. Duplicate keys in the dimension table raise :class:`ConfigError` unless
``duplicates: first`` keeps the first row of each key (for example the repeated hour at the end
of daylight saving time in ``weather``).
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .columns import Dictionary, DictMap, StrColumn
from .source import TableSource


class LookupJoin:
    """Args: ``path`` (Parquet file(s)), ``on`` (``{batch column: dimension column}``),
    ``columns`` (``{dimension column: output name}``), ``indicator`` (add ``<prefix>matched``),
    ``duplicates`` (``"raise"`` or ``"first"``), ``prefix`` (for the indicator's name)."""

    def __init__(self, path, on: dict, columns: dict, indicator: bool = True, duplicates: str = "raise",
                 prefix: str = "", name: str = "join"):
        self.name, self.on, self.columns, self.prefix = name, dict(on), dict(columns), prefix
        self.indicator = indicator
        src = TableSource(path, list(dict.fromkeys([*self.on.values(), *self.columns])))
        self.identity, self.paths = src.identity(), src.paths
        dim = src.read_all()
        self.kinds = {out: src.kinds[c] for c, out in self.columns.items()}
        self.uniques, codes = [], []
        for dc in self.on.values():
            v = dim[dc]
            if isinstance(v, StrColumn):
                vals = np.asarray(v.to_list(), dtype=object)
                ok = v.codes >= 0
                u, inv = np.unique(vals[ok].astype(str), return_inverse=True)
                code = np.full(len(vals), -1, np.int64)
                code[ok] = inv
                self.uniques.append({s: i for i, s in enumerate(u.tolist())})
            else:
                if src.kinds[dc] == "float" and np.isnan(v).any():
                    ok = ~np.isnan(v)
                else:
                    ok = np.ones(len(v), bool)
                u, inv = np.unique(v[ok], return_inverse=True)
                code = np.full(len(v), -1, np.int64)
                code[ok] = inv
                self.uniques.append(u)
            codes.append(code)
        self.radix = [len(u) for u in self.uniques]
        if float(np.prod([max(r, 1) for r in self.radix], dtype=np.float64)) >= 2 ** 62:
            raise ConfigError(f"{name}: too many distinct key combinations to combine into one int64 key")
        valid = np.all([c >= 0 for c in codes], axis=0)
        key = self._combine(codes)
        rows = np.nonzero(valid)[0]
        order = rows[np.argsort(key[rows], kind="stable")]
        k = key[order]
        dup = np.nonzero(k[1:] == k[:-1])[0]
        if len(dup):
            if duplicates != "first":
                ex = order[dup[0] + 1]
                desc = ", ".join(f"{dc}={dim[dc].to_list()[ex] if isinstance(dim[dc], StrColumn) else dim[dc][ex]}"
                                 for dc in self.on.values())
                raise ConfigError(f"{name}: {len(dup)} duplicate keys in {src.paths[0]} (first: {desc}); "
                                  "set duplicates: first to keep the first row of each key")
            keep = np.ones(len(k), bool)
            keep[dup + 1] = False
            k, order = k[keep], order[keep]
        self.duplicates_dropped = int(len(dup))
        self.keys, self.rows = k, order
        self.values = {}
        for c, out in self.columns.items():
            v = dim[c]
            if isinstance(v, StrColumn):
                self.values[out] = StrColumn(np.append(v.codes, np.int32(-1)), Dictionary(v.dictionary.values))
            else:
                self.values[out] = np.append(v.astype(np.float64), np.nan)
        self._maps = [DictMap(lambda s, m=u: m.get(s, -1), -1) if isinstance(u, dict) else None for u in self.uniques]

    def _combine(self, codes: list[np.ndarray]) -> np.ndarray:
        key = np.zeros(len(codes[0]), np.int64)
        for c, r in zip(codes, self.radix):
            key = key * max(r, 1) + np.maximum(c, 0)
        return key

    def match(self, cols: dict) -> np.ndarray:
        """Dimension row of each batch row (-1: no match)."""
        codes = []
        for (bc, dc), u, m in zip(self.on.items(), self.uniques, self._maps):
            if bc not in cols:
                raise ConfigError(f"{self.name}: key column {bc!r} is not in the batch")
            v = cols[bc]
            if m is not None:
                if not isinstance(v, StrColumn):
                    raise ConfigError(f"{self.name}: key {bc!r} is numeric but {dc!r} in the dimension table is a string")
                codes.append(m.apply(v))
            else:
                if isinstance(v, StrColumn):
                    raise ConfigError(f"{self.name}: key {bc!r} is a string but {dc!r} in the dimension table is numeric")
                pos = np.searchsorted(u, v)
                pos_c = np.minimum(pos, max(len(u) - 1, 0))
                hit = (pos < len(u)) & (u[pos_c] == v) if len(u) else np.zeros(len(v), bool)
                codes.append(np.where(hit, pos_c, -1))
        valid = np.all([c >= 0 for c in codes], axis=0)
        key = self._combine(codes)
        pos = np.searchsorted(self.keys, key)
        pos_c = np.minimum(pos, max(len(self.keys) - 1, 0))
        hit = valid & (pos < len(self.keys)) & (self.keys[pos_c] == key)
        return np.where(hit, self.rows[pos_c], -1)

    def apply(self, cols: dict) -> dict:
        row = self.match(cols)
        for out, v in self.values.items():
            if isinstance(v, StrColumn):
                cols[out] = StrColumn(v.codes[row], v.dictionary)  # -1 -> the appended missing value
            else:
                cols[out] = v[row]
        if self.indicator:
            cols[f"{self.prefix}matched"] = (row >= 0).astype(np.float32)
        return cols

    def outputs(self) -> dict:
        """Output name -> kind ("float" or "str"; joined integers become float, NaN = no match)."""
        d = {out: ("str" if k == "str" else "float") for out, k in self.kinds.items()}
        if self.indicator:
            d[f"{self.prefix}matched"] = "float"
        return d
