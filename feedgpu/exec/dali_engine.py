"""NVIDIA DALI as an engine for a pipeline's built-in stages, on the CPU or the GPU.

feedgpu keeps the order, the randomness and the error handling; DALI does the pixel work:

* Samples are fed through ``fn.external_source`` in feedgpu's sampler order (DALI's own readers
  shuffle and shard their own way, which would break the seeded order, the equal batch counts
  per rank and exact mid-epoch resume), so both engines see the same batches.
* Random parameters (crop window, flip) are drawn in Python from the same per-sample generator as
  the Python engine, ``sample_rng(seed, epoch, index, stage position)``, and fed per sample: both
  engines crop and flip identically; only the resampling arithmetic differs.
* Each header is read in Python first (:meth:`Decode.probe`): empty, unidentifiable or oversized
  files never reach DALI (they are skipped or raised as on the Python engine). Files whose
  decoding rules are Pillow's (PNG/WebP/GIF, CMYK or YCCK JPEG, alpha, 16-bit) are decoded by
  the Python decode stage and rejoin the batch through a second DALI pipeline fed with pixels.
* If DALI fails on a batch anyway (a corrupt entropy-coded segment, say), the batch is redone on
  the Python engine and the DALI pipelines are rebuilt; the loader stays usable. All of it is
  counted in ``loader.stats()["engine"]``.
* ``device="cpu"`` runs DALI's CPU operators with ``device_id=None`` (C++ thread pool);
  ``device="gpu"`` decodes with ``device="mixed"`` (nvJPEG and the hardware JPEG decoder,
  ``hw_decoder_load``) and runs the rest on the GPU; outputs are copied into torch tensors with
  DALI's ``feed_ndarray`` (pinned host memory when CUDA is present; on the GPU, on the training
  loop's current stream, so the copy is ordered with it).
"""
from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from collections import Counter

import numpy as np

from ..errors import ConfigError, SampleError
from ..stages.base import sample_rng
from ..stages.decode import UNKNOWN_KEY, Decode
from .assemble import Assembler, BatchReport, Spares
from .plan import Plan
from .work import Batch

#: Share of JPEG decoding sent to the hardware decoder on the GPU. 0.75 was the fastest setting
#: at 8 threads in shared/docs/anchors.md (30,851 img/s; 0.9: 29,579; defaults: 24,860 on H200).
DEFAULT_HW_DECODER_LOAD = 0.75


def dali_available() -> bool:
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


class DaliWork:
    """Produces batches with DALI, in the main process (DALI has its own thread pool).

    Args:
        source, plan, seed, on_error: as for :class:`~feedgpu.exec.assemble.Assembler`.
        batch_size: largest batch.
        device: ``"cpu"`` (``device_id=None``) or ``"gpu"``.
        threads: DALI CPU threads.
        device_id: CUDA device for ``device="gpu"``.
        hw_decoder_load: share of JPEGs for the hardware decoder (GPU only).
        in_dali_batch_stage: run the batch stage (normalize) inside DALI; False when the loader
            runs it on the GPU after copying uint8.
    """

    def __init__(self, source, plan: Plan, seed: int, on_error: str, batch_size: int, device: str = "cpu",
                 threads: int = 2, device_id: int = 0, hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD,
                 in_dali_batch_stage: bool = True):
        if not dali_available():
            raise ConfigError("engine 'dali' needs NVIDIA DALI: pip install 'feedgpu[dali]' "
                              "(nvidia-dali-cuda130)")
        check_dali_plan(plan)
        self.source, self.plan, self.seed, self.on_error = source, plan, int(seed), on_error
        self.batch_size, self.device, self.threads = batch_size, device, max(1, int(threads))
        self.device_id, self.hw_decoder_load = device_id, float(hw_decoder_load)
        self.decode: Decode = plan.sample_stages[0]
        self.ops = list(plan.sample_stages[1:])
        self.batch_stage = plan.batch_stage if in_dali_batch_stage else None
        probe_rng = np.random.default_rng(0)
        self.param_names = [sorted(st.dali_params(64, 64, probe_rng)[0]) for st in self.ops]
        self._pipes: dict[bool, object] = {}
        self._python = Assembler(source, plan, seed, on_error)  # whole-batch fallback
        spec = plan.out_spec if self.batch_stage is not None else plan.pool_spec
        self.out_shape, self.out_dtype = spec.shape, spec.dtype
        self.counters: Counter = Counter()
        self.orphans: dict = {}
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feedgpu-dali-prep")
        self._ahead: dict = {}   # (epoch, seq) -> (indices, Future of the prepared batch)

    # -- the pool-work interface the loader's iterator uses ------------------------------------
    def can_submit(self) -> bool:
        return False

    def refresh(self) -> None:
        pass

    def on_exit(self) -> None:
        """The loader's iterator ended or was dropped: a batch prepared ahead is stale (the next
        iteration may run another epoch, from another batch)."""
        self._drop_ahead()

    def _drop_ahead(self) -> None:
        for _, f in self._ahead.values():
            f.cancel()
        self._ahead.clear()

    def close(self) -> None:
        self._drop_ahead()
        self._prep.shutdown(wait=True, cancel_futures=True)
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feedgpu-dali-prep")
        self._pipes.clear()

    def stats(self) -> dict:
        return {"name": "dali", "device": self.device, "threads": self.threads,
                "hw_decoder_load": self.hw_decoder_load if self.device == "gpu" else None, **self.counters}

    # -- DALI graphs ---------------------------------------------------------------------------
    def _pipe(self, encoded: bool):
        pipe = self._pipes.get(encoded)
        if pipe is not None:
            return pipe
        from nvidia.dali import fn, pipeline_def, types

        dev = self.device

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads,
                      device_id=self.device_id if dev == "gpu" else None,
                      exec_async=False, exec_pipelined=False, prefetch_queue_depth=1)
        def graph():
            x = fn.external_source(name="x", dtype=types.UINT8, layout=None if encoded else "HWC")
            if encoded:
                x = self.decode.dali(x, {"hw_decoder_load": self.hw_decoder_load}, dev)
            elif dev == "gpu":
                x = x.gpu()
            for i, (st, names) in enumerate(zip(self.ops, self.param_names), start=1):
                args = {n: fn.external_source(name=f"s{i}_{n}") for n in names}
                x = st.dali(x, args, dev)
            if self.batch_stage is not None:
                x = self.batch_stage.dali(x, {}, dev)
            return x

        pipe = graph()
        pipe.build()
        self._pipes[encoded] = pipe
        return pipe

    # -- one batch -------------------------------------------------------------------------------
    def _prepare(self, idx: int, epoch: int, secs: dict):
        """Read, probe (or Python-decode) one sample and draw its parameters."""
        t0 = time.perf_counter()
        try:
            rec = self.source.read(idx)
        except OSError as e:
            raise SampleError(self.source.key(idx), "unreadable", str(e)) from None
        t1 = time.perf_counter()
        secs["read"] += t1 - t0
        try:
            payload = rec.payload
            dali_ok = False
            if isinstance(payload, (bytes, bytearray, memoryview)):
                w, h, dali_ok = self.decode.probe(payload)
            if dali_ok:
                item = np.frombuffer(payload, np.uint8)
            else:
                item = np.ascontiguousarray(np.asarray(self.decode.apply(payload, None)))
                h, w = item.shape[:2]
                self.counters["python_decoded"] += 1
        except SampleError as e:
            raise type(e)(rec.key if e.key == UNKNOWN_KEY else e.key, e.reason, e.detail) from None
        t2 = time.perf_counter()
        secs["probe" if dali_ok else "python_decode"] += t2 - t1
        params = {}
        size = (w, h)
        for i, st in enumerate(self.ops, start=1):
            rng = None if st.deterministic else sample_rng(self.seed, epoch, idx, i)
            args, size = st.dali_params(size[0], size[1], rng)
            for n, v in args.items():
                params[f"s{i}_{n}"] = v
        secs["params"] += time.perf_counter() - t2
        return dali_ok, item, params, rec.label

    def prefetch(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> None:
        """Prepare batch ``seq`` (read, probe, draw parameters) on a helper thread while DALI
        runs the current one (DALI releases the GIL while it works)."""
        if (epoch, seq) not in self._ahead:
            self._ahead[(epoch, seq)] = (indices, self._prep.submit(self._prepare_batch, epoch, indices, spares))

    def _prepare_batch(self, epoch: int, indices: np.ndarray, spares: np.ndarray):
        rep = BatchReport(stage_seconds=Counter())
        groups = {True: ([], [], {}), False: ([], [], {})}   # encoded? -> (positions, items, params)
        labels = np.empty(len(indices), np.int64)
        supply = Spares(spares, self.on_error, rep.skipped, len(indices))
        for j, idx in enumerate(indices.tolist()):
            ok, item, params, labels[j] = supply.run(lambda i: self._prepare(i, epoch, rep.stage_seconds), idx)
            pos, items, ps = groups[ok]
            pos.append(j)
            items.append(item)
            for n, v in params.items():
                ps.setdefault(n, []).append(v)
        rep.rows = len(indices)
        return groups, labels, rep

    def run_inline(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray):
        import torch

        ahead = self._ahead.pop((epoch, seq), None)
        if ahead is not None and not np.array_equal(ahead[0], indices):
            ahead = None  # prepared for other samples (a user sampler that changed): redo
        groups, labels, rep = ahead[1].result() if ahead is not None else self._prepare_batch(epoch, indices, spares)
        t0 = time.perf_counter()
        try:
            images = self._run(groups, len(indices))
        except Exception as e:  # noqa: BLE001 - DALI raises RuntimeError for bad data: redo on Python
            return self._fallback(seq, epoch, indices, spares, e, rep)
        rep.stage_seconds["dali"] += time.perf_counter() - t0
        self.counters["batches"] += 1
        return Batch(images, torch.from_numpy(labels)), rep

    def _fallback(self, seq: int, epoch: int, indices, spares, error: Exception, rep: BatchReport):
        """Redo a batch DALI failed on with the Python engine; rebuild the DALI pipelines."""
        import warnings

        import torch

        self.counters["dali_errors"] += 1
        self._pipes.clear()
        first = _reason(error)
        warnings.warn(f"feedgpu: DALI failed on batch {seq} of epoch {epoch} ({type(error).__name__}: {first}); "
                      "redone on the Python engine", stacklevel=3)
        spec = self.plan.pool_spec  # what the Python assembler writes
        buf = np.empty((len(indices), *spec.shape), spec.dtype)
        labels = np.empty(len(indices), np.int64)
        rep.skipped = self._python.fill(buf, labels, indices, spares, epoch).skipped
        images = torch.from_numpy(buf)
        if self.device == "gpu":
            images = images.to(f"cuda:{self.device_id}")
        if self.batch_stage is not None and self.plan.batch_on_device:
            images = self.batch_stage.apply_batch(images)
        return Batch(images, torch.from_numpy(labels)), rep

    def _run(self, groups, n: int):
        import torch
        from nvidia.dali.plugin.pytorch import feed_ndarray

        on_gpu = self.device == "gpu"
        dtype = {"uint8": torch.uint8, "float32": torch.float32, "float16": torch.float16}[self.out_dtype]
        if on_gpu:
            out = torch.empty((n, *self.out_shape), dtype=dtype, device=f"cuda:{self.device_id}")
        else:
            out = torch.empty((n, *self.out_shape), dtype=dtype, pin_memory=torch.cuda.is_available())
        for encoded, (pos, items, params) in groups.items():
            if not pos:
                continue
            pipe = self._pipe(encoded)
            pipe.feed_input("x", items)
            for name, values in params.items():
                pipe.feed_input(name, values)
            tl = pipe.run()[0].as_tensor()
            whole = len(pos) == n
            dst = out if whole else torch.empty((len(pos), *self.out_shape), dtype=dtype, device=out.device)
            stream = torch.cuda.current_stream(out.device) if on_gpu else None
            feed_ndarray(tl, dst, cuda_stream=stream)
            if not whole:
                out[torch.as_tensor(pos, device=out.device)] = dst
        return out


def _reason(error: Exception) -> str:
    """The informative lines of a DALI error: its first line is "Critical error in pipeline:", and
    the traceback of the operator's definition (between "which was used in the pipeline
    definition" and "encountered:") is left out."""
    keep, in_traceback = [], False
    for line in str(error).splitlines():
        text = line.strip()
        low = text.lower()
        if low.startswith("which was used in the pipeline definition"):
            in_traceback = True
        elif low.startswith("encountered:"):
            in_traceback = False
        elif text and not in_traceback and not low.startswith(
                ("critical error in pipeline", "current pipeline object is no longer valid")):
            keep.append(text)
    return " ".join(keep[:3]) if keep else str(error).strip().split("\n")[0]
