"""``feedgpu bench --dataset module:factory``: torch's DataLoader against ``feedgpu.DataLoader`` on
a user's own Dataset (the factory returns it), same arguments, alternating rounds in this
process, so a user sees what the one-line change gains before making it, with
``loader.explain()`` (which transforms feedgpu compiled, which run as Python and why)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

__all__ = ["compare_dataset", "dataset_lines"]


def _load(ref: str):
    """The Dataset ``ref``'s factory returns; its module is looked up from the current directory
    first, as ``python -m`` does (the ``feedgpu`` command's own path does not hold it)."""
    import os
    import sys

    from ..stages.custom import import_callable

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    factory = import_callable(ref, what="bench --dataset")
    return _checked(ref, factory())


def _checked(ref: str, ds):
    """``ds`` when both loaders can measure it: a map-style Dataset (``__getitem__`` and
    ``__len__``, as torch's loader reads one; the runs shuffle). Raises
    :class:`~feedgpu.errors.ConfigError` naming what the factory returned otherwise."""
    import torch.utils.data as tud

    from ..errors import ConfigError

    what = f"bench --dataset: {ref!r} returned {ds!r:.80} ({type(ds).__name__})"
    if isinstance(ds, tud.IterableDataset):
        raise ConfigError(f"{what}, an IterableDataset: bench --dataset measures map-style Datasets "
                          "(shuffled, as a training loop reads them); return one with __getitem__ and __len__")
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")) or isinstance(ds, (str, bytes)):
        raise ConfigError(f"{what}, not a Dataset: the factory must return a map-style Dataset (a "
                          "torch.utils.data.Dataset with __getitem__ and __len__, e.g. an ImageFolder)")
    return ds


def _endless(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def _run(make, ds, workers: int, batch_size: int, batches: int, warmup: int) -> dict:
    loader = make(ds, batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=workers > 0)
    it = _endless(loader)
    for _ in range(warmup):
        next(it)
    n, m0, t0 = 0, time.process_time(), time.perf_counter()
    for _ in range(batches):
        batch = next(it)
        n += len(batch[-1]) if isinstance(batch, (list, tuple)) else batch_size
    wall = time.perf_counter() - t0
    explain = loader.explain() if hasattr(loader, "explain") else None
    it.close()
    del it, loader
    return {"samples_per_s": n / wall, "main_cpu_ms_per_sample": 1e3 * (time.process_time() - m0) / n,
            "explain": explain}


def compare_dataset(ref: str, workers: int = 2, batch_size: int = 64, batches: int = 10, rounds: int = 3,
                    warmup: int = 1, note: Callable[[str], None] = lambda s: None) -> dict:
    """Measure both loaders on the Dataset ``ref`` (``"module:factory"``) returns: ``rounds``
    rounds, the order alternating, each run ``batches`` batches after ``warmup``. Returns
    ``{"dataset", "settings", "runs": {loader: [run, ...]}, "median": {loader: samples/s},
    "ratio", "explain"}``. Raises :class:`~feedgpu.errors.ConfigError` when ``ref`` does not
    import or its factory returns no map-style Dataset, and whatever the factory or the loaders raise."""
    import torch.utils.data as tud

    import feedgpu

    ds = _load(ref)
    makers = {"torch": tud.DataLoader, "feedgpu": feedgpu.DataLoader}
    runs: dict[str, list] = {k: [] for k in makers}
    explain = None
    for r in range(rounds):
        names = list(makers) if r % 2 == 0 else list(makers)[::-1]
        for name in names:
            res = _run(makers[name], ds, workers, batch_size, batches, warmup)
            explain = explain or res.pop("explain")
            res.pop("explain", None)
            runs[name].append(res)
        note(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]['samples_per_s']:,.0f}/s" for k, v in runs.items()))
    median = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in runs.items()}
    return {"dataset": ref, "dataset_type": type(ds).__name__, "samples": len(ds),
            "settings": {"workers": workers, "batch_size": batch_size, "batches": batches, "rounds": rounds,
                         "warmup": warmup},
            "runs": runs, "median": median, "ratio": median["feedgpu"] / median["torch"], "explain": explain}


def dataset_lines(doc: dict) -> list[str]:
    """The report of :func:`compare_dataset` as text lines."""
    s = doc["settings"]
    lines = [f"dataset: {doc['dataset']} -> {doc['dataset_type']} ({doc['samples']} samples); "
             f"{s['workers']} workers, batch {s['batch_size']}, {s['batches']} batches x {s['rounds']} rounds", "",
             f"{'loader':<10} {'samples/s (median)':>20} {'per round':>30}"]
    for k, v in doc["runs"].items():
        rounds = ", ".join(f"{x['samples_per_s']:,.0f}" for x in v)
        lines.append(f"{k:<10} {doc['median'][k]:>20,.0f} {rounds:>30}")
    lines += ["", f"feedgpu.DataLoader / torch's DataLoader: {doc['ratio']:.2f}x (ratio of medians)"]
    if doc.get("explain"):
        lines += ["", doc["explain"]]
    return lines
