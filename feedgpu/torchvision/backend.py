"""The torchvision backend of :class:`feedgpu.DataLoader`: a recognised torchvision dataset
(:mod:`~feedgpu.torchvision.recognise`) with its transform compiled
(:mod:`~feedgpu.torchvision.compile`), run by :class:`~feedgpu.torchvision.work.TorchvisionWork`
in feedgpu's workers. The loader keeps torch's behaviour for everything around the samples
(samplers, ``collate_fn``, ``pin_memory``, ``drop_last``, ``generator``, sharding,
``state_dict()``), as for any map-style Dataset."""
from __future__ import annotations

import logging

from .compile import FEEDGPU, Compiled, compile_transform
from .recognise import Found, recognise
from .work import TorchvisionWork

__all__ = ["TorchvisionBackend", "backend_for", "explain_loader"]

log = logging.getLogger("feedgpu.torchvision")


class TorchvisionBackend:
    """A recognised dataset and its compiled transform. ``found``: the dataset;
    ``compiled``: the transform's ops, tail and explain rows."""

    def __init__(self, found: Found, compiled: Compiled):
        self.found, self.compiled = found, compiled
        self._logged = False

    def make_work(self, loader) -> TorchvisionWork:
        """The work for ``loader``'s current settings; logs :meth:`summary` at INFO the first time
        (when the loader's first iteration starts)."""
        if not self._logged:
            self._logged = True
            log.info("%s", self.summary())
        return TorchvisionWork(self.found, self.compiled, loader._collate, loader.seed,
                               batched=loader.batch_sampler is not None, positional=loader._user is not None)

    def summary(self) -> str:
        """One line: how many transforms were compiled and what runs as Python, and why."""
        rows = self.compiled.rows
        n = sum(r.where == FEEDGPU for r in rows)
        text = f"feedgpu.DataLoader: {self.found.describe()}: {n} of {len(rows)} transforms compiled into feedgpu stages"
        py = [r for r in rows if r.where != FEEDGPU]
        if py:
            text += f"; as Python in the workers: {', '.join(r.transform.split('(')[0] for r in py)} " \
                    f"({py[0].why})"
        return text

    def explain(self) -> str:
        """A table: each transform, where it runs, the feedgpu stage it compiled to, and why
        the ones that are not compiled are not."""
        base = self.found.base
        lines = [f"dataset: {self.found.describe()}",
                 "backend: torchvision (files read with the dataset's loader, PIL, in feedgpu's workers)",
                 f"{'#':>2}  {'transform':<60}  {'runs as':<36}  {'stage':<20}  why not compiled"]
        for i, r in enumerate(self.compiled.rows):
            lines.append(f"{i:>2}  {r.transform[:60]:<60}  {r.where:<36}  {r.stage:<20}  {r.why}")
        if not self.compiled.rows:
            lines.append("    (no transform: samples are the loader's PIL images)")
        tt = base.target_transform
        lines.append(f"target_transform: {'none' if tt is None else repr(tt) + ' (python, in the workers)'}")
        lines.append("random stages draw per sample from (seed, epoch, sample index): reproducible for any "
                     "worker count; transforms run as Python draw from torch's RNG, seeded as torch seeds workers")
        return "\n".join(lines)


def backend_for(dataset, compile: bool = True) -> tuple[TorchvisionBackend | None, str]:
    """``(backend, "")`` for a torchvision dataset the backend takes (and ``compile``), else
    ``(None, why)``."""
    if not compile:
        return None, "compile=False: run as a plain Dataset"
    found, why = recognise(dataset)
    if found is None:
        return None, why
    return TorchvisionBackend(found, compile_transform(found.base.transform)), ""


def explain_loader(loader) -> str:
    """:meth:`feedgpu.DataLoader.explain`: a pipeline's plan, a torchvision dataset's transforms
    (compiled or run as Python, and why), or a plain Dataset and why it was not compiled."""
    if loader.pipeline is not None:
        return loader.pipeline.explain(loader._device)
    backend = getattr(loader, "_torchvision", None)
    if backend is not None:
        return backend.explain()
    why = getattr(loader, "_plain_why", "an IterableDataset: run as torch runs it")
    return (f"dataset: {type(loader.dataset).__name__} (dataset[i] in feedgpu's workers, then collate_fn, "
            f"as torch's loader)\nnot compiled: {why}")
