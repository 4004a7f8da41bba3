"""Local cache of a pipeline's deterministic prefix (decode, resize ...) in Arrow IPC files."""
from .fingerprint import NotFingerprintable, fingerprint
from .settings import CacheSettings, parse_compression, parse_size
from .store import CacheEntry, clear, entries, evict_lru, verify

__all__ = ["CacheEntry", "CacheSettings", "NotFingerprintable", "clear", "entries", "evict_lru", "fingerprint",
           "open_entry", "parse_compression", "parse_size", "verify"]


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
        fp = fingerprint(source.identity(), prefix)
    except NotFingerprintable as e:
        warnings.warn(f"feedgpu cache disabled: {e}", stacklevel=3)
        return None
    meta = {"source": source.describe(), "stages": [{"name": s.name, "config": s.config()} for s in prefix]}
    return CacheEntry(settings, fp, len(source), meta)
