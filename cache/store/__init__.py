"""The cache's store, one room: the protocol (:mod:`.protocol`, its design note on top) and KernelCache, its face."""

from __future__ import annotations

from jitwarm.cache.store.kernel_cache import KernelCache
from jitwarm.cache.store.protocol import BuildFn, CacheResult, CacheStats, LocalCache, Outcome, Reservation

__all__ = ["BuildFn", "CacheResult", "CacheStats", "KernelCache", "LocalCache", "Outcome", "Reservation"]
