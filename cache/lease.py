"""FleetLease: a build lease on one key in Redis, kept alive by a heartbeat thread while its holder builds."""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time

from jitwarm.cache.locks import LockHolder, this_host
from jitwarm.cache.remote import RemoteFailure, RemoteStore

log = logging.getLogger("jitwarm.cache")

# Compare-and-extend and compare-and-delete: only the holder's token may touch the lease, so a holder that
# stalled past its expiry cannot extend or delete the lease a new holder took meanwhile.
_EXTEND = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class FleetLease:
    """The fleet-wide build lease of one cache key: ``<prefix>:v1:lease:<key>``.

    Taken with ``SET NX PX`` and a token ``{"host", "pid", "since", "nonce"}`` that waiters read to say
    who builds. While held, a daemon thread extends it every third of its lifetime; a holder that dies
    (even by SIGKILL) stops extending it, so it expires after at most ``ttl_s`` and another node takes
    over. There is no lock file to break and no liveness guess: expiry is the only way a lease ends
    without its holder. If an extension finds the lease gone (the holder stalled longer than ``ttl_s``),
    :attr:`lost` is set and a warning logged; the build still completes, and another node may build the
    same key once more (never a corrupt entry: uploads replace whole entries).

    Parameters
    ----------
    store : RemoteStore
        The remote this lease lives on.
    key : str
        The cache key.
    ttl_s : float
        Lifetime of the lease without an extension.

    """

    def __init__(self, store: RemoteStore, key: str, ttl_s: float) -> None:
        self.store = store
        self.key = key
        self.name = store.lease_name(key)
        self.ttl_ms = max(100, int(ttl_s * 1000))
        self.lost = False
        self._token: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; start the heartbeat. Raises RemoteFailure."""
        record = LockHolder(host=this_host(), pid=os.getpid(), since=time.time())
        token = json.dumps({**record.to_json(), "nonce": secrets.token_hex(8)})
        if not self.store.call("lease", lambda c: c.set(self.name, token, nx=True, px=self.ttl_ms)):
            return False
        self._token = token
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"jitwarm-lease-{self.key[:8]}", daemon=True)
        self._thread.start()
        return True

    def holder(self) -> LockHolder | None:
        """Return who holds the lease now (None if nobody, or an unreadable token). Raises RemoteFailure."""
        raw = self.store.call("lease", lambda c: c.get(self.name))
        try:
            data = json.loads(raw)
            return LockHolder(host=str(data["host"]), pid=int(data["pid"]), since=float(data["since"]))
        except (TypeError, ValueError, KeyError):
            return None

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours; never raises for Redis errors."""
        if self._token is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        token, self._token = self._token, None
        try:
            self.store.call("lease", lambda c: c.eval(_RELEASE, 1, self.name, token))
        except RemoteFailure as exc:  # it expires by itself
            log.debug("could not release the fleet lease of %s (%s); it expires in %d ms", self.key, exc,
                      self.ttl_ms)

    def _beat(self) -> None:
        """Extend the lease every third of its lifetime until released, or until it is found lost."""
        token = self._token
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                if not self.store.call("lease", lambda c: c.eval(_EXTEND, 1, self.name, token, self.ttl_ms)):
                    self.lost = True
                    log.warning("fleet lease of cache key %s on %s was lost (held past its %.1f s expiry); "
                                "another node may build it too", self.key, self.store.display, self.ttl_ms / 1000)
                    return
            except RemoteFailure as exc:  # keep trying: a short outage need not cost the lease
                log.debug("could not extend the fleet lease of %s: %s", self.key, exc)
