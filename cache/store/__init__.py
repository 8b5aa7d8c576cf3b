"""The cache's store, one room: the protocol (:mod:`.protocol`, its reads :mod:`.reading`) and KernelCache, its face."""

from __future__ import annotations

from jitwarm.cache.store.kernel_cache import KernelCache
from jitwarm.cache.store.protocol import BuildFn, CacheResult, LocalCache, Outcome, Reservation
from jitwarm.cache.store.reading import CacheReader, CacheStats, VerifyReport

__all__ = ["BuildFn", "CacheReader", "CacheResult", "CacheStats", "KernelCache", "LocalCache", "Outcome", "Reservation",
           "VerifyReport"]
