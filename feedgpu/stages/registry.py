"""Stage names -> classes. Third-party stages register through the ``feedgpu.stages`` entry-point
group (``name = "package.module:StageClass"``)."""
from __future__ import annotations

from importlib.metadata import entry_points

from .base import Stage
from .custom import PythonStage
from .decode import Decode
from .geometry import HorizontalFlip, RandomResizedCrop, Resize, ResizeCenterCrop
from .normalize import Normalize

BUILTIN: dict[str, type[Stage]] = {c.name: c for c in (
    Decode, Resize, RandomResizedCrop, ResizeCenterCrop, HorizontalFlip, Normalize, PythonStage)}


def stage_classes() -> dict[str, type[Stage]]:
    """Built-in stages plus those installed under the ``feedgpu.stages`` entry-point group."""
    found = dict(BUILTIN)
    for ep in entry_points(group="feedgpu.stages"):
        found.setdefault(ep.name, ep.load())
    return found
