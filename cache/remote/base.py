"""StoreBase: what every remote store does alike, whatever it keeps entries in: health, failures, reports.

Each remote URL has one health record in this process (its pooled client, and whether and why it is down),
shared by every cache: a failure one of them sees turns the remote off for all, for :data:`RETRY_AFTER_S`.
A store (:mod:`.redis`, :mod:`.s3`) says how it connects, which client errors are faults, how it asks for
keys and how it lays entries out; the bookkeeping around those calls is here, once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from jitwarm.cache.entry import MANIFEST, MAX_MANIFEST_BYTES, Entry, FileRecord, unchanged
from jitwarm.cache.errors import RemoteUnavailable
from jitwarm.cache.files import open_regular

log = logging.getLogger("jitwarm.cache")

T = TypeVar("T")

#: After a failure the remote is skipped for this long by every cache of this process, then tried again.
RETRY_AFTER_S = 60.0


class RemoteFailure(Exception):
    """A call to the remote failed (internal: :meth:`StoreBase.failed` logs it, or raises RemoteUnavailable)."""


@dataclass(frozen=True)
class RemoteReport:
    """Which keys the remote holds (``available`` False: it could not be asked, ``error`` says why)."""

    url: str
    prefix: str
    available: bool
    error: str | None = None
    present: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return asdict(self)


class _Health:
    """One remote URL in this process: its pooled client (made on first use), and whether (and why) it is down."""

    def __init__(self) -> None:
        self.client: Any = None
        self.down_until = 0.0
        self.error: str | None = None
        self.warned = False


#: Per URL, shared by every cache of this process: a failure one of them sees turns the remote off for all.
_HEALTH: dict[str, _Health] = {}
_HEALTH_LOCK = threading.Lock()


def _health(url: str) -> _Health:
    with _HEALTH_LOCK:
        return _HEALTH.setdefault(url, _Health())


def reset_health() -> None:
    """Close this process's pooled clients and forget each remote's health (for tests)."""
    with _HEALTH_LOCK:
        records = list(_HEALTH.values())
        _HEALTH.clear()
    for record in records:
        if record.client is not None:
            with contextlib.suppress(Exception):
                record.client.close()


class StoreBase:
    """Entries of one cache format on one remote, and the health of that remote.

    Every call to the remote goes through :meth:`call`, which raises :class:`RemoteFailure` (never a client
    library's exception); the caller hands it to :meth:`failed`. Nothing here locks: the caller holds the
    key's host lock. ``max_bytes`` caps what is uploaded or downloaded; ``shared`` is the local root's
    ``allow_shared``; ``count`` adds to a counter. A store defines ``_connect``, ``_errors``, ``_probe`` and
    ``_present`` (and ``_describe`` where its errors say more than their text).
    """

    def __init__(self, url: str, display: str, prefix: str, *, required: bool, max_bytes: int, shared: bool,
                 count: Callable[..., None] | None, trust_key: bytes | None) -> None:
        self.trust_key = trust_key  # the fleet key (jitwarm.cache.signing): sign uploads, check downloads
        self.url = url
        self.display = display
        self.prefix = prefix
        self.required = required
        self.max_bytes = max_bytes
        self.shared = shared
        self._count = count or (lambda name, amount=1: None)
        self._rejected: dict[str, str] = {}  # key -> what identifies an entry already rejected (sha1, ETag)

    def _connect(self) -> Any:
        """Return a new client of ``self.url`` (connecting to nothing yet)."""
        raise NotImplementedError

    def _errors(self) -> tuple[type[BaseException], ...]:
        """The exceptions of a call that are a fault of the remote (imported here: they cost an import)."""
        raise NotImplementedError

    def _describe(self, exc: BaseException) -> str:
        """One line for a client error, after ``<what>: `` in its RemoteFailure."""
        return f"{type(exc).__name__}: {exc}"

    def _probe(self) -> None:
        """Ask the remote something cheap; RemoteFailure when it does not answer."""
        raise NotImplementedError

    def _present(self, keys: list[str]) -> list[bool]:
        """Whether the remote holds each of ``keys``; RemoteFailure."""
        raise NotImplementedError

    def _client(self) -> Any:
        """The pooled client of this URL, made on first use (importing jitwarm.cache must not cost its import)."""
        health = _health(self.url)
        with _HEALTH_LOCK:
            if health.client is None:
                health.client = self._connect()
            return health.client

    @property
    def usable(self) -> bool:
        """False while this process considers the remote down (a required remote is always tried)."""
        return self.required or time.monotonic() >= _health(self.url).down_until

    @property
    def error(self) -> str | None:
        """Why the remote is considered down now, or None."""
        health = _health(self.url)
        return health.error if time.monotonic() < health.down_until else None

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)``; a client or socket error becomes RemoteFailure("<what>: <error>")."""
        errors = self._errors()
        try:
            return fn(self._client())
        except errors as exc:
            raise RemoteFailure(f"{what}: {self._describe(exc)}") from exc

    def failed(self, exc: RemoteFailure) -> None:
        """Record a failure: ``RemoteUnavailable`` if required, else log once and go local-only for a while."""
        self._count("remote_errors")
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self.required:
            raise RemoteUnavailable(self.display, reason) from exc
        health = _health(self.url)
        with _HEALTH_LOCK:
            health.down_until = time.monotonic() + RETRY_AFTER_S
            health.error = reason
            warn, health.warned = not health.warned, True
        # A fleet start-up must never fail because the shared cache is down: say so once, then go on.
        (log.warning if warn else log.debug)("remote cache %s unavailable (%s): continuing with the local "
                                             "cache only", self.display, reason)

    def check(self) -> str | None:
        """Probe the remote: None when it answers, else why not (after :meth:`failed`, which may raise)."""
        try:
            self._probe()
        except RemoteFailure as exc:
            self.failed(exc)
            return str(exc)
        return None

    def report(self, keys: Iterable[str]) -> RemoteReport:
        """Return which of ``keys`` the remote holds; ``RemoteUnavailable`` if a required one cannot be asked."""
        keys = list(keys)
        try:
            found = self._present(keys)
        except RemoteFailure as exc:
            self.failed(exc)
            return RemoteReport(self.display, self.prefix, available=False, error=str(exc))
        return RemoteReport(self.display, self.prefix, available=True,
                            present=tuple(k for k, f in zip(keys, found, strict=True) if f),
                            missing=tuple(k for k, f in zip(keys, found, strict=True) if not f))

    def _reject(self, key: str, why: str, seen: str | None, uploader: dict[str, Any]) -> None:
        """Report a remote entry that failed the check; ``seen`` (that entry) is not downloaded again here."""
        if seen is not None:
            self._rejected[key] = seen
        self._count("remote_rejected")
        origin = f"pid {uploader.get('pid')} on {uploader.get('host')}" if uploader.get("host") else \
            "unknown uploader"
        log.warning("rejected remote entry %s on %s (uploaded by %s): %s; it is not used and will be "
                    "replaced by the next build", key, self.display, str(origin)[:200], why)

    def _read_entry(self, entry: Entry) -> tuple[bytes, list[tuple[FileRecord, bytes]], list[str]] | None:
        """Read a verified local entry to upload: (manifest, each record with its bytes, executable files).

        Read, not hashed again (its signature is compared after the read). None, logged, for an entry over
        ``max_bytes`` or changed since it was hashed.
        """
        if entry.size_bytes > self.max_bytes:
            log.info("not uploading cache key %s to %s: %d bytes is over the remote size cap of %d bytes "
                     "(JITWARM_REMOTE_MAX_BYTES)", entry.key, self.display, entry.size_bytes, self.max_bytes)
            return None
        manifest = _read(entry.path / MANIFEST, MAX_MANIFEST_BYTES)
        files, executable = [], []
        for rec in entry.records:
            path = entry.path / rec.path
            files.append((rec, _read(path, rec.size)))
            if os.lstat(path).st_mode & 0o111:
                executable.append(rec.path)
        if not unchanged(entry):  # checked after reading: what was read is what was hashed
            log.warning("not uploading cache key %s: its files changed since they were verified", entry.key)
            return None
        return manifest, files, executable


class RenewedLease:
    """A fleet lease renewed in the background, every third of its lifetime, until released or found lost.

    A store's lease (:class:`~jitwarm.cache.remote.fleet.FleetLease` for Redis,
    :class:`~jitwarm.cache.remote.s3_lease.ObjectLease`) says how one renewal is made (:meth:`_renew`);
    the thread, its stop and the warning when a renewal finds the lease taken over are here, once.
    ``lost`` is then set: another node may build the key once more, never a corrupt entry.
    """

    def __init__(self, key: str, ttl_s: float, display: str) -> None:
        self.key = key
        self.lost = False
        self._every_s = ttl_s / 3
        self._lifetime_s = ttl_s
        self._display = display
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _renew(self) -> bool:
        """Renew the lease once: False when it is no longer ours. RemoteFailure for a store fault."""
        raise NotImplementedError

    def _start_renewing(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"jitwarm-lease-{self.key[:8]}", daemon=True)
        self._thread.start()

    def _stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                if self._renew():
                    continue
            except RemoteFailure as exc:  # keep trying: a short outage need not cost the lease
                log.debug("could not renew the fleet lease of %s: %s", self.key, exc)
                continue
            log.warning("fleet lease of cache key %s on %s was lost (held past its %.1f s expiry); another node "
                        "may build it too", self.key, self._display, self._lifetime_s)
            self.lost = True  # after the warning: whoever sees it set can read why
            return


def _read(path: Path, size: int) -> bytes:
    """Read a file of a local entry to upload it (a replaced or grown file fails the signature check after)."""
    fd, _st = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        return f.read(size + 1)
