"""Data that lives elsewhere: URLs through fsspec (:mod:`~feedgpu.remote.urls`), the node-local
shard cache (:class:`~feedgpu.remote.cache.ShardCache`), the index file ``feedgpu convert``
writes (:mod:`~feedgpu.remote.index`) and uploads (:mod:`~feedgpu.remote.upload`).

Nothing here imports fsspec until a URL is used, so ``import feedgpu`` works without it.
"""
from .cache import ShardCache
from .index import INDEX_FILE
from .urls import Identity, has_url, is_url

__all__ = ["INDEX_FILE", "Identity", "ShardCache", "has_url", "is_url"]
