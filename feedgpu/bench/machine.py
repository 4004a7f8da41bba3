"""What a benchmark ran on: the machine (CPUs, memory, OS, Python, torch, PIL build) and the data
(images, mean encoded size and image size).

Every result ``feedgpu bench`` and the ``bench/`` scripts write records :func:`machine_info`.
"""
from __future__ import annotations

import os
import platform
import statistics

__all__ = ["cpu_model", "data_info", "machine_info"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else :func:`platform.processor`, else "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """CPUs (``cpu_count``, ``cpus_usable`` by affinity, ``cpu_model``), ``ram_gb``, OS, Python, torch,
    the active PIL build (``pil``, ``pil_label``) and ``cuda_available``, as a JSON-ready dict."""
    import psutil
    import torch

    from ..imaging import pil_build, pil_label

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    return {"cpu_count": os.cpu_count(), "cpus_usable": usable, "cpu_model": cpu_model(),
            "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "pil": pil_build(),
            "pil_label": pil_label(), "cuda_available": torch.cuda.is_available()}


def data_info(pipeline, path: str | None, sample: int | None = 256) -> dict:
    """Number of samples, mean encoded bytes and mean image size, over ``sample`` records spread
    evenly through the source (all when ``sample`` is None); only image headers are parsed."""
    import io

    from PIL import Image

    src = pipeline.source
    n = len(src)
    k = n if sample is None else min(n, sample)
    idx = sorted({int(i * n / k) for i in range(k)}) if k else []
    nbytes, w, h, mp = [], [], [], []
    for i in idx:
        rec = src.read(i)
        payload = rec.payload
        if isinstance(payload, (bytes, bytearray, memoryview)):
            nbytes.append(len(payload))
            try:
                size = Image.open(io.BytesIO(payload)).size
            except Exception:  # noqa: BLE001 - a bad sample does not stop the summary
                continue
        else:
            continue
        w.append(size[0])
        h.append(size[1])
        mp.append(size[0] * size[1] / 1e6)
    mean = statistics.fmean
    return {"path": path, "source": pipeline.source_label(), "images": n, "measured_on": len(idx),
            "mean_bytes": round(mean(nbytes)) if nbytes else None,
            "mean_width": round(mean(w)) if w else None, "mean_height": round(mean(h)) if h else None,
            "mean_megapixels": round(mean(mp), 4) if mp else None}
