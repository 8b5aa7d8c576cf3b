"""The fleet protocol: under the host lock, download a key from the remote, or take its lease and build it."""

from __future__ import annotations

import logging
import time
from typing import Any

from jitwarm.cache.durable import remove_tree
from jitwarm.cache.entry import Entry
from jitwarm.cache.errors import LockTimeout
from jitwarm.cache.lease import FleetLease
from jitwarm.cache.locks import WAIT_LOG_AFTER_S, OnWait
from jitwarm.cache.publish import BuildFn, Publisher
from jitwarm.cache.remote import RemoteFailure, RemoteStore
from jitwarm.cache.reports import StatsCounter

log = logging.getLogger("jitwarm.cache")

#: Waiters on another node's lease poll the remote with this backoff (seconds): first, factor, cap.
POLL_FIRST_S, POLL_FACTOR, POLL_MAX_S = 0.05, 1.5, 1.0


class FleetBuilder:
    """Gets a key through the remote tier: exactly one build per key across every node sharing the remote.

    Contract: :meth:`get_or_build` runs while the caller holds the key's host lock (so one process per
    host talks to the remote for a key) and returns ``(entry, outcome)``, outcome ``"downloaded"`` (a
    remote entry, checked and published into the local root through the normal atomic path) or
    ``"built"`` (this process built it under the fleet lease, published it locally, then uploaded it).
    A Redis failure at any step is handed to :meth:`RemoteStore.failed`: logged once and the key built
    locally, or :class:`~jitwarm.cache.errors.RemoteUnavailable` when the remote is required. Raises
    ``LockTimeout`` when another node holds the lease past ``timeout_s`` and ``BuildError`` as
    :meth:`Publisher.build` does; the lease is released (if still ours) on every path.
    """

    def __init__(self, store: RemoteStore, publisher: Publisher, *, lease_s: float, stats: StatsCounter) -> None:
        self.store = store
        self.publisher = publisher
        self.lease_s = lease_s
        self._stats = stats

    def get_or_build(self, key: str, preimage: dict[str, Any], build: BuildFn, timeout_s: float,
                     on_wait: OnWait | None) -> tuple[Entry, str]:
        """Download ``key``, else wait for the node that builds it, else build and upload it here."""
        if not self.store.usable:
            return self.publisher.build(key, preimage, build), "built"
        try:
            entry = self._download(key)
            if entry is not None:
                return entry, "downloaded"
            self._stats.add("remote_misses")
            lease, entry = self._lease_or_download(key, timeout_s, on_wait)
        except RemoteFailure as exc:
            self.store.failed(exc)
            return self.publisher.build(key, preimage, build), "built"
        if entry is not None:
            return entry, "downloaded"
        try:
            try:
                # The last holder may have uploaded between our last look and our SET NX: look again.
                entry = self._download(key)
            except RemoteFailure as exc:
                self.store.failed(exc)
            if entry is not None:
                return entry, "downloaded"
            entry = self.publisher.build(key, preimage, build)
            if self.store.usable:
                try:
                    self.store.upload(entry)
                except RemoteFailure as exc:
                    self.store.failed(exc)
            return entry, "built"
        finally:
            lease.release()

    def _download(self, key: str) -> Entry | None:
        """Fetch ``key`` into a staging dir and publish it locally; None when the remote has no valid entry."""
        layout = self.publisher.layout
        staging = layout.new_staging_dir(key)  # named for the key: a dead downloader's copy gets swept
        layout.ensure(layout.staging)
        try:
            if not self.store.fetch(key, staging):
                return None
            entry = self.publisher.install(key, staging, keep_fallback=True)
        except BaseException:
            remove_tree(staging)
            raise
        self._stats.add("remote_hits")
        return entry

    def _lease_or_download(self, key: str, timeout_s: float,
                           on_wait: OnWait | None) -> tuple[FleetLease | None, Entry | None]:
        """Take the key's lease, or wait (polling with backoff) until its holder's upload can be downloaded."""
        lease = FleetLease(self.store, key, self.lease_s)
        if lease.try_acquire():
            return lease, None
        self._stats.add("lease_waits")
        holder = lease.holder()
        if on_wait is not None:
            on_wait(holder)
        start = time.monotonic()
        delay, logged = POLL_FIRST_S, False
        try:
            while True:
                elapsed = time.monotonic() - start
                if not logged and elapsed >= WAIT_LOG_AFTER_S:
                    holder = lease.holder() or holder
                    log.info("waiting for cache key %s: fleet lease on %s %s", key, self.store.display,
                             holder.describe() if holder else "(holder unknown)")
                    logged = True
                if elapsed >= timeout_s:
                    raise LockTimeout(key, lease.holder() or holder, timeout_s)
                time.sleep(min(delay, timeout_s - elapsed))
                delay = min(delay * POLL_FACTOR, POLL_MAX_S)
                entry = self._download(key)
                if entry is not None:
                    return None, entry
                if lease.try_acquire():  # the holder released without uploading, or died and its lease expired
                    return lease, None
        finally:
            self._stats.add("lock_wait_s", time.monotonic() - start)
