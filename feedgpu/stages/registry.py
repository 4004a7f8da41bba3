"""Stage names -> classes: the built-in stages and those other packages register.

Built-in stages are found, not listed: every :class:`~feedgpu.stages.base.Stage` subclass that
a module of this package defines with its own ``name`` is one (adding a built-in stage is
writing its class). Third-party stages register through the ``feedgpu.stages`` entry-point
group, in the package's ``pyproject.toml``::

    [project.entry-points."feedgpu.stages"]
    my_blur = "my_package.blur:Blur"

and are then usable from YAML (``{op: my_blur, sigma: 2}``), validated from their signature
(:mod:`feedgpu.stages.params`) and listed by ``feedgpu stages``, as the built-in ones are.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
import warnings

from .base import Stage

__all__ = ["BUILTIN", "builtin_stages", "stage_classes"]

ENTRY_POINT_GROUP = "feedgpu.stages"
_NOT_STAGES = {"base", "registry", "params", "draws", "jpeg_header"}


def _is_stage_class(obj, module: str) -> bool:
    return (isinstance(obj, type) and issubclass(obj, Stage) and obj.__module__ == module
            and "name" in obj.__dict__ and not obj.__name__.startswith("_"))


def builtin_stages() -> dict[str, type[Stage]]:
    """The stage classes defined in ``feedgpu.stages``' modules, by name, sorted by name.
    Raises :class:`RuntimeError` when two of them share a name."""
    found: dict[str, type[Stage]] = {}
    for info in pkgutil.iter_modules(_package_path()):
        if info.name.startswith("_") or info.name in _NOT_STAGES:
            continue
        mod = importlib.import_module(f"{__package__}.{info.name}")
        for obj in vars(mod).values():
            if _is_stage_class(obj, mod.__name__):
                if obj.name in found and found[obj.name] is not obj:
                    raise RuntimeError(f"two built-in stages are named {obj.name!r}: "
                                       f"{found[obj.name].__qualname__} and {obj.__qualname__}")
                found[obj.name] = obj
    return dict(sorted(found.items()))


def _package_path() -> list[str]:
    return list(importlib.import_module(__package__).__path__)


BUILTIN: dict[str, type[Stage]] = builtin_stages()


def _plugins() -> list[tuple[str, type[Stage]]]:
    out = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as e:  # noqa: BLE001 - one broken plugin must not break every pipeline
            warnings.warn(f"feedgpu.stages entry point {ep.name!r} ({ep.value}) failed to load and is "
                          f"ignored: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Stage)):
            warnings.warn(f"feedgpu.stages entry point {ep.name!r} ({ep.value}) is not a feedgpu Stage "
                          "subclass (SampleStage or BatchStage) and is ignored", RuntimeWarning, stacklevel=3)
            continue
        if cls.name != ep.name:
            warnings.warn(f"feedgpu.stages entry point {ep.name!r} loads {cls.__qualname__}, whose name is "
                          f"{cls.name!r}: it is registered as {cls.name!r} (YAML 'op: {cls.name}')",
                          RuntimeWarning, stacklevel=3)
        out.append((cls.name, cls))
    return out


def stage_classes() -> dict[str, type[Stage]]:
    """Built-in stages plus those installed under the ``feedgpu.stages`` entry-point group
    (read again on every call, so a package installed meanwhile is seen). A plugin that fails
    to load, is not a Stage, or reuses a built-in's name is left out with a
    :class:`RuntimeWarning` naming it."""
    found = dict(BUILTIN)
    for name, cls in _plugins():
        if name in found and found[name] is not cls:
            warnings.warn(f"feedgpu.stages entry point {name!r} ({cls.__module__}:{cls.__qualname__}) "
                          f"reuses the name of {found[name].__module__}:{found[name].__qualname__}; "
                          "the first one is kept", RuntimeWarning, stacklevel=2)
            continue
        found[name] = cls
    return found
