"""ObjectLease: the fleet build lease of one key as an object, taken and renewed by conditional puts.

``leases/<key>.json`` holds ``{"host", "pid", "since", "nonce", "ttl_s"}``. It is taken with ``If-None-Match:
*`` and renewed every third of its lifetime with ``If-Match: <our ETag>``, so a holder that stalled past its
expiry cannot renew the lease a new holder took meanwhile. It expires by the store's clock: ``ttl_s`` (the
holder's own) after its Last-Modified, read against the store's ``Date`` header, plus one second for their
whole-second resolution. No node's clock is trusted, and a dead holder's lease cannot outlive it by more.
An expired lease is taken over with ``If-Match: <its ETag>``: of two nodes taking it over, one wins.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jitwarm.cache.files import loads
from jitwarm.cache.remote.lease import MAX_TOKEN_BYTES, RenewedLease, holder_of

if TYPE_CHECKING:
    from jitwarm.cache.remote.s3 import Got, ObjectStore

log = logging.getLogger("jitwarm.cache")

#: Last-Modified and Date have whole-second resolution: a lease is expired only this long after its lifetime.
CLOCK_RESOLUTION_S = 1.0
#: A lease naming a longer lifetime than this (planted, or garbled) is held to it: the fleet heals.
MAX_TTL_S = 3600.0


class ObjectLease(RenewedLease):
    """The fleet build lease of one key in an object store (:class:`~jitwarm.cache.remote.lease.RenewedLease`)."""

    store: ObjectStore

    def _take(self) -> str | None:
        etag = self._put(IfNoneMatch="*")
        if etag is None:
            current = self._get()
            if current is None:  # released between our put and our read: one more try
                etag = self._put(IfNoneMatch="*")
            elif self._expired(current):
                etag = self._put(IfMatch=current.etag)
                if etag is not None:
                    log.info("took over the expired fleet lease of cache key %s on %s (%s)", self.key,
                             self.store.display, holder_of(current.body) or "unreadable lease")
        return etag

    def _read(self) -> bytes | None:
        current = self._get()
        return None if current is None else current.body

    def _renew(self) -> bool:
        """Put the lease again with ``If-Match: <our ETag>``: False (412) once another node took it over."""
        etag = self._put(IfMatch=self._held or "")
        if etag is None:
            return False
        self._held = etag
        return True

    def _delete(self, held: str) -> None:
        current = self._get()
        # Compare, then delete: a node can take the lease over only once it expired, a lifetime after our
        # last renewal, so it is still ours between the two calls.
        if current is not None and current.etag == held and not self.lost:
            self.store.call("lease", lambda c: c.delete_object(Bucket=self.store.bucket, Key=self.name))

    def _get(self) -> Got | None:
        return self.store.get(self.name, MAX_TOKEN_BYTES, "lease", clip=True)

    def _put(self, **condition: str) -> str | None:
        return self.store.put(self.name, self._token(ttl_s=self.ttl_s), "lease", **condition)

    def _expired(self, current: Got) -> bool:
        """Whether ``current`` outlived its holder's lifetime (ours when it names none), by the store's clock."""
        ttl = self.ttl_s
        try:
            named = float(loads(current.body)["ttl_s"])
            if 0 < named:
                ttl = min(named, MAX_TTL_S)
        except (TypeError, ValueError, KeyError, OverflowError):
            pass
        return current.age_s > ttl + CLOCK_RESOLUTION_S
