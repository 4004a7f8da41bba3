"""Tar shards (WebDataset layout) as a source: :class:`TarShardSource` and what it stands on.

* :mod:`.source`: :class:`TarShardSource`, the source itself (local paths, globs, brace ranges
  and URLs of shards; the index over them; reading a sample by its index).
* :mod:`.members`: the members of a shard as the source sees them (the WebDataset key rule,
  field kinds, labels).
* :mod:`.scan`: the numpy scan of a plain (uncompressed) shard's headers; :mod:`.walk`: the
  :mod:`tarfile` walk for any other shard. Both give the same index.
* :mod:`.local`: one local shard's part of the index, from its saved index, the member table
  beside it, or a scan; several shards at once in threads.
* :mod:`.index`: the saved index of a local shard (file layout, where it lives, when it is stale).
* :mod:`.table`: the member table written beside a shard (``<shard>.feedgpu-index``, by
  ``feedgpu convert`` and ``feedgpu index``), taken while it matches the shard.
"""
from .source import TarShardSource

__all__ = ["TarShardSource"]
