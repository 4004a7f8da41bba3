"""The backend of an ``IterableDataset``: run as torch runs it, by
:class:`~feedgpu.exec.iterable.runner.IterableRunner` (each worker iterates its own copy; batches in torch's
round-robin order over the workers)."""
from __future__ import annotations

from ..exec.iterable.runner import IterableRunner, runner_for_loader
from ..settings import LoaderSettings
from .options import UNSET

__all__ = ["IterableBackend"]

#: feedgpu's keywords, which an IterableDataset refuses (it orders, shards and seeds itself)
_FEEDGPU_ONLY = ("seed", "rank", "world_size", "device", "on_error", "cache", "engine", "executor", "stats_callback",
                 "max_skipped")
#: torch's keywords whose default, when not given, is torch's (:meth:`~feedgpu.settings.LoaderSettings.torch_keywords`)
_TORCH_DEFAULTED = ("batch_size", "num_workers", "drop_last", "timeout", "persistent_workers")
_PASSED = ("shuffle", "sampler", "batch_sampler", "collate_fn", "pin_memory", "worker_init_fn",
           "multiprocessing_context", "generator", "prefetch_factor", "in_order", "pin_memory_device")


class IterableBackend:
    """An ``IterableDataset``'s batches (see the module docstring); ``given``: the loader's keywords.
    Raises :class:`~feedgpu.errors.ConfigError` for what torch refuses with an ``IterableDataset``
    and for feedgpu's own keywords."""

    reports = False
    max_skipped = None   # an IterableDataset skips nothing itself: no budget

    def __init__(self, dataset, given: dict):
        passed = {k: v for k, v in given.items() if v is not UNSET}
        torch_kw = LoaderSettings.torch_keywords(passed, _TORCH_DEFAULTED)
        opts = {k: passed.get(k) for k in _FEEDGPU_ONLY}
        self.runner: IterableRunner = runner_for_loader(dataset, **torch_kw, **{k: given[k] for k in _PASSED},
                                                        feedgpu_options=opts)
        self.dataset = dataset
        self.mirror = None   # (the loader's attributes never change: the runner's settings are fixed)

    def torch_attributes(self, given: dict) -> dict:
        """torch's attributes of the loader, as the runner resolved them."""
        r = self.runner
        return {"pipeline": None, "shuffle": False, "sampler": None, "batch_sampler": None,
                "batch_size": r.batch_size, "drop_last": r.drop_last, "timeout": r.timeout,
                "collate_fn": r.collate_fn, "worker_init_fn": r.worker_init_fn,
                "persistent_workers": r.persistent_workers,
                "multiprocessing_context": given["multiprocessing_context"] if r.num_workers > 0 else None}

    @property
    def num_workers(self) -> int:
        return self.runner.num_workers

    @property
    def pin_memory(self) -> bool:
        return self.runner.pin_memory

    @property
    def prefetch_factor(self) -> int | None:
        return self.runner.prefetch_factor

    def __iter__(self):
        return iter(self.runner)

    def __len__(self) -> int:
        return len(self.runner)

    def set_epoch(self, epoch: int) -> None:
        self.runner.set_epoch(epoch)

    def state_dict(self) -> dict:
        """See :meth:`feedgpu.exec.iterable.runner.IterableRunner.state_dict`."""
        return self.runner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.runner.load_state_dict(state)

    def worker_pids(self) -> list[int]:
        return self.runner.worker_pids()

    def shutdown(self) -> None:
        self.runner.shutdown()

    def stats(self) -> dict:
        raise TypeError("stats() counts the batches of map-style datasets and pipelines; an IterableDataset's "
                        "batches are run as torch runs them and are not counted")

    def explain(self) -> str:
        where = "each worker iterates its own copy; batches in round-robin order over the workers" \
            if self.runner.num_workers else "iterated in the main process"
        return (f"dataset: {type(self.dataset).__name__} (an IterableDataset, run as torch's loader runs it: "
                f"{where}; then collate_fn)\nnot compiled: an IterableDataset gives its samples itself")
