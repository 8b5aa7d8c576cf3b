"""The fleet protocol: under a host lock, download a key from the remote, or take its lease, build and upload.

:mod:`jitwarm.cache.store.protocol` hands :meth:`Fleet.get_or_build` the :class:`LocalSteps` of the key; this module
reaches the local root only through those callables, never by import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path

from jitwarm.cache.entry import Entry
from jitwarm.cache.files import remove_tree
from jitwarm.cache.locks import OnWait, wait_until
from jitwarm.cache.remote.base import RemoteFailure, StoreBase
from jitwarm.cache.remote.lease import LeaseWithoutExpiry, RenewedLease

log = logging.getLogger("jitwarm.cache")

#: Waiters on another node's lease poll the remote with this backoff (seconds): first, factor, cap.
POLL_BACKOFF = (0.05, 1.5, 1.0)

_warned_lock = threading.Lock()
_warned: set[str] = set()


@dataclass(frozen=True)
class LocalSteps:
    """What the local tier hands the fleet protocol for one key, all run under the key's host lock.

    ``new_staging()``: a fresh staging dir named for the key; ``publish(staged)``: rename a checked entry
    into the root, returning what is published; ``build()``: yield the staging dir to build into, then seal
    and publish it (``BuildError``), as ``LocalCache._build``.
    """

    new_staging: Callable[[], Path]
    publish: Callable[[Entry], Entry]
    build: Callable[[], Generator[Path, None, Entry]]


class Fleet:
    """Gets a key through the remote tier: exactly one build per key across every node sharing the remote.

    A store failure at any step goes to :meth:`StoreBase.failed` (logged once, built locally;
    ``RemoteUnavailable`` when required). The lease is released (if still ours) on every path.
    """

    def __init__(self, store: StoreBase, *, lease_s: float, count: Callable[..., None]) -> None:
        self.store = store
        self.lease_s = lease_s
        self._count = count

    def get_or_build(self, key: str, steps: LocalSteps, timeout_s: float,
                     on_wait: OnWait | None) -> Generator[Path, None, tuple[Entry, str]]:
        """Download ``key``, else wait for the node that builds it, else build and upload it here.

        Runs under the key's host lock, as the local steps' generator: it yields the staging dir to build into
        only when this node builds (the lease held meanwhile). Returns ``(entry, "downloaded")`` or ``(entry,
        "built")``. Raises ``LockTimeout`` (another node kept the lease past ``timeout_s``) or ``BuildError``.
        """
        if not self.store.usable:
            return (yield from steps.build()), "built"
        try:
            entry = self._download(key, steps)                                  # 1. download
            if entry is not None:
                return entry, "downloaded"
            self._count("remote_misses")
            lease, entry = self._lease_or_download(key, steps, timeout_s, on_wait)  # 2-3. lease, or wait
        except LeaseWithoutExpiry as exc:  # not an outage: this key alone goes local, required or not
            _warn_once(exc.args[0], f"{exc}: building cache key {key} locally; the lease now expires "
                       f"in {self.lease_s:.0f} s")
            return (yield from self._build_and_upload(steps)), "built"
        except RemoteFailure as exc:
            self.store.failed(exc)
            return (yield from steps.build()), "built"
        if entry is not None:
            return entry, "downloaded"
        try:
            try:
                # 4. The last holder may have uploaded between our last look and our SET NX: look again.
                entry = self._download(key, steps)
            except RemoteFailure as exc:
                self.store.failed(exc)
            if entry is not None:
                return entry, "downloaded"
            return (yield from self._build_and_upload(steps)), "built"          # build, publish, 5. upload
        finally:
            lease.release()                                                     # 6. release

    def _build_and_upload(self, steps: LocalSteps) -> Generator[Path, None, Entry]:
        """Build and publish locally, then upload (a store failure only costs the upload)."""
        entry = yield from steps.build()
        if self.store.usable:
            try:
                self.store.upload(entry)
            except RemoteFailure as exc:
                self.store.failed(exc)
        return entry

    def _download(self, key: str, steps: LocalSteps) -> Entry | None:
        """Fetch ``key`` into a staging dir and publish it; None when the remote has no valid entry."""
        staging = steps.new_staging()
        try:
            staged = self.store.fetch(key, staging)
            if staged is None:
                remove_tree(staging)
                return None
            entry = steps.publish(staged)  # it may serve the staged copy itself (NFS): never remove it then
        except BaseException:
            remove_tree(staging)
            raise
        self._count("remote_hits")
        return entry

    def _lease_or_download(self, key: str, steps: LocalSteps, timeout_s: float,
                           on_wait: OnWait | None) -> tuple[RenewedLease | None, Entry | None]:
        """Take the key's lease, or wait (polling with backoff) until its holder's upload can be downloaded."""
        lease = self.store.new_lease(key, self.lease_s)
        if lease.try_acquire():
            return lease, None
        lease.check_expiry()
        self._count("lease_waits")
        first = lease.holder()
        if on_wait is not None:
            on_wait(first)

        def poll() -> tuple[RenewedLease | None, Entry | None] | None:
            entry = self._download(key, steps)
            if entry is not None:
                return None, entry
            # The holder released without uploading, or died and its lease expired.
            if lease.try_acquire():
                return lease, None
            lease.check_expiry()
            return None

        start = time.monotonic()
        try:
            return wait_until(poll, timeout_s, key=key, holder=lambda: lease.holder() or first,
                              where=f" (fleet lease on {self.store.display})", backoff=POLL_BACKOFF)
        finally:
            self._count("lock_wait_s", time.monotonic() - start)


def _warn_once(what: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``what`` is seen in this process, later at debug level."""
    with _warned_lock:
        first = what not in _warned
        _warned.add(what)
    (log.warning if first else log.debug)("%s", message)
