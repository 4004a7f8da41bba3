"""A user's Python callable as a stage (runs in the Python process pool)."""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Optional, Union

from ..errors import ConfigError
from ..spec import ImageSpec
from .base import SampleStage
from .params import PositiveInt


def import_callable(ref: str, what: str = "python stage: fn") -> Callable:
    """``"package.module:attr"`` -> the object. Raises :class:`ConfigError` when missing, its
    message starting with ``what`` (the option that named it)."""
    mod, sep, attr = ref.partition(":")
    if not sep or not mod or not attr:
        raise ConfigError(f"{what} must look like 'module:callable', got {ref!r}")
    try:
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what}: cannot import {ref!r}: {e}") from None
    if not callable(obj):
        raise ConfigError(f"{what}: {ref!r} is not callable")
    return obj


class PythonStage(SampleStage):
    """Run ``fn(img)`` (or ``fn(img, rng)`` when ``random=True``) on each sample.

    Args:
        fn: a callable, or ``"module:callable"``. It receives a PIL RGB image (or whatever the
            previous stage produced) and returns a PIL image or an HWC uint8 array.
        random: the callable draws random numbers from the ``numpy.random.Generator`` it gets as
            second argument (seeded per sample; never use global RNGs, they differ per worker).
        size: ``[height, width]`` of the output when the callable changes the size, so the batch
            shape is known before data flows; ``None`` keeps the input's size.
        name: label in ``explain`` and errors (default: the callable's qualified name).
    """

    name = "python"

    def __init__(self, fn: Union[str, Callable], random: bool = False,
                 size: Optional[tuple[PositiveInt, PositiveInt]] = None, name: Optional[str] = None):
        self.ref = fn if isinstance(fn, str) else f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        self.fn = import_callable(fn) if isinstance(fn, str) else fn
        if not callable(self.fn):
            raise ConfigError(f"python stage: {fn!r} is not callable")
        self.random = bool(random)
        self.size = None if size is None else (int(size[0]), int(size[1]))
        self.label = name or self.ref
        if self.random:
            try:
                inspect.signature(self.fn).bind(None, None)
            except (TypeError, ValueError):
                raise ConfigError(f"python stage {self.label}: random=True needs fn(img, rng)") from None

    @property
    def deterministic(self) -> bool:  # type: ignore[override]
        return not self.random

    def config(self) -> dict[str, Any]:
        return {"fn": self.ref, "random": self.random, "size": None if self.size is None else list(self.size)}

    def out_spec(self, spec: ImageSpec) -> ImageSpec:
        return spec if self.size is None else spec.with_(height=self.size[0], width=self.size[1])

    def torch_baseline(self) -> list:
        """The same callable, a random one with a Generator seeded from torch's RNG."""
        from ..torch_ref import PilCallable

        return [PilCallable(self.fn, self.random, self.label)]

    def apply(self, x: Any, rng=None) -> Any:
        return self.fn(x, rng) if self.random else self.fn(x)
