"""RenewedLease: the fleet-wide build lease of one cache key, whatever store holds it (Redis, S3).

A node that misses a key on the remote takes its lease before it builds, so the fleet builds each key about
once (:mod:`jitwarm.cache.remote.fleet`); each store says how a lease is taken, read, renewed and deleted.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from typing import Any

from jitwarm.cache.files import loads
from jitwarm.cache.locks import LockHolder, this_host
from jitwarm.cache.remote.base import RemoteFailure

log = logging.getLogger("jitwarm.cache")

#: A lease token is a few dozen bytes; only this much of one is read.
MAX_TOKEN_BYTES = 4096


class LeaseWithoutExpiry(RemoteFailure):
    """Another writer set a key's fleet lease without a TTL: this node builds the key locally (internal)."""


class RenewedLease:
    """The fleet-wide build lease of one cache key, renewed in the background every third of its lifetime.

    Every call but :meth:`release` raises RemoteFailure for a store fault. A store's lease defines how it is
    taken (``_take()``: what proves it ours, or None), read (``_read()``: the token, or None), renewed
    (``_renew()``: False once it is not ours) and deleted (``_delete(held)``: only if ours). Its token
    ``{"host", "pid", "since", "nonce"}`` says who builds. A renewal that finds the lease taken over (its holder
    stalled past its expiry) warns and sets :attr:`lost`: another node may build the key once more, never a
    corrupt entry.
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
