"""Local worker processes and remote Ray workers behind the interface of one pool.

``executor: ray`` gives the loader a :class:`MixedPool`: an optional local
:class:`~feedgpu.exec.pool.process_pool.ProcessPool` (none with ``num_workers=0``) and
:class:`~feedgpu.exec.remote.ray_workers.RemoteWorkers`. Each task goes to whichever worker, local or
remote, holds the fewest tasks (local first on a tie: no network, no copy; a remote worker only
once Ray has started it, so a cluster with no free CPU never holds a batch back); results come back as
``(tag, seq, worker_id, ok, payload)`` in the order they finish, and the loader puts them in
batch order as it does for the local pool. A remote result is landed (``land(task, payload)``,
e.g. copied into the task's shared-memory slot) before it is returned, so the loader handles
both kinds alike.
"""
from __future__ import annotations

import time
from typing import Callable

from ...errors import LoaderTimeout
from ..executors import ExecutorSettings
from ..pool.errors import timeout_message
from ..pool.process_pool import ProcessPool


class MixedPool:
    """Args:
        local: the local pool, or None (every task runs remotely).
        remote_handler: ``handler(task) -> payload`` for the remote workers (picklable).
        land: ``land(task, payload) -> payload`` in this process for each remote result.
        remote_workers: remote workers to start (>= 0; >= 1 without a local pool).
        settings: the executor settings (cluster address, CPUs per remote worker).
        max_task_deaths: as :class:`ProcessPool` (default 2).
    """

    def __init__(self, local: ProcessPool | None, remote_handler: Callable, land: Callable,
                 remote_workers: int, settings: ExecutorSettings, max_task_deaths: int = 2):
        from .ray_workers import RemoteWorkers

        self.local = local
        self.remote = RemoteWorkers(remote_handler, remote_workers, settings, land=land,
                                    max_task_deaths=max_task_deaths)
        self.local_batches = 0

    # -- the ProcessPool surface the loader uses ----------------------------------------------
    @property
    def num_workers(self) -> int:
        """Local workers taking tasks (remote ones: :attr:`remote_workers`)."""
        return self.local.num_workers if self.local is not None else 0

    @property
    def remote_workers(self) -> int:
        return self.remote.num_workers

    @property
    def remote_started(self) -> int:
        """Remote workers Ray has placed and started."""
        return self.remote.ready_workers

    @property
    def closed(self) -> bool:
        return self.remote.closed

    def pids(self) -> list[int]:
        """Local worker process ids (the autoscaler measures their CPU)."""
        return self.local.pids() if self.local is not None else []

    def resize(self, n: int, park_s: float = 0.0) -> None:
        """Local workers from now on (see :meth:`ProcessPool.resize`)."""
        if self.local is not None:
            self.local.resize(n, park_s)

    def retire_parked(self) -> int:
        """See :meth:`ProcessPool.retire_parked`."""
        return self.local.retire_parked() if self.local is not None else 0

    def resize_remote(self, n: int) -> None:
        """Remote workers from now on (see :meth:`RemoteWorkers.resize`)."""
        self.remote.resize(n)

    def submit(self, task: tuple) -> None:
        local = self.local
        if local is not None and local.least_held() <= self.remote.least_held():  # large until one has started
            local.submit(task)
        else:
            self.remote.submit(task)

    def get(self, timeout: float | None = None) -> tuple:
        """Next ``(tag, seq, worker_id, ok, payload)`` from either side. Raises
        :class:`LoaderTimeout` (``DataLoader timed out after T seconds. ...``, as torch begins it)
        after ``timeout`` seconds without one (None or 0: forever), and
        :class:`~feedgpu.errors.WorkerError` as the pools do."""
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            r = self.remote.poll()
            if r is not None:
                return r
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                where = self.local.holding() + "; " if self.local is not None else ""
                raise LoaderTimeout(timeout_message(timeout, where + self.remote.holding()))
            if self.local is None:
                r = self.remote.poll(block_s=0.5 if left is None else min(0.5, left))
                if r is not None:
                    return r
                continue
            try:
                r = self.local.get(left, wake=self.remote.wake)
            except LoaderTimeout:
                continue  # the message above names both sides
            if r is not None:
                if r[0] is not None and r[3]:
                    self.local_batches += 1
                return r

    def flush(self, timeout: float = 60.0) -> list[tuple]:
        """Flush the local workers (remote ones buffer nothing: no cache with ``executor: ray``)."""
        return self.local.flush(timeout) if self.local is not None else []

    def stats(self) -> dict:
        """``{local_workers, local_batches, remote: RemoteWorkers.stats()}``."""
        return {"local_workers": self.num_workers, "local_batches": self.local_batches, **self.remote.stats()}

    def close(self, grace_s: float | None = None) -> None:
        self.remote.close()
        if self.local is not None:
            self.local.close(grace_s)
