"""Pipeline definitions in YAML: schema, validation with key paths, overrides.

The ``stages`` entries are checked against the stages registered at the time
(:func:`feedgpu.stages.registry.stage_classes`: built-in and third-party alike), each with the
schema its class declares in its constructor (:func:`feedgpu.stages.params.param_model`); the
other sections are the settings classes of :mod:`feedgpu.settings`. This module restates none of
their keys, defaults or bounds.

Files are read with ``yaml.safe_load`` (plain data only). Errors name the key as a path
(``stages[1].scale``) and, where the set is finite, the allowed keys or values.
"""
from __future__ import annotations

import copy
import functools
import os
from typing import Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from .errors import ConfigError
from .cache.settings import CacheSection
from .exec.engines import EngineSettings
from .exec.executors import ExecutorSettings
from .settings import LoaderSettings, OutputSettings, SourceSettings
from .settings_base import UNKNOWN_KEY, merge_branches, message, nested
from .stages.params import param_model
from .stages.registry import stage_classes


class _PipelineBase(BaseModel):
    """The pipeline sections, each one settings class of :mod:`feedgpu.settings` (which holds
    their defaults and bounds); :func:`pipeline_model` adds ``stages`` for a set of stage
    classes."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    name: str = "pipeline"
    source: SourceSettings
    loader: LoaderSettings = Field(default_factory=LoaderSettings)
    output: OutputSettings = Field(default_factory=OutputSettings)
    cache: CacheSection = Field(default_factory=CacheSection)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    executor: ExecutorSettings = Field(default_factory=ExecutorSettings)

    #: {op: param model}, set on each model :func:`pipeline_model` makes
    stage_models: ClassVar[dict[str, type[BaseModel]]] = {}

    @model_validator(mode="after")
    def _output_matches_stages(self):
        # a stage that takes the output's dtype (normalize) makes float batches; without one
        # the batch is the uint8 NHWC images
        makers = sorted(op for op, m in self.stage_models.items() if "dtype" in m.stage_class.from_output)
        has_norm = any(s.op in makers for s in self.stages)
        if has_norm and self.output.dtype == "uint8":
            raise ValueError("output.dtype: 'uint8' cannot follow a normalize stage; allowed: float32, float16")
        if not has_norm and self.output.dtype != "uint8":
            raise ValueError(f"output.dtype: {self.output.dtype!r} needs a stage that makes it "
                             f"({', '.join(makers)}); add one or use dtype: uint8")
        if not has_norm and self.output.layout != "NHWC":
            raise ValueError("output.layout: uint8 output is NHWC; allowed: NHWC")
        return self


@functools.lru_cache(maxsize=16)
def _pipeline_model(classes: tuple) -> type[_PipelineBase]:
    models = {name: param_model(cls) for name, cls in classes}
    union = Annotated[Union[tuple(models.values())], Field(discriminator="op")]  # type: ignore[valid-type]
    model = create_model("PipelineCfg", __base__=_PipelineBase,
                         stages=(Annotated[list[union], Field(min_length=1)], ...))  # type: ignore[valid-type]
    model.stage_models = models
    return model


def pipeline_model(classes: dict[str, type] | None = None) -> type[_PipelineBase]:
    """The pydantic model of a pipeline file whose stages are ``classes`` (``{op: stage
    class}``; default: :func:`~feedgpu.stages.registry.stage_classes`)."""
    if classes is None:
        classes = stage_classes()
    return _pipeline_model(tuple(sorted(classes.items())))


def _model_at(loc: tuple, root: type[_PipelineBase]) -> Any:
    """The config model or settings class a validation error location points into (for listing
    allowed keys)."""
    model: Any = root
    i = 0
    while i < len(loc):
        key = loc[i]
        if model is root and key == "stages":
            if i + 2 < len(loc) and loc[i + 2] in root.stage_models:
                model, i = root.stage_models[loc[i + 2]], i + 3
                continue
            return None
        inner = nested(model, key)
        if inner is None:
            return model
        model, i = inner, i + 1
    return model


def _path(loc: tuple, stage_ops) -> str:
    out = ""
    skip_tag = False
    for i, part in enumerate(loc):
        if skip_tag:
            skip_tag = False
            continue
        if isinstance(part, int):
            out += f"[{part}]"
            if i >= 1 and loc[i - 1] == "stages" and i + 1 < len(loc) and loc[i + 1] in stage_ops:
                out += f" ({loc[i + 1]})"
                skip_tag = True
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def format_errors(err: ValidationError, where: str, root: type[_PipelineBase] | None = None) -> str:
    """One line per problem: the key path (``stages[1] (random_resized_crop).scale``) and what
    is wrong, with the allowed keys or values where the set is finite."""
    root = root or pipeline_model()
    lines = [f"{where}: invalid pipeline definition"]
    for e in merge_branches(err.errors()):
        loc = tuple(e["loc"])
        if e["type"] == "union_tag_invalid" and loc[:1] == ("stages",):
            ops = ", ".join(repr(op) for op in root.stage_models)
            msg = (f"unknown op {e['ctx']['tag']!r}; allowed ops: {ops} (other packages add stages through the "
                   "'feedgpu.stages' entry point: see feedgpu stages)")
        elif e["type"] == "union_tag_not_found" and loc[:1] == ("stages",):
            msg = "a stage needs an 'op' key naming the stage: see feedgpu stages"
        else:
            msg = message(e, _model_at(loc[:-1], root) if e["type"] in UNKNOWN_KEY else None)
        path = _path(loc, root.stage_models)
        # a check across a section's keys names them itself ("executor.address and ...")
        lines.append(f"  {msg}" if len(loc) == 1 and msg.startswith(f"{path}.") else f"  {path}: {msg}")
    return "\n".join(lines)


def merge(base: dict, overrides: dict) -> dict:
    """Deep-merge ``overrides`` into a copy of ``base`` (mappings merge, anything else replaces).
    Keys may be dotted paths: ``{"loader.batch_size": 64}``."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        parts = str(key).split(".")
        node = out
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        last = parts[-1]
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            node[last] = merge(node[last], value)
        else:
            node[last] = copy.deepcopy(value)
    return out


def load_yaml(path: str | os.PathLike) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such pipeline file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a pipeline file holds a mapping at the top level")
    return data


def validate(data: dict, where: str = "pipeline", classes: dict[str, type] | None = None) -> _PipelineBase:
    """Check a pipeline definition against the stages ``classes`` (``{op: stage class}``;
    default: every registered stage). Raises :class:`ConfigError` listing every problem."""
    model = pipeline_model(classes)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e, where, model)) from None
