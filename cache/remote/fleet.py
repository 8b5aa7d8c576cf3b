"""The fleet protocol: under a host lock, download a key from the remote, or take its lease, build and upload.

The lease (:class:`RenewedLease`) makes the fleet build each key about once; each store says how a lease is
taken, read, renewed and deleted. This module reaches the local root only through :class:`LocalSteps`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jitwarm.cache.entry import Entry
from jitwarm.cache.files import loads, remove_tree
from jitwarm.cache.locks import LockHolder, OnWait, this_host, wait_until
from jitwarm.cache.remote.base import RemoteFailure, StoreBase

log = logging.getLogger("jitwarm.cache")

#: Waiters on another node's lease poll the remote with this backoff (seconds): first, factor, cap.
POLL_BACKOFF = (0.05, 1.5, 1.0)
#: A lease token is a few dozen bytes; only this much of one is read.
MAX_TOKEN_BYTES = 4096

_warned_lock = threading.Lock()
_warned: set[str] = set()


@dataclass(frozen=True)
class LocalSteps:
    """What the local tier hands the fleet protocol for one key, all run under the key's host lock.

    ``new_staging()``: a fresh staging dir; ``publish(staged)``: rename a checked entry into the root;
    ``build()``: yield the staging dir to build into, then seal and publish it (``BuildError``).
    """

    new_staging: Callable[[], Path]
    publish: Callable[[Entry], Entry]
    build: Callable[[], Generator[Path, None, Entry]]


class Fleet:
    """Gets a key through the remote tier: one build per key across the fleet; a store failure builds locally."""

    def __init__(self, store: StoreBase, *, lease_s: float, count: Callable[..., None]) -> None:
        self.store = store
        self.lease_s = lease_s
        self._count = count

    def get_or_build(self, key: str, steps: LocalSteps, timeout_s: float,
                     on_wait: OnWait | None) -> Generator[Path, None, tuple[Entry, str]]:
        """Download ``key``, else wait for the node that builds it, else build and upload it here.

        Yields the staging dir only when this node builds (the lease held meanwhile); returns ``(entry,
        outcome)``. Raises ``LockTimeout`` (another node kept the lease past ``timeout_s``) or ``BuildError``.
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
            with _warned_lock:
                first = exc.args[0] not in _warned  # warned once per lease name, later at debug level
                _warned.add(exc.args[0])
            (log.warning if first else log.debug)("%s: building cache key %s locally; the lease now expires in "
                                                  "%.0f s", exc, key, self.lease_s)
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
        lease = self.store.lease_class(self.store, key, self.lease_s)
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


class LeaseWithoutExpiry(RemoteFailure):
    """Another writer set a key's fleet lease without a TTL: this node builds the key locally (internal)."""


class RenewedLease:
    """The fleet-wide build lease of one cache key, renewed in the background every third of its lifetime.

    Every call but :meth:`release` raises RemoteFailure. A store's lease defines ``_take()`` (what proves it
    ours, or None), ``_read()`` (the token), ``_renew()`` (False once not ours) and ``_delete(held)``. A lease
    found taken over sets :attr:`lost`: another node may build the key once more, never a corrupt entry.
    """

    def __init__(self, store: Any, key: str, ttl_s: float) -> None:
        self.store = store
        self.key = key
        self.name: str = store.lease_name(key)
        self.ttl_s = max(0.1, float(ttl_s))
        self.lost = False
        self._held: Any = None  # what proves the lease ours: our token (Redis) or its ETag (S3)
        self._since = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it (or its holder's expired) and start renewing it."""
        self._since = time.time()
        self._held = self._take()
        if self._held is None:
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"jitwarm-lease-{self.key[:8]}", daemon=True)
        self._thread.start()
        return True

    def holder(self) -> LockHolder | None:
        """Return who holds the lease now (None if nobody, or an unreadable token)."""
        return holder_of(self._read())

    def check_expiry(self) -> None:
        """Heal a lease that would never expire, and raise LeaseWithoutExpiry (here: every lease expires)."""

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours; never raises for store errors."""
        if self._held is None:
            return
        self._stop_renewing()
        held, self._held = self._held, None
        try:
            self._delete(held)
        except RemoteFailure as exc:  # it expires by itself
            log.debug("could not release the fleet lease of %s (%s); it expires in %.1f s", self.key, exc,
                      self.ttl_s)

    def _token(self, **extra: Any) -> bytes:
        """A new token naming this process as the holder since :meth:`try_acquire`."""
        record = LockHolder(host=this_host(), pid=os.getpid(), since=self._since)
        return json.dumps({**record.to_json(), "nonce": secrets.token_hex(8), **extra}).encode()

    def _stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self._renew():
                    continue
            except RemoteFailure as exc:  # keep trying: a short outage need not cost the lease
                log.debug("could not renew the fleet lease of %s: %s", self.key, exc)
                continue
            log.warning("fleet lease of cache key %s on %s was lost (held past its %.1f s expiry); another node "
                        "may build it too", self.key, self.store.display, self.ttl_s)
            self.lost = True  # after the warning: whoever sees it set can read why
            return


def holder_of(token: bytes | None) -> LockHolder | None:
    """Who a lease token names, or None for no token or an unreadable one."""
    try:
        return LockHolder.from_record(loads(token or b""))
    except (TypeError, ValueError, KeyError, OverflowError):
        return None
