"""Remote workers on a Ray cluster: Ray actors that run the same stage code as the local pool.

Why Ray core actors and not a Ray Data ``map_batches`` per epoch: the loader already owns the
order (it submits each batch of sample indices, sharded for its rank, and reorders results by
batch number), so what it needs from Ray is a place to run one batch at a time with
(1) a worker count the balancer sets from outside, between two batches, (2) the failure of one
call visible as that call's error, so the loader redoes exactly that batch and records why, and
(3) no per-epoch start-up. A Ray Data dataset sizes its actor pool with its own autoscaler,
retries blocks inside its executor where the loader cannot count them, and starts a new
streaming execution per epoch; actors give the three directly. Ray still does the cluster work:
placement on nodes, process start-up and death detection, and moving the batch arrays through
its object store (zero-copy on the loader's node).

Each actor holds the work's remote handler (for a pipeline: its source index and stages, see
:class:`~feedgpu.exec.work.RemoteFill`), pickled once with ``ray.put`` and shared by all actors.
A call runs one task; a batch depends only on ``(seed, epoch, batch indices)``, so running it
again after a failure gives the same bytes: no sample is lost or repeated.

Ray is imported here only; ``import feedgpu`` does not import this module.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
import uuid
from collections import Counter, deque
from typing import Any, Callable

from ...errors import ConfigError, WorkerError
from ..executors import ExecutorSettings
from ..pool.errors import pack_exception

log = logging.getLogger("feedgpu.ray")
#: Seconds one ``ray.wait`` blocks before the collector thread picks up new calls.
WAIT_S = 0.05
NAMESPACE = "feedgpu"
#: Seconds :func:`connect` waits for a TCP connection to an explicit ``HOST:PORT`` address.
CONNECT_CHECK_S = 5.0


def import_ray():
    """``ray``, or :class:`ConfigError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("executor 'ray' needs Ray: pip install 'feedgpu[ray]' (or pip install ray) on every "
                          "node of the cluster") from None
    return ray


def connect(settings: ExecutorSettings) -> None:
    """Join the cluster ``settings.address`` names (see :class:`ExecutorSettings`), unless this
    process already joined one. Raises :class:`ConfigError` when it cannot be reached."""
    ray = import_ray()
    if ray.is_initialized():
        return
    _check_reachable(settings.address if settings.address is not None else os.environ.get("RAY_ADDRESS"))
    try:
        if settings.address is None:
            ray.init(include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
        else:
            ray.init(address=settings.address, log_to_driver=False, namespace=NAMESPACE)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"executor.address {settings.address!r}: cannot join the Ray cluster ({e})") from e


def _check_reachable(address: str | None, timeout_s: float = CONNECT_CHECK_S) -> None:
    """Raises :class:`ConfigError` when ``address`` is ``HOST:PORT`` (or ``ray://HOST:PORT``) and
    nothing accepts a TCP connection there within ``timeout_s``. ``ray.init`` would otherwise
    retry such an address for ever (Ray 2.x logs "Failed to get cluster ID from GCS server"
    every 30 s and never returns). ``None``, ``auto``, ``local`` and other forms are Ray's."""
    if not address or address in ("auto", "local"):
        return
    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    host = host.strip("[]")  # [IPv6]:PORT
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"executor.address {address!r}: cannot join the Ray cluster (nothing answers at "
                          f"{host}:{port} within {timeout_s:g} s: {e}); check the head's address and port "
                          "(ray start --head prints them) and that this node can reach it") from None


def _actor_class(ray):
    @ray.remote
    class FeedgpuRemoteWorker:
        """Runs ``handler(task)`` per call; ``handler`` comes from the object store once."""

        def __init__(self, handler):
            import torch

            torch.set_num_threads(1)  # as local workers: one core per worker
            self.handler = handler

        def run(self, task):
            return self.handler(task)

        def pid(self) -> int:
            import os

            return os.getpid()

    return FeedgpuRemoteWorker


def _death_errors(ray) -> tuple:
    ex = ray.exceptions
    names = ("RayActorError", "WorkerCrashedError", "ObjectLostError", "OwnerDiedError", "NodeDiedError",
             "ActorUnavailableError", "ObjectReconstructionFailedError")
    return tuple(getattr(ex, n) for n in names if hasattr(ex, n))


def _reason(e: BaseException) -> str:
    """A short reason for a remote worker's death, for ``stats()["executor"]["retry_reasons"]``."""
    name = type(e).__name__
    text = str(e)
    if "killed" in text.lower() and "ray.kill" in text:
        reason = "actor killed (ray.kill)"
    elif "exit" in text.lower() or "crashed" in text.lower() or "died" in text.lower():
        reason = "worker process died"
    else:
        reason = "worker lost"
    return f"{reason}: {name}"


class _Remote:
    """One actor, the calls it holds (``ObjectRef -> task``, in call order) and whether it has
    started (``ready``: Ray placed it and its constructor ran; ``ready_ref`` resolves then)."""

    def __init__(self, wid: str, actor, ready_ref):
        self.wid, self.actor, self.ready_ref = wid, actor, ready_ref
        self.held: dict[Any, tuple] = {}
        self.retiring = False
        self.ready = False


class RemoteWorkers:
    """Ray actors running ``handler`` on tasks, for :class:`~feedgpu.exec.remote.mixed_pool.MixedPool`.

    Args:
        handler: ``handler(task) -> payload``, picklable (cloudpickle), run in the actors.
        num_workers: actors to start (>= 0).
        settings: the executor settings (address, CPUs per actor).
        land: ``land(task, payload) -> payload``, run in this process on each result before
            :meth:`poll` returns it (default: the payload as it came).
        max_task_deaths: a task whose actor died this many times raises :class:`WorkerError`
            (default 2, as the local pool: a sample that crashes a stage is not retried forever).
        max_respawns: deaths replaced over the workers' life before :class:`WorkerError` (8).

    Results are collected by a thread that waits on the calls in flight and wakes the consumer
    through :attr:`wake` (a connection to pass to :meth:`ProcessPool.get`); :meth:`poll` turns
    them into ``(tag, seq, worker_id, ok, payload)`` in the caller's thread, where failed calls
    are retried. ``stats()`` counts batches, retries and their reasons.
    """

    def __init__(self, handler: Callable, num_workers: int, settings: ExecutorSettings,
                 land: Callable[[tuple, Any], Any] | None = None, max_task_deaths: int = 2, max_respawns: int = 8):
        ray = self._ray = import_ray()
        connect(settings)
        self.settings = settings
        self._land = land
        self.max_task_deaths, self.max_respawns = max_task_deaths, max_respawns
        self._deaths = _death_errors(ray)
        self._handler_ref = ray.put(handler)
        self._cls = _actor_class(ray)
        self._prefix = f"feedgpu-{uuid.uuid4().hex[:8]}"
        self._ids = 0
        self._workers: dict[str, _Remote] = {}
        self._gone: dict[str, _Remote] = {}             # dead actors whose finished calls are not collected yet
        self._lock = threading.Lock()
        self._inflight: dict[Any, str] = {}            # ref -> wid (what the collector waits on)
        self._done: queue.Queue = queue.Queue()         # (ref, wid, value or exception, ok)
        self.wake, self._wake_w = mp.Pipe(duplex=False)
        self._task_deaths: Counter = Counter()
        self.respawns = 0
        self.retries = 0
        self.retry_reasons: Counter = Counter()
        self.retried: deque = deque(maxlen=100)         # (tag, seq, worker id, reason)
        self.batches = 0
        self.closed = False
        self._stop = threading.Event()
        self._new = threading.Event()                    # a call was submitted: wake the collector
        self._thread = threading.Thread(target=self._collect, name="feedgpu-ray-collector", daemon=True)
        self._thread.start()
        for _ in range(num_workers):
            self._spawn()

    # -- workers --------------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        """Actors taking new tasks."""
        return sum(not r.retiring for r in self._workers.values())

    def names(self) -> list[str]:
        """Ray actor names of the workers taking tasks (namespace :data:`NAMESPACE`)."""
        return [r.wid for r in self._workers.values() if not r.retiring]

    def _spawn(self) -> _Remote:
        wid = f"{self._prefix}-{self._ids}"
        self._ids += 1
        actor = self._cls.options(name=wid, namespace=NAMESPACE, num_cpus=self.settings.cpus_per_worker,
                                  max_restarts=0, max_task_retries=0).remote(self._handler_ref)
        r = self._workers[wid] = _Remote(wid, actor, actor.pid.remote())
        with self._lock:
            self._inflight[r.ready_ref] = wid
        self._new.set()
        return r

    @property
    def ready_workers(self) -> int:
        """Active actors that have started (a cluster without a free CPU leaves new ones pending)."""
        return sum(r.ready and not r.retiring for r in self._workers.values())

    def resize(self, n: int) -> None:
        """Run ``n`` (>= 0) actors from now on: new ones start at once (Ray schedules them where a
        CPU is free; a call waits until its actor is placed), surplus ones take no new task and
        are released when their calls are done."""
        if n < 0:
            raise WorkerError(f"remote workers must be >= 0, got {n}")
        active = [r for r in self._workers.values() if not r.retiring]
        for _ in range(n - len(active)):
            self._spawn()
        for r in sorted(active, key=lambda r: len(r.held))[:max(0, len(active) - n)]:
            r.retiring = True
            if not r.held:
                self._release(r)
        if n != len(active):
            log.info("remote workers: %d -> %d", len(active), n)

    def _release(self, r: _Remote) -> None:
        self._workers.pop(r.wid, None)
        self._gone.pop(r.wid, None)
        try:
            self._ray.kill(r.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def least_held(self) -> int:
        """Calls held by the least loaded started actor (a large number when none has started)."""
        return min((len(r.held) for r in self._workers.values() if r.ready and not r.retiring), default=1 << 30)

    # -- tasks ----------------------------------------------------------------------------------
    def submit(self, task: tuple) -> None:
        """Give ``task`` to the started actor holding the fewest calls; while none has started,
        to the active one holding the fewest (its call waits until Ray places it)."""
        r = min((r for r in self._workers.values() if not r.retiring), key=lambda r: (not r.ready, len(r.held)))
        self._call(r, task)

    def _call(self, r: _Remote, task: tuple) -> None:
        ref = r.actor.run.remote(task)
        r.held[ref] = task
        with self._lock:
            self._inflight[ref] = r.wid
        self._new.set()

    def _collect(self) -> None:
        """Collector thread: wait on the calls in flight and hand each finished one over."""
        ray = self._ray
        while not self._stop.is_set():
            with self._lock:
                refs = list(self._inflight)
            if not refs:
                self._new.wait(WAIT_S)
                self._new.clear()
                continue
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=WAIT_S)
            except Exception:  # noqa: BLE001 - Ray shutting down
                if self._stop.is_set():
                    return
                time.sleep(WAIT_S)
                continue
            for ref in ready:
                with self._lock:
                    wid = self._inflight.pop(ref, None)
                if wid is None:
                    continue
                try:
                    self._done.put((ref, wid, ray.get(ref), True))
                except BaseException as e:  # noqa: BLE001 - judged in poll()
                    self._done.put((ref, wid, e, False))
                try:
                    self._wake_w.send_bytes(b"x")
                except OSError:
                    return

    def poll(self, block_s: float = 0.0) -> tuple | None:
        """The next finished call as ``(tag, seq, worker_id, ok, payload)``, waiting up to
        ``block_s`` seconds, or None. A call whose actor died is given to a new actor and not
        returned (raises :class:`WorkerError` past ``max_task_deaths`` / ``max_respawns``)."""
        while self.wake.poll():
            self.wake.recv_bytes()
        deadline = time.monotonic() + block_s
        while True:
            left = deadline - time.monotonic()
            try:
                ref, wid, value, ok = self._done.get(timeout=left) if left > 0 else self._done.get_nowait()
            except queue.Empty:
                return None
            r = self._workers.get(wid) or self._gone.get(wid)
            if r is not None and ref == r.ready_ref:
                if ok:
                    r.ready = True
                elif isinstance(value, self._deaths) and self._workers.get(wid) is r:
                    self._died(r, value)
                continue
            if r is None or ref not in r.held:  # a call of a worker already given up and redone elsewhere
                continue
            if not ok and isinstance(value, self._deaths):
                self._died(r, value)
                continue
            task = r.held.pop(ref)
            if not r.held and (r.retiring or r.wid in self._gone):
                self._release(r)
            if ok:
                self.batches += 1
                self._task_deaths.pop((task[0], task[1]), None)
                return (task[0], task[1], wid, True, value if self._land is None else self._land(task, value))
            cause = getattr(value, "cause", None)  # RayTaskError: the stage's own exception
            return (task[0], task[1], wid, False, pack_exception(cause if cause is not None else value, wid))

    def _succeeded(self, ref) -> bool:
        """True when the call ``ref`` has finished with a result (before its actor died)."""
        ray = self._ray
        if not ray.wait([ref], timeout=0)[0]:
            return False
        try:
            ray.get(ref, timeout=0)
            return True
        except Exception:  # noqa: BLE001 - failed with the actor
            return False

    def _died(self, r: _Remote, e: BaseException) -> None:
        """``r``'s actor is gone. Its calls ran in order (one caller's calls to an actor do): those
        that finished keep their results (they come through :meth:`poll` as usual), the first
        that did not is the one it died in and counts a death towards ``max_task_deaths``, and
        every unfinished call is given to another actor now (their own failures are ignored)."""
        reason = _reason(e)
        self._workers.pop(r.wid, None)
        tasks = []
        for ref, t in list(r.held.items()):
            if self._succeeded(ref):
                continue
            tasks.append(t)
            del r.held[ref]
            with self._lock:
                self._inflight.pop(ref, None)
        if r.held:   # finished calls still to hand over
            self._gone[r.wid] = r
        else:
            self._gone.pop(r.wid, None)
        key = (tasks[0][0], tasks[0][1]) if tasks else None
        if key is not None:
            self._task_deaths[key] += 1
        if key is not None and self._task_deaths[key] >= self.max_task_deaths:
            raise WorkerError(f"remote worker {r.wid} died ({reason}); batch {key[1]} has now lost "
                              f"{self._task_deaths[key]} workers, so it is not retried (a sample that crashes "
                              f"a stage?)\n{e}")
        self.respawns += 1
        if self.respawns > self.max_respawns:
            raise WorkerError(f"remote worker {r.wid} died ({reason}); {self.respawns} remote workers have "
                              f"died, more than max_respawns={self.max_respawns}\n{e}")
        if not r.retiring:
            self._spawn()
        log.warning("remote worker %s died (%s); replaced, its %d batch(es) redone", r.wid, reason, len(tasks))
        for t in tasks:
            self.retries += 1
            self.retry_reasons[reason] += 1
            self.retried.append((t[0], t[1], r.wid, reason))
            if self.num_workers:
                self.submit(t)
            else:  # it was being released: a short-lived actor finishes its calls, then goes too
                helper = self._spawn()
                helper.retiring = True
                self._call(helper, t)

    def holding(self) -> str:
        """Which batches each actor holds, for timeout messages."""
        parts = [f"remote worker {r.wid} ({'started' if r.ready else 'not started: no free CPU on the cluster?'}) "
                 f"holds batch(es) {[t[1] for t in r.held.values()]}" for r in self._workers.values() if r.held]
        return "; ".join(parts) or "no remote worker holds a task"

    def stats(self) -> dict:
        """``{workers, started, names, batches, retries, retry_reasons, retried, respawns}``: batches run
        remotely, calls redone after a worker died and why (``retried``: the last 100 as
        ``[tag, batch, worker, reason]``)."""
        return {"workers": self.num_workers, "started": self.ready_workers, "names": self.names(),
                "batches": self.batches,
                "retries": self.retries, "retry_reasons": dict(self.retry_reasons),
                "retried": [list(x) for x in self.retried], "respawns": self.respawns}

    def close(self) -> None:
        """Release every actor and stop the collector (the Ray connection stays: it is the
        process's, see :func:`connect`)."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._new.set()
        self._thread.join(2.0)
        for r in list(self._workers.values()):
            self._release(r)
        self._workers.clear()
        with self._lock:
            self._inflight.clear()
        for c in (self.wake, self._wake_w):
            try:
                c.close()
            except OSError:
                pass
