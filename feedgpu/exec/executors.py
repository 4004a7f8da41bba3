"""Where the CPU stages run: the local process pool only, or also on a Ray cluster.

``executor: local`` (default) runs the Python engine's stages in forked worker processes on this
machine. ``executor: ray`` also runs them on a Ray cluster (Ray is the ``ray`` extra: ``pip install
"feedgpu[ray]"``; ``import feedgpu`` does not need it): each batch of sample indices, already in
the sampler's order and sharded for this rank, becomes a call on a remote worker (a Ray actor that
holds the pipeline's stages), and the batch arrays come back through Ray's object store. See
:mod:`feedgpu.exec.remote.ray_workers`.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from ..errors import ConfigError
from ..settings_base import from_value, settings_class

EXECUTORS = ("local", "ray")


@settings_class("executor")
class ExecutorSettings:
    """The ``executor:`` section (a name alone, ``executor: ray``, is ``{name: ray}``).

    Args:
        name (str): ``"local"`` (default) or ``"ray"``.
        address (str | None): the Ray cluster: ``None`` (default) uses the one this process
            already joined with ``ray.init``, else ``ray.init()``'s default (``RAY_ADDRESS``, a
            cluster started on this node with ``ray start``, or a new local one with one CPU per
            core); ``"auto"`` joins the cluster started on this node with ``ray start``;
            ``"ray://HOST:10001"`` connects through Ray Client (``pip install "ray[client]"``;
            not covered by feedgpu's tests); any other non-empty value (``HOST:PORT``)
            is passed to ``ray.init(address=...)``. Unreachable: :class:`ConfigError` at the
            first iteration.
        remote_workers (int | None): remote workers (Ray actors, each ``cpus_per_worker`` CPUs)
            to start with, in [0, ``max_remote_workers``]. Default: ``max_remote_workers`` when
            ``num_workers`` is fixed, 0 under ``num_workers="auto"`` (the balancer adds them when
            the local pool is saturated and the training loop still waits).
        max_remote_workers (int): the most remote workers the balancer may use (>= 0, default 4).
        cpus_per_worker (float): Ray CPUs each remote worker reserves (> 0, default 1.0; stages
            are single threaded).
        max_local_workers (int | None): the most local worker processes the balancer may use
            (>= 1, taken as given even above the cores; default None: one more than the cores
            this process may run on, see :func:`feedgpu.balancer.autoscale.default_config`). With a fixed
            ``num_workers`` that count is used; with ``num_workers=0`` every batch runs on the
            cluster.

    ``address`` and ``remote_workers`` need ``name="ray"``. Raises
    :class:`~feedgpu.errors.ConfigError` naming the key (``executor.remote_workers: ...``).
    """

    name: Literal[EXECUTORS] = "local"  # type: ignore[valid-type]
    address: Union[Annotated[str, Field(min_length=1)], None] = None
    remote_workers: Union[Annotated[int, Field(ge=0, strict=True)], None] = None
    max_remote_workers: Annotated[int, Field(ge=0, strict=True)] = 4
    cpus_per_worker: Annotated[float, Field(gt=0)] = 1.0
    max_local_workers: Union[Annotated[int, Field(ge=1, strict=True)], None] = None

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, v):
        return {"name": v} if isinstance(v, str) else v  # `executor: ray` is `executor: {name: ray}`

    @model_validator(mode="after")
    def _combination(self):
        if self.name == "local" and (self.address is not None or self.remote_workers):
            raise ValueError("executor.address and executor.remote_workers need executor.name 'ray'")
        if self.remote_workers is not None and self.remote_workers > self.max_remote_workers:
            raise ValueError(f"executor.remote_workers must be an int in [0, max_remote_workers="
                             f"{self.max_remote_workers}], got {self.remote_workers!r}")
        return self

    @classmethod
    def make(cls, value) -> "ExecutorSettings":
        """From ``None``, a name (``"local"``, ``"ray"``), a mapping of the fields, or an instance.

        Raises :class:`ConfigError` naming the bad key or value."""
        return from_value(cls, value, "'local', 'ray'")

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
