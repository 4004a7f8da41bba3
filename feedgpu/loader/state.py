"""The checkpoint schema of :class:`feedgpu.DataLoader` (``state_dict`` / ``load_state_dict``).

``feedgpu.loader/2``::

    {"format": "feedgpu.loader/2",
     "fingerprint": str,      # which records the source holds, in which order, with which labels
                              # (Source.order_identity): another dataset is refused
     "epoch": int,            # the epoch the next batch belongs to
     "samples_seen": int,     # feedgpu's own order: indices of the epoch order consumed by ALL
                              # ranks together (a prefix, feedgpu.order.sharded); a user sampler: the
                              # samples this rank received this epoch
     "batches_seen": int,     # batches this rank received this epoch (informational for
                              # feedgpu's own order; the position for a user sampler)
     "seed": int,
     "world_size": int,       # of the run that saved it (informational)
     "sampler": {...},        # the order's settings, without rank and world size
     "num_batches": int}      # len(loader) of the run that saved it (None: a sampler without len)

Any rank can load any rank's state: with feedgpu's own order, each rank derives its share of
what remains of the epoch from the global position, on the world size it runs with now (another
world size or worker count continues the same global order, nothing repeated or lost). A resume
is a seek: nothing is replayed. States of format ``feedgpu.loader/1`` (per-rank positions) load
too when they were saved on the world size the loader runs with.
"""
from __future__ import annotations

import dataclasses

from ..errors import StateError

FORMAT = "feedgpu.loader/2"
OLD_FORMAT = _OLD = "feedgpu.loader/1"
_RANKLESS = ("rank", "world_size", "seed")


def order_settings(config: dict) -> dict:
    """An order's settings as a state records them (no rank, world size or seed)."""
    return {k: v for k, v in config.items() if k not in _RANKLESS}


def make_state(fingerprint: str, epoch: int, start: int, batches: int, rows: int, seed: int, config: dict,
               sharded: bool, num_batches: int | None) -> dict:
    return {"format": FORMAT, "fingerprint": fingerprint, "epoch": int(epoch),
            "samples_seen": int(start if sharded else rows), "batches_seen": int(batches), "seed": int(seed),
            "world_size": int(config.get("world_size", 1)), "sampler": order_settings(config),
            "num_batches": None if num_batches is None else int(num_batches)}


def read_state(state, fingerprint: str, config: dict, sharded: bool) -> tuple[int, int, int, int, int]:
    """``(epoch, start, batches, rows, seed)`` to resume from ``state``.

    ``start`` is the global position for feedgpu's order, the batches to skip for a user sampler.
    Raises :class:`StateError` for a state of another format, dataset or order (the differences
    are listed)."""
    if not isinstance(state, dict) or state.get("format") not in (FORMAT, _OLD):
        raise StateError(f"not a feedgpu loader state (format {FORMAT!r} expected)")
    if state.get("fingerprint") != fingerprint:
        raise StateError("the state was saved for another dataset (source fingerprint differs)")
    saved = dict(state["sampler"])
    if state["format"] == _OLD:
        saved_world = saved.get("world_size", 1)
        if sharded and saved_world != config.get("world_size", 1):
            raise StateError(f"a {_OLD} state holds per-rank positions: it resumes only on the world size it "
                             f"was saved with (world_size: saved {saved_world}, here {config.get('world_size', 1)})")
    mine, theirs = order_settings(config), order_settings(saved)
    diff = {k: (theirs.get(k), mine.get(k)) for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
    if diff:
        raise StateError("the state's sampler differs from this loader's: " +
                         ", ".join(f"{k}: saved {a!r}, here {b!r}" for k, (a, b) in sorted(diff.items())))
    epoch, batches, seed = int(state["epoch"]), int(state["batches_seen"]), int(state["seed"])
    rows = int(state.get("samples_seen", 0))
    if not sharded:
        return epoch, batches, batches, rows, seed
    if state["format"] == _OLD:
        start = min(batches * config["world_size"] * config["batch_size"], config["n"])
    else:
        start = rows
    if not 0 <= start <= config["n"]:
        raise StateError(f"samples_seen {start} is not in [0, {config['n']}]")
    same_world = int(state.get("world_size", saved.get("world_size", 1))) == config.get("world_size", 1)
    return epoch, start, batches if same_world else 0, 0, seed


def fingerprint_for(state, fingerprint: str, pipeline) -> str:
    """The fingerprint to check ``state`` against: ``fingerprint``, or for a ``feedgpu.loader/1``
    state saved before states held the order identity, the pipeline source's full identity when
    that is what it names."""
    if isinstance(state, dict) and state.get("format") == OLD_FORMAT and pipeline is not None \
            and state.get("fingerprint") != fingerprint and state.get("fingerprint") == pipeline.source.identity():
        return state["fingerprint"]
    return fingerprint


@dataclasses.dataclass
class Position:
    """Where a loader's training loop is, what :func:`make_state` records; the loader owns it and
    its epoch runner commits to it as batches reach the training loop.

    Attributes:
        epoch: the epoch the next batch belongs to.
        start: the position in it: indices of the epoch order consumed by all ranks (feedgpu's
            order), batches received (a user's sampler).
        rows_seen, batches_seen: samples and batches this rank received this epoch.
        next_epoch: the epoch the loader's next iteration starts (one more once an epoch completes).
    """

    epoch: int = 0
    start: int = 0
    rows_seen: int = 0
    batches_seen: int = 0
    next_epoch: int = 0

    def begin(self, epoch: int, start: int) -> None:
        """An iteration starts ``epoch`` at ``start`` (from its first batch: the counts restart)."""
        self.epoch, self.start = epoch, start
        if start == 0:
            self.rows_seen = self.batches_seen = 0

    def commit(self, epoch: int, start: int, rows: int) -> None:
        """A batch of ``rows`` samples reached the training loop; ``start``: the position after it."""
        self.epoch, self.start = epoch, start
        self.rows_seen += rows
        self.batches_seen += 1

    def complete(self, epoch: int) -> None:
        """``epoch``'s last batch reached the training loop: the next iteration starts the next one."""
        self.epoch = self.next_epoch = epoch + 1
        self.start = self.rows_seen = self.batches_seen = 0

    def seek(self, epoch: int, start: int, rows: int | None = None, batches: int | None = None) -> None:
        """The position set by ``set_epoch`` (the counts kept) or ``load_state_dict``."""
        self.epoch, self.start, self.next_epoch = epoch, start, epoch
        if rows is not None:
            self.rows_seen, self.batches_seen = rows, batches
