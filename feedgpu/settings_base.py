"""The frame of every settings class: a frozen pydantic dataclass per YAML section, validated
when it is made, with errors that name the key.

A class decorated with :func:`settings_class` is a frozen ``pydantic.dataclasses.dataclass``
(``extra="forbid"``): its fields, defaults and bounds are written once, on the class, and serve
both the YAML schema (:mod:`feedgpu.config` nests the classes) and Python
(``LoaderSettings(batch_size=64)``, ``dataclasses.replace(s, batch_size=0)``, which validates
again). Made from Python, a bad value raises :class:`~feedgpu.errors.ConfigError` (one line per
problem, ``loader.batch_size: Input should be greater than 0 (got 0)``); from YAML the same
problems are listed with the file's name by :func:`feedgpu.config.format_errors`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from .errors import ConfigError

#: error types of a key the class does not have (a mapping's key, a keyword argument)
UNKNOWN_KEY = ("extra_forbidden", "unexpected_keyword_argument")
_BRANCHES = {"int", "float", "str", "bool", "none", "list", "dict", "tuple"}


def settings_class(section: str):
    """Decorate a class as the settings of YAML section ``section``: a frozen pydantic dataclass
    that refuses unknown keys and raises :class:`ConfigError` naming ``section.key`` when made
    (or replaced) with a bad value."""

    def wrap(cls):
        cls = pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))(cls)
        validated_init = cls.__init__

        @functools.wraps(validated_init)
        def __init__(self, *args, **kwargs):
            try:
                validated_init(self, *args, **kwargs)
            except ValidationError as e:
                raise settings_error(e, type(self)) from None

        cls.__init__ = __init__
        cls.__section__ = section
        return cls

    return wrap


def field_names(model: Any) -> list[str]:
    """The keys of a settings class or a pydantic model, in declaration order."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return [f.name for f in dataclasses.fields(model)]


def defaults(cls) -> dict[str, Any]:
    """``{field: default}`` of a settings class (a field without a default is left out)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def nested(model: Any, key) -> Any:
    """The settings class or pydantic model of field ``key`` of ``model``, if it has one."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        fields = model.model_fields
    else:
        fields = getattr(model, "__pydantic_fields__", {})
    field = fields.get(key)
    ann = field.annotation if field is not None else None
    if isinstance(ann, type) and (issubclass(ann, BaseModel) or dataclasses.is_dataclass(ann)):
        return ann
    return None


def from_value(cls, value, expected: str):
    """A settings object from ``None`` (the defaults), an instance (itself), a name (``"ray"``:
    ``{"name": "ray"}``) or a mapping of its fields. ``expected``: the names it takes, for the
    message. Raises :class:`ConfigError` for another type or a bad field."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{cls.__section__}: expected {expected}, a mapping or {cls.__name__}, got {value!r}")
    return cls(**value)


def _is_branch(seg) -> bool:
    """A location segment naming a branch of a union type (``literal['auto']``, ``constrained-int``),
    not a key of the user's file."""
    return isinstance(seg, str) and (seg in _BRANCHES or any(c in seg for c in "[]-'(") and not seg.startswith("_"))


def merge_branches(errors: list[dict]) -> list[dict]:
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


def message(e: dict, model: Any) -> str:
    """What is wrong, for one pydantic error ``e`` about a key of ``model`` (the settings class or
    model holding the key; for an unknown key its allowed keys are listed)."""
    loc = tuple(e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] in UNKNOWN_KEY:
        allowed = sorted(field_names(model)) if model is not None else []
        return f"unknown key {loc[-1]!r}; allowed keys: {', '.join(allowed)}"
    if e["type"] == "missing":
        return "required key is missing"
    if e["type"] == "string_pattern_mismatch" and loc[-1:] == ("device",):
        return f"got {e['input']!r}; allowed: auto, cpu, cuda, cuda:N"
    inp = e.get("input")
    if "input" in e and not isinstance(inp, (dict, list)) and type(inp).__name__ != "ArgsKwargs" \
            and "got " not in msg and not (isinstance(inp, str) and repr(inp) in msg):
        msg = f"{msg} (got {inp!r})"
    return msg


def settings_error(err: ValidationError, cls) -> ConfigError:
    """A :class:`ConfigError` listing every problem of ``err`` (raised making ``cls``), each
    under its key (``loader.batch_size: ...``)."""
    section = cls.__section__
    lines = []
    for e in merge_branches(err.errors()):
        loc = tuple(e["loc"])
        model = cls
        for key in loc[:-1]:
            model = nested(model, key) or model
        msg = message(e, model)
        path = ".".join([section, *map(str, loc)])
        lines.append(msg if msg.startswith(section + ".") and not loc else f"{path}: {msg}")
    if len(lines) == 1:
        return ConfigError(lines[0])
    return ConfigError(f"invalid {section} settings:\n" + "\n".join(f"  {line}" for line in lines))
