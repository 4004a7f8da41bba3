"""The worker side of :mod:`feedgpu.exec.iterable.runner`: batching an ``IterableDataset``'s stream
(:class:`Fetcher`, also used in the main process with ``num_workers=0``) and the loop of one
worker process (:func:`worker_loop`).

Messages on a worker's duplex pipe (tuples, sent with multiprocessing's ForkingPickler, for
which ``torch.multiprocessing`` registers tensor reductions: tensors travel in shared memory)::

    main -> worker   ("reset", epoch, credits, state, pipe_seed)   start a pass, from ``state`` if not
                     None (``pipe_seed``: reseed an IterDataPipe first)
                     ("credit", epoch, k)               produce k more batches of that pass
                     ("stop",)                          exit
    worker -> main   ("started", None)                  first, before anything else (see iterable.pool)
                     ("ready", epoch, snapshot, None)   the pass started (snapshot: its state)
                     ("batch", epoch, data, snapshot)   a batch and the state right after it
                     ("error", epoch, packed, snapshot) the batch raised (see :func:`pack_error`)
                     ("end", epoch, None, None)         the worker's stream is exhausted
"""
from __future__ import annotations


from ..pool.errors import pack_exception, unsendable
from ..pool.lifetime import enter_worker
from ..pool.start import seed_worker

POLL_S = 0.2   # how often an idle worker checks that its parent is alive


def is_stateful(obj) -> bool:
    """torchdata's ``Stateful`` protocol: callable ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Fetcher:
    """Batches from one pass over ``dataset``, as torch's iterable fetcher makes them.

    ``batch_size=None``: each item through ``collate_fn`` (torch's ``default_convert`` by
    default); else up to ``batch_size`` items through ``collate_fn``; the last, shorter batch is
    dropped with ``drop_last``; after a short batch the pass has ended without asking the
    iterator again. ``state`` (a :meth:`snapshot`) restores the pass: the dataset loads its part
    before ``iter()``, the iterator its own part (when it is Stateful) after.
    """

    def __init__(self, dataset, batch_size: int | None, drop_last: bool, collate_fn, stateful: bool,
                 state: dict | None = None):
        self.dataset, self.batch_size, self.drop_last, self.collate_fn = dataset, batch_size, drop_last, collate_fn
        self.stateful = stateful
        self.ended = False
        ds_state = None
        if stateful:
            if state is not None:
                dataset.load_state_dict(state["dataset"])
                ds_state = state["dataset"]
            else:
                ds_state = dataset.state_dict()
        self.it = iter(dataset)
        if stateful and state is not None:
            if state.get("iterator") is not None and is_stateful(self.it):
                self.it.load_state_dict(state["iterator"])
            self.ended = bool(state.get("ended", False))
        self.start = self._snap(ds_state) if stateful else None

    def _snap(self, ds_state) -> dict:
        return {"dataset": ds_state, "iterator": self.it.state_dict() if is_stateful(self.it) else None,
                "ended": self.ended}

    def snapshot(self) -> dict | None:
        """The state after the last batch (None when the dataset is not Stateful)."""
        return self._snap(self.dataset.state_dict()) if self.stateful else None

    def next_batch(self):
        """The next batch; raises ``StopIteration`` at the end of the pass."""
        if self.ended:
            raise StopIteration
        if self.batch_size is None:
            return self.collate_fn(next(self.it))
        items = []
        for _ in range(self.batch_size):
            try:
                items.append(next(self.it))
            except StopIteration:
                self.ended = True
                break
        if not items or (self.drop_last and len(items) < self.batch_size):
            raise StopIteration
        return self.collate_fn(items)


def _send(conn, msg: tuple, wid: int, epoch) -> None:
    try:
        conn.send(msg)
    except (BrokenPipeError, EOFError, ConnectionResetError):
        raise
    except Exception as e:  # noqa: BLE001 - the batch cannot travel: say why instead of dying
        err = unsendable(e)
        conn.send(("error", epoch, pack_exception(err, wid), msg[3] if len(msg) > 3 else None))


def worker_loop(wid: int, num_workers: int, dataset, conn, base_seed: int, init_fn, batch_size, drop_last: bool,
                collate_fn, stateful: bool, parent_pid: int) -> None:
    """Body of worker ``wid``: seeds as torch does, runs ``init_fn(wid)``, then serves passes
    over its copy of ``dataset`` as the main process asks (module doc). An exception from
    ``init_fn`` or ``iter(dataset)`` is sent as the first batch of the pass, which then ends;
    one from producing a batch is that batch, and the pass goes on."""
    conn.send(("started", None))   # first, before anything slow: the main process watches for it
    orphaned = enter_worker(parent_pid)   # exits even in the middle of a batch once the main process is gone
    seed_worker(wid, base_seed, num_workers, dataset)
    init_error = None
    if init_fn is not None:
        try:
            init_fn(wid)
        except Exception as e:  # noqa: BLE001 - reported with the worker's first batch
            init_error = e
    epoch, fetcher, credits, ended = None, None, 0, True
    try:
        while True:
            busy = credits > 0 and not ended
            if conn.poll(0 if busy else POLL_S):
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "credit":
                    if msg[1] == epoch:
                        credits += msg[2]
                    continue
                # "reset": a new pass
                epoch, credits, state = msg[1], msg[2], msg[3]
                if len(msg) > 4 and msg[4] is not None:   # an IterDataPipe's seed for this pass
                    from . import datapipes

                    datapipes.apply_seed(dataset, msg[4])
                fetcher, ended = None, False
                if state is not None and state.get("finished"):
                    ended = True
                    conn.send(("end", epoch, None, None))
                    continue
                try:
                    if init_error is not None:
                        raise init_error
                    fetcher = Fetcher(dataset, batch_size, drop_last, collate_fn, stateful, state)
                except Exception as e:  # noqa: BLE001
                    init_error, ended = None, True
                    conn.send(("error", epoch, pack_exception(e, wid), None))
                    conn.send(("end", epoch, None, None))
                    continue
                conn.send(("ready", epoch, fetcher.start, None))
                continue
            if not busy:
                if orphaned():
                    return
                continue
            try:
                data = fetcher.next_batch()
            except StopIteration:
                ended = True
                conn.send(("end", epoch, None, None))
                continue
            except Exception as e:  # noqa: BLE001 - the batch's error, raised in the main process
                msg = ("error", epoch, pack_exception(e, wid), _safe_snapshot(fetcher))
            else:
                msg = ("batch", epoch, data, _safe_snapshot(fetcher))
                del data
            credits -= 1
            _send(conn, msg, wid, epoch)
            del msg
    except (BrokenPipeError, EOFError, ConnectionResetError, KeyboardInterrupt):
        return   # the main process is gone or stopped us


def _safe_snapshot(fetcher):
    try:
        return fetcher.snapshot()
    except Exception as e:  # noqa: BLE001 - a broken state_dict() fails state_dict() later, not the batch
        return {"error": f"{type(e).__name__}: {e}"}
