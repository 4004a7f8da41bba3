"""The torchvision backend of :class:`feedgpu.DataLoader`: a recognised torchvision dataset
(:mod:`~feedgpu.torchvision.recognise`) with its transform compiled
(:mod:`~feedgpu.torchvision.compile`), run by :class:`~feedgpu.torchvision.work.TorchvisionWork`
in feedgpu's workers. The loader keeps torch's behaviour for everything around the samples
(samplers, ``collate_fn``, ``pin_memory``, ``drop_last``, ``generator``, sharding,
``state_dict()``), as for any map-style Dataset.

The loader follows the dataset as torch's loader reads it (:class:`~feedgpu.loader.kinds.TorchvisionDatasetBackend`):
when an iteration starts, a dataset that is no longer :meth:`TorchvisionBackend.current` is
recognised and compiled again, unless persistent workers are running, which keep the dataset as
it was when they started, as torch's do."""
from __future__ import annotations

import textwrap

from .compile import FEEDGPU, Compiled, compile_transform
from .recognise import Found, dataset_key, recognise, same_key

__all__ = ["TorchvisionBackend", "backend_for"]


class TorchvisionBackend:
    """A recognised dataset and its compiled transform. ``found``: the dataset;
    ``compiled``: the transform's ops, tail and explain rows; ``key``: what they were made from
    (:func:`~feedgpu.torchvision.recognise.dataset_key`)."""

    def __init__(self, found: Found, compiled: Compiled):
        self.found, self.compiled = found, compiled
        self.key = dataset_key(found.outer)

    def current(self, dataset) -> bool:
        """Whether ``dataset`` is still what this backend was made from."""
        return dataset is self.found.outer and same_key(self.key, dataset_key(dataset))

    def summary(self) -> str:
        """One line: how many transforms were compiled and what runs as Python, and why."""
        rows = self.compiled.rows
        n = sum(r.where == FEEDGPU for r in rows)
        text = f"feedgpu.DataLoader: {self.found.describe()}: {n} of {len(rows)} transforms compiled into feedgpu ops"
        py = [r for r in rows if r.where != FEEDGPU]
        if py:
            text += f"; as Python in the workers: {', '.join(r.transform.split('(')[0] for r in py)} " \
                    f"({py[0].why})"
        return text

    def explain(self) -> str:
        """A table: each transform (its whole repr, wrapped), where it runs, the op it compiled to,
        and why the ones that are not compiled are not. Compiled ops are not pipeline stages
        (``feedgpu stages``): they run torchvision's kernels with feedgpu's draws."""
        base = self.found.base
        lines = [f"dataset: {self.found.describe()}",
                 "backend: torchvision (files read with the dataset's loader, PIL, in feedgpu's workers)",
                 f"{'#':>2}  {'transform':<60}  {'runs as':<36}  {'compiled op':<20}  why not compiled"]
        for i, r in enumerate(self.compiled.rows):
            text = textwrap.wrap(r.transform, 60, break_on_hyphens=False) or [""]
            lines.append(f"{i:>2}  {text[0]:<60}  {r.where:<36}  {r.stage:<20}  {r.why}".rstrip())
            lines += [f"    {more}" for more in text[1:]]
        if not self.compiled.rows:
            lines.append("    (no transform: samples are the loader's PIL images)")
        tt = base.target_transform
        lines.append(f"target_transform: {'none' if tt is None else repr(tt) + ' (python, in the workers)'}")
        lines.append("compiled ops run torchvision's own kernels in feedgpu's workers; they are not pipeline stages "
                     "(feedgpu stages; feedgpu.torchvision.pipeline_yaml(ds) writes the pipeline of this dataset)")
        lines.append("random ops draw per sample from (seed, epoch, sample index): reproducible for any "
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

