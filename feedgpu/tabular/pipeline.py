"""``TablePipeline``: Parquet rows -> lookup joins -> feature stages -> a dict of arrays.

Output of :meth:`TablePipeline.transform` for ``B`` row indices (the DataLoader turns each
array into a torch tensor, without a copy):

* ``"dense"``: float32 ``[B, D]``, the ``outputs.dense`` columns in order (a one-hot block adds
  its ``cardinality`` columns; :meth:`dense_names` names every column);
* one entry per ``outputs.categorical`` column: int64 ``[B]`` indices in
  ``[0, cardinalities()[name])`` (0 = missing; see :mod:`feedgpu.tabular.ops`);
* ``outputs.label`` (default ``"label"``): float32 or int64 ``[B]``.

NaN left in ``dense`` raises :class:`~feedgpu.errors.TableDataError` naming the columns, unless
``outputs.on_nan: keep``. The pipeline is a map-style dataset (``len``: rows; ``[i]``: one row's
outputs) that :class:`feedgpu.DataLoader` runs in batches (:meth:`make_work`). ``DataLoader(p)``
takes torch's defaults for a dataset (``shuffle=False``, ``batch_size=1``, a seed from torch's
RNG); :meth:`TablePipeline.loader` takes the YAML's ``loader`` section instead.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..config import load_yaml, merge
from ..errors import ConfigError, TableDataError
from .categorical import OneHot
from .columns import StrColumn
from .config import TablePipelineCfg, validate
from .fit import FitStore, digest
from .joins import LookupJoin
from .numeric import Label
from .ops import STAGES
from .source import TableSource
from .stage import ColumnStage

TABLE_FORMAT = "feedgpu.tabular/1"


def _list(v) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


class TablePipeline:
    """Build with :meth:`from_yaml` or :meth:`from_config`. Attributes: ``source``
    (:class:`TableSource`), ``joins``, ``stages`` (fitted), ``engine`` (``"python"``/``"dali"``),
    ``loader_cfg`` (the YAML's loader defaults), ``fit_store``."""

    def __init__(self, cfg: TablePipelineCfg, base_dir: str | os.PathLike = "."):
        self.cfg, base = cfg, Path(base_dir)

        def res(p):
            return [x if os.path.isabs(x) else str(base / x) for x in (os.path.expanduser(y) for y in _list(p))]

        self.joins = []
        for j in cfg.joins:
            on = {k: k for k in _list(j.keys)} if not isinstance(j.keys, dict) else dict(j.keys)
            cols = {k: k for k in j.columns} if isinstance(j.columns, list) else dict(j.columns)
            self.joins.append(LookupJoin(res(j.path), on, cols, j.indicator, j.duplicates, j.prefix, j.name))
        produced = {c for j in self.joins for c in j.outputs()}
        specs = self._expand(cfg.features)
        needed: list[str] = []
        for j in self.joins:
            needed += [c for c in j.on if c not in needed]
        made = set(produced)
        for spec in specs:
            for c in spec["inputs"]:
                if c not in made and c not in needed:
                    needed.append(c)
            made |= set(spec["outputs"])
        out = cfg.outputs
        for c in [*out.dense, *out.categorical, *([out.label] if out.label else [])]:
            if c not in made and c not in needed:
                needed.append(c)
        columns = cfg.source.columns if cfg.source.columns is not None else needed
        self.source = TableSource(res(cfg.source.path), columns, cfg.source.cache_bytes)
        self.read_columns = [c for c in needed if c in self.source.columns]
        self.engine_settings = cfg.engine
        self.loader_cfg = cfg.loader
        spec_hash = digest({"source": self.source.identity(), "joins": [j.model_dump() for j in cfg.joins],
                            "features": [s["config"] for s in specs]})
        fit_path = res(cfg.fit.path)[0] if cfg.fit.path else None
        self.fit_store = FitStore(fit_path, spec_hash, cfg.fit.mode)
        self.stages = self._build(specs)
        self.fit_store.save()
        self._check_outputs()

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def _expand(features) -> list[dict]:
        """One spec per stage instance (multi-column ops become one stage per column)."""
        specs = []
        for f in features:
            d = f.model_dump()
            op = d.pop("op")
            if op in ("fill", "standardize", "minmax", "log1p", "clip"):
                for c in _list(d.pop("columns")):
                    outs = [c] + ([f"{c}_missing"] if op == "fill" and d.get("indicator") else [])
                    specs.append({"op": op, "args": {"column": c, **d}, "inputs": [c], "outputs": outs})
            elif op == "cross":
                out = d.pop("out") or "_x_".join(d["columns"])
                specs.append({"op": op, "args": {**d, "out": out}, "inputs": d["columns"], "outputs": [out]})
            elif op == "label":
                s = Label(**d)
                specs.append({"op": op, "args": d, "inputs": s.inputs, "outputs": s.outputs})
            else:
                out = d.pop("out") or f"{d['column']}_{op}"
                specs.append({"op": op, "args": {**d, "out": out}, "inputs": [d["column"]], "outputs": [out]})
        for s in specs:
            s["config"] = {"op": s["op"], **s["args"]}
        return specs

    def _build(self, specs) -> list[ColumnStage]:
        cards: dict[str, int] = {}
        stages: list[ColumnStage] = []
        fit_cols = None
        for i, s in enumerate(specs):
            args = dict(s["args"])
            if s["op"] in ("one_hot", "cross"):
                ins = s["inputs"]
                missing = [c for c in ins if c not in cards]
                if missing:
                    raise ConfigError(f"features: {s['op']} of {missing} needs categorical input made by an earlier "
                                      "bucketize, hash, categorify or cross stage")
                if s["op"] == "one_hot":
                    args["cardinality"] = cards[ins[0]]
                else:
                    args["cards"] = [cards[c] for c in ins]
            st = STAGES[s["op"]](**args)
            key = f"{i}:{s['op']}({','.join(s['inputs'])})"
            if st.needs_fit:
                state = self.fit_store.get(key)
                if state is None:
                    if fit_cols is None:
                        fit_cols = self._fit_rows(stages)
                    state = st.fit(fit_cols)
                st.load(state)
                self.fit_store.put(key, s["config"], state)
            if fit_cols is not None:  # rare values of the fit rows are out of vocabulary by design: no raise
                mode = getattr(st, "on_oov", None)
                if mode:
                    st.on_oov = "index"
                st.apply(fit_cols)
                if mode:
                    st.on_oov = mode
            if st.out_kind == "cat":
                cards[s["outputs"][0]] = st.cardinality
            stages.append(st)
        self._cards = cards
        for st in stages:  # the fit pass's out-of-vocabulary count is not the training data's
            if hasattr(st, "oov"):
                st.oov = 0
        return stages

    def _fit_rows(self, earlier: list[ColumnStage]) -> dict:
        n, fc = len(self.source), self.cfg.fit
        idx = np.arange(n) if n <= fc.max_rows else np.sort(
            np.random.default_rng(fc.seed).choice(n, fc.max_rows, replace=False))
        cols = self._read(idx)
        for st in earlier:
            st.apply(cols)
        return cols

    def _check_outputs(self) -> None:
        kinds = self._kinds()
        out = self.cfg.outputs
        for c in out.dense:
            if c not in kinds:
                raise ConfigError(f"outputs.dense: no column {c!r} (available: {', '.join(sorted(kinds))})")
            if kinds[c] == "str":
                raise ConfigError(f"outputs.dense: {c!r} holds strings; categorify, hash or one-hot it first")
        for c in out.categorical:
            if c not in self._cards and kinds.get(c) != "int":
                raise ConfigError(f"outputs.categorical: {c!r} is not made by bucketize, hash, categorify or cross "
                                  "(nor an integer column)")
        if out.label and out.label not in kinds:
            raise ConfigError(f"outputs.label: no column {out.label!r}")

    def _kinds(self) -> dict:
        k = {c: self.source.kinds[c] for c in self.source.columns}
        for j in self.joins:
            k.update(j.outputs())
        for st in self.stages:
            for o in st.outputs:
                k[o] = "int" if st.out_kind == "cat" else ("label" if st.name == "label" else "float")
        return k

    @classmethod
    def from_config(cls, data: dict, where: str = "pipeline", base_dir: str | os.PathLike = ".") -> "TablePipeline":
        return cls(validate(data, where), base_dir)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides) -> "TablePipeline":
        """Relative paths in the file are relative to the file's directory. ``overrides``:
        dotted keys, e.g. ``**{"engine.name": "dali", "fit.path": None}``."""
        data = merge(load_yaml(path), overrides)
        return cls.from_config(data, str(path), Path(path).resolve().parent)

    # -- running --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        return {k: v[0] for k, v in self.transform(np.array([i])).items()}

    def _read(self, indices) -> dict:
        cols = self.source.take(indices, self.read_columns)
        for j in self.joins:
            j.apply(cols)
        return cols

    def transform(self, indices) -> dict:
        """Outputs for rows ``indices`` on the CPU engine (numpy): see the module docstring."""
        cols = self._read(indices)
        for st in self.stages:
            st.apply(cols)
        return self.assemble(cols, len(indices))

    def dense_names(self) -> list[str]:
        """Names of the ``dense`` columns (one-hot blocks as ``name=index``)."""
        names = []
        for c in self.cfg.outputs.dense:
            st = next((s for s in reversed(self.stages) if c in s.outputs), None)
            names += [f"{c}={k}" for k in range(st.width)] if isinstance(st, OneHot) else [c]
        return names

    def cardinalities(self) -> dict[str, int]:
        """Embedding table size of each categorical output (integer columns: max + 1 is the user's)."""
        return {c: self._cards[c] for c in self.cfg.outputs.categorical if c in self._cards}

    def assemble(self, cols: dict, n: int) -> dict:
        out = self.cfg.outputs
        parts = [np.asarray(cols[c], np.float32).reshape(n, -1) for c in out.dense]
        dense = np.concatenate(parts, axis=1) if parts else np.zeros((n, 0), np.float32)
        self.check_nan(dense)
        res = {"dense": dense}
        for c in out.categorical:
            v = cols[c]
            if isinstance(v, StrColumn):
                raise ConfigError(f"outputs.categorical: {c!r} holds strings")
            res[c] = np.asarray(v, np.int64)
        if out.label:
            res[out.label] = cols[out.label]
        return res

    def check_nan(self, dense: np.ndarray) -> None:
        if self.cfg.outputs.on_nan == "raise" and np.isnan(dense.sum()):
            bad = np.isnan(dense).sum(axis=0)
            names = self.dense_names()
            which = ", ".join(f"{names[i]} ({bad[i]} rows)" for i in np.nonzero(bad)[0][:8])
            raise TableDataError(f"NaN in dense features: {which}; fill them (op: fill) or set outputs.on_nan: keep")

    # -- identity -------------------------------------------------------------------------------
    def identity(self) -> str:
        """What a loader state is tied to: the source's identity (a refit keeps the row order)."""
        return self.source.identity()

    def fingerprint(self) -> str:
        """Hex digest of everything the outputs depend on: table format, feedgpu version, source and
        dimension tables, join and stage configurations, fit states (``fit_store.hash()``), outputs."""
        from .._version import __version__

        return digest({"format": TABLE_FORMAT, "feedgpu": __version__, "source": self.source.identity(),
                       "joins": [(j.identity, j.on, j.columns) for j in self.joins],
                       "stages": [s.config() for s in self.stages], "fit": self.fit_store.hash(),
                       "outputs": self.cfg.outputs.model_dump()})

    @property
    def engine(self) -> str:
        """``"python"`` or ``"dali"`` (``engine_settings.name``)."""
        return self.engine_settings.name

    @property
    def threads(self) -> int | None:
        return self.engine_settings.threads

    @property
    def device(self) -> str:
        """DALI's device, ``"cpu"`` or ``"gpu"``."""
        return self.engine_settings.device

    def with_engine(self, name: str, threads: int | None = None, device: str | None = None) -> "TablePipeline":
        """A copy running on engine ``name`` (``"python"`` or ``"dali"``; DALI ``device``
        ``"cpu"`` or ``"gpu"``; unset ones stay). The stages (and their fit states) are shared
        with this one; the engine settings are replaced (``dataclasses.replace``, validated:
        :class:`ConfigError` naming the key)."""
        import copy
        import dataclasses

        engine = dataclasses.replace(self.engine_settings, name=name,
                                     **{k: v for k, v in (("threads", threads), ("device", device)) if v is not None})
        p = copy.copy(self)   # shares the fitted stages, which a new pipeline would fit again
        p.engine_settings = engine
        return p

    def make_work(self, seed: int = 0):
        """The DataLoader's work object for this pipeline (:class:`~feedgpu.tabular.work.TableWork`)."""
        from .work import TableWork

        return TableWork(self)

    def loader(self, **kwargs):
        """A :class:`feedgpu.DataLoader` with the YAML's ``loader`` settings; ``kwargs`` override them."""
        from ..loader.front import DataLoader

        lc = self.loader_cfg
        d = dict(batch_size=lc.batch_size, shuffle=lc.shuffle, drop_last=lc.drop_last, num_workers=lc.num_workers,
                 seed=lc.seed, persistent_workers=lc.persistent_workers)
        if d["num_workers"] != 0:  # a count or "auto"
            d["prefetch_factor"] = lc.prefetch_factor
        d.update(kwargs)
        return DataLoader(self, **d)

    def explain(self) -> str:
        """Engine placement of each step, for the user."""
        lines = [f"table pipeline: {len(self)} rows from {len(self.source.paths)} file(s), "
                 f"{len(self.source.counts)} row groups; engine {self.engine}"]
        for j in self.joins:
            lines.append(f"  join {j.name}: on {j.on} -> {list(j.outputs())} [cpu]")
        for st in self.stages:
            where = "dali" if self.engine == "dali" and st.has_dali else "cpu"
            lines.append(f"  {st.label} -> {st.outputs} [{where}]")
        lines.append(f"  dense: {len(self.dense_names())} float32 columns; categorical: {self.cardinalities()}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TablePipeline({len(self)} rows, {len(self.stages)} stages, engine={self.engine})"
