"""The DataLoader's work object for a :class:`~feedgpu.tabular.pipeline.TablePipeline`.

Tasks ``(tag, seq, epoch, indices)``; a worker (or the main process with ``num_workers=0``)
gathers the rows, runs the joins and stages on the pipeline's engine and returns the output dict
of numpy arrays; the main process wraps each array in a torch tensor (``torch.from_numpy``, no
copy). Worker code is numpy/pyarrow (and DALI) only: no torch op runs in a forked worker. Stages
have no randomness, so batches do not depend on the worker count or the seed beyond the order.
"""
from __future__ import annotations

import os

import numpy as np

from ..exec.work import PayloadWork


class TableWork(PayloadWork):
    """Payload: ``{name: numpy array}`` for a batch of rows (see the module doc)."""

    def __init__(self, pipeline):
        super().__init__()
        self.pipeline = pipeline
        self._engine = None
        self._pid = None
        self._creator = os.getpid()

    def engine(self):
        """Per process: a DALI pipeline does not survive a fork, so each worker builds its own."""
        if self._engine is None or self._pid != os.getpid():
            if self.pipeline.engine == "dali":
                from ..errors import ConfigError
                from .dali import DaliTableEngine

                if self.pipeline.device == "gpu" and os.getpid() != self._creator:
                    raise ConfigError("engine dali on the GPU runs in the main process (CUDA does not survive "
                                      "fork): use num_workers=0, or engine.device: cpu with workers")
                self._engine = DaliTableEngine(self.pipeline, threads=self.pipeline.threads or 1,
                                               device=self.pipeline.device)
            else:
                self._engine = self.pipeline
            self._pid = os.getpid()
        return self._engine

    def handle(self, task: tuple) -> dict:
        return self.engine().transform(task[3])

    def finish(self, task: tuple, payload: dict) -> dict:
        import torch

        return {k: torch.from_numpy(v) for k, v in payload.items()}

    def run_inline(self, seq: int, epoch: int, indices: np.ndarray, spares: np.ndarray):
        return self.finish(None, self.handle((0, seq, epoch, indices))), None

    def stats(self) -> dict:
        """Engine name, and for this process: out-of-vocabulary counts per categorify stage, row
        groups decoded, DALI graph builds."""
        p = self.pipeline
        d = {"name": p.engine, "oov": {s.outputs[0]: s.oov for s in p.stages if hasattr(s, "oov")},
             "row_groups_read": p.source.row_groups_read}
        if p.engine == "dali" and self._engine is not None and self._engine is not p:
            d["dali_builds"] = self._engine.builds
        return d

    def close(self) -> None:
        self._engine = None
