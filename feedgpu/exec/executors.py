"""Where the CPU stages run: the local process pool only, or also on a Ray cluster.

``executor: local`` (default) runs the Python engine's stages in forked worker processes on this
machine. ``executor: ray`` also runs them on a Ray cluster (Ray is the ``ray`` extra: ``pip install
"feedgpu[ray]"``; ``import feedgpu`` does not need it): each batch of sample indices, already in
the sampler's order and sharded for this rank, becomes a call on a remote worker (a Ray actor that
holds the pipeline's stages), and the batch arrays come back through Ray's object store. See
:mod:`feedgpu.exec.ray_workers`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .section import section_fields

EXECUTORS = ("local", "ray")
_KEYS = ("address", "cpus_per_worker", "max_local_workers", "max_remote_workers", "name", "remote_workers")


@dataclass(frozen=True)
class ExecutorSettings:
    """Args:
        name: ``"local"`` (default) or ``"ray"``.
        address: the Ray cluster: ``None`` (default) uses the one this process already joined
            with ``ray.init``, else ``ray.init()``'s default (``RAY_ADDRESS``, a cluster started
            on this node with ``ray start``, or a new local one with one CPU per core);
            ``"auto"`` joins the cluster started on this node with ``ray start``;
            ``"ray://HOST:10001"`` connects through Ray Client (``pip install "ray[client]"``;
            not covered by feedgpu's tests); any other value (``HOST:PORT``)
            is passed to ``ray.init(address=...)``. Unreachable: :class:`ConfigError` at the
            first iteration.
        remote_workers: remote workers (Ray actors, each ``cpus_per_worker`` CPUs) to start with.
            Default: ``max_remote_workers`` when ``num_workers`` is fixed, 0 under
            ``num_workers="auto"`` (the balancer adds them when the local pool is saturated and
            the training loop still waits).
        max_remote_workers: the most remote workers the balancer may use (default 4).
        cpus_per_worker: Ray CPUs each remote worker reserves (default 1.0; stages are single
            threaded).
        max_local_workers: the most local worker processes the balancer may use (default: the
            cores this process may run on). With a fixed ``num_workers`` that count is used; with
            ``num_workers=0`` every batch runs on the cluster.
    """

    name: str = "local"
    address: str | None = None
    remote_workers: int | None = None
    max_remote_workers: int = 4
    cpus_per_worker: float = 1.0
    max_local_workers: int | None = None

    @classmethod
    def make(cls, value) -> "ExecutorSettings":
        """From ``None``, a name (``"local"``, ``"ray"``), a mapping of the fields, or an instance.

        Raises :class:`ConfigError` naming the bad key or value."""
        if value is None:
            return cls()
        if isinstance(value, ExecutorSettings):
            return value
        s = cls(**section_fields(value, "executor", "'local', 'ray'", _KEYS))
        if s.name not in EXECUTORS:
            raise ConfigError(f"executor.name {s.name!r} is not one of {list(EXECUTORS)}")
        if s.address is not None and (not isinstance(s.address, str) or not s.address):
            raise ConfigError(f"executor.address must be a non-empty string or null, got {s.address!r}")
        if s.name == "local" and (s.address is not None or s.remote_workers):
            raise ConfigError("executor.address and executor.remote_workers need executor.name 'ray'")
        if isinstance(s.max_remote_workers, bool) or not isinstance(s.max_remote_workers, int) \
                or s.max_remote_workers < 0:
            raise ConfigError(f"executor.max_remote_workers must be an int >= 0, got {s.max_remote_workers!r}")
        if s.remote_workers is not None and (isinstance(s.remote_workers, bool) or not isinstance(s.remote_workers, int)
                                             or not 0 <= s.remote_workers <= s.max_remote_workers):
            raise ConfigError(f"executor.remote_workers must be an int in [0, max_remote_workers="
                              f"{s.max_remote_workers}], got {s.remote_workers!r}")
        if not isinstance(s.cpus_per_worker, (int, float)) or isinstance(s.cpus_per_worker, bool) \
                or not s.cpus_per_worker > 0:
            raise ConfigError(f"executor.cpus_per_worker must be > 0, got {s.cpus_per_worker!r}")
        if s.max_local_workers is not None and (isinstance(s.max_local_workers, bool)
                                                or not isinstance(s.max_local_workers, int)
                                                or s.max_local_workers < 1):
            raise ConfigError(f"executor.max_local_workers must be an int >= 1 or null, got {s.max_local_workers!r}")
        return s

    @property
    def remote(self) -> bool:
        return self.name == "ray"

    def start_remote(self, auto_workers: bool) -> int:
        """Remote workers to start with (see ``remote_workers``)."""
        if self.remote_workers is not None:
            return self.remote_workers
        return 0 if auto_workers else self.max_remote_workers


def check_executor(executor: ExecutorSettings, engine, cache) -> None:
    """Raise :class:`ConfigError` for combinations the Ray executor cannot run: the DALI engine
    (its pipeline lives in this process and on this GPU) and a cache (remote workers would
    write cache files on their own disks, which this process never reads)."""
    if not executor.remote:
        return
    if engine is not None and engine.name != "python":
        raise ConfigError(f"executor 'ray' runs the Python engine's stages; engine {engine.name!r} cannot run "
                          "there (use engine: python)")
    if cache is not None:
        raise ConfigError("executor 'ray' and a cache cannot be combined yet: remote workers would write the cache "
                          "on their own disks; turn the cache off or use executor: local")
