"""NVIDIA DALI as an engine for a pipeline's built-in stages, on the CPU or the GPU.

feedgpu keeps the order, the randomness and the error handling; DALI does the pixel work:

* Samples are fed through ``fn.external_source`` in feedgpu's sampler order (DALI's own readers
  shuffle and shard their own way, which would break the seeded order, the equal batch counts
  per rank and exact mid-epoch resume), so both engines see the same batches.
* Random parameters (crop window, flip) are computed in Python for the whole batch from the same
  per-sample draws as on the Python engine (``sample_uniforms(seed, epoch, index, stage
  position)``, :mod:`feedgpu.stages.draws`), and fed per sample: both engines crop and flip
  identically; only the resampling arithmetic differs.
* Each header is read in Python first (:meth:`Decode.probe`): empty, unidentifiable or oversized
  files never reach DALI (they are skipped or raised as on the Python engine). Files whose
  decoding rules are Pillow's (PNG/WebP/GIF, CMYK or YCCK JPEG, alpha, 16-bit) are decoded by
  the Python decode stage and rejoin the batch through a second DALI pipeline fed with pixels.
* If DALI fails on a batch anyway (a corrupt entropy-coded segment, say), the batch is redone on
  the Python engine and the DALI pipelines are rebuilt; the loader stays usable. All of it is
  counted in ``loader.stats()["engine"]``.
* DALI runs ahead of the training loop: batch b+1's Python side (read, probe, parameters) runs
  on one helper thread while DALI computes batch b on another (DALI releases the GIL), up to
  the loader's ``prefetch_factor`` batches ahead, and the training step runs meanwhile.
* Local files (a folder source) are read in Python only for the first header check; later
  epochs stat() each file and, when its length, inode and status-change time are those checked,
  give DALI its path (``fn.io.file.read``, C++ threads): the Python side then costs ~15 us a sample
  (one thread: ~65,000 samples/s), so it does not cap the GPU path.
* Two graph rewrites that keep the output (``bench/results/dali_cpu.md`` measures each):
  crop-on-decode — when the first stage after decode resizes a window (random resized crop,
  resize + center crop), upright JPEGs are decoded only over that window plus the resampling
  filter's reach (``decoders.image_slice``) and the window is shifted into it; and a
  ``horizontal_flip`` right before normalize becomes ``crop_mirror_normalize(mirror=...)``.
* ``device="cpu"`` runs DALI's CPU operators with ``device_id=None`` (C++ thread pool);
  ``device="gpu"`` decodes with ``device="mixed"`` (nvJPEG and the hardware JPEG decoder,
  ``hw_decoder_load``) and runs the rest on the GPU. CPU batches on a machine without CUDA are
  DALI's output buffers themselves (DLPack, no copy, as DALI's own PyTorch iterator does with
  the dynamic executor); with CUDA they are copied with DALI's ``feed_ndarray`` into reused,
  pinned host buffers (:class:`~feedgpu.exec.host_buffers.HostBuffers`) that return when the
  training loop drops the batch. GPU batches are copied on a side stream, and the training
  loop's stream waits on it before it uses the batch.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import ConfigError, SampleError
from ..stages.draws import sample_uniforms
from ..stages.decode import UNKNOWN_KEY, Decode
from .assemble import Assembler, BatchReport, Spares
from .contract import WorkBase
from .host_buffers import HostBuffers
from .plan import Plan
from .work import Batch

#: Sample groups of a batch, each run by its own DALI graph: JPEGs decoded over a window only,
#: JPEGs decoded whole (EXIF-rotated ones, or no window stage), pixels decoded by Pillow.
WINDOW, WHOLE, PIXELS = "window", "whole", "pixels"

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
    undrawn = [s.name for s in plan.sample_stages[1:] if not s.deterministic and not s.draws]
    if undrawn:   # DALI arguments are computed per batch from uniform draws (stages.draws)
        raise ConfigError("engine 'dali': random stages must declare their uniform draws per sample "
                          f"(the stage attribute 'draws'): {', '.join(undrawn)}")


class DaliWork(WorkBase):
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
        window_decode: decode only the window a window-resizing first stage keeps (default True).
        ahead: batches computed ahead of the training loop (the loader passes its
            ``prefetch_factor``; default 2).
    """

    def __init__(self, source, plan: Plan, seed: int, on_error: str, batch_size: int, device: str = "cpu",
                 threads: int = 2, device_id: int = 0, hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD,
                 in_dali_batch_stage: bool = True, window_decode: bool = True, ahead: int = 2):
        if not dali_available():
            raise ConfigError("engine 'dali' needs NVIDIA DALI: pip install 'feedgpu[dali]' "
                              "(nvidia-dali-cuda130)")
        check_dali_plan(plan)
        self.source, self.plan, self.seed, self.on_error = source, plan, int(seed), on_error
        self.batch_size, self.device, self.threads = batch_size, device, max(1, int(threads))
        self.device_id, self.hw_decoder_load = device_id, float(hw_decoder_load)
        self.ahead = max(1, int(ahead))
        self.decode: Decode = plan.sample_stages[0]
        self.ops = list(plan.sample_stages[1:])
        self.batch_stage = plan.batch_stage if in_dali_batch_stage else None
        # crop-on-decode: the first stage after decode resizes a window
        self.window = bool(window_decode and self.ops and self.ops[0].window_resize)
        # a flip right before normalize is done by crop_mirror_normalize(mirror=...)
        # the last op folded into the batch stage (a flip into normalize's mirror), as the op declares
        self.fold = self.ops[-1].dali_fold(self.batch_stage) if self.ops else None
        one = np.array([[64, 64]], np.int64)
        self.param_names = [sorted(st.dali_params(one, None if st.deterministic else np.zeros((1, st.draws)))[0])
                            for st in self.ops]
        self._pipes: dict[str, object] = {}
        self._python = Assembler(source, plan, seed, on_error)  # whole-batch fallback
        spec = plan.out_spec if self.batch_stage is not None else plan.pool_spec
        self.out_shape, self.out_dtype = spec.shape, spec.dtype
        self.counters: Counter = Counter()
        self.orphans: dict = {}
        self._host = None if device == "gpu" else HostBuffers(
            batch_size, self.out_shape, self.out_dtype, pinned=_cuda_available(), count=self.ahead + 2)
        self._zero_copy = _zero_copy_output(device)
        self._stream = None
        self._headers = _Headers(len(source))
        # local files (a folder source) are read by DALI's C++ threads, except where the header
        # check needs their bytes (first epoch) or Pillow decodes them
        self._local = source.local_file(0) is not None if len(source) else False
        self._start_threads()
        self._ahead: dict = {}   # (epoch, seq) -> (indices, Future of the finished batch)

    def _start_threads(self) -> None:
        # one thread prepares batches (Python: GIL), one drives DALI (feeds, schedules, copies out)
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feedgpu-dali-prep")
        self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feedgpu-dali-run")
        self._lock = threading.Lock()
        self._queue: deque[_InFlight] = deque()   # started batches not yet collected, in order

    # -- the pool-work interface the loader's iterator uses ------------------------------------
    runs_ahead = True   # prefetch(): batches scheduled on DALI's executor ahead of the loop

    def can_submit(self) -> bool:
        return False

    def refresh(self) -> None:
        pass

    def on_exit(self) -> None:
        """The loader's iterator ended or was dropped: batches started ahead are stale (the next
        iteration may run another epoch, from another batch)."""
        self._drop_ahead()

    def _drop_ahead(self) -> None:
        for _, f in self._ahead.values():
            f.cancel()
        self._ahead.clear()
        with self._lock:
            stale, self._queue = list(self._queue), deque()
        if stale:
            # after the runner's current job: outputs DALI computed for the dropped batches
            # would be collected in their place, so such pipelines are rebuilt
            self._runner.submit(self._discard, stale)

    def _discard(self, stale: list) -> None:
        # a stale batch's job still running when the next epoch started may also have
        # scheduled some of the new batches: _reset schedules those again
        if any(f.fed for f in stale):
            self._reset()

    def close(self) -> None:
        self._drop_ahead()
        self._prep.shutdown(wait=True, cancel_futures=True)
        self._runner.shutdown(wait=True, cancel_futures=True)
        self._pipes.clear()
        self._start_threads()

    def stats(self) -> dict:
        return {"name": "dali", "device": self.device, "threads": self.threads,
                "hw_decoder_load": self.hw_decoder_load if self.device == "gpu" else None,
                "window_decode": self.window, "ahead": self.ahead, **self.counters}

    # -- DALI graphs ---------------------------------------------------------------------------
    def _pipe(self, group: str):
        pipe = self._pipes.get(group)
        if pipe is not None:
            return pipe
        from nvidia.dali import fn, pipeline_def, types

        dev = self.device
        hw = {"hw_decoder_load": self.hw_decoder_load}
        last = len(self.ops)

        # DALI's dynamic executor (the default since DALI 2.0), asynchronous: schedule_run()
        # returns at once, several scheduled iterations queue up and run while an earlier one's
        # outputs are copied out; prefetch_queue_depth=1, as feedgpu feeds exactly the batches
        # it wants (with 2, the first schedule_run would run two fed batches at once).
        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads,
                      device_id=self.device_id if dev == "gpu" else None,
                      exec_async=True, exec_pipelined=True, exec_dynamic=True, prefetch_queue_depth=1)
        def graph():
            x = fn.external_source(name="x", dtype=types.UINT8, layout=None if group != PIXELS else "HWC")
            if self._local and group != PIXELS:
                x = fn.io.file.read(x)   # x: the files' paths
            if group == WINDOW:
                x = self.decode.dali_window(x, fn.external_source(name="dec_start", dtype=types.INT32),
                                            fn.external_source(name="dec_end", dtype=types.INT32), hw, dev)
            elif group == WHOLE:
                x = self.decode.dali(x, hw, dev)
            elif dev == "gpu":
                x = x.gpu()
            folded = {}
            for i, (st, names) in enumerate(zip(self.ops, self.param_names), start=1):
                args = {n: fn.external_source(name=f"s{i}_{n}") for n in names}
                if i == last and self.fold:
                    folded = {dst: args[src] for src, dst in self.fold.items()}
                    continue
                x = st.dali(x, args, dev)
            if self.batch_stage is not None:
                x = self.batch_stage.dali(x, folded, dev)
            return x

        pipe = graph()
        pipe.build()
        self._pipes[group] = pipe
        return pipe

    # -- one batch -------------------------------------------------------------------------------
    def _prepare(self, idx: int, secs: dict):
        """Read and probe (or Python-decode) one sample: ``(group, item, width, height, label, idx)``.
        ``item`` is the encoded file, or for a local file its path (DALI reads it), or pixels."""
        t0 = time.perf_counter()
        local = self.source.local_file(idx) if self._local else None
        stamp = None   # a local file's (size, version): its header is kept for that version
        if local is not None:
            try:
                st = os.stat(local[0])
                stamp = (st.st_size, _file_version(st))
            except OSError:
                pass    # read() below names the error
            else:       # a header known from an earlier epoch: DALI reads the file
                w, h, kind = self._headers.get(idx, *stamp)
                if kind in (_Headers.UPRIGHT, _Headers.ROTATED):
                    secs["probe"] += time.perf_counter() - t0
                    return self._jpeg_group(kind), _encoded_path(local[0]), w, h, local[1], idx
        try:
            rec = self.source.read(idx)
        except OSError as e:
            raise SampleError(self.source.key(idx), "unreadable", str(e)) from None
        t1 = time.perf_counter()
        secs["read"] += t1 - t0
        try:
            payload = rec.payload
            group = PIXELS
            if isinstance(payload, (bytes, bytearray, memoryview)):
                # other sources: 0; a local file that changed between stat() and read: -1, not kept
                version = 0 if local is None else (stamp[1] if stamp and stamp[0] == len(payload) else -1)
                w, h, kind = self._headers.get(idx, len(payload), version)
                if kind == _Headers.UNKNOWN:
                    w, h, dali_ok, upright = self.decode.header(payload)
                    kind = self._headers.put(idx, len(payload), version, w, h, dali_ok, upright)
                if kind != _Headers.PILLOW:
                    group = self._jpeg_group(kind)
            if group == PIXELS:
                item = np.ascontiguousarray(np.asarray(self.decode.apply(payload, None)))
                h, w = item.shape[:2]
                self.counters["python_decoded"] += 1
            else:
                item = _encoded_path(local[0]) if local is not None else np.frombuffer(payload, np.uint8)
        except SampleError as e:
            raise type(e)(rec.key if e.key == UNKNOWN_KEY else e.key, e.reason, e.detail) from None
        secs["probe" if group != PIXELS else "python_decode"] += time.perf_counter() - t1
        return group, item, w, h, rec.label, idx

    def _jpeg_group(self, kind: int) -> str:
        """The DALI graph of a JPEG DALI decodes: upright ones over their window (crop-on-decode)."""
        return WINDOW if (kind == _Headers.UPRIGHT and self.window) else WHOLE

    def _params(self, epoch: int, indices: np.ndarray, sizes: np.ndarray, window: np.ndarray) -> dict:
        """Every stage's DALI arguments for the batch's samples (``indices``: the samples kept,
        spares included; ``sizes``: int64 ``(n, 2)`` width, height after decode), each an array
        with a row per sample; for the rows of ``window`` (crop-on-decode) the decode window too."""
        params = {}
        for i, st in enumerate(self.ops, start=1):
            u = None if st.deterministic else sample_uniforms(self.seed, epoch, indices, i, st.draws)
            args, out = st.dali_params(sizes, u)
            if i == 1 and window.any():
                args = _decode_windows(args, sizes, out, window, params)
            for n, v in args.items():
                params[f"s{i}_{n}"] = v
            sizes = out
        return params

    def prefetch(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> None:
        """Start batch ``seq``: its Python side on the helper thread, then DALI, while the
        training loop works on earlier batches. Batches start in the order of the calls; a batch
        already started is left as it is."""
        if (epoch, seq) not in self._ahead:
            job = _InFlight(self._prep.submit(self._prepare_batch, epoch, indices, spares), len(indices))
            with self._lock:
                self._queue.append(job)
            self._ahead[(epoch, seq)] = (indices, self._runner.submit(self._compute, job))

    def _prepare_batch(self, epoch: int, indices: np.ndarray, spares: np.ndarray):
        rep = BatchReport(stage_seconds=Counter())
        supply = Spares(spares, self.on_error, rep.skipped, len(indices))
        secs = rep.stage_seconds
        rows = [supply.run(lambda i: self._prepare(i, secs), idx) for idx in indices.tolist()]
        t0 = time.perf_counter()
        kinds, items, ws, hs, labels, used = zip(*rows)
        kinds = np.array(kinds)
        sizes = np.stack([np.array(ws, np.int64), np.array(hs, np.int64)], axis=1)
        params = self._params(epoch, np.array(used, np.int64), sizes, kinds == WINDOW)
        groups = {}   # group -> (positions, items, {argument: array with a row per position})
        for g in (WINDOW, WHOLE, PIXELS):
            pos = np.flatnonzero(kinds == g)
            self.counters[f"{g}_decoded" if g != PIXELS else "pixels_fed"] += len(pos)
            if g != WINDOW:   # only the crop-on-decode rows have a decode window
                pos_params = {n: v[pos] for n, v in params.items() if not n.startswith("dec_")}
            else:
                pos_params = {n: v if n.startswith("dec_") else v[pos] for n, v in params.items()}
            at = pos.tolist()
            groups[g] = (at, [items[j] for j in at], pos_params)
        secs["params"] += time.perf_counter() - t0
        rep.rows = len(indices)
        return groups, np.array(labels, np.int64), rep

    def _compute(self, job: "_InFlight"):
        """On the runner thread: ``(images or None, labels, report, DALI's exception or None,
        CUDA event or None)`` of ``job``; a sample error from the Python side is raised.

        Before waiting for ``job``'s outputs it schedules the batches after it whose Python side
        is done (up to ``ahead``), so DALI's threads go on with them during the copy out."""
        try:
            groups, labels, rep = job.prepared.result()
            t0 = time.perf_counter()
            self._schedule(job)
            with self._lock:
                later = [j for j in self._queue if j is not job and not j.fed][:self.ahead]
            for nxt in later:
                if not nxt.prepared.done() or nxt.prepared.exception() is not None:
                    break
                self._schedule(nxt)
                if nxt.error is not None:
                    # the pipelines were dropped: ``job`` goes into the new ones before any later
                    # batch, as each pipeline returns its outputs in the order it was fed
                    break
            self._schedule(job)  # again, if a later batch's failure dropped the pipelines
            if job.error is None:
                try:
                    images, event = self._collect(job)
                except Exception as e:  # noqa: BLE001 - DALI raises RuntimeError for bad data
                    job.error = e
                    self._reset()
            if job.error is not None:
                return None, labels, rep, job.error, None
            rep.stage_seconds["dali"] += time.perf_counter() - t0
            return images, labels, rep, None, event
        finally:
            with self._lock:
                if job in self._queue:
                    self._queue.remove(job)

    def _schedule(self, job: "_InFlight") -> None:
        """Feed ``job``'s groups to their pipelines and schedule one iteration of each."""
        if job.fed or job.error is not None:
            return
        groups = job.prepared.result()[0]
        try:
            for group, (pos, items, params) in groups.items():
                if not pos:
                    continue
                pipe = self._pipe(group)
                pipe.feed_input("x", items)
                for name, values in params.items():
                    pipe.feed_input(name, values)
                pipe.schedule_run()
                job.fed.append(group)
        except Exception as e:  # noqa: BLE001 - DALI refused the batch: redo it on Python
            job.error = e
            self._reset()

    def _reset(self) -> None:
        """A pipeline failed: drop them all (a failed pipeline is not run again) and schedule the
        batches that were waiting in them again on new ones."""
        self._pipes.clear()
        with self._lock:
            for j in self._queue:
                if j.error is None:
                    j.fed.clear()

    def run_inline(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray):
        import torch

        ahead = self._ahead.pop((epoch, seq), None)
        if ahead is not None and not np.array_equal(ahead[0], indices):
            ahead = None  # computed for other samples (a user sampler that changed): redo
        if ahead is None:
            self.prefetch(seq, epoch, indices, spares)
            ahead = self._ahead.pop((epoch, seq))
        images, labels, rep, error, event = ahead[1].result()
        if error is not None:
            return self._fallback(seq, epoch, indices, spares, error, rep)
        if event is not None:  # the training loop's stream waits for the copy on the side stream
            stream = torch.cuda.current_stream(images.device)
            stream.wait_event(event)
            images.record_stream(stream)
        self.counters["batches"] += 1
        return Batch(images, torch.from_numpy(labels)), rep

    def _fallback(self, seq: int, epoch: int, indices, spares, error: Exception, rep: BatchReport):
        """Redo a batch DALI failed on with the Python engine (the DALI pipelines were dropped
        and are rebuilt for the next batch)."""
        import warnings

        import torch

        self.counters["dali_errors"] += 1
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

    def _collect(self, job: "_InFlight"):
        """Wait for ``job``'s iterations and copy their outputs to the rows of one batch tensor:
        ``(images, CUDA event or None)``."""
        import torch
        from nvidia.dali.plugin.pytorch import feed_ndarray

        groups, n = job.prepared.result()[0], job.n
        dtype = getattr(torch, self.out_dtype)
        stream = None
        if self.device == "gpu":
            if self._stream is None:
                self._stream = torch.cuda.Stream(f"cuda:{self.device_id}")
            stream = self._stream
            with torch.cuda.stream(stream):
                out = torch.empty((n, *self.out_shape), dtype=dtype, device=f"cuda:{self.device_id}")
            buf = None
        elif self._zero_copy and len(job.fed) == 1 and len(groups[job.fed[0]][0]) == n:
            # one group holds the whole batch: DALI's output buffer itself (_zero_copy_output)
            return torch.from_dlpack(self._pipes[job.fed[0]].outputs()[0].as_tensor()), None
        else:
            buf = self._host.take()
            out = torch.from_numpy(buf[:n])
        try:
            for group in list(job.fed):
                pos = groups[group][0]
                tl = self._pipes[group].outputs(cuda_stream=stream)[0].as_tensor()
                whole = len(pos) == n
                dst = out if whole else torch.empty((len(pos), *self.out_shape), dtype=dtype, device=out.device)
                feed_ndarray(tl, dst, cuda_stream=stream)
                if not whole:
                    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                        out[torch.as_tensor(pos, device=out.device)] = dst
        except BaseException:
            if buf is not None:
                self._host.give_back(buf)
            raise
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            return out, event
        del out
        return self._host.hand_out(buf, n), None


class _Headers:
    """What :meth:`Decode.header` found per sample, kept for later epochs (17 bytes a sample):
    the size after EXIF orientation and how the file is decoded. Keyed by index and checked
    against the file's length and, for local files, its version (:func:`_file_version`; 0 for
    other sources), so a replaced or rewritten file is probed again. Files the header check rejects are
    not kept: they are skipped (or raise) every epoch."""

    UNKNOWN, UPRIGHT, ROTATED, PILLOW = 0, 1, 2, 3

    def __init__(self, n: int):
        self.size = np.zeros((n, 2), np.int32)
        self.kind = np.zeros(n, np.int8)
        self.nbytes = np.zeros(n, np.int64)
        self.version = np.zeros(n, np.int64)

    def get(self, idx: int, nbytes: int, version: int = 0) -> tuple[int, int, int]:
        if (idx >= len(self.kind) or self.nbytes[idx] != nbytes or self.version[idx] != version
                or version < 0):
            return 0, 0, self.UNKNOWN
        w, h = self.size[idx]
        return int(w), int(h), int(self.kind[idx])

    def put(self, idx: int, nbytes: int, version: int, w: int, h: int, dali_ok: bool, upright: bool) -> int:
        kind = (self.UPRIGHT if upright else self.ROTATED) if dali_ok else self.PILLOW
        if idx < len(self.kind) and version >= 0:
            self.size[idx] = (w, h)
            self.kind[idx], self.nbytes[idx], self.version[idx] = kind, nbytes, version
        return kind


class _InFlight:
    """A batch started on the DALI engine: its Python side (a Future of ``(groups, labels,
    report)``), its row count, the groups fed to DALI and scheduled, DALI's error if any."""

    __slots__ = ("prepared", "n", "fed", "error")

    def __init__(self, prepared, n: int):
        self.prepared, self.n = prepared, n
        self.fed: list[str] = []
        self.error: Exception | None = None


def _decode_windows(args: dict, sizes: np.ndarray, out: np.ndarray, rows: np.ndarray, params: dict) -> dict:
    """For crop-on-decode: the window of each stored image of ``rows`` (a boolean mask) to
    decode — the stage's resize window (float32 ``(n, 2)`` ``(y, x)`` ``roi_start``/``roi_end``)
    widened by the resampling filter's reach, so the resize sees the same pixels as on the whole
    image, and clamped to it — into ``params`` (int32 ``(rows, 2)`` ``dec_start``/``dec_end``, one
    row per True of ``rows``); returns the stage's windows with those rows shifted into the
    decoded ones.

    An antialiased linear or cubic filter reaches ``scale`` (or 2 ``scale``) source pixels from
    an output pixel's centre when shrinking by ``scale``, at least 1 (2) when enlarging; the margin
    is 2 ``scale`` + 2, enough for both (DALI resampling, dali/kernels/imgproc/resample)."""
    w, h = sizes[rows, 0], sizes[rows, 1]
    ow, oh = np.maximum(out[rows, 0], 1), np.maximum(out[rows, 1], 1)
    start, end = args["roi_start"][rows].astype(np.float64), args["roi_end"][rows].astype(np.float64)
    lo, hi = np.minimum(start, end), np.maximum(start, end)
    scale = np.maximum(np.maximum((hi[:, 0] - lo[:, 0]) / oh, (hi[:, 1] - lo[:, 1]) / ow), 1.0)
    m = (2.0 * scale + 2.0)[:, None]
    top_left = np.maximum(0, np.floor(lo - m)).astype(np.int32)
    bottom_right = np.minimum(np.stack([h, w], axis=1), np.ceil(hi + m)).astype(np.int32)
    params["dec_start"], params["dec_end"] = top_left, bottom_right
    shift = np.zeros_like(args["roi_start"])
    shift[rows] = top_left
    return {**args, "roi_start": args["roi_start"] - shift, "roi_end": args["roi_end"] - shift}


def _file_version(st: os.stat_result) -> int:
    """A local file's version for the kept headers: its inode and status-change time (ns) folded
    into a non-negative int64. Not the modification time, which tools set back (``cp -p``,
    ``rsync -a``, ``exiftool -P`` after rewriting an orientation tag, ``os.utime``): the
    status-change time moves with every write, ``utime`` or rename and cannot be set, and the
    inode tells apart a file renamed over the checked one."""
    return hash((st.st_ino, st.st_ctime_ns)) & 0x7FFFFFFFFFFFFFFF


def _encoded_path(path: str) -> np.ndarray:
    """A path as ``fn.io.file.read`` takes it: its UTF-8 bytes as a uint8 array."""
    return np.frombuffer(path.encode("utf-8", "surrogateescape"), np.uint8)


def _zero_copy_output(device: str) -> bool:
    """CPU batches on a machine without CUDA are DALI's own output buffers, handed over through
    DLPack (the dynamic executor does not reuse an output buffer while it is referenced; DALI's
    PyTorch iterator does the same since DALI 1.44). With CUDA they are copied into pinned
    buffers, from which the copy to the GPU is asynchronous."""
    return device == "cpu" and not _cuda_available()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


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
