"""Pipeline definitions in YAML: schema, validation with key paths, overrides.

Files are read with ``yaml.safe_load`` (plain data only). Errors name the key as a path
(``stages[1].scale``) and, where the set is finite, the allowed keys or values.
"""
from __future__ import annotations

import copy
import os
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError
from .stages.decode import IMAGENET_MEAN_PIXEL, PILLOW_MAX_PIXELS
from .stages.geometry import INTERPOLATIONS
from .stages.normalize import IMAGENET_MEAN, IMAGENET_STD

Interp = Literal[tuple(INTERPOLATIONS)]  # type: ignore[valid-type]
Size = Union[Annotated[int, Field(gt=0)], tuple[Annotated[int, Field(gt=0)], Annotated[int, Field(gt=0)]]]
Byte = Annotated[int, Field(ge=0, le=255)]


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


class DecodeCfg(_Strict):
    op: Literal["decode"]
    exif_orientation: bool = True
    max_pixels: Annotated[int, Field(gt=0)] = PILLOW_MAX_PIXELS
    background: tuple[Byte, Byte, Byte] = IMAGENET_MEAN_PIXEL


class RandomResizedCropCfg(_Strict):
    op: Literal["random_resized_crop"]
    size: Size = 224
    scale: tuple[Annotated[float, Field(gt=0, le=1)], Annotated[float, Field(gt=0, le=1)]] = (0.08, 1.0)
    ratio: tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)]] = (3 / 4, 4 / 3)
    interpolation: Interp = "bilinear"


class ResizeCfg(_Strict):
    op: Literal["resize"]
    size: Annotated[int, Field(gt=0)] = 256
    interpolation: Interp = "bilinear"
    upscale: bool = True


class ResizeCenterCropCfg(_Strict):
    op: Literal["resize_center_crop"]
    resize: Annotated[int, Field(gt=0)] = 256
    crop: Size = 224
    interpolation: Interp = "bilinear"


class HorizontalFlipCfg(_Strict):
    op: Literal["horizontal_flip"]
    p: Annotated[float, Field(ge=0, le=1)] = 0.5


class NormalizeCfg(_Strict):
    op: Literal["normalize"]
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)]] = IMAGENET_STD


class PythonCfg(_Strict):
    op: Literal["python"]
    fn: str
    random: bool = False
    size: Union[tuple[Annotated[int, Field(gt=0)], Annotated[int, Field(gt=0)]], None] = None
    name: Union[str, None] = None


STAGE_CFGS = {c.model_fields["op"].annotation.__args__[0]: c for c in (
    DecodeCfg, ResizeCfg, RandomResizedCropCfg, ResizeCenterCropCfg, HorizontalFlipCfg, NormalizeCfg, PythonCfg)}
StageCfg = Annotated[Union[tuple(STAGE_CFGS.values())], Field(discriminator="op")]  # type: ignore[valid-type]


class LoaderCfg(_Strict):
    batch_size: Annotated[int, Field(gt=0)] = 256
    shuffle: bool = True
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


class PipelineCfg(_Strict):
    version: Literal[1] = 1
    name: str = "pipeline"
    source: SourceCfg
    stages: Annotated[list[StageCfg], Field(min_length=1)]  # type: ignore[valid-type]
    loader: LoaderCfg = LoaderCfg()
    output: OutputCfg = OutputCfg()
    cache: CacheCfg = CacheCfg()
    engine: EngineCfg = EngineCfg()
    executor: ExecutorCfg = ExecutorCfg()

    @model_validator(mode="after")
    def _output_matches_stages(self):
        has_norm = any(s.op == "normalize" for s in self.stages)
        if has_norm and self.output.dtype == "uint8":
            raise ValueError("output.dtype: 'uint8' cannot follow a normalize stage; allowed: float32, float16")
        if not has_norm and self.output.dtype != "uint8":
            raise ValueError(f"output.dtype: {self.output.dtype!r} needs a normalize stage; "
                             "add one or use dtype: uint8")
        if not has_norm and self.output.layout != "NHWC":
            raise ValueError("output.layout: uint8 output is NHWC; allowed: NHWC")
        return self


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The config model a validation error location points into (for listing allowed keys)."""
    model: Any = PipelineCfg
    i = 0
    while i < len(loc):
        key = loc[i]
        if model is PipelineCfg and key == "stages":
            if i + 2 < len(loc) and loc[i + 2] in STAGE_CFGS:
                model, i = STAGE_CFGS[loc[i + 2]], i + 3
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


def _path(loc: tuple) -> str:
    out = ""
    skip_tag = False
    for i, part in enumerate(loc):
        if skip_tag:
            skip_tag = False
            continue
        if isinstance(part, int):
            out += f"[{part}]"
            if i >= 1 and loc[i - 1] == "stages" and i + 1 < len(loc) and loc[i + 1] in STAGE_CFGS:
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


def format_errors(err: ValidationError, where: str) -> str:
    lines = [f"{where}: invalid pipeline definition"]
    for e in _merge_branches(err.errors()):
        loc = tuple(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            model = _model_at(loc[:-1])
            allowed = sorted(model.model_fields) if model is not None else []
            msg = f"unknown key {loc[-1]!r}; allowed keys: {', '.join(allowed)}"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] == "string_pattern_mismatch" and loc == ("output", "device"):
            msg = f"got {e['input']!r}; allowed: auto, cpu, cuda, cuda:N"
        elif e["type"] == "string_pattern_mismatch" and loc == ("cache", "compression"):
            msg = f"got {e['input']!r}; allowed: none, zstd, zstd:1 ... zstd:22"
        elif "input" in e and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  {_path(loc)}: {msg}")
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


def validate(data: dict, where: str = "pipeline") -> PipelineCfg:
    """Check a pipeline definition. Raises :class:`ConfigError` listing every problem."""
    try:
        return PipelineCfg.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e, where)) from None
