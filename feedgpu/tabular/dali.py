"""The DALI engine of a table pipeline (CPU operators with ``device_id=None``, or the GPU).

Same stage definitions as the CPU engine (:mod:`feedgpu.tabular.ops`). Per batch:

1. on the CPU: rows are gathered and joined, and the stages DALI has no operator for run in
   order (``fill``: no select operator; ``label``; integer ``categorify`` whose values are not
   small non-negative lookup keys); they must come before any stage that reads their outputs
   from DALI, else :class:`ConfigError` at build;
2. in one DALI graph, batch size 1, each column fed as one 1-D sample of ``B`` values through
   ``fn.external_source`` (one sample per column keeps DALI's per-sample overhead out): arithmetic
   for standardize/minmax/clip/log1p/bucketize/hash/cross, ``fn.lookup_table`` for string
   vocabularies and string hashes (fed as dictionary codes + 1, the table computed on the CPU per
   dictionary entry; dictionaries over 65,536 entries are mapped on the CPU, as
   ``fn.lookup_table`` takes keys up to 65,535), ``fn.one_hot``, ``fn.cast``, and ``fn.cat`` for
   the dense matrix.

The lookup tables are built from the column dictionaries seen so far; when a batch brings new
dictionary entries the graph is rebuilt (``builds`` counts it; a shuffled epoch sees every row
group in its first batches, so this settles at once).
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from . import ops as O
from .columns import StrColumn


#: ``fn.lookup_table`` accepts keys in [0, 65535]; larger string dictionaries are mapped on the CPU.
MAX_LOOKUP_KEYS = 65536


class _Nodes:
    def __init__(self, fn, types, cols: dict, device: str):
        self.fn, self.types, self.cols, self.device = fn, types, cols, device
        self.made: dict = {}
        self.feeds: list[tuple[str, str, object]] = []   # (external name, column, how)
        self.tables: list[tuple] = []                   # (column, dictionary, length) built for
        self.cpu_lookups = 0

    def is_str(self, c: str) -> bool:
        return c not in self.made and isinstance(self.cols.get(c), StrColumn)

    def __call__(self, c: str):
        if c in self.made:
            return self.made[c]
        v = self.cols.get(c)
        if v is None:
            raise ConfigError(f"dali engine: column {c!r} is not in the batch")
        if isinstance(v, StrColumn):
            raise ConfigError(f"dali engine: column {c!r} holds strings; this stage needs numbers")
        integer = v.dtype.kind in "iub"
        node = self.fn.external_source(name=c, ndim=v.ndim, dtype=self.types.INT64 if integer else self.types.FLOAT,
                                       device=self.device)
        self.feeds.append((c, c, "int" if integer else "float"))
        self.made[c] = node
        return node

    def lookup(self, c: str, dictmap):
        v = self.cols[c]
        table = dictmap.table(v.dictionary)
        name = f"{c}#codes{len(self.feeds)}"
        node = self.fn.external_source(name=name, ndim=1, dtype=self.types.INT64, device=self.device)
        if len(table) > MAX_LOOKUP_KEYS:  # fn.lookup_table takes keys in [0, 65535]: map on the CPU
            self.feeds.append((name, c, dictmap))
            self.cpu_lookups += 1
            return node
        self.feeds.append((name, c, "codes"))
        self.tables.append((c, v.dictionary, len(v.dictionary)))
        return self.fn.lookup_table(node, keys=list(range(len(table))), values=table.tolist(),
                                    default_value=int(dictmap.missing), dtype=self.types.INT64)


class DaliTableEngine:
    """Args: ``pipeline`` (a :class:`TablePipeline`), ``threads`` (DALI CPU threads),
    ``device`` (``"cpu"``: ``device_id=None``; ``"gpu"``: arithmetic on ``device_id``, outputs
    copied back to host arrays)."""

    def __init__(self, pipeline, threads: int = 1, device: str = "cpu", device_id: int = 0):
        from ..exec.dali.graph import dali_available

        if not dali_available():
            raise ConfigError("engine 'dali' needs NVIDIA DALI (pip install feedgpu[dali]); use engine: python")
        self.p, self.threads, self.device, self.device_id = pipeline, threads, device, device_id
        self.cpu_stages, self.dali_stages = [], []
        on_dali: set[str] = set()
        for st in pipeline.stages:
            if st.has_dali:
                self.dali_stages.append(st)
                on_dali |= set(st.outputs)
            else:
                late = [c for c in st.inputs if c in on_dali]
                if late:
                    raise ConfigError(f"engine 'dali': {st.label} runs on the CPU but reads {late}, made by an earlier "
                                      "DALI stage; move it before them")
                self.cpu_stages.append(st)
                on_dali -= set(st.outputs)
        self.label = pipeline.cfg.outputs.label
        kinds = {**pipeline.source.kinds, **{c: k for j in pipeline.joins for c, k in j.outputs().items()}}
        self.hash_checks = [st for st in self.dali_stages if isinstance(st, O.Hash) and st.inputs[0] not in on_dali
                            and kinds.get(st.inputs[0]) == "int"]
        self.pipe, self.nodes, self.builds = None, None, 0

    def _build(self, cols: dict) -> None:
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline

        out = self.p.cfg.outputs
        pipe = Pipeline(batch_size=1, num_threads=self.threads,
                        device_id=None if self.device == "cpu" else self.device_id,
                        exec_pipelined=False, exec_async=False, prefetch_queue_depth=1)
        nodes = _Nodes(fn, types, cols, self.device)  # on the GPU, inputs are copied there and every op runs there
        with pipe:
            for st in self.dali_stages:
                nodes.made.update(st.dali(nodes))
            parts = []
            for c in out.dense:
                x = fn.cast(nodes(c), dtype=types.FLOAT)
                parts.append(x if self._is_2d(c) else fn.expand_dims(x, axes=[1]))
            outs = [fn.cat(*parts, axis=1) if len(parts) > 1 else parts[0]] if parts else []
            for c in out.categorical:
                x = nodes(c)
                outs.append(fn.cast(x, dtype=types.INT64))
            self.oov_outputs = [st.outputs[0] for st in self.dali_stages
                                if isinstance(st, O.Categorify) and st.outputs[0] not in out.categorical]
            outs += [nodes(c) for c in self.oov_outputs]
            pipe.set_outputs(*outs)
        pipe.build()
        self.pipe, self.nodes = pipe, nodes
        self.builds += 1

    def _is_2d(self, c: str) -> bool:
        st = next((s for s in reversed(self.p.stages) if c in s.outputs), None)
        return isinstance(st, O.OneHot)

    def _stale(self, cols: dict) -> bool:
        if self.pipe is None:
            return True
        return any(not isinstance(cols.get(c), StrColumn) or cols[c].dictionary is not d or len(d) > n
                   for c, d, n in self.nodes.tables)

    def transform(self, indices) -> dict:
        """Same outputs as :meth:`TablePipeline.transform` (dense float32 within atol=rtol=1e-5)."""
        p = self.p
        cols = p._read(indices)
        for st in self.cpu_stages:
            st.apply(cols)
        for st in self.hash_checks:  # the CPU engine's range check of hashed integers
            st.check_ints(cols[st.inputs[0]])
        if self._stale(cols):
            self._build(cols)
        for name, c, how in self.nodes.feeds:
            v = cols[c]
            if how == "codes":
                arr = v.codes.astype(np.int64) + 1
            elif not isinstance(how, str):  # a DictMap: the lookup done on the CPU
                arr = how.apply(v)
            elif how == "int":
                arr = np.ascontiguousarray(v, np.int64)
            else:
                arr = np.ascontiguousarray(v, np.float32)
            self.pipe.feed_input(name, [arr])
        res = self.pipe.run()
        out, k, o = {}, 0, p.cfg.outputs
        n = len(indices)

        def host(t):
            if self.device == "gpu":
                t = t.as_cpu()
            return np.array(t.as_array()[0])

        if o.dense:
            out["dense"] = host(res[0]).reshape(n, -1)
            k = 1
        else:
            out["dense"] = np.zeros((n, 0), np.float32)
        p.check_nan(out["dense"])
        for c in o.categorical:
            out[c] = host(res[k])
            k += 1
        extra = {c: host(res[k + i]) for i, c in enumerate(self.oov_outputs)}
        for st in self.dali_stages:  # out-of-vocabulary count (and on_oov: raise) on the result
            if isinstance(st, O.Categorify):
                st.check_oov(out[st.outputs[0]] if st.outputs[0] in out else extra[st.outputs[0]])
        if o.label:
            out[o.label] = cols[o.label]
        return out
