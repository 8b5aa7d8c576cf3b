"""EntryIndex: verified lookups over the writable root and read-only layers, with quarantine."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from jitwarm.cache.durable import write_atomic
from jitwarm.cache.entry import Entry, Signature, signature, verify_entry
from jitwarm.cache.errors import CorruptEntry
from jitwarm.cache.layout import RootLayout
from jitwarm.cache.locks import KeyLock
from jitwarm.cache.reports import StatsCounter, VerifyReport
from jitwarm.cache.trust import check_trusted

log = logging.getLogger("jitwarm.cache")

#: Refresh an entry's last-used stamp (its directory mtime) at most this often per cache instance.
TOUCH_INTERVAL_S = 600.0


class EntryIndex:
    """Finds verified entries in a writable root, then in read-only layers.

    Contract: :meth:`find` returns an :class:`Entry` only after it passed :func:`verify_entry` in this
    instance, and only while the stat signature of its files is unchanged since (else it is verified
    again). It returns None for a missing or corrupt entry and raises ``CacheError`` only for an
    untrusted directory. A corrupt entry of the writable root is moved to quarantine, under the key's
    lock so that a good replacement is never moved; a corrupt layer entry is skipped.
    """

    def __init__(self, root: RootLayout, layers: Sequence[RootLayout], lock_dir: Path, *,
                 root_read_only: bool, allow_shared: bool, stats: StatsCounter) -> None:
        self.root = root
        self.layers = tuple(layers)
        self.lock_dir = lock_dir
        self.root_read_only = root_read_only
        self.allow_shared = allow_shared
        self._stats = stats
        self._mutex = threading.Lock()
        self._verified: dict[Path, tuple[Signature, Entry]] = {}
        self._trusted: set[Path] = set()
        self._touched: dict[str, float] = {}

    def search_order(self) -> list[tuple[RootLayout, bool]]:
        """Return ``(layout, read_only)`` of the root, then each layer."""
        return [(self.root, self.root_read_only), *((layer, True) for layer in self.layers)]

    def find(self, key: str, *, locked: bool = False) -> Entry | None:
        """Return the first verified entry of ``key``; ``locked``: the caller holds the key's lock."""
        for layout, read_only in self.search_order():
            entry = self._find_in(layout, key, read_only=read_only, locked=locked)
            if entry is not None:
                self._touch(entry)
                return entry
        return None

    def remember(self, entry: Entry, sig: Signature) -> None:
        """Record an entry this process has just verified (e.g. after publishing it)."""
        with self._mutex:
            self._verified[entry.path] = (sig, entry)

    def forget(self, path: Path) -> None:
        """Drop what is known about the entry directory ``path`` (it was removed)."""
        with self._mutex:
            self._verified.pop(path, None)

    def check_root(self, layout: RootLayout) -> None:
        """Trust-check a root's top directories (those that exist), once per instance each."""
        for path in (layout.root, layout.base, layout.entries):
            if path in self._trusted:
                continue
            try:
                check_trusted(path, "cache root", allow_shared=self.allow_shared)
            except FileNotFoundError:
                return
            self._trusted.add(path)

    def verify(self, keys: Sequence[str] | None) -> VerifyReport:
        """Re-hash every copy of ``keys`` (all entries when None); see :meth:`KernelCache.verify`."""
        ok, corrupt, quarantined, seen = set(), {}, set(), set()
        for layout, read_only in self.search_order():
            if keys is None:
                found = list(layout.iter_entry_dirs())
            else:
                found = [(k, layout.entry_dir(k)) for k in keys if os.path.lexists(layout.entry_dir(k))]
            if found:
                self.check_root(layout)
            for key, path in found:
                seen.add(key)
                try:
                    entry, sig = verify_entry(path, key, allow_shared=self.allow_shared, read_only=read_only)
                except FileNotFoundError:
                    continue
                except CorruptEntry as exc:
                    if not os.path.lexists(path):
                        continue
                    self._stats.add("corrupt")
                    corrupt[key] = "; ".join(filter(None, (corrupt.get(key), str(exc))))
                    if not read_only:
                        self.quarantine(layout, key, str(exc), locked=False)
                        if not os.path.lexists(path):
                            quarantined.add(key)
                    continue
                ok.add(key)
                self.remember(entry, sig)
        missing = tuple(k for k in keys or () if k not in seen)
        return VerifyReport(ok=tuple(sorted(ok)), corrupt=corrupt, missing=missing,
                            quarantined=tuple(sorted(quarantined)))

    def quarantine(self, layout: RootLayout, key: str, reason: str, *, locked: bool) -> None:
        """Move the corrupt entry of ``key`` aside, to ``<root>/v1/quarantine/<key>-<time>-<pid>-<rand>``.

        Without ``locked`` it takes the key's lock without waiting (a held lock means a builder is on it
        and will quarantine it itself) and verifies once more, since another process may have replaced
        the bad entry with a good one meanwhile.
        """
        path = layout.entry_dir(key)
        self.forget(path)
        lock = None
        if not locked:
            lock = KeyLock(self.lock_dir, key)
            if not lock.try_acquire():
                log.warning("corrupt cache entry %s (not quarantined: its lock is held): %s", key, reason)
                return
        try:
            if not locked:
                with contextlib.suppress(CorruptEntry, FileNotFoundError):
                    verify_entry(path, key, allow_shared=self.allow_shared)
                    return
            dest = layout.quarantine_dir(key)
            try:
                layout.ensure(layout.quarantine)
                path.rename(dest)
            except FileNotFoundError:
                return
            except OSError as exc:  # e.g. another user's entry in a shared root: leave it, still a miss
                log.warning("corrupt cache entry %s could not be quarantined (%s): %s", key, exc, reason)
                return
            with contextlib.suppress(OSError):
                write_atomic(dest.with_name(dest.name + ".reason"), reason.encode(), durable=False)
            log.warning("quarantined corrupt cache entry %s to %s: %s", key, dest, reason)
        finally:
            if lock is not None:
                lock.release()

    def _find_in(self, layout: RootLayout, key: str, *, read_only: bool, locked: bool) -> Entry | None:
        """Look in one root: memo with an unchanged signature, else full verification."""
        path = layout.entry_dir(key)
        with self._mutex:
            memo = self._verified.get(path)
        if memo is not None:
            if signature(memo[1]) == memo[0]:
                return memo[1]
            self.forget(path)
        if not os.path.lexists(path):
            return None
        self.check_root(layout)
        check_trusted(path.parent, "cache directory", allow_shared=self.allow_shared)
        try:
            entry, sig = verify_entry(path, key, allow_shared=self.allow_shared, read_only=read_only)
        except FileNotFoundError:
            return None
        except CorruptEntry as exc:
            if not os.path.lexists(path):
                return None  # moved away (pruned, quarantined) while we read it: a plain miss
            self._stats.add("corrupt")
            if read_only:
                log.warning("skipping corrupt cache entry in read-only %s: %s", layout.root, exc)
            else:
                self.quarantine(layout, key, str(exc), locked=locked)
            return None
        self.remember(entry, sig)
        return entry

    def _touch(self, entry: Entry) -> None:
        """Stamp the entry directory's mtime as its last use (works on noatime mounts), rate-limited."""
        if entry.read_only:
            return
        now = time.time()
        with self._mutex:
            if now - self._touched.get(entry.key, 0.0) < TOUCH_INTERVAL_S:
                return
            self._touched[entry.key] = now
        with contextlib.suppress(OSError):
            os.utime(entry.path)
