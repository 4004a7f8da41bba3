"""Which engine runs a pipeline's stages: the Python process pool or NVIDIA DALI."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from ..settings_base import from_value, settings_class

ENGINES = ("python", "dali")
DEVICES = ("auto", "cpu", "gpu")


@settings_class("engine")
class EngineSettings:
    """The ``engine:`` section (a name alone, ``engine: dali``, is ``{name: dali}``).

    Args:
        name (str): ``"python"`` (worker processes, Pillow-SIMD; default) or ``"dali"``.
        device (str): for DALI, ``"cpu"`` (``device_id=None``), ``"gpu"`` or ``"auto"`` (default:
            gpu when torch sees CUDA and the batches go there).
        threads (int | None): DALI threads, >= 1 (default None: the loader's ``num_workers``, at
            least 1).
        hw_decoder_load (float): DALI GPU only, share of JPEGs for the hardware decoder, in
            [0, 1] (default 0.75).
        window_decode (bool): DALI only: when the first stage after decode resizes a window
            (random resized crop, resize + center crop), decode only that window of upright JPEGs
            (crop-on-decode; default True). Pixels stay within 1 level of decoding whole images.

    Raises :class:`~feedgpu.errors.ConfigError` naming the key (``engine.hw_decoder_load: ...``)
    for a bad value or an unknown key.
    """

    name: Literal[ENGINES] = "python"  # type: ignore[valid-type]
    device: Literal[DEVICES] = "auto"  # type: ignore[valid-type]
    threads: Union[Annotated[int, Field(gt=0)], None] = None
    hw_decoder_load: Annotated[float, Field(ge=0, le=1)] = 0.75
    window_decode: bool = True

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, v):
        return {"name": v} if isinstance(v, str) else v  # `engine: dali` is `engine: {name: dali}`

    @classmethod
    def make(cls, value) -> "EngineSettings":
        """From ``None`` (defaults), a name (``"python"``, ``"dali"``), a mapping of the fields,
        or an instance. Raises :class:`~feedgpu.errors.ConfigError`."""
        return from_value(cls, value, "'python', 'dali'")

    def dali_device(self, output_device: str | None = None) -> str:
        """``"cpu"`` or ``"gpu"``. ``"auto"`` is the GPU when torch sees CUDA and the batches are
        wanted there (``output_device`` other than ``"cpu"``), else DALI's CPU operators."""
        if self.device != "auto":
            return self.device
        if output_device == "cpu":
            return "cpu"
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
