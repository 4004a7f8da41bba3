"""The Python side of a DALI batch, run on the engine's helper thread ahead of DALI: read each
sample (or, for a local file whose header is known, only stat it: DALI reads the file), check its
header (:meth:`Decode.header`: what DALI may decode, the size after EXIF orientation), decode in
Python what follows Pillow's rules (PNG, CMYK JPEG...), sort the samples into the groups of
:mod:`feedgpu.exec.dali.graph`, and compute every stage's per-sample DALI arguments from the
same uniform draws as the Python engine (:func:`~feedgpu.stages.draws.sample_uniforms`).
"""
from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np

from ...errors import SampleError
from ...stages.decode import UNKNOWN_KEY, Decode
from ...stages.draws import sample_uniforms
from ..assemble import BatchReport, Spares
from .graph import GROUPS, PIXELS, WHOLE, WINDOW

__all__ = ["BatchPreparer", "Headers", "decode_windows", "encoded_path", "file_version"]


class BatchPreparer:
    """Prepares batches of ``source`` for the DALI graphs of ``ops`` (the stages after ``decode``).

    Args:
        source: the pipeline's source.
        decode: its decode stage.
        ops: the stages after decode, as DALI runs them.
        seed: the loader's seed (the per-sample draws).
        on_error: ``"skip"`` or ``"raise"``, as for :class:`~feedgpu.exec.assemble.Assembler`.
        window: crop-on-decode: upright JPEGs go to the window group.
        counters: where the decoded / fed counts per group are added (the engine's stats).
        draw_ids: the draw key of decode and of each op (``Plan.draw_ids``).
    """

    def __init__(self, source, decode: Decode, ops: list, seed: int, on_error: str, window: bool,
                 counters: Counter, draw_ids: tuple[int, ...]):
        self.source, self.decode, self.ops, self.seed, self.on_error = source, decode, ops, int(seed), on_error
        self.draw_ids = draw_ids
        self.window, self.counters = window, counters
        self.headers = Headers(len(source))
        # local files (a folder source) are read by DALI's C++ threads, except where the header
        # check needs their bytes (first epoch) or Pillow decodes them
        self.local = source.local_file(0) is not None if len(source) else False

    def sample(self, idx: int, secs: dict):
        """Read and probe (or Python-decode) one sample: ``(group, item, width, height, label, idx)``.
        ``item`` is the encoded file, or for a local file its path (DALI reads it), or pixels."""
        t0 = time.perf_counter()
        local = self.source.local_file(idx) if self.local else None
        stamp = None   # a local file's (size, version): its header is kept for that version
        if local is not None:
            try:
                st = os.stat(local[0])
                stamp = (st.st_size, file_version(st))
            except OSError:
                pass    # read() below names the error
            else:       # a header known from an earlier epoch: DALI reads the file
                w, h, kind = self.headers.get(idx, *stamp)
                if kind in (Headers.UPRIGHT, Headers.ROTATED):
                    secs["probe"] += time.perf_counter() - t0
                    return self.jpeg_group(kind), encoded_path(local[0]), w, h, local[1], idx
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
                w, h, kind = self.headers.get(idx, len(payload), version)
                if kind == Headers.UNKNOWN:
                    w, h, dali_ok, upright = self.decode.header(payload)
                    kind = self.headers.put(idx, len(payload), version, w, h, dali_ok, upright)
                if kind != Headers.PILLOW:
                    group = self.jpeg_group(kind)
            if group == PIXELS:
                item = np.ascontiguousarray(np.asarray(self.decode.apply(payload, None)))
                h, w = item.shape[:2]
                self.counters["python_decoded"] += 1
            else:
                item = encoded_path(local[0]) if local is not None else np.frombuffer(payload, np.uint8)
        except SampleError as e:
            raise type(e)(rec.key if e.key == UNKNOWN_KEY else e.key, e.reason, e.detail) from None
        secs["probe" if group != PIXELS else "python_decode"] += time.perf_counter() - t1
        return group, item, w, h, rec.label, idx

    def jpeg_group(self, kind: int) -> str:
        """The DALI graph of a JPEG DALI decodes: upright ones over their window (crop-on-decode)."""
        return WINDOW if (kind == Headers.UPRIGHT and self.window) else WHOLE

    def params(self, epoch: int, indices: np.ndarray, sizes: np.ndarray, window: np.ndarray) -> dict:
        """Every stage's DALI arguments for the batch's samples (``indices``: the samples kept,
        spares included; ``sizes``: int64 ``(n, 2)`` width, height after decode), each an array
        with a row per sample; for the rows of ``window`` (crop-on-decode) the decode window too."""
        params = {}
        for i, st in enumerate(self.ops, start=1):
            u = None if st.deterministic else sample_uniforms(self.seed, epoch, indices, self.draw_ids[i], st.draws)
            args, out = st.dali_params(sizes, u)
            if i == 1 and window.any():
                args = decode_windows(args, sizes, out, window, params)
            for n, v in args.items():
                params[f"s{i}_{n}"] = v
            sizes = out
        return params

    def batch(self, epoch: int, indices: np.ndarray, spares: np.ndarray):
        """The Python side of one batch: ``(groups, labels, report)``, ``groups`` mapping each of
        :data:`~feedgpu.exec.dali.graph.GROUPS` to ``(positions in the batch, items, {DALI argument:
        array with a row per position})``; a sample error beyond the spares is raised."""
        rep = BatchReport(stage_seconds=Counter())
        supply = Spares(spares, self.on_error, rep.skipped, len(indices))
        secs = rep.stage_seconds
        rows = [supply.run(lambda i: self.sample(i, secs), idx) for idx in indices.tolist()]
        t0 = time.perf_counter()
        kinds, items, ws, hs, labels, used = zip(*rows)
        kinds = np.array(kinds)
        sizes = np.stack([np.array(ws, np.int64), np.array(hs, np.int64)], axis=1)
        params = self.params(epoch, np.array(used, np.int64), sizes, kinds == WINDOW)
        groups = {}   # group -> (positions, items, {argument: array with a row per position})
        for g in GROUPS:
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


class Headers:
    """What :meth:`Decode.header` found per sample, kept for later epochs (17 bytes a sample):
    the size after EXIF orientation and how the file is decoded. Keyed by index and checked
    against the file's length and, for local files, its version (:func:`file_version`; 0 for
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


def decode_windows(args: dict, sizes: np.ndarray, out: np.ndarray, rows: np.ndarray, params: dict) -> dict:
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


def file_version(st: os.stat_result) -> int:
    """A local file's version for the kept headers: its inode and status-change time (ns) folded
    into a non-negative int64. Not the modification time, which tools set back (``cp -p``,
    ``rsync -a``, ``exiftool -P`` after rewriting an orientation tag, ``os.utime``): the
    status-change time moves with every write, ``utime`` or rename and cannot be set, and the
    inode tells apart a file renamed over the checked one."""
    return hash((st.st_ino, st.st_ctime_ns)) & 0x7FFFFFFFFFFFFFFF


def encoded_path(path: str) -> np.ndarray:
    """A path as ``fn.io.file.read`` takes it: its UTF-8 bytes as a uint8 array."""
    return np.frombuffer(path.encode("utf-8", "surrogateescape"), np.uint8)
