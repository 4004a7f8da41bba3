"""Local cache of a pipeline's deterministic prefix (decode, resize ...) in Arrow IPC files.

**A step of the plan.** A plan's cache cuts it after its leading deterministic sample stages
(:attr:`feedgpu.exec.plan.Plan.cache_cut`, shown by ``feedgpu pipeline explain`` as the
``[cache]`` row). At run time the cut is a :class:`feedgpu.exec.cache_step.CacheStep` over one
:class:`CacheEntry` (one fingerprint's directory): ``lookup(index)`` gives a cached sample's
uint8 ``(height, width, 3)`` RGB pixels and label without reading the source or running the
stages before the cut; for other samples those stages run and ``store(index, key, label, x)``
keeps their output. The stages after the cut get the pixels as a
:class:`feedgpu.exec.pixels.Pixels`: the cached array itself for a stage that takes arrays (the
flips) and for the batch writer, a PIL image for the others, so a hit is converted to PIL only
where a stage needs it. Batches are the same bytes with or without the cache, hit or miss.

**One flush policy.** Rows a process stores stream into a part file that others cannot read
yet; :class:`FlushPolicy` (one per entry and process, ``entry.policy``) alone decides when it is
*published* (renamed into place and listed in the manifest, with newly quarantined samples):

* the open part reached ``part_bytes`` (:meth:`FlushPolicy.row_added`, from ``put``);
* a batch of another epoch than the last begins (:meth:`FlushPolicy.batch`, from the cache step
  before each batch), so an epoch reads what the one before cached;
* the worker pauses (:meth:`FlushPolicy.pause`): it stops, has been idle for the pool's
  ``IDLE_S``, or is asked to flush at the end of an epoch (persistent workers); an inline
  (``num_workers=0``) epoch ends; a ``feedgpu cache build`` worker stops;
* the entry is closed (:meth:`FlushPolicy.end`): the loader shuts down, ``feedgpu scan
  --to-cache`` has added its quarantined samples.

Nothing else calls :meth:`CacheEntry.flush`.
"""
from .fingerprint import NotFingerprintable, fingerprint
from .flush import FlushPolicy
from .settings import CacheSettings, parse_compression, parse_size

__all__ = ["CacheEntry", "CacheSettings", "FlushPolicy", "NotFingerprintable", "clear", "entries", "evict_lru",
           "fingerprint", "open_entry", "parse_compression", "parse_size", "verify"]


def open_entry(settings: CacheSettings, source, stages, plan) -> "CacheEntry | None":
    """The entry for ``source`` + the plan's cacheable prefix, or None (with a warning) when there
    is nothing to cache or a stage cannot be fingerprinted."""
    import warnings

    k = plan.cache_prefix
    if k == 0:
        warnings.warn("feedgpu cache: the pipeline has no deterministic stage before its first random one; "
                      "nothing to cache", stacklevel=3)
        return None
    prefix = list(plan.sample_stages[:k])
    try:
        fp = fingerprint(source.identity(content=settings.fingerprint == "content"), prefix)
    except NotFingerprintable as e:
        warnings.warn(f"feedgpu cache disabled: {e}", stacklevel=3)
        return None
    meta = {"source": source.describe(), "stages": [{"name": s.name, "config": s.config()} for s in prefix]}
    from .store import CacheEntry

    return CacheEntry(settings, fp, len(source), meta)


_STORE = ("CacheEntry", "clear", "entries", "evict_lru", "verify")


def __getattr__(name: str):
    # the store (pyarrow) is imported on first use: a loader without a cache does not need it
    if name in _STORE:
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
