"""The DALI engine of table pipelines against the CPU engine, on DALI's CPU operators
(``device_id=None``): integer outputs exactly equal, dense float32 within atol=rtol=1e-5."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")

from feedgpu.errors import ConfigError, TableDataError  # noqa: E402
from feedgpu.tabular import TablePipeline  # noqa: E402
from feedgpu.tabular.dali import DaliTableEngine  # noqa: E402

from conftest import REPO, SHARED  # noqa: E402

YAML = REPO / "pipelines" / "flights_features.yaml"
TABLES = SHARED / "data" / "tables"
pytestmark = [pytest.mark.dali, pytest.mark.timeout(180)]
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def flights(tmp_path_factory):
    return TablePipeline.from_yaml(YAML, **{"fit.path": str(tmp_path_factory.mktemp("fit") / "f.json")})


def assert_parity(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if a[k].dtype.kind == "f":
            np.testing.assert_allclose(a[k], b[k], **TOL, err_msg=k)
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_flights_yaml_parity_over_an_epoch_of_batches(flights):
    eng = DaliTableEngine(flights)
    perm = np.random.default_rng(0).permutation(len(flights))
    for b in range(0, len(perm), 40_000):  # 9 batches of up to 40,000 rows cover every row
        idx = perm[b:b + 40_000]
        assert_parity(flights.transform(idx), eng.transform(idx))
    assert eng.builds == 1  # the first batch saw every row group: dictionaries complete
    placed = flights.with_engine("dali").explain()
    assert "standardize(dep_delay) -> ['dep_delay'] [dali]" in placed and "fill(dep_delay)" in placed


def test_flights_yaml_switches_engine_with_one_key(flights, tmp_path):
    p = TablePipeline.from_yaml(YAML, **{"engine.name": "dali", "fit.path": str(tmp_path / "f.json")})
    assert p.engine == "dali"
    a = [b for b in flights.loader(batch_size=20_000, seed=5)]
    d = [b for b in p.loader(batch_size=20_000, seed=5, num_workers=2)]  # each worker builds its own graph
    assert len(a) == len(d)
    for x, y in zip(a, d):
        assert_parity({k: v.numpy() for k, v in x.items()}, {k: v.numpy() for k, v in y.items()})
        assert isinstance(y["dense"], torch.Tensor)


def _cfg(features, **outputs):
    return {"kind": "table", "source": {"path": str(TABLES / "flights.parquet")}, "features": features,
            "outputs": {"dense": [], "categorical": [], "label": None, **outputs}, "fit": {"max_rows": 50_000}}


def test_each_stage_kind_on_dali(tmp_path):
    p = TablePipeline.from_config(_cfg([
        {"op": "clip", "columns": ["air_time"], "min": 30, "max": 400},      # NaN kept
        {"op": "log1p", "columns": ["air_time"]},
        {"op": "bucketize", "column": "dep_delay", "out": "dq", "quantiles": 5},
        {"op": "categorify", "column": "hour", "out": "hour_idx"},          # integers via lookup_table
        {"op": "categorify", "column": "flight", "out": "flight_idx", "min_count": 300},
        {"op": "categorify", "column": "sched_dep_time", "out": "sdt_idx", "min_count": 1000},
        {"op": "hash", "column": "dest", "out": "dh", "buckets": 17},
        {"op": "one_hot", "column": "dq"},
        {"op": "cross", "columns": ["dq", "hour_idx", "dh"], "out": "x", "buckets": 99},
    ], dense=["air_time", "dq_one_hot"], categorical=["dq", "hour_idx", "flight_idx", "sdt_idx", "dh", "x"],
        on_nan="keep"))
    eng = DaliTableEngine(p)
    assert all(s.has_dali for s in p.stages)
    idx = np.random.default_rng(2).permutation(len(p))[:30_000]
    a, b = p.transform(idx), eng.transform(idx)
    assert np.isnan(a["dense"][:, 0]).any()
    assert_parity(a, b)


def test_dali_errors(tmp_path):
    p = TablePipeline.from_config(_cfg([{"op": "standardize", "columns": ["dep_delay"]},
                                        {"op": "fill", "columns": ["dep_delay"]}], dense=["dep_delay"]))
    with pytest.raises(ConfigError, match="move it before"):
        DaliTableEngine(p)
    p = TablePipeline.from_config(_cfg([{"op": "standardize", "columns": ["dep_delay"]}], dense=["dep_delay"]))
    with pytest.raises(TableDataError, match="NaN in dense"):
        DaliTableEngine(p).transform(np.arange(5000))
    p = TablePipeline.from_config(_cfg([{"op": "categorify", "column": "dest", "out": "d", "min_count": 5000,
                                         "on_oov": "raise"}], categorical=[]))
    with pytest.raises(TableDataError, match="outside the vocabulary"):
        DaliTableEngine(p).transform(np.arange(5000))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flights_yaml_parity_on_the_gpu(flights):
    idx = np.random.default_rng(3).permutation(len(flights))[:50_000]
    eng = DaliTableEngine(flights, device="gpu")
    assert_parity(flights.transform(idx), eng.transform(idx))
    b = next(iter(flights.with_engine("dali", device="gpu").loader(batch_size=8192)))
    assert b["dense"].shape == (8192, len(flights.dense_names()))


def test_gpu_engine_refuses_workers(flights):
    with pytest.raises(ConfigError, match="main process"):
        next(iter(flights.with_engine("dali", device="gpu").loader(batch_size=1024, num_workers=1)))


def test_large_dictionaries_are_mapped_on_the_cpu(monkeypatch):
    import feedgpu.tabular.dali as D

    monkeypatch.setattr(D, "MAX_LOOKUP_KEYS", 50)  # dest (105 values) and tailnum exceed it, carrier does not
    p = TablePipeline.from_config(_cfg([
        {"op": "categorify", "column": "dest", "out": "d", "min_count": 20},
        {"op": "categorify", "column": "carrier", "out": "c"},
        {"op": "hash", "column": "tailnum", "out": "t", "buckets": 300}], categorical=["d", "c", "t"]))
    eng = DaliTableEngine(p)
    idx = np.random.default_rng(4).permutation(len(p))[:20_000]
    assert_parity(p.transform(idx), eng.transform(idx))
    assert eng.nodes.cpu_lookups == 2


def test_hashed_integers_out_of_range_raise_on_both_engines(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from feedgpu.tabular import SchemaError

    pq.write_table(pa.table({"k": pa.array([3, -1, 5], pa.int64())}), tmp_path / "neg.parquet")
    p = TablePipeline.from_config({"kind": "table", "source": {"path": str(tmp_path / "neg.parquet")},
                                   "features": [{"op": "hash", "column": "k", "out": "h", "buckets": 8}],
                                   "outputs": {"categorical": ["h"], "label": None}})
    with pytest.raises(SchemaError, match=r"\[0, 2\^31\)"):
        p.transform(np.arange(3))
    with pytest.raises(SchemaError, match=r"\[0, 2\^31\)"):
        DaliTableEngine(p).transform(np.arange(3))
    np.testing.assert_array_equal(p.transform(np.array([0, 2]))["h"], DaliTableEngine(p).transform(np.array([0, 2]))["h"])
