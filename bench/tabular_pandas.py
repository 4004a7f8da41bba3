"""The pandas baseline of ``bench/tabular.py``: a table pipeline's joins and stages written with
pandas, as a user of pandas would, reusing the pipeline's fit statistics (the fit is not timed).

Rows of a batch: ``DataFrame.take``; string columns are ``category`` dtype (read once);
joins: ``DataFrame.join`` on an indexed dimension table; fill: ``fillna``; clip/log1p/
standardize/minmax: Series arithmetic; bucketize: ``np.searchsorted`` on the Series; categorify
and string hashing: ``Series.map`` of a dict made once (on category dtype pandas maps each
category once);
one-hot: ``pd.get_dummies`` on a ``Categorical`` with every index as category; the result:
``to_numpy`` and ``torch.from_numpy``, the same dict of tensors as feedgpu's.
"""
from __future__ import annotations

import operator

import numpy as np
import pandas as pd

from feedgpu.tabular.categorical import Categorify, Cross, Hash, OneHot
from feedgpu.tabular.numeric import Bucketize, Clip, Fill, Label, Log1p, MinMax, Standardize
from feedgpu.tabular.stage import mult_hash, string_hash


CMP = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne}


class PandasPipeline:
    def __init__(self, p):
        self.p = p
        cols = p.read_columns
        self.df = pd.read_parquet(p.source.paths, columns=cols)
        for c in cols:
            if p.source.kinds[c] == "str":
                self.df[c] = self.df[c].astype("category")
        self.joins = []
        for j in p.joins:
            dim = pd.read_parquet(j.paths, columns=list(dict.fromkeys([*j.on.values(), *j.columns])))
            dim = dim.drop_duplicates(list(j.on.values()), keep="first").set_index(list(j.on.values()))
            dim = dim[list(j.columns)].rename(columns=j.columns)
            for c in dim.columns:
                if dim[c].dtype == object or str(dim[c].dtype) in ("str", "string"):
                    dim[c] = dim[c].astype("category")
                else:
                    dim[c] = dim[c].astype("float64")
            if j.indicator:
                dim[f"{j.prefix}matched"] = np.float32(1.0)
            self.joins.append((list(j.on), dim, j))
        self.maps, self.hashes = {}, {}  # vocabularies and string hashes as dicts, computed once
        for st in p.stages:
            if isinstance(st, Categorify) and st.state["kind"] == "str":
                self.maps[id(st)] = {s: i + 2 for i, s in enumerate(st.state["vocab"])}
            if isinstance(st, Hash) and p.source.kinds.get(st.inputs[0]) == "str":
                vals = self.df[st.inputs[0]].cat.categories
                self.hashes[id(st)] = {s: string_hash(s, st.buckets) for s in vals}

    def transform(self, idx: np.ndarray) -> dict:
        b = self.df.take(idx)
        blocks = {}
        for on, dim, j in self.joins:
            b = b.join(dim, on=on)
            if j.indicator:
                b[f"{j.prefix}matched"] = b[f"{j.prefix}matched"].fillna(0).astype(np.float32)
        for st in self.p.stages:
            c, out = st.inputs[0], st.outputs[0]
            if isinstance(st, Label):
                x = b[c]
                y = CMP[st.cmp](x, float(st.num)) if st.cmp else x
                y = y.astype(st.dtype)
                y[x.isna()] = float(st.if_missing)
                b[out] = y
            elif isinstance(st, Fill):
                x = b[c].astype(np.float32)
                if st.indicator:
                    b[st.outputs[1]] = x.isna().astype(np.float32)
                b[c] = x.fillna(np.float32(st.state["value"] if st.needs_fit else st.value))
            elif isinstance(st, Clip):
                b[c] = b[c].astype(np.float32).clip(st.lo, st.hi)
            elif isinstance(st, Log1p):
                b[c] = np.log1p(b[c].astype(np.float32))
            elif isinstance(st, Standardize):
                m, s = st._k()
                b[c] = (b[c].astype(np.float32) - m) / s
            elif isinstance(st, MinMax):
                lo, r = st._k()
                b[c] = (b[c].astype(np.float32) - lo) / r
            elif isinstance(st, Bucketize):
                x = b[c].astype(np.float32)
                k = np.searchsorted(st.boundaries, x.to_numpy(), side="right") + 1
                b[out] = np.where(x.isna(), 0, k)
            elif isinstance(st, Categorify):
                x = b[c]
                if st.state["kind"] == "str":
                    v = x.map(self.maps[id(st)]).astype("float64").fillna(1)
                    v[x.isna()] = 0
                    b[out] = v.astype(np.int64)
                else:
                    b[out] = st.map_ints(x.to_numpy())
            elif isinstance(st, Hash):
                x = b[c]
                if not pd.api.types.is_numeric_dtype(x.dtype):
                    x = x.astype("category")  # DataFrame.join on it turned it back into str
                    v = x.map(self.hashes[id(st)]).astype("float64").fillna(0)
                    b[out] = v.astype(np.int64)
                else:
                    b[out] = mult_hash(x.to_numpy(np.int64), st.buckets)
            elif isinstance(st, OneHot):
                blocks[out] = pd.get_dummies(pd.Categorical(b[c], categories=range(st.width)),
                                             dtype=np.float32).to_numpy()
            elif isinstance(st, Cross):
                key, nz = 0, True
                for ci, card in zip(st.inputs, st.cards):
                    key = key * card + b[ci]
                    nz = nz & (b[ci] != 0)
                b[out] = np.where(nz, mult_hash(key.to_numpy(np.int64), st.buckets), 0)
        o = self.p.cfg.outputs
        parts = [blocks[c] if c in blocks else b[c].to_numpy(np.float32)[:, None] for c in o.dense]
        res = {"dense": np.concatenate(parts, axis=1).astype(np.float32)}
        for c in o.categorical:
            res[c] = b[c].to_numpy(np.int64)
        if o.label:
            res[o.label] = b[o.label].to_numpy()
        return res
