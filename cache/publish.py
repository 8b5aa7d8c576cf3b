"""The publish protocol: build into staging, seal, rename into place; and the rename race."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jitwarm.cache import prune
from jitwarm.cache.durable import fsync_dir, remove_tree
from jitwarm.cache.entry import Entry, seal, verify_entry
from jitwarm.cache.errors import BuildError, CacheError, LockTimeout
from jitwarm.cache.index import EntryIndex
from jitwarm.cache.layout import RootLayout
from jitwarm.cache.locks import WAIT_LOG_AFTER_S, KeyLock, LockHolder, OnWait
from jitwarm.cache.reports import ImportReport, StatsCounter

if TYPE_CHECKING:
    from jitwarm.cache.fleet import FleetBuilder

log = logging.getLogger("jitwarm.cache")

BuildFn = Callable[[Path], None]

# NFS can hide a just-renamed directory from other clients for a moment (DeepEP #683): look again.
NFS_RETRY_DELAYS_S = (0.02, 0.05, 0.1, 0.2)


class Publisher:
    """Publishes entries into the writable root.

    Every method expects the caller to hold the key's lock, except :meth:`get_or_build`,
    :meth:`wait_published` and :meth:`import_staged`, which take (or only read) each lock themselves.
    """

    def __init__(self, layout: RootLayout, index: EntryIndex, lock_dir: Path, *, allow_shared: bool,
                 stats: StatsCounter) -> None:
        self.layout = layout
        self.index = index
        self.lock_dir = lock_dir
        self.allow_shared = allow_shared
        self._stats = stats

    def find_fresh(self, key: str, *, retry: bool) -> Entry | None:
        """Look up under the lock; with ``retry``, look again a few times to outwait NFS attribute caching."""
        entry = self.index.find(key, locked=True)
        for delay in NFS_RETRY_DELAYS_S if retry and entry is None else ():
            time.sleep(delay)
            refresh_dir(self.layout.entry_dir(key).parent)
            entry = self.index.find(key, locked=True)
            if entry is not None:
                break
        return entry

    def get_or_build(self, key: str, preimage: dict[str, Any], build: BuildFn, timeout_s: float,
                     on_wait: OnWait | None, fleet: FleetBuilder | None) -> tuple[Entry, str]:
        """Steps 2-7 of the protocol after a lock-free miss: lock, look again, then build (or ask ``fleet``).

        Returns ``(entry, outcome)``; takes and releases the key's lock itself. See
        :meth:`KernelCache.get_or_build` for what it raises.
        """
        waited = False

        def note_wait(holder: LockHolder | None) -> None:
            nonlocal waited
            waited = True
            self._stats.add("waits")
            if on_wait is not None:
                on_wait(holder)

        found: list[Entry] = []

        def published() -> bool:
            # Waiters need not queue on the lock once the holder's entry is visible.
            entry = self.index.find(key)
            found.extend([entry] if entry is not None else [])
            return entry is not None

        lock = KeyLock(self.lock_dir, key)
        start = time.monotonic()
        try:
            acquired = lock.acquire(timeout_s, on_wait=note_wait, give_up=published)
        finally:
            if waited:
                self._stats.add("lock_wait_s", time.monotonic() - start)
        if not acquired:
            return found[0], "waited"
        try:
            entry = self.find_fresh(key, retry=waited)
            if entry is not None:
                if not waited:
                    self._stats.add("hits")
                return entry, "waited" if waited else "hit"
            if fleet is not None:  # the second level: one download or build per key per fleet
                left = max(0.0, timeout_s - (time.monotonic() - start))
                return fleet.get_or_build(key, preimage, build, left, on_wait if on_wait and not waited else None)
            return self.build(key, preimage, build), "built"
        finally:
            lock.release()

    def wait_published(self, key: str, timeout_s: float) -> Entry:
        """Poll for ``key`` with a backoff from 20 ms to 0.5 s until it is published; see ``KernelCache.wait_for``."""
        lock = KeyLock(self.lock_dir, key)  # only read: its holder record
        start = time.monotonic()
        delay, logged = 0.02, False
        try:
            while True:
                elapsed = time.monotonic() - start
                if not logged and elapsed >= WAIT_LOG_AFTER_S:
                    logged = lock.log_wait()
                if elapsed >= timeout_s:
                    raise LockTimeout(key, lock.read_holder(), timeout_s)
                time.sleep(min(delay, timeout_s - elapsed))
                delay = min(delay * 1.5, 0.5)
                refresh_dir(self.layout.entry_dir(key).parent)
                entry = self.index.find(key)
                if entry is not None:
                    return entry
        finally:
            self._stats.add("lock_wait_s", time.monotonic() - start)

    def build(self, key: str, preimage: dict[str, Any], build: BuildFn) -> Entry:
        """Run ``build`` into a fresh staging dir, seal it and publish it.

        Raises
        ------
        BuildError
            ``build`` raised (chained as ``__cause__``) or wrote nothing usable. The staging dir is gone.

        """
        # Our lock on the key proves no live builder of it; clear what dead ones of this host left.
        prune.sweep_staging(self.layout, self.lock_dir, only_key=key)
        staging = self.layout.new_staging_dir(key)
        self.layout.ensure(self.layout.staging)
        staging.mkdir(mode=self.layout.dir_mode)
        self._stats.add("builds")
        try:
            try:
                build(staging)
            except Exception as exc:
                raise BuildError(key, f"{type(exc).__name__}: {exc}") from exc
            try:
                seal(staging, key, preimage, shared=self.layout.shared)
            except (CacheError, OSError) as exc:
                raise BuildError(key, str(exc)) from exc
            return self.install(key, staging, keep_fallback=True)
        except BaseException:
            remove_tree(staging)
            raise

    def install(self, key: str, src: Path, *, keep_fallback: bool) -> Entry:
        """Rename the sealed entry directory ``src`` to ``<root>/v1/entries/<kk>/<key>``.

        Losing the rename race (EEXIST/ENOTEMPTY: someone published without our lock, e.g. another host
        with its own lock dir) is success: verify the winner and drop ours. If the winner stays invisible
        (NFS, DeepEP #683), serve our own copy from ``src`` rather than fail (as DeepEP PR #684 does);
        it is left for ``prune`` once this process is gone.

        Raises
        ------
        CacheError
            The winner exists but cannot be seen or verified and ``keep_fallback`` is False.

        """
        final = self.layout.entry_dir(key)
        self.layout.ensure(final.parent)
        for _attempt in range(2):
            try:
                src.rename(final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                winner = self.find_fresh(key, retry=True)  # quarantines a corrupt winner: retry then
                if winner is not None:
                    remove_tree(src)
                    return winner
                continue
            fsync_dir(final.parent)
            entry, sig = verify_entry(final, key, allow_shared=self.allow_shared)
            self.index.remember(entry, sig)
            return entry
        if not keep_fallback:
            raise CacheError(f"could not publish cache key {key}: {final} exists but cannot be verified")
        log.warning("cache key %s: published %s is not visible; using our own copy %s", key, final, src)
        return verify_entry(src, key, allow_shared=self.allow_shared)[0]

    def import_staged(self, staged: Mapping[str, Path], timeout_s: float) -> ImportReport:
        """Publish verified, unpacked entries, each under its key's lock; skip keys already available."""
        imported, present = [], []
        for key, src in sorted(staged.items()):
            if self.index.find(key) is not None:
                present.append(key)
                continue
            with KeyLock(self.lock_dir, key) as lock:
                lock.acquire(timeout_s)
                if self.find_fresh(key, retry=False) is not None:
                    present.append(key)
                    continue
                self.install(key, src, keep_fallback=False)
                imported.append(key)
        return ImportReport(imported=tuple(imported), present=tuple(present))


def refresh_dir(path: Path) -> None:
    """List ``path`` to make an NFS client revalidate its cached view of the directory."""
    with contextlib.suppress(OSError):
        os.listdir(path)  # noqa: PTH208 - a cheap readdir is the point, not the entries
