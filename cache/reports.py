"""What cache operations report back: per-process counters and the results of verify, prune, import."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class CacheStats:
    """Counters of one :class:`~jitwarm.cache.KernelCache` in this process.

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
        Seconds spent waiting for other processes.
    corrupt : int
        Entries that failed verification when this cache looked at them.
    remote_hits : int
        Entries downloaded from the remote tier, verified and published into the local root.
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
    """Thread-safe accumulator behind :meth:`KernelCache.stats`."""

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


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`KernelCache.verify`.

    Attributes
    ----------
    ok : tuple of str
        Keys with at least one copy (root or layer) that verified.
    corrupt : dict of str to str
        Keys with a copy that failed, and why (with its path).
    missing : tuple of str
        Requested keys with no copy anywhere.
    quarantined : tuple of str
        Corrupt keys whose bad copy was moved to ``<root>/v1/quarantine`` (layer copies cannot be).

    """

    ok: tuple[str, ...] = ()
    corrupt: dict[str, str] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    quarantined: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        """True when nothing was corrupt or missing."""
        return not self.corrupt and not self.missing

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return {"ok": list(self.ok), "corrupt": dict(self.corrupt), "missing": list(self.missing),
                "quarantined": list(self.quarantined)}


@dataclass(frozen=True)
class PruneReport:
    """Result of :meth:`KernelCache.prune`.

    Attributes
    ----------
    removed : tuple of str
        Keys whose entries were removed, least recently used first.
    freed_bytes : int
        Bytes of artifact files removed with them.
    skipped_locked : tuple of str
        Keys that were due for removal but whose lock was held, so were kept.
    staging_removed : tuple of str
        Names of abandoned staging directories removed (their builder is dead).
    quarantine_removed : tuple of str
        Names of quarantined copies removed (only with ``older_than_s``).
    remaining_bytes : int
        Size of the entries left in the writable root.

    """

    removed: tuple[str, ...] = ()
    freed_bytes: int = 0
    skipped_locked: tuple[str, ...] = ()
    staging_removed: tuple[str, ...] = ()
    quarantine_removed: tuple[str, ...] = ()
    remaining_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return asdict(self)


@dataclass(frozen=True)
class ImportReport:
    """Result of :meth:`KernelCache.import_bundle`.

    Attributes
    ----------
    imported : tuple of str
        Keys published into the writable root by this import.
    present : tuple of str
        Keys of the bundle that were already available (root or layer), left as they were.

    """

    imported: tuple[str, ...] = ()
    present: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key of the bundle."""
        return tuple(sorted((*self.imported, *self.present)))

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return asdict(self)


@dataclass(frozen=True)
class RemoteReport:
    """Result of :meth:`KernelCache.remote_report`: which keys the remote tier holds.

    Attributes
    ----------
    url : str
        The remote's URL, password removed.
    prefix : str
        The key namespace on that server.
    available : bool
        False when the remote could not be asked; ``present`` and ``missing`` are then empty.
    error : str or None
        Why it is not available.
    present : tuple of str
        Keys whose entry (manifest and files) is on the remote.
    missing : tuple of str
        Keys the remote does not hold.

    """

    url: str
    prefix: str
    available: bool
    error: str | None = None
    present: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return asdict(self)
