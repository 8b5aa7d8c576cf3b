"""ObjectLease: the fleet build lease of one key as an object, taken and renewed by conditional puts.

``leases/<key>.json`` holds ``{"host", "pid", "since", "nonce", "ttl_s"}``. It is taken with ``If-None-Match:
*`` and renewed every third of its lifetime with ``If-Match: <our ETag>``, so a holder that stalled past its
expiry cannot renew the lease a new holder took meanwhile. It expires by the store's clock: ``ttl_s`` (the
holder's own) after its Last-Modified, read against the store's ``Date`` header, plus one second for their
whole-second resolution. No node's clock is trusted, and a dead holder's lease cannot outlive it by more.
An expired lease is taken over with ``If-Match: <its ETag>``: of two nodes taking it over, one wins.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time

from jitwarm.cache.files import loads
from jitwarm.cache.locks import LockHolder, this_host
from jitwarm.cache.remote.base import RemoteFailure, RenewedLease
from jitwarm.cache.remote.s3 import Got, ObjectStore

log = logging.getLogger("jitwarm.cache")

#: A lease is a few dozen bytes; only this much of one is read.
MAX_LEASE_BYTES = 4096
#: Last-Modified and Date have whole-second resolution: a lease is expired only this long after its lifetime.
CLOCK_RESOLUTION_S = 1.0
#: A lease naming a longer lifetime than this (planted, or garbled) is held to it: the fleet heals.
MAX_TTL_S = 3600.0


class ObjectLease(RenewedLease):
    """The fleet-wide build lease of one cache key in an object store (the calls :class:`Fleet` makes).

    Renewed as :class:`~jitwarm.cache.remote.base.RenewedLease` says (``lost``). Every call raises
    RemoteFailure for a store fault but :meth:`release`.
    """

    def __init__(self, store: ObjectStore, key: str, ttl_s: float) -> None:
        self.store = store
        self.name = store.lease_name(key)
        self.ttl_s = max(0.1, float(ttl_s))
        super().__init__(key, self.ttl_s, store.display)
        self._etag: str | None = None
        self._since = time.time()

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it or its holder's lease expired; start the renewals."""
        self._since = time.time()
        etag = self.store.put(self.name, self._token(), "lease", IfNoneMatch="*")
        if etag is None:
            current = self.store.get(self.name, MAX_LEASE_BYTES, "lease", clip=True)
            if current is None:  # released between our put and our read: one more try
                etag = self.store.put(self.name, self._token(), "lease", IfNoneMatch="*")
            elif self._expired(current):
                etag = self.store.put(self.name, self._token(), "lease", IfMatch=current.etag)
                if etag is not None:
                    log.info("took over the expired fleet lease of cache key %s on %s (%s)", self.key,
                             self.store.display, _holder(current.body) or "unreadable lease")
        if etag is None:
            return False
        self._etag = etag
        self._start_renewing()
        return True

    def holder(self) -> LockHolder | None:
        """Return who holds the lease now (None if nobody, or an unreadable lease)."""
        current = self.store.get(self.name, MAX_LEASE_BYTES, "lease", clip=True)
        return None if current is None else _holder(current.body)

    def check_expiry(self) -> None:
        """Nothing to heal: every lease here expires by the store's clock (one without ``ttl_s`` by ours)."""

    def release(self) -> None:
        """Stop the renewals and delete the lease if it is still ours; never raises for store errors."""
        if self._etag is None:
            return
        self._stop_renewing()
        etag, self._etag = self._etag, None
        try:
            current = self.store.get(self.name, MAX_LEASE_BYTES, "lease", clip=True)
            # Compare, then delete: a node can take the lease over only once it expired, a lifetime after
            # our last renewal, so it is still ours between the two calls.
            if current is not None and current.etag == etag and not self.lost:
                self.store.call("lease", lambda c: c.delete_object(Bucket=self.store.bucket, Key=self.name))
        except RemoteFailure as exc:  # it expires by itself
            log.debug("could not release the fleet lease of %s (%s); it expires in %.1f s", self.key, exc,
                      self.ttl_s)

    def _token(self) -> bytes:
        record = LockHolder(host=this_host(), pid=os.getpid(), since=self._since)
        return json.dumps({**record.to_json(), "nonce": secrets.token_hex(8), "ttl_s": self.ttl_s}).encode()

    def _expired(self, current: Got) -> bool:
        """Whether ``current`` outlived its holder's lifetime (ours when it names none), by the store's clock."""
        ttl = self.ttl_s
        try:
            named = float(loads(current.body)["ttl_s"])
            if 0 < named:
                ttl = min(named, MAX_TTL_S)
        except (TypeError, ValueError, KeyError, OverflowError):
            pass
        return current.server_now - current.modified > ttl + CLOCK_RESOLUTION_S

    def _renew(self) -> bool:
        """Put the lease again with ``If-Match: <our ETag>``: False (412) once another node took it over."""
        etag = self.store.put(self.name, self._token(), "lease", IfMatch=self._etag or "")
        if etag is None:
            return False
        self._etag = etag
        return True


def _holder(body: bytes) -> LockHolder | None:
    try:
        return LockHolder.from_record(loads(body))
    except (TypeError, ValueError, KeyError, OverflowError):
        return None
