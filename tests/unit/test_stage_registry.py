"""One stage = one definition: a third-party stage, installed as a package with a ``feedgpu.stages``
entry point, is validated, listed and run from YAML exactly as the built-in stages are."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from PIL import Image, ImageFilter

from conftest import PHOTOS, REPO
from feedgpu import ConfigError, DataLoader, Pipeline
from feedgpu.bench.torch_baseline import build_transforms
from feedgpu.sample_data import build_imagenet_like
from feedgpu.stages import registry
from feedgpu.stages.params import describe_stage, param_model

pytestmark = pytest.mark.timeout(300)

PLUGIN = '''
"""A third-party package's stages (it imports only feedgpu's public stage API and pydantic)."""
from typing import Annotated, Literal

from PIL import Image, ImageFilter
from pydantic import Field

from feedgpu.stages import SampleStage


class Blur(SampleStage):
    """Blur with radius ``sigma`` pixels (CPU only, no torch baseline)."""

    name = "my_blur"

    def __init__(self, sigma: Annotated[float, Field(gt=0, le=10)] = 1.5,
                 mode: Literal["gaussian", "box"] = "gaussian"):
        self.sigma, self.mode = float(sigma), mode

    def config(self):
        return {"sigma": self.sigma, "mode": self.mode}

    def apply(self, img, rng=None):
        f = ImageFilter.GaussianBlur if self.mode == "gaussian" else ImageFilter.BoxBlur
        return img.filter(f(self.sigma))


def _vflip(img):
    return img.transpose(Image.Transpose.FLIP_TOP_BOTTOM)


class VFlip(SampleStage):
    """Mirror top-bottom (Python and DALI, with a torch baseline)."""

    name = "my_vflip"
    has_dali = True

    def apply(self, img, rng=None):
        return _vflip(img)

    def torch_baseline(self):
        return [_vflip]

    def dali(self, x, args, device):
        from nvidia.dali import fn

        return fn.flip(x, horizontal=0, vertical=1, device=device)


class Broken:
    """Not a stage: its entry point is refused with a warning."""
'''

ENTRY_POINTS = """[feedgpu.stages]
my_blur = fgplugin_demo.stages:Blur
my_vflip = fgplugin_demo.stages:VFlip
not_a_stage = fgplugin_demo.stages:Broken
missing = fgplugin_demo.nowhere:Gone
"""


@pytest.fixture(scope="module")
def plugin_root(tmp_path_factory):
    """The package ``fgplugin_demo`` as pip leaves it: its code and a dist-info with entry points."""
    root = tmp_path_factory.mktemp("site")
    (root / "fgplugin_demo").mkdir()
    (root / "fgplugin_demo" / "__init__.py").write_text("")
    (root / "fgplugin_demo" / "stages.py").write_text(textwrap.dedent(PLUGIN))
    info = root / "fgplugin_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fgplugin-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


@pytest.fixture
def installed(plugin_root, monkeypatch):
    """The plugin on sys.path, as after ``pip install fgplugin-demo``."""
    monkeypatch.syspath_prepend(str(plugin_root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the two broken entry points (tested below)
        yield


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    return build_imagenet_like(tmp_path_factory.mktemp("folder") / "train", 18, photos_dir=PHOTOS, seed=0)


def _definition(folder, *extra, engine="python"):
    return {"name": "plugin", "source": {"format": "folder", "path": str(folder)},
            "stages": [{"op": "decode"}, {"op": "resize_center_crop", "resize": 72, "crop": 64}, *extra],
            "loader": {"batch_size": 6, "shuffle": False, "num_workers": 2, "seed": 1},
            "output": {"device": "cpu", "dtype": "uint8", "layout": "NHWC"},
            "engine": {"name": engine, "device": "cpu"} if engine == "dali" else {"name": engine}}


def _epoch(p: Pipeline) -> tuple[torch.Tensor, torch.Tensor]:
    loader = DataLoader(p)
    try:
        batches = [(b.images.clone(), b.labels.clone()) for b in loader]
    finally:
        loader.shutdown()
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def test_the_plugin_is_registered_next_to_the_built_in_stages(plugin_root, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_root))
    with pytest.warns(RuntimeWarning) as caught:
        found = registry.stage_classes()
    assert found["my_blur"].__module__ == "fgplugin_demo.stages" and found["my_vflip"].has_dali
    assert set(registry.BUILTIN) < set(found) and "not_a_stage" not in found and "missing" not in found
    texts = " ".join(str(w.message) for w in caught)
    assert "'not_a_stage'" in texts and "not a feedgpu Stage" in texts       # named, not silently dropped
    assert "'missing'" in texts and "failed to load" in texts
    assert "my_blur" not in registry.BUILTIN


def test_a_plugin_stage_runs_from_yaml_through_the_loader(installed, small_folder):
    plain = Pipeline.from_config(_definition(small_folder))
    blurred = Pipeline.from_config(_definition(small_folder, {"op": "my_blur", "sigma": 2}))
    assert [s.name for s in blurred.stages] == ["decode", "resize_center_crop", "my_blur"]
    assert blurred.stages[2].config() == {"sigma": 2.0, "mode": "gaussian"}   # the default filled in
    (a, la), (b, lb) = _epoch(plain), _epoch(blurred)
    assert torch.equal(la, lb) and len(la) == 18 and b.shape == (18, 64, 64, 3)
    want = np.stack([np.asarray(Image.fromarray(x).filter(ImageFilter.GaussianBlur(2.0))) for x in a.numpy()])
    assert np.array_equal(b.numpy(), want), "each sample went through the plugin's apply"
    assert not torch.equal(a, b)
    assert "my_blur" in blurred.explain("cpu")


def test_a_plugin_that_declares_dali_runs_on_both_engines(installed, small_folder):
    pytest.importorskip("nvidia.dali")
    py_plain, _ = _epoch(Pipeline.from_config(_definition(small_folder)))
    py, lp = _epoch(Pipeline.from_config(_definition(small_folder, {"op": "my_vflip"})))
    da, ld = _epoch(Pipeline.from_config(_definition(small_folder, {"op": "my_vflip"}, engine="dali")))
    assert torch.equal(py, torch.flip(py_plain, dims=[1]))
    assert torch.equal(lp, ld)
    d = (py.float() - da.float()).abs()
    assert float(d.mean()) <= 0.25 and float(d.max()) <= 2.0, "DALI's resize differs by rounding only"
    # flipped on DALI too: the unflipped Python output is far from DALI's
    assert float((py_plain.float() - da.float()).abs().mean()) > 5 * max(float(d.mean()), 0.1)
    with pytest.raises(ConfigError, match=r"engine 'dali' cannot run these stages: my_blur"):
        Pipeline.from_config(_definition(small_folder, {"op": "my_blur"}, engine="dali"))


@pytest.mark.parametrize("stage, fragments", [
    ({"op": "my_blur", "sigma": -1}, ["stages[2] (my_blur).sigma", "greater than 0", "got -1"]),
    ({"op": "my_blur", "sigma": 11}, ["stages[2] (my_blur).sigma", "less than or equal to 10"]),
    ({"op": "my_blur", "mode": "median"}, ["stages[2] (my_blur).mode", "'gaussian'", "'box'", "got 'median'"]),
    ({"op": "my_blur", "radius": 2}, ["stages[2] (my_blur).radius: unknown key 'radius'",
                                      "allowed keys: mode, op, sigma"]),
    ({"op": "my_vflip", "p": 0.5}, ["stages[2] (my_vflip).p: unknown key 'p'; allowed keys: op"]),
    ({"op": "my_blurr"}, ["stages[2]: unknown op 'my_blurr'", "'my_blur'", "'my_vflip'", "'decode'"]),
])
def test_bad_plugin_parameters_name_the_key_path_and_the_allowed_values(installed, small_folder, stage, fragments):
    with pytest.raises(ConfigError) as info:
        Pipeline.from_config(_definition(small_folder, stage), where="p.yaml")
    msg = str(info.value)
    assert msg.startswith("p.yaml: invalid pipeline definition")
    for f in fragments:
        assert f in msg, (f, msg)


def test_without_the_plugin_its_op_is_unknown(small_folder):
    with pytest.raises(ConfigError, match=r"stages\[2\]: unknown op 'my_blur'; allowed ops: 'decode'"):
        Pipeline.from_config(_definition(small_folder, {"op": "my_blur"}))


def test_the_torch_baseline_comes_from_the_stage(installed, small_folder):
    t = build_transforms(Pipeline.from_config(_definition(small_folder, {"op": "my_vflip"})))
    photo = sorted(PHOTOS.glob("*.jpg"))[0]
    out = t(photo.read_bytes())
    assert out.shape == (64, 64, 3) and out.dtype == torch.uint8
    assert "_vflip" in repr(t) and "CenterCrop((64, 64))" in repr(t)
    unflipped = build_transforms(Pipeline.from_config(_definition(small_folder)))(photo.read_bytes())
    assert torch.equal(out, torch.flip(unflipped, dims=[0]))
    with pytest.raises(ConfigError, match=r"stages\[2\] \(my_blur\): the torch baseline has no equivalent"):
        build_transforms(Pipeline.from_config(_definition(small_folder, {"op": "my_blur"})))


def _by_name(listing):
    return {d["name"]: d for d in listing}


def test_stages_json_lists_built_ins_and_the_plugin_with_parameters(installed):
    from feedgpu.cli.main import main

    res = CliRunner().invoke(main, ["stages", "--json"])
    assert res.exit_code == 0, res.output
    got = _by_name(json.loads(res.stdout))
    assert set(got) >= set(registry.BUILTIN) | {"my_blur", "my_vflip"}
    blur = got["my_blur"]
    assert blur["builtin"] is False and blur["class"] == "fgplugin_demo.stages:Blur" and blur["dali"] is False
    assert [(p["name"], p["default"], p["required"]) for p in blur["params"]] == [
        ("sigma", 1.5, False), ("mode", "gaussian", False)]
    assert blur["params"][0]["type"] == "float in (0, 10]" and "'box'" in blur["params"][1]["type"]
    assert got["my_vflip"]["dali"] is True and got["my_vflip"]["torch_baseline"] is True
    rrc = got["random_resized_crop"]
    assert rrc["builtin"] and rrc["deterministic"] is False and rrc["draws"] == 22 and rrc["dali"]
    assert {p["name"]: p["default"] for p in rrc["params"]} == {
        "size": 224, "scale": [0.08, 1.0], "ratio": [0.75, 4 / 3], "interpolation": "bilinear"}
    assert got["normalize"]["set_from_output"] == ["dtype", "layout"]
    assert [p["name"] for p in got["normalize"]["params"]] == ["mean", "std"]
    assert got["horizontal_flip"]["dali_folds"] == ["normalize"]
    assert got["python"]["deterministic"] is None and got["python"]["params"][0] == {
        "name": "fn", "type": "str", "default": None, "required": True}
    text = CliRunner().invoke(main, ["stages"])
    assert text.exit_code == 0 and "my_blur  (sample stage, deterministic, engines: python, plugin " in text.stdout
    assert "    sigma: float in (0, 10], default 1.5" in text.stdout


def test_the_console_command_sees_an_installed_plugin(plugin_root):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(plugin_root)]))
    res = subprocess.run([sys.executable, "-W", "ignore", "-m", "feedgpu.cli.main", "stages", "--json"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=str(REPO))
    assert res.returncode == 0, res.stderr
    got = _by_name(json.loads(res.stdout))
    assert got["my_vflip"]["class"] == "fgplugin_demo.stages:VFlip" and "decode" in got


def test_every_built_in_declares_its_parameters_once():
    """The signature is the definition: defaults build the stage, config() returns those keys,
    and the YAML model has exactly the signature's parameters."""
    for name, cls in registry.BUILTIN.items():
        d = describe_stage(cls)
        names = {p["name"] for p in d["params"]}
        assert set(param_model(cls).model_fields) == names | {"op"}, name
        if any(p["required"] for p in d["params"]):
            continue   # python: needs its callable
        st = cls()
        assert set(st.config()) == names | set(d["set_from_output"]), name
        again = cls(**st.config())
        assert again.config() == st.config(), name


def test_shipped_pipelines_validate_against_the_registry():
    files = sorted((REPO / "pipelines").glob("*.yaml")) + sorted((REPO / "feedgpu" / "pipelines").glob("*.yaml"))
    images = [f for f in files if "\nkind: table" not in f.read_text()]
    assert len(images) >= 4
    for f in images:
        p = Pipeline.from_yaml(f)
        assert [s.name for s in p.stages] == [s["op"] for s in yaml.safe_load(f.read_text())["stages"]]


# -- a built-in stage added in one file: vertical_flip (feedgpu/stages/geometry.py) -----------------
def _vflip_definition(folder, p, engine="python"):
    return _definition(folder, {"op": "vertical_flip", "p": p}, engine=engine)


def test_vertical_flip_is_usable_from_yaml_and_flips_by_its_draws(small_folder):
    from feedgpu.stages.draws import sample_uniforms

    plain, labels = _epoch(Pipeline.from_config(_definition(small_folder)))
    always, _ = _epoch(Pipeline.from_config(_vflip_definition(small_folder, 1.0)))
    never, _ = _epoch(Pipeline.from_config(_vflip_definition(small_folder, 0.0)))
    half, half_labels = _epoch(Pipeline.from_config(_vflip_definition(small_folder, 0.5)))
    assert torch.equal(always, torch.flip(plain, dims=[1])) and torch.equal(never, plain)
    assert torch.equal(labels, half_labels)
    # sample i (shuffle off: the i-th row) flips when its draw for stage 2 is below p
    want = sample_uniforms(1, 0, np.arange(len(plain)), 2, 1)[:, 0] < 0.5
    got = np.array([torch.equal(half[i], always[i]) and not torch.equal(half[i], plain[i])
                    for i in range(len(plain))])
    assert 0 < want.sum() < len(want) and np.array_equal(got, want)
    with pytest.raises(ConfigError, match=r"stages\[2\] \(vertical_flip\)\.p: Input should be less than or equal to 1"):
        Pipeline.from_config(_vflip_definition(small_folder, 1.5))
    listed = describe_stage(registry.BUILTIN["vertical_flip"])
    assert listed["draws"] == 1 and listed["dali"] and listed["torch_baseline"] and listed["deterministic"] is False
    t = build_transforms(Pipeline.from_config(_vflip_definition(small_folder, 1.0)))
    photo = sorted(PHOTOS.glob("*.jpg"))[1].read_bytes()
    unflipped = build_transforms(Pipeline.from_config(_definition(small_folder)))(photo)
    assert torch.equal(t(photo), torch.flip(unflipped, dims=[0]))


def test_vertical_flip_flips_the_same_samples_on_dali(small_folder):
    pytest.importorskip("nvidia.dali")
    py, lp = _epoch(Pipeline.from_config(_vflip_definition(small_folder, 0.5)))
    da, ld = _epoch(Pipeline.from_config(_vflip_definition(small_folder, 0.5, engine="dali")))
    assert torch.equal(lp, ld)
    d = (py.float() - da.float()).abs()
    assert float(d.mean()) <= 0.25 and float(d.max()) <= 2.0, "the same flips; DALI's resize differs by rounding"


# -- the parameter rules (feedgpu.stages.params), through the registry's loader ---------------------
def test_parameter_rules_required_unannotated_and_extra_keys(monkeypatch, small_folder):
    from feedgpu.stages import SampleStage

    class Tint(SampleStage):
        """Add a constant to every pixel."""

        name = "tint"

        def __init__(self, amount: int, note="t", **extra):
            self.amount, self.note, self.extra = amount, note, extra

        def apply(self, img, rng=None):
            return Image.fromarray(np.clip(np.asarray(img, np.int16) + self.amount, 0, 255).astype(np.uint8))

    monkeypatch.setattr(registry, "_plugins", lambda: [("tint", Tint)])
    with pytest.raises(ConfigError, match=re.escape("stages[2] (tint).amount: required key is missing")):
        Pipeline.from_config(_definition(small_folder, {"op": "tint"}))
    with pytest.raises(ConfigError, match=re.escape("stages[2] (tint).amount: Input should be a valid integer")):
        Pipeline.from_config(_definition(small_folder, {"op": "tint", "amount": "lots"}))
    p = Pipeline.from_config(_definition(small_folder, {"op": "tint", "amount": 5, "note": [1, 2], "colour": "red"}))
    st = p.stages[2]
    assert (st.amount, st.note, st.extra) == (5, [1, 2], {"colour": "red"})   # unannotated: any value; **extra
    from feedgpu.cli.main import main

    d = _by_name(json.loads(CliRunner().invoke(main, ["stages", "--json"]).stdout))["tint"]
    assert d["params"] == [{"name": "amount", "type": "int", "default": None, "required": True},
                           {"name": "note", "type": "any", "default": "t", "required": False}]
    assert d["other_keys"] is True
    plain, _ = _epoch(Pipeline.from_config(_definition(small_folder)))
    tinted, _ = _epoch(p)
    assert torch.equal(tinted.to(torch.int16), torch.clamp(plain.to(torch.int16) + 5, 0, 255))


def test_a_plugin_cannot_take_a_built_in_name(monkeypatch):
    from feedgpu.stages import SampleStage

    class Impostor(SampleStage):
        name = "decode"

    monkeypatch.setattr(registry, "_plugins", lambda: [("decode", Impostor)])
    with pytest.warns(RuntimeWarning, match="reuses the name of feedgpu.stages.decode:Decode"):
        assert registry.stage_classes()["decode"] is registry.BUILTIN["decode"]
