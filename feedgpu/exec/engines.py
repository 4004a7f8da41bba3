"""Which engine runs a pipeline's stages: the Python process pool or NVIDIA DALI."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .section import section_fields

ENGINES = ("python", "dali")
DEVICES = ("auto", "cpu", "gpu")


@dataclass(frozen=True)
class EngineSettings:
    """Args:
        name: ``"python"`` (worker processes, Pillow-SIMD; default) or ``"dali"``.
        device: for DALI, ``"cpu"`` (``device_id=None``), ``"gpu"`` or ``"auto"`` (gpu when torch
            sees CUDA).
        threads: DALI threads (default: the loader's ``num_workers``, at least 1).
        hw_decoder_load: DALI GPU only, share of JPEGs for the hardware decoder (default 0.75).
        window_decode: DALI only: when the first stage after decode resizes a window (random
            resized crop, resize + center crop), decode only that window of upright JPEGs
            (crop-on-decode; default True). Pixels stay within 1 level of decoding whole images.
    """

    name: str = "python"
    device: str = "auto"
    threads: int | None = None
    hw_decoder_load: float = 0.75
    window_decode: bool = True

    @classmethod
    def make(cls, value) -> "EngineSettings":
        if value is None:
            return cls()
        if isinstance(value, EngineSettings):
            return value
        value = section_fields(value, "engine", "'python', 'dali'",
                               ("device", "hw_decoder_load", "name", "threads", "window_decode"))
        s = cls(**value)
        if s.name not in ENGINES:
            raise ConfigError(f"engine.name {s.name!r} is not one of {list(ENGINES)}")
        if s.device not in DEVICES:
            raise ConfigError(f"engine.device {s.device!r} is not one of {list(DEVICES)}")
        if not 0.0 <= s.hw_decoder_load <= 1.0:
            raise ConfigError(f"engine.hw_decoder_load must be in [0, 1], got {s.hw_decoder_load}")
        if s.threads is not None and s.threads < 1:
            raise ConfigError(f"engine.threads must be >= 1, got {s.threads}")
        return s

    def dali_device(self, output_device: str | None = None) -> str:
        """``"cpu"`` or ``"gpu"``. ``"auto"`` is the GPU when torch sees CUDA and the batches are
        wanted there (``output_device`` other than ``"cpu"``), else DALI's CPU operators."""
        if self.device != "auto":
            return self.device
        if output_device == "cpu":
            return "cpu"
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
