"""Feature stages: batch transforms over a dict of columns, one definition for both engines.
This module lists them (:data:`STAGES`, by the ``op`` a pipeline file names); they are defined in :mod:`~feedgpu.tabular.numeric` and
:mod:`~feedgpu.tabular.categorical` on the contract of :mod:`~feedgpu.tabular.stage`.

Each stage reads ``inputs`` and writes ``outputs`` of the column dict (see
:mod:`feedgpu.tabular.columns`). ``fit(cols)`` returns the stage's statistics as a JSON-able
dict (stages without statistics return ``None``); ``load(state)`` sets them; ``apply(cols)`` is
the CPU engine (numpy, vectorised per batch); ``dali(node)`` builds the same computation from
``nvidia.dali`` operators where DALI has them (``node(name)`` gives a column's DataNode); stages
with ``has_dali = False`` run on the CPU before the DALI graph in both engines.

Floating results are ``float32``: the CPU engine computes in float32 with the same float32
constants as DALI, so both engines agree within ``atol=rtol=1e-5`` (log1p: DALI computes
``log(x + 1)``). Categorical results are ``int64`` indices with a shared convention
(as in NVTabular's Categorify): **0 = missing value**, and for ``categorify`` **1 = out of
vocabulary**, vocabulary entries from 2; ``cardinality`` is the embedding table size.
"""
from __future__ import annotations

from .categorical import Categorify, Cross, Hash, OneHot
from .numeric import Bucketize, Clip, Fill, Label, Log1p, MinMax, Standardize
from .stage import ColumnStage

__all__ = ["STAGES"]

#: Every feature stage by its ``op`` in a pipeline file (its :attr:`ColumnStage.name`).
STAGES: dict[str, type[ColumnStage]] = {cls.name: cls for cls in (
    Fill, Standardize, MinMax, Log1p, Clip, Bucketize, Hash, Categorify, OneHot, Cross, Label)}
