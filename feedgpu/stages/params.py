"""A stage's parameters, read from its constructor's signature.

A stage declares its parameters once, as the keyword arguments of ``__init__``: the default is
the signature's default, the type and bounds its annotation (plain types, or the ``Annotated``
types below, e.g. ``p: Probability = 0.5``). From that one declaration come the YAML schema
(:func:`param_model`: a pydantic model that names the key path and the allowed values of a bad
setting), ``feedgpu stages`` (:func:`describe_stage`) and the round trip ``cls(**stage.config())``.

Rules: an unannotated parameter accepts any value; a parameter without a default is required;
``**kwargs`` lets unknown keys through; names in the class's ``from_output`` (``normalize``'s
``dtype`` and ``layout``) are set from the pipeline's ``output`` section, not from the stage's
own keys. Checks that tie parameters together (``scale`` min <= max) stay in ``__init__`` and
raise :class:`~feedgpu.errors.ConfigError`, which the YAML loader prefixes with the stage's path.
"""
from __future__ import annotations

import functools
import inspect
import typing
import warnings
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, create_model

__all__ = ["Byte", "NonNegativeInt", "PositiveFloat", "PositiveInt", "Probability", "RGB", "Size",
           "describe_stage", "param_model", "stage_params"]

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
#: a float in [0, 1]
Probability = Annotated[float, Field(ge=0, le=1)]
Byte = Annotated[int, Field(ge=0, le=255)]
RGB = tuple[Byte, Byte, Byte]
#: an output size: ``int`` (square) or ``[height, width]``, in pixels
Size = Union[PositiveInt, tuple[PositiveInt, PositiveInt]]


class Param(typing.NamedTuple):
    name: str
    annotation: Any          # the resolved type (``Any`` when unannotated)
    default: Any             # ``inspect.Parameter.empty`` when required

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty


def stage_params(cls: type) -> tuple[list[Param], bool]:
    """``(parameters settable from YAML, whether **kwargs takes other keys)`` of stage class
    ``cls``, from ``cls.__init__``'s signature and resolved annotations."""
    init = cls.__init__
    if init is object.__init__:   # no constructor of its own: no parameters
        return [], False
    try:
        sig = inspect.signature(init)
    except (TypeError, ValueError):
        return [], False
    try:
        hints = typing.get_type_hints(init, include_extras=True)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: accept any value
        hints = {}
    skip = set(getattr(cls, "from_output", ()))
    out: list[Param] = []
    extra = False
    for i, p in enumerate(sig.parameters.values()):
        if i == 0 and p.name == "self":
            continue
        if p.kind is p.VAR_KEYWORD:
            extra = True
            continue
        if p.kind is p.VAR_POSITIONAL or p.name in skip:
            continue
        out.append(Param(p.name, hints.get(p.name, Any), p.default))
    return out, extra


@functools.lru_cache(maxsize=None)
def param_model(cls: type) -> type[BaseModel]:
    """The pydantic model of one YAML stage entry of ``cls``: ``op`` (the literal
    ``cls.name``) plus its parameters with their defaults and bounds. Unknown keys are refused
    (their error lists the allowed keys) unless ``__init__`` takes ``**kwargs``."""
    params, extra = stage_params(cls)
    fields: dict[str, Any] = {"op": (Literal[cls.name], ...)}
    for p in params:
        fields[p.name] = (_checkable(cls, p), ... if p.required else p.default)
    model = create_model(f"{cls.__name__}Params", __config__=ConfigDict(
        extra="allow" if extra else "forbid", arbitrary_types_allowed=True), **fields)
    model.stage_class = cls
    return model


def _checkable(cls: type, p: Param) -> Any:
    """``p``'s annotation, or ``Any`` (with a warning) when pydantic cannot check it: a
    third-party stage's exotic annotation must not break every pipeline file."""
    try:
        TypeAdapter(p.annotation, config=ConfigDict(arbitrary_types_allowed=True))
    except Exception as e:  # noqa: BLE001 - pydantic raises several kinds here
        warnings.warn(f"stage {cls.name!r} ({cls.__module__}:{cls.__qualname__}): parameter {p.name!r} has an "
                      f"annotation YAML values cannot be checked against ({type(e).__name__}); any value is "
                      "passed through", RuntimeWarning, stacklevel=4)
        return Any
    return p.annotation


def _type_text(annotation: Any) -> str:
    if annotation is Any:
        return "any"
    try:
        schema = TypeAdapter(annotation).json_schema()
    except Exception:  # noqa: BLE001 - a type JSON schema cannot express (a callable)
        return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
    return _schema_text(schema)


_BOUNDS = (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))


def _schema_text(s: dict) -> str:
    if "enum" in s:
        return "one of " + ", ".join(repr(v) for v in s["enum"])
    if "const" in s:
        return repr(s["const"])
    if "anyOf" in s:
        return " or ".join(_schema_text(b) for b in s["anyOf"])
    t = s.get("type")
    if t == "array":
        items = s.get("prefixItems")
        if items:
            return "[" + ", ".join(_schema_text(b) for b in items) + "]"
        return f"list of {_schema_text(s.get('items', {}))}"
    lo = next(((k, s[k]) for k in ("minimum", "exclusiveMinimum") if k in s), None)
    hi = next(((k, s[k]) for k in ("maximum", "exclusiveMaximum") if k in s), None)
    if lo and hi:   # "float in (0, 1]"
        bounds = f"in {'(' if lo[0].startswith('ex') else '['}{lo[1]}, {hi[1]}{')' if hi[0].startswith('ex') else ']'}"
    else:
        bounds = " ".join(f"{op} {s[k]}" for k, op in _BOUNDS if k in s)
    name = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}.get(t, t or "any")
    return f"{name} {bounds}".strip()


def _plain(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _determinism(cls: type) -> bool | None:
    value = inspect.getattr_static(cls, "deterministic", True)
    return value if isinstance(value, bool) else None   # a property: depends on the parameters


def describe_stage(cls: type) -> dict[str, Any]:
    """What ``feedgpu stages --json`` prints for stage class ``cls``: plain data with ``name``,
    ``class`` (``module:qualname``), ``kind`` (``"sample"`` or ``"batch"``), ``summary`` (the
    docstring's first line), ``deterministic`` (``None``: depends on the parameters), ``draws``,
    ``dali`` (has a DALI implementation), ``dali_folds`` (the DALI arguments it passes to the
    batch stage after it instead of running, :meth:`~feedgpu.stages.base.SampleStage.dali_fold`),
    ``torch_baseline`` (has a torch equivalent for ``feedgpu bench``), ``takes_arrays`` (its
    ``apply`` also takes uint8 HWC arrays: after the cache it gets the cached array as it is),
    ``set_from_output`` and
    ``params`` (each ``{name, type, default, required}``; ``default`` is ``None`` when required)."""
    from .base import BatchStage, Stage

    params, extra = stage_params(cls)
    doc = inspect.getdoc(cls) or ""
    return {
        "name": cls.name,
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "kind": "batch" if issubclass(cls, BatchStage) else "sample",
        "summary": " ".join(doc.strip().split("\n\n")[0].split()),
        "deterministic": _determinism(cls),
        "draws": int(getattr(cls, "draws", 0) or 0),
        "dali": bool(getattr(cls, "has_dali", False)),
        "dali_folds": sorted(getattr(cls, "dali_folds", {}) or {}),
        "torch_baseline": cls.torch_baseline is not Stage.torch_baseline,
        "takes_arrays": bool(getattr(cls, "takes_arrays", False)),
        "set_from_output": list(getattr(cls, "from_output", ())),
        "params": [{"name": p.name, "type": _type_text(p.annotation),
                    "default": None if p.required else _plain(p.default), "required": p.required}
                   for p in params],
        "other_keys": extra,
    }
