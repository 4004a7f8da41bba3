"""YAML pipelines: the shipped files validate; errors name the key path and the allowed values."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import yaml

from conftest import REPO
from feedgpu import ConfigError, DataLoader, FolderSource, Pipeline
from feedgpu.stages import Decode, HorizontalFlip, Normalize, RandomResizedCrop, ResizeCenterCrop
from feedgpu.stages.geometry import INTERPOLATIONS
from feedgpu.stages.registry import BUILTIN

# image pipelines; table pipelines (kind: table) are tested in test_tabular.py
PIPELINES = sorted(p for p in (REPO / "pipelines").glob("*.yaml") if "\nkind: table" not in p.read_text())
TRAIN = REPO / "pipelines" / "imagenet_train.yaml"


def test_pipeline_files_exist():
    assert {p.name for p in PIPELINES} >= {"imagenet_train.yaml", "imagenet_val.yaml"}


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_shipped_pipelines_validate(path):
    p = Pipeline.from_yaml(path)
    data = yaml.safe_load(path.read_text())
    assert p.name == data["name"]
    assert [type(s).name for s in p.stages] == [s["op"] for s in data["stages"]]
    assert p.batch_size == data["loader"]["batch_size"]
    assert p.shuffle == data["loader"]["shuffle"] and p.drop_last == data["loader"]["drop_last"]
    assert p.output_dtype == data["output"]["dtype"]


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_packaged_copies_match(path):
    """``feedgpu bench`` reads the copies inside the package: they must not drift."""
    packaged = REPO / "feedgpu" / "pipelines" / path.name
    assert packaged.read_text() == path.read_text()


def test_train_pipeline_stages_carry_the_file_settings():
    p = Pipeline.from_yaml(TRAIN)
    dec, rrc, flip, norm = p.stages
    assert isinstance(dec, Decode) and dec.exif_orientation
    assert isinstance(rrc, RandomResizedCrop) and rrc.size == (224, 224) and rrc.scale == (0.08, 1.0)
    assert rrc.ratio == pytest.approx((0.75, 4 / 3)) and rrc.interpolation == "bilinear"
    assert isinstance(flip, HorizontalFlip) and flip.p == 0.5
    assert isinstance(norm, Normalize) and norm.dtype == "float32" and norm.layout == "NCHW"


def _load(tmp_path, data) -> Pipeline:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    return Pipeline.from_yaml(f)


@pytest.fixture
def train_data():
    return yaml.safe_load(TRAIN.read_text())


def test_unknown_key_names_the_path_and_the_allowed_keys(tmp_path, train_data):
    train_data["stages"][1]["sizee"] = 224
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, train_data)
    msg = str(info.value)
    assert "stages[1] (random_resized_crop)" in msg
    assert "'sizee'" in msg and "allowed keys" in msg
    allowed = re.search(r"allowed keys: (.*)", msg).group(1)
    assert {k.strip() for k in allowed.split(",")} == {"op", "size", "scale", "ratio", "interpolation"}
    assert str(tmp_path / "p.yaml") in msg


def test_unknown_top_level_and_loader_keys(tmp_path, train_data):
    bad = copy.deepcopy(train_data)
    bad["loader"]["batchsize"] = 8
    bad["extra"] = 1
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, bad)
    msg = str(info.value)
    assert "loader.batchsize: unknown key 'batchsize'" in msg and "batch_size" in msg
    assert "extra: unknown key 'extra'" in msg  # every problem is listed, not just the first


def test_wrong_value_lists_the_allowed_values(tmp_path, train_data):
    train_data["stages"][1]["interpolation"] = "cubicx"
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, train_data)
    msg = str(info.value)
    assert "stages[1] (random_resized_crop).interpolation" in msg
    assert "cubicx" in msg
    for name in INTERPOLATIONS:
        assert f"'{name}'" in msg


def test_decode_reduce_off_unquoted_in_yaml(tmp_path):
    """YAML 1.1 reads a bare ``off`` as false: ``reduce: off`` as the docs write it means "off"."""
    path = tmp_path / "p.yaml"
    path.write_text("source: {format: folder, path: %s}\nstages:\n  - op: decode\n    reduce: off\n"
                    "  - {op: resize_center_crop, resize: 32, crop: 32}\n  - op: normalize\n" % tmp_path)
    assert Pipeline.from_yaml(path).stages[0].reduce == "off"
    path.write_text(path.read_text().replace("reduce: off", "reduce: on"))   # true: not a value of reduce
    with pytest.raises(ConfigError, match="reduce"):
        Pipeline.from_yaml(path)


def test_unknown_op_lists_the_allowed_ops(tmp_path, train_data):
    train_data["stages"][2] = {"op": "blur", "sigma": 2}
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, train_data)
    msg = str(info.value)
    assert "stages[2]" in msg and "blur" in msg
    for op in BUILTIN:
        assert f"'{op}'" in msg, op


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["loader"].update(on_error="ignore"), "loader.on_error"),
    (lambda d: d["loader"].update(batch_size=0), "loader.batch_size"),
    (lambda d: d["output"].update(device="tpu"), "output.device"),
    (lambda d: d["output"].update(dtype="uint8"), "output.dtype"),
    (lambda d: d["stages"][2].update(p=1.5), "stages[2] (horizontal_flip).p"),
    (lambda d: d["stages"][1].update(scale=[0.5]), "stages[1] (random_resized_crop).scale"),
    (lambda d: d["source"].update(format="zip"), "source.format"),
    (lambda d: d.pop("stages"), "stages: required key is missing"),
    (lambda d: d.update(version=2), "version"),
])
def test_invalid_values_name_their_key(tmp_path, train_data, edit, fragment):
    edit(train_data)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        _load(tmp_path, train_data)


def test_device_error_lists_allowed_devices(tmp_path, train_data):
    train_data["output"]["device"] = "gpu"
    with pytest.raises(ConfigError, match=r"output.device: got 'gpu'; allowed: auto, cpu, cuda, cuda:N"):
        _load(tmp_path, train_data)


def test_stage_level_errors_name_the_stage(tmp_path):
    data = yaml.safe_load((REPO / "pipelines" / "imagenet_val.yaml").read_text())
    data["stages"][1]["resize"] = 200
    with pytest.raises(ConfigError, match=r"stages\[1\] \(resize_center_crop\): .*must be >= crop"):
        _load(tmp_path, data)
    data = yaml.safe_load((REPO / "pipelines" / "imagenet_val.yaml").read_text())
    data["stages"] = data["stages"][1:]
    with pytest.raises(ConfigError, match="first stage must be 'decode'"):
        _load(tmp_path, data)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such pipeline file"):
        Pipeline.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Pipeline.from_yaml(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        Pipeline.from_yaml(bad)
    bad.write_text("!!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Pipeline.from_yaml(bad)  # safe_load: no code runs


def test_overrides_with_dotted_keys_and_nested_mappings(folder_ds):
    p = Pipeline.from_yaml(TRAIN, **{"loader.batch_size": 8, "source.path": str(folder_ds)})
    assert p.batch_size == 8 and p.shuffle is True and p.num_workers == "auto"  # the rest stays
    p = Pipeline.from_yaml(TRAIN, loader={"num_workers": 0, "seed": 3}, source={"path": str(folder_ds)})
    assert (p.batch_size, p.num_workers, p.seed, p.drop_last) == (256, 0, 3, True)
    assert isinstance(p.source, FolderSource) and len(p.source) > 0
    p = Pipeline.from_yaml(TRAIN, **{"output.dtype": "float16", "output.layout": "NHWC"})
    assert p.stages[-1].dtype == "float16" and p.stages[-1].layout == "NHWC"
    with pytest.raises(ConfigError, match="loader.batch_size"):
        Pipeline.from_yaml(TRAIN, **{"loader.batch_size": -1})
    assert yaml.safe_load(TRAIN.read_text())["loader"]["batch_size"] == 256  # the file is not changed


def test_source_path_must_be_set_before_use():
    p = Pipeline.from_yaml(TRAIN)
    with pytest.raises(ConfigError, match="source.path is not set"):
        p.source


@pytest.mark.parametrize("fmt, fixture", [("folder", "folder_ds"), ("tar", "tar_ds"), ("parquet", "parquet_ds")])
def test_yaml_pipeline_runs_on_every_format(request, fmt, fixture):
    path = request.getfixturevalue(fixture)
    p = Pipeline.from_yaml(REPO / "pipelines" / "imagenet_val.yaml", source={"format": fmt, "path": str(path)},
                           loader={"batch_size": 10, "num_workers": 0}, output={"device": "cpu"})
    batch = next(iter(DataLoader(p)))
    assert batch.images.shape == (10, 3, 224, 224) and batch.images.dtype == torch.float32
    assert batch.labels.dtype == torch.int64


def test_explain_describes_stages_and_output(folder_ds):
    p = Pipeline.from_yaml(TRAIN, source={"path": str(folder_ds)})
    text = p.explain("cpu")
    for op in ("decode", "random_resized_crop", "horizontal_flip", "normalize"):
        assert op in text
    assert "float32 NCHW [256, 3, 224, 224]" in text and "labels int64 [256]" in text
    assert "cpu pool" in text
    v = Pipeline.from_yaml(REPO / "pipelines" / "imagenet_val.yaml",
                           **{"output.dtype": "float16", "output.layout": "NHWC"})
    assert "float16 NHWC [256, 224, 224, 3]" in v.explain("cpu")


def test_uint8_output_without_normalize(tmp_path, train_data):
    train_data["stages"] = train_data["stages"][:3]
    train_data["output"] = {"dtype": "uint8", "layout": "NHWC", "device": "cpu"}
    p = _load(tmp_path, train_data)
    assert p.output_dtype == "uint8"
    assert "uint8 NHWC [256, 224, 224, 3]" in p.explain()
    train_data["output"]["layout"] = "NCHW"
    with pytest.raises(ConfigError, match="output.layout"):
        _load(tmp_path, train_data)


def test_python_stage_from_yaml(tmp_path, train_data):
    train_data["stages"].insert(2, {"op": "python", "fn": "test_stages:invert"})
    p = _load(tmp_path, train_data)
    assert p.stages[2].ref == "test_stages:invert"
    train_data["stages"][2]["fn"] = "test_stages:missing"
    with pytest.raises(ConfigError, match="cannot import"):
        _load(tmp_path, train_data)


def test_pipeline_rejects_bad_settings(folder_ds):
    src = FolderSource(folder_ds)
    stages = [Decode(), ResizeCenterCrop()]
    with pytest.raises(ConfigError, match="on_error"):
        Pipeline(src, stages, on_error="ignore")
    with pytest.raises(ConfigError):
        Pipeline(src, stages, batch_size=0)
    with pytest.raises(ConfigError):
        Pipeline(src, stages, prefetch_factor=0)


@pytest.mark.parametrize("value, detail", [
    ("many", "a valid integer, unable to parse string as an integer (got 'many')"),
    (-1, "greater than or equal to 0 (got -1)"),
])
def test_a_value_matching_no_branch_of_a_union_gets_one_plain_message(value, detail):
    with pytest.raises(ConfigError) as info:
        Pipeline.from_yaml(TRAIN, **{"source.path": "/tmp", "loader.num_workers": value})
    text = str(info.value)
    assert f"  loader.num_workers: Input should be 'auto', or input should be {detail}" in text
    assert "literal" not in text and "constrained" not in text and text.count("num_workers") == 1


def test_executor_key(tmp_path, train_data, folder_ds):
    """``executor: ray`` or a mapping; errors name the key; explain says where the stages run.
    (Running on Ray: tests/integration/test_ray_executor.py.)"""
    p = Pipeline.from_yaml(TRAIN, source={"path": str(folder_ds)}, executor="ray")
    assert (p.executor.name, p.executor.address, p.executor.max_remote_workers) == ("ray", None, 4)
    assert "cpu pool + Ray (ray.init default)" in p.explain("cpu")
    p = Pipeline.from_yaml(TRAIN, executor={"name": "ray", "address": "auto", "max_local_workers": 2})
    assert (p.executor.address, p.executor.max_local_workers) == ("auto", 2)
    assert Pipeline.from_yaml(TRAIN).executor.name == "local"
    for bad, fragment in [("spark", "executor.name: Input should be 'local' or 'ray'"),
                          ({"name": "ray", "remote_workers": -1}, "executor.remote_workers: Input should be greater"),
                          ({"name": "ray", "adress": "auto"}, "executor.adress: unknown key 'adress'; allowed keys: "
                                                              "address, cpus_per_worker")]:
        train_data["executor"] = bad
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            _load(tmp_path, train_data)
    with pytest.raises(ConfigError, match="remote_workers must be an int in"):
        Pipeline.from_yaml(TRAIN, executor={"name": "ray", "remote_workers": 5, "max_remote_workers": 4})
    with pytest.raises(ConfigError, match="need executor.name 'ray'"):
        Pipeline.from_yaml(TRAIN, executor={"name": "local", "address": "auto"})
