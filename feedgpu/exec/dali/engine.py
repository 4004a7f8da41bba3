"""NVIDIA DALI as an engine for a pipeline's built-in stages, on the CPU or the GPU.

feedgpu keeps the order, the randomness and the error handling; DALI does the pixel work:

* Samples are fed through ``fn.external_source`` in feedgpu's sampler order (DALI's own readers
  shuffle and shard their own way, which would break the seeded order, the equal batch counts
  per rank and exact mid-epoch resume), so both engines see the same batches.
* Random parameters (crop window, flip) are computed in Python for the whole batch from the same
  per-sample draws as on the Python engine (``sample_uniforms(seed, epoch, index, stage
  draw key)``, :mod:`feedgpu.stages.draws`), and fed per sample: both engines crop and flip
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
  give DALI its path (``fn.io.file.read``, C++ threads): the Python side then costs a stat() and
  the per-sample arguments, so it does not cap the GPU path.
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
  pinned host buffers (:class:`~feedgpu.exec.buffers.host.HostBuffers`) that return when the
  training loop drops the batch. GPU batches are copied on a side stream, and the training
  loop's stream waits on it before it uses the batch (:mod:`feedgpu.exec.buffers.handoff`, shared with
  the Python engine's device prefetch).

The module holds the running engine; the graphs are built by :mod:`feedgpu.exec.dali.graph`,
the Python side of each batch is :mod:`feedgpu.exec.dali.prepare`.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ...errors import ConfigError
from ...stages.decode import Decode
from ..assemble import Assembler, BatchReport
from ..buffers.handoff import SideStream, hand_over
from ..buffers.host import HostBuffers
from ..contract import WorkBase
from ..plan import Plan
from ..work import Batch
from .graph import DEFAULT_HW_DECODER_LOAD, build_graph, check_dali_plan, dali_available
from .prepare import BatchPreparer

__all__ = ["DaliWork"]


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
        self._threads_asked = self.threads
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
        self._side: SideStream | None = None   # the GPU's copy stream, made at the first GPU batch
        self._prep_side = BatchPreparer(source, self.decode, self.ops, self.seed, on_error, self.window,
                                        self.counters, plan.draw_ids)
        self._start_threads()
        self._ahead: dict = {}   # (epoch, seq) -> (indices, Future of the finished batch)

    def _start_threads(self) -> None:
        # one thread prepares batches (Python: GIL), one drives DALI (feeds, schedules, copies out)
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feedgpu-dali-prep")
        self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feedgpu-dali-run")
        self._lock = threading.Lock()
        self._queue: deque[_InFlight] = deque()   # started batches not yet collected, in order

    # -- the pool-work interface the loader's iterator uses ------------------------------------
    def lookahead(self, depth: int) -> int:
        """``depth``: the batches after the one the loop asks for are started on DALI's executor
        (:meth:`prefetch`), so they are computed while the training loop works."""
        return depth

    def can_submit(self) -> bool:
        return False

    def set_threads(self, threads: int, ahead: int | None = None) -> None:
        """Run DALI with ``threads`` CPU threads (>= 1) and compute ``ahead`` batches ahead (the
        balancer's decision) from the batches started after this call. DALI fixes a pipeline's
        thread count when it is built, so the pipelines are rebuilt on the runner thread once the
        batches started before have been computed; a later batch fed to the old pipelines ahead
        is fed to the new ones again (same samples, draws and order: the batches do not depend
        on the thread count)."""
        if ahead is not None:
            self.ahead = max(1, int(ahead))
        threads = max(1, int(threads))
        if threads != self._threads_asked:
            self._threads_asked = threads
            self._runner.submit(self._retune, threads)

    def _retune(self, threads: int) -> None:
        if threads != self.threads:
            self.threads = threads
            self.counters["rebuilds"] += 1
            self._reset()

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
        self._threads_asked = self.threads
        self._start_threads()

    def stats(self) -> dict:
        return {"name": "dali", "device": self.device, "threads": self.threads,
                "hw_decoder_load": self.hw_decoder_load if self.device == "gpu" else None,
                "window_decode": self.window, "ahead": self.ahead, **self.counters}

    # -- DALI graphs ---------------------------------------------------------------------------
    def _pipe(self, group: str):
        pipe = self._pipes.get(group)
        if pipe is None:
            pipe = self._pipes[group] = build_graph(
                group, batch_size=self.batch_size, threads=self.threads, device=self.device,
                device_id=self.device_id, hw_decoder_load=self.hw_decoder_load, local=self._prep_side.local,
                decode=self.decode, ops=self.ops, param_names=self.param_names, fold=self.fold,
                batch_stage=self.batch_stage)
        return pipe

    # -- one batch -------------------------------------------------------------------------------
    def prefetch(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray) -> None:
        """Start batch ``seq``: its Python side on the helper thread, then DALI, while the
        training loop works on earlier batches. Batches start in the order of the calls; a batch
        already started is left as it is."""
        if (epoch, seq) not in self._ahead:
            job = _InFlight(self._prep.submit(self._prep_side.batch, epoch, indices, spares), len(indices))
            with self._lock:
                self._queue.append(job)
            self._ahead[(epoch, seq)] = (indices, self._runner.submit(self._compute, job))

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
        """Drop the pipelines (after a failure: a failed pipeline is not run again; or to build
        them with another thread count) and schedule the batches that were waiting in them again
        on new ones."""
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
            hand_over(event, images)
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
            if self._side is None:
                self._side = SideStream(f"cuda:{self.device_id}")
            stream = self._side.stream
            with self._side.use():
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
                    with self._side.use() if stream is not None else contextlib.nullcontext():
                        out[torch.as_tensor(pos, device=out.device)] = dst
        except BaseException:
            if buf is not None:
                self._host.give_back(buf)
            raise
        if stream is not None:
            return out, self._side.record()
        del out
        return self._host.hand_out(buf, n), None


class _InFlight:
    """A batch started on the DALI engine: its Python side (a Future of ``(groups, labels,
    report)``), its row count, the groups fed to DALI and scheduled, DALI's error if any."""

    __slots__ = ("prepared", "n", "fed", "error")

    def __init__(self, prepared, n: int):
        self.prepared, self.n = prepared, n
        self.fed: list[str] = []
        self.error: Exception | None = None


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
