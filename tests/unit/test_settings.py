"""One settings model: each YAML section is one frozen settings class (feedgpu.settings) whose
defaults and bounds serve YAML, ``Pipeline(...)`` keywords, ``Pipeline.replace`` and the
DataLoader's overrides alike."""
from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from conftest import REPO
from feedgpu import ConfigError, DataLoader, Pipeline
from feedgpu.cache import CacheSettings, parse_compression
from feedgpu.config import pipeline_model, validate
from feedgpu.pipeline import LOADER_KEYS
from feedgpu.cache.settings import CacheSection
from feedgpu.exec.engines import EngineSettings
from feedgpu.exec.executors import ExecutorSettings
from feedgpu.settings import SECTIONS, LoaderSettings, OutputSettings, SourceSettings
from feedgpu.settings_base import defaults
from feedgpu.stages import Decode, Normalize, RandomResizedCrop, ResizeCenterCrop

TRAIN = REPO / "pipelines" / "imagenet_train.yaml"
SRC = {"format": "folder", "path": "/nonexistent/not-opened"}
UINT8 = {"source": SRC, "output": {"dtype": "uint8", "layout": "NHWC"},
         "stages": [{"op": "decode"}, {"op": "resize_center_crop", "resize": 40, "crop": 32}]}

#: (section, field, a value its bounds refuse)
BAD = [("loader", "batch_size", 0), ("loader", "prefetch_factor", 0), ("loader", "num_workers", -1),
       ("loader", "shard_window", 0), ("loader", "on_error", "ignore"), ("loader", "max_skipped", 1.5),
       ("loader", "max_skipped", True), ("loader", "worker_memory", "1KiB"), ("loader", "timeout", -1.0),
       ("loader", "shuffle", "blocks"), ("output", "device", "tpu"), ("output", "dtype", "int8"),
       ("engine", "name", "tensorrt"), ("engine", "device", "tpu"), ("engine", "threads", 0),
       ("engine", "hw_decoder_load", 1.5), ("executor", "name", "spark"), ("executor", "max_remote_workers", -1),
       ("executor", "cpus_per_worker", 0), ("executor", "max_local_workers", 0), ("cache", "compression", "zstd:23"),
       ("cache", "compression", "lz4"), ("cache", "max_size", "big"), ("cache", "max_size", 0),
       ("source", "format", "zip")]


def test_every_section_is_a_frozen_settings_class():
    for section, cls in SECTIONS.items():
        s = cls(format="folder") if cls is SourceSettings else cls()
        field = dataclasses.fields(s)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(s, field, getattr(s, field))
        assert pickle.loads(pickle.dumps(s)) == s   # pipelines travel to worker processes
        assert hash(s) == hash(pickle.loads(pickle.dumps(s)))


@pytest.mark.parametrize("section, field, bad", BAD, ids=lambda v: str(v))
def test_replace_validates_and_names_the_key(section, field, bad):
    cls = SECTIONS[section]
    s = cls(format="folder") if cls is SourceSettings else cls()
    with pytest.raises(ConfigError, match=f"{section}\\.{field}: ") as e:
        dataclasses.replace(s, **{field: bad})
    assert "Traceback" not in str(e.value) and "pydantic" not in str(e.value)
    with pytest.raises(ConfigError, match=f"{section}\\.{field}: "):   # and made directly
        cls(**{**({"format": "folder"} if cls is SourceSettings else {}), field: bad})


@pytest.mark.parametrize("section, field, bad", BAD, ids=lambda v: str(v))
def test_yaml_names_the_same_key(section, field, bad):
    data = {**UINT8, section: {**UINT8.get(section, {}), field: bad}}
    if section == "cache":
        data["cache"]["enabled"] = True
    with pytest.raises(ConfigError, match=f"  {section}\\.{field}: "):
        Pipeline.from_config(data)


def test_yaml_sections_are_the_settings_classes_and_their_defaults():
    """The YAML schema restates no default: each section's model is the settings class, and a
    file that leaves a section out gets the class's defaults, field by field."""
    model = pipeline_model()
    for section, cls in SECTIONS.items():
        assert model.model_fields[section].annotation is cls, section
    c = validate(UINT8)
    for section, cls in SECTIONS.items():
        if section in ("source", "output"):   # required / set by the file
            continue
        assert dataclasses.asdict(getattr(c, section)) == dataclasses.asdict(cls()), section
    # a section given in part: the rest are the class's defaults, field by field
    part = validate({**UINT8, "loader": {"seed": 5}, "engine": {"threads": 2}, "executor": "ray"})
    assert part.loader == LoaderSettings(seed=5) and part.engine == EngineSettings(threads=2)
    assert part.executor == ExecutorSettings(name="ray")
    for field, default in defaults(LoaderSettings).items():
        assert getattr(part.loader, field) == (5 if field == "seed" else default), field
    assert CacheSection().settings() is None and c.cache.settings() is None   # YAML: no cache unless enabled
    assert validate({**UINT8, "cache": {"enabled": True}}).cache.settings() == CacheSettings()


def test_keyword_defaults_are_the_loader_settings_defaults():
    """Pipeline's loader keywords have no defaults of their own: they are the fields of
    LoaderSettings, so a bare Pipeline gets LoaderSettings() and the YAML's defaults."""
    params = inspect.signature(Pipeline).parameters
    assert not set(params) & set(LOADER_KEYS) and params["loader_keys"].kind is inspect.Parameter.VAR_KEYWORD
    p = Pipeline(SRC, [Decode(), ResizeCenterCrop(40, 32)])
    assert p.loader == LoaderSettings() == Pipeline.from_config(UINT8).loader
    assert (p.batch_size, p.num_workers, p.max_skipped, p.worker_memory, p.prefetch_factor) == (256, "auto", 0.01,
                                                                                                 "auto", 2)
    assert p.engine == EngineSettings() and p.executor == ExecutorSettings() and p.cache is None
    assert p.output == OutputSettings(dtype="uint8", layout="NHWC")


def test_yaml_and_keywords_give_equal_settings(tmp_path):
    loader = dict(batch_size=32, shuffle="shards", shard_window=3, drop_last=True, num_workers=0, prefetch_factor=3,
                  persistent_workers=False, seed=7, on_error="raise", max_skipped=5, timeout=2.5,
                  worker_memory="96MiB")
    cache = {"dir": str(tmp_path / "c"), "compression": "zstd:3", "max_size": "1GiB"}
    engine = {"name": "python", "threads": 2, "hw_decoder_load": 0.5, "window_decode": False}
    executor = {"name": "ray", "address": "auto", "remote_workers": 1, "max_remote_workers": 2}
    y = Pipeline.from_config({"source": SRC, "loader": loader, "output": {"device": "cpu", "dtype": "float16",
                                                                         "layout": "NHWC"},
                              "engine": engine, "executor": executor, "cache": {"enabled": False, **cache},
                              "stages": [{"op": "decode"}, {"op": "random_resized_crop", "size": 32},
                                         {"op": "normalize"}]})
    stages = [Decode(), RandomResizedCrop(32), Normalize(dtype="float16", layout="NHWC")]
    k = Pipeline(SRC, stages, device="cpu", engine=engine, executor=executor, **loader)
    for section in ("loader", "output", "engine", "executor", "cache"):
        assert getattr(y, section) == getattr(k, section), section
    assert y.source_settings == k.source_settings == SourceSettings(**SRC)
    assert (k.shuffle, k.shard_window, k.device) == (True, 3, "cpu")
    objs = Pipeline(SourceSettings(**SRC), stages, loader=LoaderSettings(**loader), output=y.output,
                    engine=EngineSettings(**engine), executor=ExecutorSettings(**executor))
    assert (objs.loader, objs.output, objs.engine, objs.executor) == (k.loader, k.output, k.engine, k.executor)
    c = Pipeline.from_config({**UINT8, "cache": {"enabled": True, **cache}}).cache
    assert c == Pipeline(SRC, [Decode(), ResizeCenterCrop(40, 32)], cache=cache).cache
    assert (c.dir, c.max_size, c.codec) == (tmp_path / "c", 2**30, ("zstd", 3))


def test_a_keyword_contradicting_a_settings_object_is_refused():
    stages = [Decode(), ResizeCenterCrop(40, 32)]
    with pytest.raises(ConfigError, match=r"batch_size=8 \(loader.batch_size is 64\)"):
        Pipeline(SRC, stages, loader=LoaderSettings(batch_size=64), batch_size=8)
    assert Pipeline(SRC, stages, loader=LoaderSettings(batch_size=64), batch_size=64).batch_size == 64
    with pytest.raises(ConfigError, match=r"device='cpu' \(output.device is 'cuda'\)"):
        Pipeline(SRC, stages, output=OutputSettings(device="cuda", dtype="uint8", layout="NHWC"), device="cpu")
    with pytest.raises(ConfigError, match="output.dtype is 'float32' but the stages make 'uint8'"):
        Pipeline(SRC, stages, output=OutputSettings(device="cpu"))
    with pytest.raises(TypeError, match="batchsize"):
        Pipeline(SRC, stages, batchsize=8)


def test_pipeline_replace_makes_a_new_validated_pipeline():
    p = Pipeline(SRC, [Decode(), ResizeCenterCrop(40, 32)], batch_size=16, num_workers=0, seed=3)
    q = p.replace(batch_size=8, engine={"name": "python", "threads": 2}, device="cpu", name="q")
    assert (q.batch_size, q.seed, q.num_workers, q.engine.threads, q.device, q.name) == (8, 3, 0, 2, "cpu", "q")
    assert (p.batch_size, p.engine.threads, p.device, p.name) == (16, None, "auto", "pipeline")   # unchanged
    assert q.stages == p.stages and q.source_settings == p.source_settings
    with pytest.raises(ConfigError, match="loader.batch_size: "):
        p.replace(batch_size=0)
    with pytest.raises(ConfigError, match="engine 'dali'"):
        p.replace(executor="ray", engine="dali")   # the constructor's checks across sections run too
    with pytest.raises(TypeError, match="bogus"):
        p.replace(bogus=1)
    r = p.replace(stages=[Decode(), ResizeCenterCrop(40, 32), Normalize()])   # the output follows new stages
    assert (r.output.dtype, r.output.layout, r.output_dtype) == ("float32", "NCHW", "float32")


def test_the_loader_overrides_through_the_same_validators(folder_ds):
    p = Pipeline({"format": "folder", "path": str(folder_ds)}, [Decode(), ResizeCenterCrop(40, 32)], batch_size=4,
                 num_workers=0)
    with pytest.raises(ConfigError, match="loader.on_error: "):
        DataLoader(p, on_error="ignore")
    with pytest.raises(ConfigError, match="loader.max_skipped: "):
        DataLoader(p, max_skipped=2.0)
    with pytest.raises(ConfigError, match="engine.hw_decoder_load: "):
        DataLoader(p, engine={"hw_decoder_load": 3})
    dl = DataLoader(p, engine={"name": "python", "threads": 3}, max_skipped=None)
    assert dl.engine_settings.threads == 3 and dl.pipeline.engine.threads == 3 and p.engine.threads is None
    assert dl._backend.max_skipped is None and p.max_skipped == 0.01


def test_the_loader_takes_loader_and_output_settings_objects(folder_ds):
    """``DataLoader(p, loader=LoaderSettings(...), output=OutputSettings(...))`` is the loader of
    ``p.replace(loader=..., output=...)``: the same batches; single keywords still override a
    field; mappings are validated with the key named; a torch Dataset is refused."""
    import torch

    p = Pipeline({"format": "folder", "path": str(folder_ds)}, [Decode(), ResizeCenterCrop(40, 32)], batch_size=4,
                 num_workers=0)
    ls = LoaderSettings(batch_size=10, shuffle=False, num_workers=0, seed=5)
    out = OutputSettings(device="cpu", dtype="uint8", layout="NHWC")
    dl = DataLoader(p, loader=ls, output=out)
    want = DataLoader(p.replace(loader=ls, output=out))
    assert (dl.batch_size, dl.shuffle, dl.num_workers, dl.seed) == (10, False, 0, 5)
    assert dl.dataset.loader == ls and dl.dataset.output == out and p.batch_size == 4   # p is not changed
    got, ref = list(dl), list(want)
    assert len(got) == len(ref) > 1 and all(torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
                                            for a, b in zip(got, ref))
    assert got[0].images.dtype == torch.uint8 and got[0].images.shape == (10, 32, 32, 3)
    assert DataLoader(p, loader=ls, batch_size=3).batch_size == 3           # a keyword overrides one field
    assert DataLoader(p, loader={"batch_size": 6, "num_workers": 0}).batch_size == 6
    with pytest.raises(ConfigError, match="loader.batch_size: "):
        DataLoader(p, loader={"batch_size": 0})
    with pytest.raises(ConfigError, match="output.device: "):
        DataLoader(p, output={"device": "tpu"})
    with pytest.raises(ConfigError, match="go with a feedgpu Pipeline"):
        DataLoader(list(range(8)), loader=ls)


def test_compression_is_parsed_once():
    """YAML, CacheSettings and the store read the compression with one parser: what one accepts
    (any case), the others accept, and the level range is written once."""
    for ok in ("none", "zstd", "zstd:1", "ZSTD:22", " zstd:5"):
        s = CacheSettings(compression=ok)
        assert s.codec == parse_compression(ok)
        assert validate({**UINT8, "cache": {"enabled": True, "compression": ok}}).cache.compression == ok
    for bad in ("zstd:0", "zstd:23", "lz4", "zstd:x", "none:3", ""):
        with pytest.raises(ConfigError) as e:
            parse_compression(bad)
        problem = str(e.value).split(": ", 1)[1]
        with pytest.raises(ConfigError, match="cache.compression: ") as e:
            CacheSettings(compression=bad)
        assert problem in str(e.value) and "allowed: none, zstd, zstd:1 ... zstd:22" in str(e.value)


def test_from_value_fronts():
    assert EngineSettings.make("dali") == EngineSettings(name="dali") == EngineSettings.make({"name": "dali"})
    assert ExecutorSettings.make(None) == ExecutorSettings()
    s = ExecutorSettings(name="ray")
    assert ExecutorSettings.make(s) is s
    with pytest.raises(ConfigError, match="engine: expected 'python', 'dali', a mapping or EngineSettings"):
        EngineSettings.make(3)
    with pytest.raises(ConfigError, match="engine.exec: unknown key 'exec'; allowed keys: device, hw_decoder_load"):
        EngineSettings.make({"exec": "async"})
    assert CacheSettings.make({"enabled": False, "dir": "/tmp"}) is None    # as in YAML
    assert CacheSettings.make(CacheSection(enabled=True, compression="zstd")) == CacheSettings(compression="zstd")


def test_the_cache_codecs_are_one_list_for_settings_and_parts():
    """What ``cache.compression`` accepts is what a stored part may name: one tuple."""
    from feedgpu.cache import parts, settings

    assert parts.CODECS is settings.CODECS == ("none", "zstd")
    assert [parse_compression(c)[0] for c in settings.CODECS] == list(settings.CODECS)


def test_the_plan_is_made_once_per_device_and_again_when_what_it_was_made_from_changes(folder_ds, monkeypatch):
    """The construction's check, the loader's builders and its iterator ask the pipeline for
    the plan: one plan per device, planned again only for another stage list or section."""
    import feedgpu.pipeline as pipeline_module

    made, real = [], pipeline_module.make_plan
    monkeypatch.setattr(pipeline_module, "make_plan", lambda stages, device, **kw: made.append(device)
                        or real(stages, device, **kw))
    p = Pipeline({"format": "folder", "path": str(folder_ds)}, [Decode(), ResizeCenterCrop(40, 32), Normalize()],
                 batch_size=4, num_workers=0)
    assert made == ["cpu"]   # the stage list is checked at construction
    plan = p.plan("cpu")
    dl = DataLoader(p, num_workers=2)
    before = len(made)
    for _ in zip(range(2), dl):   # the builders and the iterator ask for the plan again
        pass
    assert len(made) == before and dl.pipeline.plan("cpu") is dl.pipeline.plan("cpu") and p.plan("cpu") is plan
    assert pickle.loads(pickle.dumps(p)).plan("cpu").out_spec == plan.out_spec   # the copy plans for itself
    p.stages = [Decode(), ResizeCenterCrop(20, 16)]                 # new stages: planned again
    assert p.plan("cpu") is not plan and p.plan("cpu").out_spec.height == 16
    n = len(made)
    p.engine = EngineSettings()                                     # an equal section: the plan is kept
    assert p.plan("cpu") is p.plan("cpu") and len(made) == n
    p.engine = EngineSettings(threads=2)                            # another engine section: planned again
    p.plan("cpu")
    assert len(made) == n + 1


def test_torch_keywords_are_the_given_ones_else_torchs_defaults_as_torchs_loader_has_them():
    import torch.utils.data as tud

    names = ("batch_size", "num_workers", "drop_last", "timeout", "persistent_workers")
    theirs = tud.DataLoader(range(4))
    assert LoaderSettings.torch_keywords({}, names) == {k: getattr(theirs, k) for k in names}
    given = {"batch_size": None, "timeout": 3, "shuffle": True}   # None is a value (unbatched), not "unset"
    assert LoaderSettings.torch_keywords(given, names) == {"batch_size": None, "num_workers": 0, "drop_last": False,
                                                           "timeout": 3, "persistent_workers": False}
    with pytest.raises(AttributeError):
        LoaderSettings.torch_keywords({}, ("rank",))
