"""The fleet protocol: under a host lock, download a key from the remote, or take its lease, build and upload.

:mod:`jitwarm.cache.protocol` calls :meth:`Fleet.get_or_build` while it holds the key's host lock and hands it
:class:`LocalSteps`; this module reaches the local root only through those callables, never by import.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from jitwarm.cache.entry import Entry
from jitwarm.cache.files import loads, remove_tree
from jitwarm.cache.locks import LockHolder, OnWait, this_host, wait_until
from jitwarm.cache.remote.base import RemoteFailure, RenewedLease
from jitwarm.cache.remote.redis import RemoteStore

if TYPE_CHECKING:
    from jitwarm.cache.remote.s3 import ObjectStore

log = logging.getLogger("jitwarm.cache")

#: Waiters on another node's lease poll the remote with this backoff (seconds): first, factor, cap.
POLL_BACKOFF = (0.05, 1.5, 1.0)

# Compare-and-extend and compare-and-delete: only the holder's token may touch the lease, so a holder that
# stalled past its expiry cannot extend or delete the lease a new holder took meanwhile.
_EXTEND = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# A lease jitwarm sets always expires (SET NX PX). One without a TTL (set by hand, by another tool) would keep
# every node waiting until its deadline: give it the lease lifetime, so the fleet heals, and say it had none.
_ADD_EXPIRY = "if redis.call('pttl', KEYS[1]) == -1 then redis.call('pexpire', KEYS[1], ARGV[1]) return 1 end return 0"
#: A lease token is a few dozen bytes; only this much of one is read.
_MAX_TOKEN_BYTES = 4096
_warned_lock = threading.Lock()
_warned: set[str] = set()


class LeaseWithoutExpiry(RemoteFailure):
    """Another writer set a key's fleet lease without a TTL: this node builds the key locally (internal)."""


@dataclass(frozen=True)
class LocalSteps:
    """What the local tier hands the fleet protocol for one key, all run under the key's host lock.

    ``new_staging()``: a fresh staging dir named for the key; ``publish(staged)``: rename a checked entry
    into the root, returning what is published; ``build()``: build, seal and publish (``BuildError``).
    """

    new_staging: Callable[[], Path]
    publish: Callable[[Entry], Entry]
    build: Callable[[], Entry]


class Lease(Protocol):
    """What the fleet needs of a key's build lease: :class:`FleetLease` (Redis), ``s3_lease.ObjectLease``."""

    lost: bool

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it (or its holder's expired); RemoteFailure."""

    def holder(self) -> LockHolder | None:
        """Who holds it now, or None; RemoteFailure."""

    def check_expiry(self) -> None:
        """Heal a lease that would never expire (LeaseWithoutExpiry); RemoteFailure."""

    def release(self) -> None:
        """Give it up if still ours; never raises for store errors."""


class Fleet:
    """Gets a key through the remote tier: exactly one build per key across every node sharing the remote.

    :meth:`get_or_build` runs under the key's host lock and returns ``(entry, "downloaded")`` or ``(entry,
    "built")`` (under the fleet lease, then uploaded). A Redis failure at any step goes to
    :meth:`RemoteStore.failed` (logged once, built locally; ``RemoteUnavailable`` when required). Raises
    ``LockTimeout`` (another node kept the lease past ``timeout_s``) and ``BuildError``; the lease is
    released (if still ours) on every path.
    """

    def __init__(self, store: RemoteStore | ObjectStore, *, lease_s: float, count: Callable[..., None]) -> None:
        self.store = store
        self.lease_s = lease_s
        self._count = count

    def get_or_build(self, key: str, steps: LocalSteps, timeout_s: float,
                     on_wait: OnWait | None) -> tuple[Entry, str]:
        """Download ``key``, else wait for the node that builds it, else build and upload it here."""
        if not self.store.usable:
            return steps.build(), "built"
        try:
            entry = self._download(key, steps)                                  # 1. download
            if entry is not None:
                return entry, "downloaded"
            self._count("remote_misses")
            lease, entry = self._lease_or_download(key, steps, timeout_s, on_wait)  # 2-3. lease, or wait
        except LeaseWithoutExpiry as exc:  # not an outage: this key alone goes local, required or not
            _warn_once(exc.args[0], f"{exc}: building cache key {key} locally; the lease now expires "
                       f"in {self.lease_s:.0f} s")
            return self._build_and_upload(steps), "built"
        except RemoteFailure as exc:
            self.store.failed(exc)
            return steps.build(), "built"
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
            return self._build_and_upload(steps), "built"                       # build, publish, 5. upload
        finally:
            lease.release()                                                     # 6. release

    def _build_and_upload(self, steps: LocalSteps) -> Entry:
        """Build and publish locally, then upload (a Redis failure only costs the upload)."""
        entry = steps.build()
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
                           on_wait: OnWait | None) -> tuple[Lease | None, Entry | None]:
        """Take the key's lease, or wait (polling with backoff) until its holder's upload can be downloaded."""
        lease = self.store.new_lease(key, self.lease_s)
        if lease.try_acquire():
            return lease, None
        lease.check_expiry()
        self._count("lease_waits")
        first = lease.holder()
        if on_wait is not None:
            on_wait(first)

        def poll() -> tuple[Lease | None, Entry | None] | None:
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


class FleetLease(RenewedLease):
    """The fleet-wide build lease of one cache key: ``<prefix>:v1:lease:<key>``, lifetime ``ttl_s``.

    Taken with ``SET NX PX`` and a token ``{"host", "pid", "since", "nonce"}`` waiters read to say who builds;
    extended every third of its lifetime (:class:`~jitwarm.cache.remote.base.RenewedLease`), so a dead
    holder's lease expires and another node takes over (no liveness guess). An extension that finds it gone
    (a stall past ``ttl_s``) sets :attr:`lost` and warns: another node may build the key once more.
    """

    def __init__(self, store: RemoteStore, key: str, ttl_s: float) -> None:
        self.store = store
        self.name = store.lease_name(key)
        self.ttl_ms = max(100, int(ttl_s * 1000))
        super().__init__(key, self.ttl_ms / 1000, store.display)
        self._token: str | None = None

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; start the heartbeat. Raises RemoteFailure."""
        record = LockHolder(host=this_host(), pid=os.getpid(), since=time.time())
        token = json.dumps({**record.to_json(), "nonce": secrets.token_hex(8)})
        if not self.store.call("lease", lambda c: c.set(self.name, token, nx=True, px=self.ttl_ms)):
            return False
        self._token = token
        self._start_renewing()
        return True

    def holder(self) -> LockHolder | None:
        """Return who holds the lease now (None if nobody, or an unreadable token). Raises RemoteFailure."""
        raw = self.store.call("lease", lambda c: c.getrange(self.name, 0, _MAX_TOKEN_BYTES - 1))
        try:
            data = loads(raw)
            return LockHolder.from_record(data)
        except (TypeError, ValueError, KeyError, OverflowError):
            return None

    def check_expiry(self) -> None:
        """Raise LeaseWithoutExpiry when the lease (held by someone else) has no TTL, after giving it one."""
        if self.store.call("lease", lambda c: c.eval(_ADD_EXPIRY, 1, self.name, self.ttl_ms)) == 1:
            raise LeaseWithoutExpiry(f"fleet lease {self.name} on {self.store.display} had no expiry")

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours; never raises for Redis errors."""
        if self._token is None:
            return
        self._stop_renewing()
        token, self._token = self._token, None
        try:
            self.store.call("lease", lambda c: c.eval(_RELEASE, 1, self.name, token))
        except RemoteFailure as exc:  # it expires by itself
            log.debug("could not release the fleet lease of %s (%s); it expires in %d ms", self.key, exc,
                      self.ttl_ms)

    def _renew(self) -> bool:
        """Extend the lease if it still holds our token (a Lua compare-and-extend): False once it does not."""
        token = self._token
        return bool(self.store.call("lease", lambda c: c.eval(_EXTEND, 1, self.name, token, self.ttl_ms)))


def _warn_once(what: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``what`` is seen in this process, later at debug level."""
    with _warned_lock:
        first = what not in _warned
        _warned.add(what)
    (log.warning if first else log.debug)("%s", message)
