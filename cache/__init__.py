"""The shared kernel cache: content-addressed entries, per-key file locks, exactly-once builds, a remote tier.

The protocol and its design note: :mod:`jitwarm.cache.store.protocol`. Importing it reads no environment and
touches no file.
"""

from __future__ import annotations

from jitwarm.cache.bundle import ImportReport
from jitwarm.cache.entry import Entry, FileRecord
from jitwarm.cache.errors import BuildError, CacheError, CacheWriteError, LockTimeout, RemoteUnavailable
from jitwarm.cache.keys import FORMAT_VERSION, key_of
from jitwarm.cache.locks import LockHolder
from jitwarm.cache.maintenance import PruneReport
from jitwarm.cache.remote import RemoteReport, reset_remote_health
from jitwarm.cache.store import CacheResult, CacheStats, KernelCache, Outcome, Reservation, VerifyReport

__all__ = ["FORMAT_VERSION", "BuildError", "CacheError", "CacheResult", "CacheStats", "CacheWriteError", "Entry",
           "FileRecord", "ImportReport", "KernelCache", "LockHolder", "LockTimeout", "Outcome", "PruneReport",
           "RemoteReport", "RemoteUnavailable", "Reservation", "VerifyReport", "key_of", "reset_remote_health"]
