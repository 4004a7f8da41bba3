"""YAML schema of a table feature pipeline (``kind: table``); see ``pipelines/flights_features.yaml``.

Errors name the key as a path (``features[3] (bucketize).quantiles``) and list allowed keys or
values, as for image pipelines.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigError
from ..settings_base import UNKNOWN_KEY, settings_class

Cols = Union[str, list[str]]
Pos = Annotated[int, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceCfg(_Strict):
    path: Union[str, list[str]]
    columns: Union[list[str], None] = None
    cache_bytes: Pos = 1 << 30


class JoinCfg(_Strict):
    name: str
    path: Union[str, list[str]]
    keys: Union[str, list[str], dict[str, str]]  # "on" would be read as true by YAML 1.1
    columns: Union[list[str], dict[str, str]]
    prefix: str = ""
    indicator: bool = True
    duplicates: Literal["raise", "first"] = "raise"


class FillCfg(_Strict):
    op: Literal["fill"]
    columns: Cols
    strategy: Literal["mean", "median", "constant"] = "median"
    value: float = 0.0
    indicator: bool = True


class _Each(_Strict):
    columns: Cols


class StandardizeCfg(_Each):
    op: Literal["standardize"]


class MinMaxCfg(_Each):
    op: Literal["minmax"]


class Log1pCfg(_Each):
    op: Literal["log1p"]


class ClipCfg(_Each):
    op: Literal["clip"]
    min: Union[float, None] = None
    max: Union[float, None] = None


class BucketizeCfg(_Strict):
    op: Literal["bucketize"]
    column: str
    out: Union[str, None] = None
    boundaries: Union[list[float], None] = None
    quantiles: Union[Annotated[int, Field(ge=2)], None] = None

    @model_validator(mode="after")
    def _one(self):
        if (self.boundaries is None) == (self.quantiles is None):
            raise ValueError("give exactly one of boundaries or quantiles")
        return self


class HashCfg(_Strict):
    op: Literal["hash"]
    column: str
    out: Union[str, None] = None
    buckets: Pos


class CategorifyCfg(_Strict):
    op: Literal["categorify"]
    column: str
    out: Union[str, None] = None
    min_count: Pos = 1
    max_size: Union[Pos, None] = None
    on_oov: Literal["index", "raise"] = "index"


class OneHotCfg(_Strict):
    op: Literal["one_hot"]
    column: str
    out: Union[str, None] = None


class CrossCfg(_Strict):
    op: Literal["cross"]
    columns: Annotated[list[str], Field(min_length=2)]
    out: Union[str, None] = None
    buckets: Pos


class LabelCfg(_Strict):
    op: Literal["label"]
    expr: str
    out: str = "label"
    dtype: Literal["float32", "int64"] = "float32"
    if_missing: Union[Literal["raise"], float] = "raise"


FeatureCfg = Annotated[Union[FillCfg, StandardizeCfg, MinMaxCfg, Log1pCfg, ClipCfg, BucketizeCfg, HashCfg,
                             CategorifyCfg, OneHotCfg, CrossCfg, LabelCfg], Field(discriminator="op")]


class OutputsCfg(_Strict):
    dense: list[str] = []
    categorical: list[str] = []
    label: Union[str, None] = "label"
    on_nan: Literal["raise", "keep"] = "raise"


class FitCfg(_Strict):
    path: Union[str, None] = None
    max_rows: Pos = 2_000_000
    seed: int = 0
    mode: Literal["auto", "load", "refit"] = "auto"


@settings_class("engine")
class TableEngineSettings:
    """The ``engine:`` section of a table pipeline.

    Args:
        name (str): ``"python"`` (default) or ``"dali"``.
        threads (int | None): DALI threads, >= 1 (default None: one).
        device (str): DALI only: ``"cpu"`` (its CPU operators; default) or ``"gpu"`` (main
            process only).

    Raises :class:`~feedgpu.errors.ConfigError` naming the key (``engine.name: ...``).
    """

    name: Literal["python", "dali"] = "python"
    threads: Union[Pos, None] = None
    device: Literal["cpu", "gpu"] = "cpu"


class LoaderCfg(_Strict):
    batch_size: Pos = 4096
    shuffle: bool = True
    drop_last: bool = False
    num_workers: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = 0
    prefetch_factor: Pos = 2
    persistent_workers: bool = False
    seed: int = 0


class TablePipelineCfg(_Strict):
    kind: Literal["table"]
    source: SourceCfg
    joins: list[JoinCfg] = []
    features: list[FeatureCfg]
    outputs: OutputsCfg
    fit: FitCfg = FitCfg()
    engine: TableEngineSettings = Field(default_factory=TableEngineSettings)
    loader: LoaderCfg = LoaderCfg()


def _path(loc: tuple) -> str:
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif i >= 2 and loc[i - 2] == "features" and isinstance(loc[i - 1], int):
            out += f" ({part})"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def validate(data: dict, where: str = "pipeline") -> TablePipelineCfg:
    """Raises :class:`ConfigError` listing every problem with its key path."""
    try:
        return TablePipelineCfg.model_validate(data)
    except ValidationError as err:
        lines = [f"{where}: invalid table pipeline definition"]
        for e in err.errors():
            loc = tuple(e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] in UNKNOWN_KEY:
                msg = f"unknown key {loc[-1]!r}"
            elif e["type"] == "missing":
                msg = "required key is missing"
            elif e["type"] == "union_tag_invalid":
                msg = (f"unknown op {e['input'].get('op') if isinstance(e['input'], dict) else e['input']!r}; allowed: "
                       "fill, standardize, minmax, log1p, clip, bucketize, hash, categorify, one_hot, cross, label")
            elif "input" in e and not isinstance(e["input"], (dict, list)):
                msg = f"{msg} (got {e['input']!r})"
            lines.append(f"  {_path(loc)}: {msg}")
        raise ConfigError("\n".join(lines)) from None
