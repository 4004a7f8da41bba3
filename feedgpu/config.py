"""Pipeline definitions in YAML: schema, validation with key paths, overrides.

The ``stages`` entries are checked against the stages registered at the time
(:func:`feedgpu.stages.registry.stage_classes`: built-in and third-party alike), each with the
schema its class declares in its constructor (:func:`feedgpu.stages.params.param_model`); this
module restates none of them.

Files are read with ``yaml.safe_load`` (plain data only). Errors name the key as a path
(``stages[1].scale``) and, where the set is finite, the allowed keys or values.
"""
from __future__ import annotations

import copy
import functools
import os
from typing import Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from .errors import ConfigError
from .stages.params import param_model
from .stages.registry import stage_classes


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceCfg(_Strict):
    format: Literal["folder", "tar", "parquet"]
    path: Union[str, list[str], None] = None
    image_column: str = "image"
    label_column: Union[str, None] = "label"
    #: folder only: stat each image file while indexing (False: list the folders only; zero-byte
    #: files are then counted as "empty" when read; see FolderSource)
    stat_files: bool = True
    #: tar and parquet sources read from URLs (s3://, gs://, http(s)://, file://, or an index
    #: file): the node-local shard cache's folder and disk budget ("200GiB"), and options passed
    #: to the store's fsspec filesystem (credentials come the store's standard way, never here)
    cache_dir: Union[str, None] = None
    cache_budget: Union[Annotated[int, Field(gt=0, strict=True)], str, None] = None
    storage_options: Union[dict, None] = None


class LoaderCfg(_Strict):
    batch_size: Annotated[int, Field(gt=0)] = 256
    #: true, false or "shards" (about shard_window shards open at a time: feedgpu.shard_order)
    shuffle: Union[bool, Literal["shards"]] = True
    shard_window: Annotated[int, Field(ge=1, strict=True)] = 8
    drop_last: bool = False
    num_workers: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = "auto"
    prefetch_factor: Annotated[int, Field(gt=0)] = 2
    persistent_workers: bool = True
    seed: int = 0
    on_error: Literal["skip", "raise"] = "skip"
    #: share of the epoch in [0, 1] (float), a count (int) or null: see feedgpu.skips
    max_skipped: Union[Annotated[int, Field(ge=0, strict=True)], Annotated[float, Field(ge=0, le=1, strict=True)], None] = 0.01
    timeout: Annotated[float, Field(ge=0)] = 0.0


class OutputCfg(_Strict):
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")] = "auto"
    dtype: Literal["float32", "float16", "uint8"] = "float32"
    layout: Literal["NCHW", "NHWC"] = "NCHW"


class EngineCfg(_Strict):
    name: Literal["python", "dali"] = "python"
    device: Literal["auto", "cpu", "gpu"] = "auto"
    threads: Union[Annotated[int, Field(gt=0)], None] = None
    hw_decoder_load: Annotated[float, Field(ge=0, le=1)] = 0.75
    window_decode: bool = True


class ExecutorCfg(_Strict):
    name: Literal["local", "ray"] = "local"
    address: Union[str, None] = None
    remote_workers: Union[Annotated[int, Field(ge=0)], None] = None
    max_remote_workers: Annotated[int, Field(ge=0)] = 4
    cpus_per_worker: Annotated[float, Field(gt=0)] = 1.0
    max_local_workers: Union[Annotated[int, Field(ge=1)], None] = None

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, v):
        return {"name": v} if isinstance(v, str) else v  # `executor: ray` is `executor: {name: ray}`


class CacheCfg(_Strict):
    enabled: bool = False
    dir: Union[str, None] = None
    compression: Annotated[str, Field(pattern=r"^(none|zstd(:([1-9]|1[0-9]|2[0-2]))?)$")] = "none"
    max_size: Union[Annotated[int, Field(gt=0)], str, None] = None

    @field_validator("max_size")
    @classmethod
    def _size(cls, v):
        from .cache.settings import parse_size

        try:
            parse_size(v)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return v


class _PipelineBase(_Strict):
    """The pipeline sections; :func:`pipeline_model` adds ``stages`` for a set of stage classes."""

    version: Literal[1] = 1
    name: str = "pipeline"
    source: SourceCfg
    loader: LoaderCfg = LoaderCfg()
    output: OutputCfg = OutputCfg()
    cache: CacheCfg = CacheCfg()
    engine: EngineCfg = EngineCfg()
    executor: ExecutorCfg = ExecutorCfg()

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


def _model_at(loc: tuple, root: type[_PipelineBase]) -> type[BaseModel] | None:
    """The config model a validation error location points into (for listing allowed keys)."""
    model: Any = root
    i = 0
    while i < len(loc):
        key = loc[i]
        if model is root and key == "stages":
            if i + 2 < len(loc) and loc[i + 2] in root.stage_models:
                model, i = root.stage_models[loc[i + 2]], i + 3
                continue
            return None
        field = getattr(model, "model_fields", {}).get(key)
        if field is None:
            return model
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
            i += 1
            continue
        return model
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


_BRANCHES = {"int", "float", "str", "bool", "none", "list", "dict", "tuple"}


def _is_branch(seg) -> bool:
    """A location segment naming a branch of a union type (``literal['auto']``, ``constrained-int``),
    not a key of the user's file."""
    return isinstance(seg, str) and (seg in _BRANCHES or any(c in seg for c in "[]-'(") and not seg.startswith("_"))


def _merge_branches(errors: list[dict]) -> list[dict]:
    """One error per key for a value that matches no branch of a union: the branches' messages
    joined with "or", the branch names dropped from the location."""
    out: list[dict] = []
    seen: dict[tuple, dict] = {}
    for e in errors:
        loc = tuple(e["loc"])
        plain = tuple(s for s in loc if not _is_branch(s))
        if plain == loc:
            out.append(e)
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if plain in seen:
            seen[plain]["msg"] += f", or {msg[0].lower() + msg[1:]}"
            continue
        merged = dict(e, loc=plain, msg=msg, type="union")
        seen[plain] = merged
        out.append(merged)
    return out


def format_errors(err: ValidationError, where: str, root: type[_PipelineBase] | None = None) -> str:
    """One line per problem: the key path (``stages[1] (random_resized_crop).scale``) and what
    is wrong, with the allowed keys or values where the set is finite."""
    root = root or pipeline_model()
    lines = [f"{where}: invalid pipeline definition"]
    for e in _merge_branches(err.errors()):
        loc = tuple(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            model = _model_at(loc[:-1], root)
            allowed = sorted(model.model_fields) if model is not None else []
            msg = f"unknown key {loc[-1]!r}; allowed keys: {', '.join(allowed)}"
        elif e["type"] == "union_tag_invalid" and loc[:1] == ("stages",):
            ops = ", ".join(repr(op) for op in root.stage_models)
            msg = (f"unknown op {e['ctx']['tag']!r}; allowed ops: {ops} (other packages add stages through the "
                   "'feedgpu.stages' entry point: see feedgpu stages)")
        elif e["type"] == "union_tag_not_found" and loc[:1] == ("stages",):
            msg = "a stage needs an 'op' key naming the stage: see feedgpu stages"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] == "string_pattern_mismatch" and loc == ("output", "device"):
            msg = f"got {e['input']!r}; allowed: auto, cpu, cuda, cuda:N"
        elif e["type"] == "string_pattern_mismatch" and loc == ("cache", "compression"):
            msg = f"got {e['input']!r}; allowed: none, zstd, zstd:1 ... zstd:22"
        elif "input" in e and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  {_path(loc, root.stage_models)}: {msg}")
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
