"""CacheStats: the counters of one KernelCache in this process, and the thread-safe counter the tiers add to.

The local tier, the fleet protocol and the remote store are handed :meth:`StatsCounter.add` as a plain
callable, so none of them imports the facade.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class CacheStats:
    """Counters of one :class:`KernelCache` in this process.

    Attributes
    ----------
    hits : int
        Calls served by an already published entry without waiting for another process.
    misses : int
        Lock-free lookups inside ``get_or_build``/``wait_for`` that found nothing.
    builds : int
        Times this process ran a build callable.
    waits : int
        Calls that found another process holding the key's lock (or, in ``wait_for``, no entry yet).
    lock_wait_s : float
        Seconds spent waiting for other processes (and other nodes' fleet leases).
    corrupt : int
        Entries that failed verification when this cache looked at them.
    remote_hits : int
        Entries downloaded from the remote tier, checked and published into the local root.
    remote_misses : int
        ``get_or_build`` calls that found the key neither locally nor on the remote.
    remote_uploads : int
        Entries this cache built and uploaded to the remote tier.
    lease_waits : int
        Calls that found another node holding the key's fleet lease and waited for it.
    remote_rejected : int
        Remote entries that failed the size and sha256 check against their manifest (never loaded).
    remote_errors : int
        Failures talking to the remote (each one turned the remote off for a while, or raised).

    """

    hits: int = 0
    misses: int = 0
    builds: int = 0
    waits: int = 0
    lock_wait_s: float = 0.0
    corrupt: int = 0
    remote_hits: int = 0
    remote_misses: int = 0
    remote_uploads: int = 0
    lease_waits: int = 0
    remote_rejected: int = 0
    remote_errors: int = 0

    def to_json(self) -> dict[str, Any]:
        """Return the counters as a JSON-able dict."""
        return asdict(self)


class StatsCounter:
    """Thread-safe accumulator behind :meth:`KernelCache.stats`; the tiers get its :meth:`add`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {f.name: 0 for f in fields(CacheStats)}

    def add(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to counter ``name``."""
        with self._lock:
            self._values[name] += amount

    def snapshot(self) -> CacheStats:
        """Return the current values."""
        with self._lock:
            return CacheStats(**self._values)  # type: ignore[arg-type]
