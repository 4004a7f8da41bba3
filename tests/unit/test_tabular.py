"""Table feature pipelines (feedgpu.tabular) on the real flights tables in ../shared/data/tables.

Most tests use a subset (every 11th flight, ~30,600 rows) written as 3 Parquet files with
4,000-row row groups, so the many-files and row-group paths are exercised; the YAML pipeline
tests use the whole table.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from feedgpu import DataLoader
from feedgpu.errors import ConfigError, SourceError, StateError, TableDataError
from feedgpu.tabular import SchemaError, TablePipeline, TableSource
from feedgpu.tabular.stage import mult_hash, string_hash

from conftest import REPO, SHARED

TABLES = SHARED / "data" / "tables"
YAML = REPO / "pipelines" / "flights_features.yaml"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="session")
def flights_sub(tmp_path_factory):
    t = pq.read_table(TABLES / "flights.parquet")
    t = t.take(np.arange(0, t.num_rows, 11))
    d = tmp_path_factory.mktemp("flights")
    n = t.num_rows
    cuts = [0, n // 3, 2 * n // 3, n]
    for i in range(3):
        pq.write_table(t.slice(cuts[i], cuts[i + 1] - cuts[i]), d / f"part-{i}.parquet", row_group_size=4000)
    return d, t


def cfg(path, features, dense=(), categorical=(), label=None, joins=(), **extra) -> dict:
    d = {"kind": "table", "source": {"path": str(path)}, "joins": list(joins), "features": list(features),
         "outputs": {"dense": list(dense), "categorical": list(categorical), "label": label}}
    d.update(extra)
    return d


def build(path, *a, **kw) -> TablePipeline:
    return TablePipeline.from_config(cfg(path, *a, **kw))


def col(t, name) -> np.ndarray:
    return t[name].to_numpy(zero_copy_only=False).astype(np.float64)


# -- source -----------------------------------------------------------------------------------------
def test_source_index_and_random_access(flights_sub):
    d, t = flights_sub
    src = TableSource(d, ["dep_delay", "carrier", "tailnum", "distance"])
    assert len(src) == t.num_rows and len(src.paths) == 3 and len(src.counts) >= 9
    assert src.kinds == {"dep_delay": "float", "carrier": "str", "tailnum": "str", "distance": "int"}
    idx = np.random.default_rng(1).permutation(len(src))[:5000]
    got = src.take(idx)
    ref = t.take(pa.array(idx))
    np.testing.assert_array_equal(got["distance"], ref["distance"].to_numpy())
    np.testing.assert_array_equal(got["dep_delay"], col(ref, "dep_delay"))  # NaN where missing
    assert got["tailnum"].to_list() == ref["tailnum"].to_pylist()            # None where missing
    assert got["carrier"].to_list() == ref["carrier"].to_pylist()
    with pytest.raises(IndexError):
        src.take(np.array([len(src)]))


def test_source_errors(flights_sub, tmp_path):
    d, t = flights_sub
    with pytest.raises(ConfigError, match=r"column 'nope' is not in .*part-0\.parquet"):
        TableSource(d, ["dep_delay", "nope"])
    with pytest.raises(SourceError):
        TableSource(tmp_path / "missing.parquet")
    pq.write_table(pa.table({"x": pa.array([[1], [2]])}), tmp_path / "lists.parquet")
    with pytest.raises(SchemaError, match="'x'"):
        TableSource(tmp_path / "lists.parquet", ["x"])
    pq.write_table(pa.table({"x": pa.array(["a"])}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([1.0])}), tmp_path / "b.parquet")
    with pytest.raises(SourceError, match="column 'x'"):
        TableSource([tmp_path / "a.parquet", tmp_path / "b.parquet"])


# -- stages -------------------------------------------------------------------------------------------
def test_numeric_stages_match_numpy(flights_sub):
    d, t = flights_sub
    p = build(d, [
        {"op": "fill", "columns": ["dep_delay"], "strategy": "median"},
        {"op": "fill", "columns": ["air_time"], "strategy": "constant", "value": -1, "indicator": False},
        {"op": "clip", "columns": ["dep_delay"], "min": -30, "max": 120},
        {"op": "standardize", "columns": ["dep_delay"]},
        {"op": "log1p", "columns": ["distance"]},
        {"op": "minmax", "columns": ["distance", "air_time"]},
    ], dense=["dep_delay", "dep_delay_missing", "distance", "air_time"])
    out = p.transform(np.arange(len(p)))["dense"]
    assert out.dtype == np.float32 and out.shape == (len(p), 4)
    x = col(t, "dep_delay")
    miss = np.isnan(x)
    x = np.clip(np.where(miss, np.nanmedian(x), x), -30, 120)
    np.testing.assert_allclose(out[:, 0], (x - x.mean()) / x.std(), atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(out[:, 1], miss.astype(np.float32))
    lx = np.log1p(col(t, "distance"))
    np.testing.assert_allclose(out[:, 2], (lx - lx.min()) / (lx.max() - lx.min()), atol=1e-5)
    a = col(t, "air_time")
    a = np.where(np.isnan(a), -1, a)
    np.testing.assert_allclose(out[:, 3], (a - a.min()) / (a.max() - a.min()), atol=1e-5)


def test_categorical_stages(flights_sub):
    d, t = flights_sub
    p = build(d, [
        {"op": "bucketize", "column": "hour", "out": "hb", "boundaries": [6, 12, 18]},
        {"op": "bucketize", "column": "dep_delay", "out": "dq", "quantiles": 4},
        {"op": "categorify", "column": "dest", "out": "dest_idx", "min_count": 50},
        {"op": "categorify", "column": "flight", "out": "flight_idx", "max_size": 10},
        {"op": "hash", "column": "tailnum", "out": "th", "buckets": 100},
        {"op": "hash", "column": "flight", "out": "fh", "buckets": 100},
        {"op": "one_hot", "column": "hb"},
        {"op": "cross", "columns": ["hb", "dest_idx"], "out": "x", "buckets": 50},
    ], dense=["hb_one_hot"], categorical=["hb", "dq", "dest_idx", "flight_idx", "th", "fh", "x"])
    n = len(p)
    o = p.transform(np.arange(n))
    card = p.cardinalities()
    for c in ["hb", "dq", "dest_idx", "flight_idx", "th", "fh", "x"]:
        assert o[c].dtype == np.int64 and o[c].shape == (n,)
        assert o[c].min() >= 0 and o[c].max() < card[c]
    hour = col(t, "hour")
    np.testing.assert_array_equal(o["hb"], np.searchsorted([6, 12, 18], hour, side="right") + 1)
    assert card["hb"] == 5
    dq, dd = o["dq"], col(t, "dep_delay")
    assert (dq[np.isnan(dd)] == 0).all() and (dq[~np.isnan(dd)] >= 1).all()
    # vocabulary: frequency >= 50, most frequent first; rarer ones -> 1, missing -> 0
    dest = t["dest"].to_pylist()
    vc = pc.value_counts(t["dest"]).to_pylist()
    vocab = [v["values"] for v in sorted(vc, key=lambda v: (-v["counts"], v["values"])) if v["counts"] >= 50]
    ref = np.array([vocab.index(s) + 2 if s in vocab else 1 for s in dest])
    np.testing.assert_array_equal(o["dest_idx"], ref)
    assert card["dest_idx"] == len(vocab) + 2
    assert p.stages[2].oov == int((ref == 1).sum()) > 0
    assert card["flight_idx"] == 12 and set(np.unique(o["flight_idx"])) <= set(range(1, 12))
    tail = t["tailnum"].to_pylist()
    np.testing.assert_array_equal(o["th"], [0 if s is None else string_hash(s, 100) for s in tail])
    np.testing.assert_array_equal(o["fh"], mult_hash(t["flight"].to_numpy(), 100))
    oh = o["dense"]
    assert oh.shape == (n, 5) and (oh.sum(1) == 1).all() and (oh.argmax(1) == o["hb"]).all()
    assert p.dense_names() == [f"hb_one_hot={k}" for k in range(5)]
    key = o["hb"] * card["dest_idx"] + o["dest_idx"]
    np.testing.assert_array_equal(o["x"], np.where((o["hb"] > 0) & (o["dest_idx"] > 0), mult_hash(key, 50), 0))


def test_string_hash_is_stable():
    assert string_hash("N14228", 2048) == string_hash("N14228", 2048)
    assert 1 <= string_hash("", 7) <= 7


def test_label_expressions(flights_sub):
    d, t = flights_sub
    feats = [{"op": "label", "expr": "arr_delay > 15", "if_missing": 1}]
    o = build(d, feats, label="label").transform(np.arange(2000))
    a = col(t, "arr_delay")[:2000]
    np.testing.assert_array_equal(o["label"], np.where(np.isnan(a), 1.0, a > 15).astype(np.float32))
    assert o["label"].dtype == np.float32
    p = build(d, [{"op": "label", "expr": "arr_delay>=0", "dtype": "int64"}], label="label")
    with pytest.raises(TableDataError, match="arr_delay"):
        p.transform(np.arange(len(p)))
    with pytest.raises(ConfigError, match="expected"):
        build(d, [{"op": "label", "expr": "arr_delay > 15 and 1"}], label="label")


# -- joins --------------------------------------------------------------------------------------------
def test_weather_and_planes_joins_match_pyarrow(flights_sub):
    d, t = flights_sub
    joins = [{"name": "weather", "path": str(TABLES / "weather.parquet"),
              "keys": ["origin", "year", "month", "day", "hour"], "columns": {"temp": "w_temp"},
              "prefix": "weather_", "duplicates": "first"},
             {"name": "planes", "path": str(TABLES / "planes.parquet"), "keys": {"tailnum": "tailnum"},
              "columns": {"seats": "seats", "manufacturer": "maker"}, "prefix": "plane_"}]
    c = cfg(d, [{"op": "categorify", "column": "maker", "out": "maker_idx"}],
            dense=["w_temp", "weather_matched", "seats", "plane_matched"], categorical=["maker_idx"], joins=joins)
    c["outputs"]["on_nan"] = "keep"
    p = TablePipeline.from_config(c)
    o = p.transform(np.arange(len(p)))["dense"]
    w = pq.read_table(TABLES / "weather.parquet")
    keys = ["origin", "year", "month", "day", "hour"]
    w = w.group_by(keys, use_threads=False).aggregate([("temp", "first")]).rename_columns(keys + ["temp"])
    tt = t.append_column("row", pa.array(np.arange(t.num_rows)))
    j = tt.join(w, keys, join_type="left outer").sort_by("row")
    ref = col(j, "temp")
    np.testing.assert_array_equal(o[:, 0].astype(np.float64), ref.astype(np.float32).astype(np.float64))
    pl = pq.read_table(TABLES / "planes.parquet")
    jp = tt.join(pl.select(["tailnum", "seats"]), "tailnum", join_type="left outer").sort_by("row")
    seats = col(jp, "seats")
    np.testing.assert_array_equal(o[:, 2], seats.astype(np.float32))
    np.testing.assert_array_equal(o[:, 3], (~np.isnan(seats)).astype(np.float32))
    assert 0 < o[:, 3].mean() < 1 and o[:, 1].mean() > 0.99
    del joins[0]["duplicates"]
    with pytest.raises(ConfigError, match="duplicate keys.*month=11, day=3, hour=1"):
        build(d, [], joins=joins[:1])


# -- fit statistics -------------------------------------------------------------------------------------
def test_fit_is_stored_reused_and_fingerprinted(flights_sub, tmp_path):
    d, t = flights_sub
    feats = [{"op": "standardize", "columns": ["distance"]},
             {"op": "categorify", "column": "dest", "out": "dest_idx", "min_count": 10}]
    fit = {"path": str(tmp_path / "fit.json")}
    p1 = build(d, feats, dense=["distance"], categorical=["dest_idx"], fit=fit)
    doc = json.loads((tmp_path / "fit.json").read_text())
    assert doc["format"] == "feedgpu.tabular.fit/1" and len(doc["stages"]) == 2 and doc["hash"]
    assert not p1.fit_store.loaded
    p2 = build(d, feats, dense=["distance"], categorical=["dest_idx"], fit={**fit, "mode": "load"})
    assert p2.fit_store.loaded and p2.fingerprint() == p1.fingerprint()
    idx = np.arange(3000)
    for k, v in p1.transform(idx).items():
        np.testing.assert_array_equal(v, p2.transform(idx)[k])
    # another vocabulary: the spec differs, so it is refitted, and the fingerprint changes
    feats[1]["min_count"] = 500
    p3 = build(d, feats, dense=["distance"], categorical=["dest_idx"], fit=fit)
    assert not p3.fit_store.loaded and p3.fingerprint() != p1.fingerprint()
    assert p3.cardinalities()["dest_idx"] < p1.cardinalities()["dest_idx"]
    with pytest.raises(ConfigError, match="no fit file"):
        build(d, feats, dense=["distance"], fit={"path": str(tmp_path / "none.json"), "mode": "load"})
    feats[1]["min_count"] = 10
    doc["stages"][1]["state"]["vocab"][0] = "XXX"  # edited by hand: refused
    (tmp_path / "fit.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="damaged"):
        build(d, feats, dense=["distance"], categorical=["dest_idx"], fit=fit)


def test_fingerprint_changes_with_vocabulary_state(flights_sub):
    d, _ = flights_sub
    feats = [{"op": "categorify", "column": "carrier", "out": "c"}]
    p = build(d, feats, categorical=["c"])
    f0 = p.fingerprint()
    st = p.fit_store.states
    key = next(iter(st))
    st[key] = {**st[key], "vocab": list(reversed(st[key]["vocab"]))}
    assert p.fingerprint() != f0


# -- bad input ------------------------------------------------------------------------------------------
def test_bad_input_errors(flights_sub):
    d, _ = flights_sub
    with pytest.raises(ConfigError, match=r"'nope' is not in .*part-0\.parquet"):
        build(d, [{"op": "standardize", "columns": ["nope"]}], dense=["nope"])
    with pytest.raises(SchemaError, match="'carrier' holds strings"):
        build(d, [{"op": "standardize", "columns": ["carrier"]}], dense=["carrier"])
    with pytest.raises(ConfigError, match="needs categorical input"):
        build(d, [{"op": "bucketize", "column": "dep_delay", "out": "b", "boundaries": [0]},
                  {"op": "cross", "columns": ["b", "dep_delay"], "buckets": 4}])
    p = build(d, [{"op": "hash", "column": "dep_delay", "out": "h", "buckets": 4}], categorical=["h"])
    with pytest.raises(SchemaError, match="'dep_delay' must hold integers without missing values"):
        p.transform(np.arange(10))
    with pytest.raises(ConfigError, match="holds strings"):
        build(d, [], dense=["carrier"])
    p = build(d, [{"op": "standardize", "columns": ["dep_delay"]}], dense=["dep_delay"])
    with pytest.raises(TableDataError, match=r"NaN in dense features: dep_delay \(\d+ rows\)"):
        p.transform(np.arange(len(p)))
    p = build(d, [{"op": "categorify", "column": "dest", "out": "di", "min_count": 1000, "on_oov": "raise"}],
              categorical=["di"], fit={"path": None})
    with pytest.raises(TableDataError, match="outside the vocabulary"):
        p.transform(np.arange(len(p)))
    with pytest.raises(ConfigError, match=r"features\[0\].*unknown op 'scale'; allowed: fill"):
        build(d, [{"op": "scale", "columns": ["x"]}])
    with pytest.raises(TableDataError, match="every value of 'w_temp' is missing"):
        build(d, [{"op": "standardize", "columns": ["w_temp"]}], dense=["w_temp"], joins=[  # dest is never NYC
            {"name": "w", "path": str(TABLES / "weather.parquet"), "keys": {"dest": "origin", "hour": "hour"},
             "columns": {"temp": "w_temp"}, "duplicates": "first"}])
    with pytest.raises(ConfigError, match="one_hot of"):
        build(d, [{"op": "one_hot", "column": "hour"}])


# -- the YAML pipeline and the DataLoader ------------------------------------------------------------------
@pytest.fixture(scope="session")
def flights(tmp_path_factory):
    fit = tmp_path_factory.mktemp("fit") / "flights.fit.json"
    return TablePipeline.from_yaml(YAML, **{"fit.path": str(fit)})


def test_yaml_pipeline_outputs(flights):
    assert len(flights) == 336_776
    o = flights.transform(np.arange(0, len(flights), 97))
    n = len(o["label"])
    assert o["dense"].dtype == np.float32 and o["dense"].shape == (n, len(flights.dense_names()))
    assert not np.isnan(o["dense"]).any()
    for c, card in flights.cardinalities().items():
        assert o[c].dtype == np.int64 and o[c].shape == (n,) and 0 <= o[c].min() and o[c].max() < card
    assert set(np.unique(o["label"])) == {0.0, 1.0}
    assert "join weather" in flights.explain()


def batches(dl):
    return [{k: v.clone() for k, v in b.items()} for b in dl]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_loader_order_workers_and_sharding(flights_sub):
    d, _ = flights_sub
    p = build(d, [{"op": "fill", "columns": ["dep_delay"]}, {"op": "standardize", "columns": ["distance"]},
                  {"op": "categorify", "column": "tailnum", "out": "tail"}],
              dense=["dep_delay", "distance"], categorical=["tail", "flight"])
    a = batches(DataLoader(p, batch_size=1000, shuffle=True, seed=3))
    assert a[0]["dense"].dtype == torch.float32 and a[0]["dense"].shape == (1000, 2)
    assert a[0]["tail"].dtype == torch.int64 and len(a) == -(-len(p) // 1000)
    same(a, batches(DataLoader(p, batch_size=1000, shuffle=True, seed=3, num_workers=2)))
    same(a, batches(DataLoader(p, batch_size=1000, shuffle=True, seed=3, num_workers="auto")))
    assert not torch.equal(a[0]["flight"], batches(DataLoader(p, batch_size=1000, shuffle=True, seed=4))[0]["flight"])
    # the rows are the sampler's: flight numbers of the epoch are a permutation of the table's
    allf = torch.cat([b["flight"] for b in a]).numpy()
    np.testing.assert_array_equal(np.sort(allf), np.sort(p.source.read_all(["flight"])["flight"]))
    shards = [batches(DataLoader(p, batch_size=500, seed=3, rank=r, world_size=2, drop_last=True)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1])
    rows = [torch.cat([b["dense"] for b in s]) for s in shards]
    assert rows[0].shape == rows[1].shape


def test_loader_resume_mid_epoch(flights_sub):
    d, _ = flights_sub
    p = build(d, [{"op": "hash", "column": "tailnum", "out": "th", "buckets": 64}], categorical=["th", "flight"])
    full = batches(DataLoader(p, batch_size=700, seed=11, num_workers=2))
    dl = DataLoader(p, batch_size=700, seed=11, num_workers=2)
    it = iter(dl)
    head = [{k: v.clone() for k, v in next(it).items()} for _ in range(5)]
    state = dl.state_dict()
    del it
    dl2 = DataLoader(p, batch_size=700, seed=0)
    dl2.load_state_dict(state)
    same(head + batches(dl2), full)
    with pytest.raises(ConfigError, match="collate_fn"):
        DataLoader(p, batch_size=10, collate_fn=list)
    other = build(TABLES / "planes.parquet", [], categorical=["engines"])
    with pytest.raises(StateError):
        DataLoader(other, batch_size=700).load_state_dict(state)


def test_pipeline_loader_uses_yaml_settings(flights):
    dl = flights.loader(batch_size=8192)
    assert dl.batch_size == 8192 and dl.shuffle and len(dl) == -(-len(flights) // 8192)
    b = next(iter(dl))
    assert set(b) == {"dense", *flights.cardinalities(), "label"}
    dl.shutdown()


def test_cli_validates_and_explains_table_pipelines(tmp_path):
    from click.testing import CliRunner

    from feedgpu.cli.main import main

    fit = f"fit.path={tmp_path / 'f.json'}"
    r = CliRunner().invoke(main, ["pipeline", "explain", str(YAML), "--set", fit, "--set", "engine.name=dali"])
    assert r.exit_code == 0, r.output
    assert "join planes" in r.output and "[dali]" in r.output and "dense: 38 float32 columns" in r.output
    r = CliRunner().invoke(main, ["pipeline", "validate", str(YAML), "--set", fit])
    assert r.exit_code == 0 and "table: 34 stages" in r.output, r.output


def test_loader_batches_are_the_sharded_orders_rows(flights_sub):
    from feedgpu.order.sharded import ShardedOrder

    d, _ = flights_sub
    p = build(d, [{"op": "standardize", "columns": ["distance"]}], dense=["distance"], categorical=["flight", "hour"])
    seen = []
    for r in (0, 1):
        dl = DataLoader(p, batch_size=900, shuffle=True, seed=8, rank=r, world_size=2, persistent_workers=True,
                        num_workers=2)
        order = ShardedOrder(len(p), 900, shuffle=True, seed=8, rank=r, world_size=2, drop_last=False)
        for epoch in (0, 1):
            got = batches(dl)
            assert len(got) == len(order)
            for b in (0, len(got) - 1):
                ref = p.transform(order.batch(epoch, b))
                for k in ref:
                    assert torch.equal(got[b][k], torch.from_numpy(ref[k])), (k, r, epoch, b)
        seen.append(np.concatenate([order.batch(0, b) for b in range(len(order))]))
        dl.shutdown()
    assert len(np.intersect1d(seen[0], seen[1])) <= 1  # one row may pad the shorter rank


def test_row_group_cache_budget_and_single_rows(flights_sub):
    d, t = flights_sub
    src = TableSource(d, ["dep_delay", "dest"], cache_bytes=1)  # keeps one row group decoded
    idx = np.random.default_rng(5).permutation(len(src))[:3000]
    got = src.take(idx)
    np.testing.assert_array_equal(got["dep_delay"], col(t.take(pa.array(idx)), "dep_delay"))
    assert len(src._cache) == 1 and src.row_groups_read == len(np.unique(np.searchsorted(src.starts, idx, "right")))
    p = build(d, [{"op": "categorify", "column": "dest", "out": "di"}], categorical=["di"], label=None)
    row = p[17]
    assert row["di"].dtype == np.int64 and row["dense"].shape == (0,)
    assert row["di"] == p.transform(np.arange(18))["di"][17]


def test_with_engine_replaces_validated_engine_settings():
    """The table pipeline's ``engine:`` is one frozen settings object; with_engine replaces it
    (validated) on a copy that shares the fitted stages."""
    import dataclasses

    p = build(TABLES / "planes.parquet", [], categorical=["engines"])
    d = p.with_engine("dali", threads=2)
    assert (d.engine, d.threads, d.device) == ("dali", 2, "cpu") and d.stages is p.stages
    assert (p.engine, p.threads) == ("python", None)   # unchanged
    assert d.with_engine("dali", device="gpu").threads == 2   # unset ones stay
    for bad, key in ((dict(name="tensorrt"), "engine.name"), (dict(name="dali", device="tpu"), "engine.device"),
                     (dict(name="dali", threads=0), "engine.threads")):
        with pytest.raises(ConfigError, match=f"{key}: "):
            p.with_engine(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.engine_settings.name = "dali"
    with pytest.raises(ConfigError, match=r"engine\.gpu: unknown key 'gpu'"):
        TablePipeline.from_config(cfg(TABLES / "planes.parquet", [], categorical=["engines"], engine={"gpu": 1}))


def test_the_feature_stages_are_column_stages_named_by_their_yaml_op():
    """One registry: each ``op`` a pipeline file may write builds the stage whose ``name`` it is,
    and the stages name their parts as the image stages do (``name``, ``has_dali``)."""
    import typing

    from feedgpu.tabular import ColumnStage
    from feedgpu.tabular.config import FeatureCfg
    from feedgpu.tabular.ops import STAGES

    union = typing.get_args(FeatureCfg)[0]
    yaml_ops = {typing.get_args(m.model_fields["op"].annotation)[0] for m in typing.get_args(union)}
    assert set(STAGES) == yaml_ops
    for op, cls in STAGES.items():
        assert issubclass(cls, ColumnStage) and cls.name == op
        assert not hasattr(cls, "op") and not hasattr(cls, "dali_ok")
    assert sorted(n for n, c in STAGES.items() if c.has_dali is False) == ["fill", "label"]
