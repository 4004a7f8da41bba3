"""The loaders ``feedgpu bench`` measures, each wrapped as a :class:`Subject`: feedgpu on its
Python engine, on DALI's CPU or GPU engine, and the torch DataLoader baseline
(:mod:`feedgpu.bench.torch_baseline`).
"""
from __future__ import annotations

import gc
from typing import Callable

__all__ = ["ENGINE_KINDS", "LOADERS", "MAKERS", "Subject", "dali_cpu_subject", "dali_gpu_subject",
           "feedgpu_subject", "python_subject", "torch_subject"]

MB = 1 << 20
LOADERS = ("feedgpu", "torch")
#: ``--engine`` choices -> loader kinds (keys of :data:`MAKERS`, and of the summary / JSON).
ENGINE_KINDS = {"python": "feedgpu", "dali-cpu": "feedgpu_dali_cpu", "dali-gpu": "feedgpu_dali_gpu",
                "torch": "torch"}


class Subject:
    """One loader as the measurement sees it: iterate, list its workers, fetch a batch, close."""

    def __init__(self, name: str, label: str, loader, pids: Callable[[], list[int]], device: str,
                 close: Callable[[], None], extra: Callable[[], dict] | None = None, to_device: bool = False):
        self.name, self.label, self.loader, self.device = name, label, loader, device
        self._pids, self._close, self._extra, self._to_device = pids, close, extra, to_device

    def __len__(self) -> int:
        return len(self.loader)

    def worker_pids(self) -> list[int]:
        return self._pids()

    def fetch(self, it):
        batch = next(it)
        if self._to_device:
            batch = [x.to(self.device, non_blocking=True) for x in batch]
        return batch

    def extra(self) -> dict:
        return self._extra() if self._extra else {}

    def close(self) -> None:
        self._close()


def feedgpu_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                    persistent: bool = False, engine=None, name: str = "feedgpu") -> Subject:
    """feedgpu's loader; ``engine`` overrides the pipeline's (``"python"``, or a DALI mapping:
    its thread count is ``workers``, as the loader does when ``engine.threads`` is unset)."""
    from ..imaging import pil_label
    from ..loader.front import DataLoader

    loader = DataLoader(pipeline, batch_size=batch_size, num_workers=workers, device=device,
                        persistent_workers=persistent and workers > 0, engine=engine)
    eng = loader.engine_settings
    if eng.name == "dali":
        dd = eng.dali_device()
        n = eng.threads or max(1, workers)
        label = f"feedgpu DALI {dd.upper()} ({n} thread{'' if n == 1 else 's'})"
    else:
        label = f"feedgpu ({pil_label()})"

    def extra() -> dict:
        st = loader.stats()
        n = max(1, st["samples"])
        budget = loader.memory_budget
        return {"stage_ms_per_sample": {k: round(v / n * 1e3, 4) for k, v in st["stage_s"].items()},
                "worker_memory_mb": round(budget.worker_bytes / MB, 1) if budget is not None else None,
                "skipped": st["skipped_total"], "engine": st["engine"],
                **({"threads": st["engine"]["threads"]} if eng.name == "dali" else {})}

    return Subject(name, label, loader, loader.worker_pids, device, loader.shutdown, extra)


def python_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                   persistent: bool = False) -> Subject:
    return feedgpu_subject(pipeline, workers, batch_size, device, persistent, engine="python")


def dali_cpu_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                     persistent: bool = False) -> Subject:
    return feedgpu_subject(pipeline, workers, batch_size, device, persistent,
                           engine={"name": "dali", "device": "cpu"}, name="feedgpu_dali_cpu")


def dali_gpu_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                     persistent: bool = False) -> Subject:
    return feedgpu_subject(pipeline, workers, batch_size, device, persistent,
                           engine={"name": "dali", "device": "gpu"}, name="feedgpu_dali_gpu")


def torch_subject(pipeline, workers: int, batch_size: int, device: str = "cpu",
                  persistent: bool = False) -> Subject:
    import psutil

    from .torch_baseline import torch_loader
    from ..imaging import pil_label

    gpu = device != "cpu"
    loader = torch_loader(pipeline, workers, batch_size, persistent_workers=persistent and workers > 0,
                          pin_memory=gpu)
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}

    def pids() -> list[int]:
        return [c.pid for c in me.children(recursive=True) if c.pid not in before]

    def close() -> None:
        it = getattr(loader, "_iterator", None)  # persistent workers live on the loader
        loader._iterator = None
        del it
        gc.collect()

    return Subject("torch", f"torch DataLoader + {pil_label()}", loader, pids, device, close, to_device=gpu)


MAKERS = {"feedgpu": python_subject, "feedgpu_dali_cpu": dali_cpu_subject, "feedgpu_dali_gpu": dali_gpu_subject,
          "torch": torch_subject}
