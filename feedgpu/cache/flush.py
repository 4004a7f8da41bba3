"""The one flush policy: when what a process cached becomes readable to the others.

Rows a process adds to a cache entry stream into a part file under a temporary name; they are
*published* (the part closed, renamed into place and listed in the manifest, with the samples
quarantined since the last publication: :meth:`CacheEntry.flush`) only when
:class:`FlushPolicy` says so. Nothing else calls ``flush``: each place that knows something
happened sends the policy an event, and the policy decides.
"""
from __future__ import annotations

import collections
import os
import weakref

__all__ = ["FlushPolicy"]


class FlushPolicy:
    """Decides when one process's rows of one cache entry are published.

    Events, and when each publishes:

    * :meth:`row_added` (the entry streamed a record batch to its open part): when the part
      holds ``part_bytes``;
    * :meth:`batch` (a batch begins; the cache step sends it for every batch): when its epoch
      is not the previous batch's, so the next epoch reads what this one cached;
    * :meth:`pause` (a worker stops, has been idle for the pool's ``IDLE_S``, or is asked to
      flush at the end of an epoch; an inline epoch ends; a ``feedgpu cache build`` worker
      stops): always;
    * :meth:`end` (the entry is closed: the loader shuts down, a scan's quarantine is
      written): always.

    Publishing with nothing buffered does nothing. A forked process starts with no epoch
    seen (its parent's rows are not its own: :class:`CacheEntry` drops them).
    ``published`` counts, per event, the publications that listed something (in this process).

    Args:
        entry: the :class:`~feedgpu.cache.store.CacheEntry` (``flush() -> bool``,
            ``open_part_bytes``).
        part_bytes: the size at which an open part is published (the settings' ``part_bytes``).
    """

    def __init__(self, entry, part_bytes: int):
        # a weak reference: the entry holds its policy, and an entry nobody holds any more must
        # be freed at once (its in-use lock released), not when the garbage collector finds a cycle
        self._entry, self.part_bytes = weakref.ref(entry), int(part_bytes)
        self.published: collections.Counter = collections.Counter()
        self._epoch: int | None = None
        self._pid = os.getpid()

    @property
    def entry(self):
        """The entry (None once it has been freed)."""
        return self._entry()

    def _publish(self, event: str) -> None:
        entry = self._entry()
        if entry is not None and entry.flush():
            self.published[event] += 1

    def _own(self) -> None:
        if self._pid != os.getpid():
            self._pid, self._epoch = os.getpid(), None
            self.published = collections.Counter()

    def row_added(self) -> None:
        """The entry wrote rows to its open part: publish it once it holds ``part_bytes``."""
        entry = self._entry()
        if entry is not None and entry.open_part_bytes >= self.part_bytes:
            self._publish("part full")

    def batch(self, epoch: int) -> None:
        """A batch of ``epoch`` begins in this process: publish what was cached in an earlier
        epoch, so the next one reads it."""
        self._own()
        if self._epoch is not None and epoch != self._epoch:
            self._publish("epoch change")
        self._epoch = epoch

    def pause(self) -> None:
        """This process stops, idles or is asked to flush: publish now."""
        self._own()
        self._publish("pause")

    def end(self) -> None:
        """The entry is being closed in this process: publish the rest."""
        self._own()
        self._publish("end")
