"""What NVIDIA DALI runs for the DALI engine: whether DALI is there, which plans it can run, and
the graph of one group of a batch's samples.

A batch's samples are split into groups, each run by its own DALI graph: JPEGs decoded over a
window only (crop-on-decode), JPEGs decoded whole (EXIF-rotated ones, or no window stage), and
pixels Pillow decoded. The graphs take each stage's per-sample arguments through
``fn.external_source`` (computed by :mod:`feedgpu.exec.dali.prepare`).
"""
from __future__ import annotations

import importlib.util

from ...errors import ConfigError
from ...stages.decode import Decode
from ..plan import Plan

__all__ = ["DEFAULT_HW_DECODER_LOAD", "GROUPS", "PIXELS", "WHOLE", "WINDOW", "build_graph", "check_dali_plan",
           "dali_available"]

#: Sample groups of a batch, each run by its own DALI graph: JPEGs decoded over a window only,
#: JPEGs decoded whole (EXIF-rotated ones, or no window stage), pixels decoded by Pillow.
WINDOW, WHOLE, PIXELS = "window", "whole", "pixels"
GROUPS = (WINDOW, WHOLE, PIXELS)

#: Share of JPEG decoding sent to the hardware decoder on the GPU: the fastest setting measured
#: at 8 threads on an H200 by ``bench/gpu_check.py`` (its results are not in ``bench/results/`` yet).
DEFAULT_HW_DECODER_LOAD = 0.75


def dali_available() -> bool:
    """Whether ``nvidia.dali`` can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:
        return False


def check_dali_plan(plan: Plan) -> None:
    """Raises :class:`ConfigError` naming the stages DALI cannot run."""
    stages = list(plan.sample_stages) + ([plan.batch_stage] if plan.batch_stage is not None else [])
    missing = [f"{s.name} ({getattr(s, 'label', s.name)})" for s in stages if not s.has_dali]
    if missing:
        raise ConfigError("engine 'dali' cannot run these stages: " + ", ".join(missing) +
                          "; custom Python stages run on the Python pool: use engine: python")
    if not isinstance(plan.sample_stages[0], Decode):
        raise ConfigError("engine 'dali': the first stage must be decode")
    undrawn = [s.name for s in plan.sample_stages[1:] if not s.deterministic and not s.draws]
    if undrawn:   # DALI arguments are computed per batch from uniform draws (stages.draws)
        raise ConfigError("engine 'dali': random stages must declare their uniform draws per sample "
                          f"(the stage attribute 'draws'): {', '.join(undrawn)}")




def build_graph(group: str, *, batch_size: int, threads: int, device: str, device_id: int,
                hw_decoder_load: float, local: bool, decode: Decode, ops: list, param_names: list[list[str]],
                fold: dict | None, batch_stage):
    """The built DALI pipeline of ``group`` (one of :data:`GROUPS`).

    Its inputs, by ``fn.external_source`` name: ``x`` (encoded files as uint8, or their paths as
    UTF-8 bytes when ``local``; HWC uint8 pixels for :data:`PIXELS`), ``dec_start``/``dec_end``
    (int32 decode windows, :data:`WINDOW` only) and ``s{i}_{name}`` for each name of
    ``param_names[i - 1]``, the arguments of ``ops[i - 1]``. ``fold`` maps the last op's
    arguments onto ``batch_stage``'s (a flip folded into normalize's mirror). ``device``:
    ``"cpu"`` (``device_id=None``) or ``"gpu"``."""
    from nvidia.dali import fn, pipeline_def, types

    dev = device
    hw = {"hw_decoder_load": hw_decoder_load}
    last = len(ops)

    # DALI's dynamic executor (the default since DALI 2.0), asynchronous: schedule_run()
    # returns at once, several scheduled iterations queue up and run while an earlier one's
    # outputs are copied out; prefetch_queue_depth=1, as feedgpu feeds exactly the batches
    # it wants (with 2, the first schedule_run would run two fed batches at once).
    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id if dev == "gpu" else None,
                  exec_async=True, exec_pipelined=True, exec_dynamic=True, prefetch_queue_depth=1)
    def graph():
        x = fn.external_source(name="x", dtype=types.UINT8, layout=None if group != PIXELS else "HWC")
        if local and group != PIXELS:
            x = fn.io.file.read(x)   # x: the files' paths
        if group == WINDOW:
            x = decode.dali_window(x, fn.external_source(name="dec_start", dtype=types.INT32),
                                   fn.external_source(name="dec_end", dtype=types.INT32), hw, dev)
        elif group == WHOLE:
            x = decode.dali(x, hw, dev)
        elif dev == "gpu":
            x = x.gpu()
        folded = {}
        for i, (st, names) in enumerate(zip(ops, param_names), start=1):
            args = {n: fn.external_source(name=f"s{i}_{n}") for n in names}
            if i == last and fold:
                folded = {dst: args[src] for src, dst in fold.items()}
                continue
            x = st.dali(x, args, dev)
        if batch_stage is not None:
            x = batch_stage.dali(x, folded, dev)
        return x

    pipe = graph()
    pipe.build()
    return pipe
