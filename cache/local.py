"""The local tier: verified lookups over a writable root and read-only layers, and the exactly-once publish.

Read top to bottom, this is the protocol of docs/cache.md: 1. **lookup** (memo while the stat signature is
unchanged, else full verification; a corrupt copy is quarantined in the root, skipped in a layer; discarded
entries are skipped), 2. **lock** the key, looking for the holder's entry while waiting, 3. **look again**
(with an NFS retry after a wait), 4. **build** into staging, 5. **seal**, 6. **rename** into place (losing
the race is success) -- or hand the key to :mod:`jitwarm.cache.fleet` with :class:`LocalSteps` --
7. **release**. Whatever writes an entry directory (build, download, bundle import, quarantine, discard) runs
under the key's lock; lookups take none, except that quarantining a corrupt copy try-locks its key.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from stat import S_ISREG
from typing import Any

from jitwarm.cache.durable import fsync_dir, make_dirs, remove_tree, write_atomic
from jitwarm.cache.entry import Entry, Signature, recheck_entry, seal, unchanged, verify_entry
from jitwarm.cache.errors import BuildError, CacheError, CorruptEntry
from jitwarm.cache.fleet import Fleet, LocalSteps
from jitwarm.cache.keys import keyed
from jitwarm.cache.layout import RootLayout, check_trusted, untrusted_reason
from jitwarm.cache.locks import KeyLock, LockHolder, OnWait, wait_until
from jitwarm.cache.prune import sweep_staging

log = logging.getLogger("jitwarm.cache")

BuildFn = Callable[[Path], None]
#: Refresh an entry's last-used stamp (its directory mtime) at most this often per cache instance.
TOUCH_INTERVAL_S = 600.0
# NFS can hide a just-renamed directory from other clients for a moment (DeepEP #683): look again.
NFS_RETRY_DELAYS_S = (0.02, 0.05, 0.1, 0.2)


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`KernelCache.verify`.

    Attributes
    ----------
    ok : tuple of str
        Keys with at least one copy (root or layer) that verified.
    corrupt : dict of str to str
        Keys with a copy that failed, and why (with its path).
    missing : tuple of str
        Requested keys with no copy anywhere.
    quarantined : tuple of str
        Corrupt keys whose bad copy was moved to ``<root>/v1/quarantine`` (layer copies cannot be).

    """

    ok: tuple[str, ...] = ()
    corrupt: dict[str, str] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    quarantined: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        """True when nothing was corrupt or missing."""
        return not self.corrupt and not self.missing

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return {"ok": list(self.ok), "corrupt": dict(self.corrupt), "missing": list(self.missing),
                "quarantined": list(self.quarantined)}


class LocalCache:
    """One writable root (or a read-only one) plus read-only layers, and the publish protocol into the root.

    Contract: :meth:`lookup` returns an entry only after this instance hashed its files (verifying it, or
    publishing it), only while their stat signature is unchanged since, and never one :meth:`discard`
    rejected; it returns None for a missing, corrupt or rejected entry and raises ``CacheError`` only for
    a directory other users can write. :meth:`get_or_build` runs ``build`` only under the key's lock. The
    callers (:class:`~jitwarm.cache.KernelCache`) check keys and the read-only flag first.
    """

    def __init__(self, root: RootLayout, layers: Sequence[RootLayout], lock_dir: Path, *, read_only: bool,
                 allow_shared: bool, count: Callable[..., None]) -> None:
        self.root = root
        self.layers = tuple(layers)
        self.lock_dir = lock_dir
        self.read_only = read_only
        self.allow_shared = allow_shared
        self._count = count
        self._mutex = threading.Lock()
        self._verified: dict[Path, Entry] = {}
        self._rejected: set[tuple[Path, Signature]] = set()
        self._trusted: set[Path] = set()
        self._touched: dict[str, float] = {}

    def search_order(self) -> list[tuple[RootLayout, bool]]:
        """Return ``(layout, read_only)`` of the root, then each layer."""
        return [(self.root, self.read_only), *((layer, True) for layer in self.layers)]

    # -- 1. lookup -----------------------------------------------------------------------------------

    def lookup(self, key: str, *, locked: bool = False) -> Entry | None:
        """Return the first usable entry of ``key`` in the root, then the layers; ``locked``: we hold its lock."""
        for layout, read_only in self.search_order():
            with self._mutex:
                entry = self._verified.get(layout.entry_dir(key))
            if entry is None or not unchanged(entry):
                entry, _why = self._check(layout, key, read_only=read_only, locked=locked, stamped=True)
            if entry is not None and (entry.path, entry.signature) not in self._rejected:
                self._touch(entry)
                return entry
        return None

    def _check(self, layout: RootLayout, key: str, *, read_only: bool, locked: bool,
               stamped: bool = False) -> tuple[Entry | None, str | None]:
        """Verify one copy: ``(entry, None)``, ``(None, why)`` if corrupt (quarantined or skipped), or a miss.

        With ``stamped``, an entry this host hashed before and whose files are unchanged since (its stamp
        matches) is accepted without reading them again; else (and for ``jitwarm verify``) every file is hashed.
        """
        path = layout.entry_dir(key)
        self.forget(path)
        if not os.path.lexists(path):
            return None, None
        self.check_root(layout)
        check_trusted(path.parent, "cache directory", allow_shared=self.allow_shared)
        if stamped and (entry := self._from_stamp(path, key, read_only)) is not None:
            with self._mutex:
                self._verified[entry.path] = entry
            return entry, None
        try:
            entry = verify_entry(path, key, allow_shared=self.allow_shared, read_only=read_only)
        except FileNotFoundError:
            return None, None
        except CorruptEntry as exc:
            if not os.path.lexists(path):
                return None, None  # moved away (pruned, quarantined) while we read it: a plain miss
            self._count("corrupt")
            if read_only:
                log.warning("skipping corrupt cache entry in read-only %s: %s", layout.root, exc)
            else:
                self._quarantine_corrupt(key, str(exc), locked=locked)
            return None, str(exc)
        self._remember(entry)
        return entry, None

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

    def _remember(self, entry: Entry) -> None:
        """Memoize an entry whose files this instance has just hashed, and stamp it for the next processes."""
        with self._mutex:
            self._verified[entry.path] = entry
        if self.read_only:
            return
        stamp = self.root.stamp_path(entry.path, entry.key)
        with contextlib.suppress(OSError):  # a stamp only saves the next process a hash: best effort
            self.root.ensure(stamp.parent)
            write_atomic(stamp, json.dumps({"path": os.fspath(entry.path), "signature": entry.signature}).encode(),
                         durable=False)

    def _from_stamp(self, path: Path, key: str, read_only: bool) -> Entry | None:
        """The entry at ``path`` when this host's stamp says its files are the ones it hashed (see recheck_entry)."""
        stamp = os.fspath(self.root.stamp_path(path, key))
        try:
            with open(stamp, "rb") as f:
                st = os.fstat(f.fileno())
                if not S_ISREG(st.st_mode) or st.st_size > 1 << 16 or untrusted_reason(st) and not self.allow_shared:
                    return None
                doc = json.loads(f.read())
            signature = tuple(tuple(item) for item in doc["signature"])
            if doc["path"] != os.fspath(path):
                return None
            return recheck_entry(path, key, signature, allow_shared=self.allow_shared, read_only=read_only)
        except (OSError, ValueError, KeyError, TypeError, CorruptEntry):
            return None

    def forget(self, path: Path) -> None:
        """Drop what is known about the entry directory ``path`` (it was removed or replaced)."""
        with self._mutex:
            self._verified.pop(path, None)

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

    # -- quarantine and discard ----------------------------------------------------------------------

    def _quarantine_corrupt(self, key: str, reason: str, *, locked: bool) -> None:
        """Move the root's corrupt copy of ``key`` aside.

        Without ``locked`` it takes the key's lock without waiting (a held lock means a builder is on it
        and will quarantine it itself) and verifies once more, since another process may have replaced
        the bad entry with a good one meanwhile.
        """
        if locked:
            self._move_to_quarantine(key, reason)
            return
        with KeyLock(self.lock_dir, key) as lock:
            if not lock.try_acquire():
                log.warning("corrupt cache entry %s (not quarantined: its lock is held): %s", key, reason)
                return
            with contextlib.suppress(CorruptEntry, FileNotFoundError):
                verify_entry(self.root.entry_dir(key), key, allow_shared=self.allow_shared)
                return
            self._move_to_quarantine(key, reason)

    def _move_to_quarantine(self, key: str, reason: str) -> None:
        """Rename the root's entry of ``key`` to ``quarantine/<key>-<utc>-<pid>-<rand>`` + ``.reason`` (locked)."""
        path, dest = self.root.entry_dir(key), self.root.quarantine_dir(key)
        self.forget(path)
        try:
            self.root.ensure(self.root.quarantine)
            path.rename(dest)
        except FileNotFoundError:
            return
        except OSError as exc:  # e.g. another user's entry in a shared root: leave it, still a miss
            log.warning("cache entry %s could not be quarantined (%s): %s", key, exc, reason)
            return
        with contextlib.suppress(OSError):
            write_atomic(dest.with_name(dest.name + ".reason"), reason.encode(), durable=False)
        log.warning("quarantined cache entry %s to %s: %s", key, dest, reason)

    def discard(self, entry: Entry, reason: str, timeout_s: float) -> None:
        """Reject an entry its caller could not use: quarantine it if it is the root's and unchanged, else skip it.

        Raises ``LockTimeout`` if the key's lock stays held past ``timeout_s`` (it is rejected all the same).
        """
        with self._mutex:
            self._rejected.add((entry.path, entry.signature))
        if entry.read_only or self.read_only or entry.path != self.root.entry_dir(entry.key):
            log.warning("rejected cache entry %s at %s: %s; it cannot be moved, so this cache skips it from now "
                        "on", entry.key, entry.path, reason)
            return
        with KeyLock(self.lock_dir, entry.key) as lock:
            lock.acquire(timeout_s)
            if unchanged(entry):  # still the very entry the caller rejected, not a rebuild of its key
                self._move_to_quarantine(entry.key, reason)

    # -- 2-7. get or build ---------------------------------------------------------------------------

    def get_or_build(self, key: str, description: Mapping[str, Any], build: BuildFn, timeout_s: float,
                     on_wait: OnWait | None, fleet: Fleet | None) -> tuple[Entry, str]:
        """Steps 2-7 after a lock-free miss; returns ``(entry, outcome)`` (see ``KernelCache.get_or_build_ex``)."""
        self.prepare_root()
        waited, found = False, []

        def note_wait(holder: LockHolder | None) -> None:
            nonlocal waited
            waited = True
            self._count("waits")
            if on_wait is not None:
                on_wait(holder)

        def published() -> bool:  # waiters need not queue on the lock once the holder's entry is visible
            found[:] = [e for e in (self.lookup(key),) if e is not None]
            return bool(found)

        lock = KeyLock(self.lock_dir, key)
        start = time.monotonic()
        try:
            acquired = lock.acquire(timeout_s, on_wait=note_wait, give_up=published)      # 2. lock
        finally:
            if waited:
                self._count("lock_wait_s", time.monotonic() - start)
        if not acquired:
            return found[0], "waited"
        try:
            entry = self._look_again(key, retry=waited)                                    # 3. look again
            if entry is not None:
                if not waited:
                    self._count("hits")
                return entry, "waited" if waited else "hit"
            if fleet is None:
                return self._build(key, description, build), "built"                      # 4-6. build
            steps = LocalSteps(new_staging=lambda: self.new_staging(key),
                               publish=lambda staged: self._publish(staged, keep_fallback=True),
                               build=lambda: self._build(key, description, build))
            left = max(0.0, timeout_s - (time.monotonic() - start))
            return fleet.get_or_build(key, steps, left, None if waited else on_wait)      # or the fleet's
        finally:
            lock.release()                                                                 # 7. release

    def prepare_root(self) -> None:
        """Create the root's top directories and the lock dir (nothing exists before the first write); check them."""
        try:
            self.root.ensure(self.root.entries)
            make_dirs(self.lock_dir, self.root.dir_mode)
        except OSError as exc:
            raise CacheError(f"cannot create the cache root {self.root.root}: {exc}; set JITWARM_CACHE_DIR to "
                             "a writable directory, or use KernelCache(read_only=True) for lookups") from exc
        self.check_root(self.root)

    def _look_again(self, key: str, *, retry: bool) -> Entry | None:
        """Look up under the lock; with ``retry``, a few more times to outwait NFS attribute caching."""
        entry = self.lookup(key, locked=True)
        for delay in NFS_RETRY_DELAYS_S if retry and entry is None else ():
            time.sleep(delay)
            _refresh_dir(self.root.entry_dir(key).parent)
            entry = self.lookup(key, locked=True)
            if entry is not None:
                break
        return entry

    def _build(self, key: str, description: Mapping[str, Any], build: BuildFn) -> Entry:
        """Run ``build`` into a fresh staging dir, seal it and publish it (the caller holds the key's lock).

        Raises ``BuildError`` (the staging dir is gone), or ValueError when ``key`` is not the key of
        ``description`` (a caller's precomputed key is checked here, before anything is built).
        """
        actual, preimage = keyed(description)
        if actual != key:
            raise ValueError(f"key {key} is not the key of this description ({actual}); pass cache.key(description)")
        # Our lock on the key proves no live builder of it; clear what dead ones of this host left.
        sweep_staging(self.root, self.lock_dir, only_key=key)
        staging = self.new_staging(key)
        staging.mkdir(mode=self.root.dir_mode)
        self._count("builds")
        try:
            try:
                build(staging)                                                             # 4. build
            except Exception as exc:
                raise BuildError(key, f"{type(exc).__name__}: {exc}") from exc
            try:
                sealed = seal(staging, key, preimage, shared=self.root.shared)             # 5. seal
            except (CacheError, OSError) as exc:
                raise BuildError(key, str(exc)) from exc
            return self._publish(sealed, keep_fallback=True)                               # 6. rename
        except BaseException:
            remove_tree(staging)
            raise

    def new_staging(self, tag: str) -> Path:
        """Return a fresh staging path of the root for ``tag`` (a key or ``BUNDLE_TAG``), its parent created."""
        self.root.ensure(self.root.staging)
        return self.root.new_staging_dir(tag)

    def _publish(self, staged: Entry, *, keep_fallback: bool) -> Entry:
        """Rename a sealed or checked entry from staging to ``entries/<kk>/<key>`` (the caller holds the lock).

        The files were hashed when they were sealed, downloaded or unpacked; a rename keeps their inodes and
        times, so an unchanged signature proves the published entry is what was hashed. Losing the rename
        race (EEXIST/ENOTEMPTY: someone published without our lock, e.g. another host with its own lock
        dir) is success: verify the winner and drop ours. If the winner stays invisible (NFS, DeepEP #683),
        serve our own copy from staging rather than fail (as DeepEP PR #684 does); ``prune`` removes it
        once this process is gone. Without ``keep_fallback`` that case raises ``CacheError``.
        """
        final = self.root.entry_dir(staged.key)
        self.root.ensure(final.parent)
        for _attempt in range(2):
            try:
                staged.path.rename(final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                winner = self._look_again(staged.key, retry=True)  # quarantines a corrupt winner: retry then
                if winner is not None:
                    remove_tree(staged.path)
                    return winner
                continue
            fsync_dir(final.parent)
            entry = replace(staged, path=final)
            if not unchanged(entry):
                entry = verify_entry(final, staged.key, allow_shared=self.allow_shared)
            self._remember(entry)
            return entry
        if not keep_fallback:
            raise CacheError(f"could not publish cache key {staged.key}: {final} exists but cannot be verified")
        log.warning("cache key %s: published %s is not visible; using our own copy %s", staged.key, final,
                    staged.path)
        return staged

    def publish_new(self, staged: Entry, timeout_s: float) -> bool:
        """Publish an unpacked, verified entry (a bundle's) under its key's lock; False if the key is available.

        Raises ``LockTimeout`` (the lock stayed busy past ``timeout_s``) or ``CacheError``.
        """
        if self.lookup(staged.key) is not None:
            return False
        with KeyLock(self.lock_dir, staged.key) as lock:
            lock.acquire(timeout_s)
            if self._look_again(staged.key, retry=False) is not None:
                return False
            self._publish(staged, keep_fallback=False)
            return True

    def wait_for(self, key: str, timeout_s: float) -> Entry:
        """Poll :meth:`lookup` until another process publishes ``key``; never builds. Raises ``LockTimeout``."""
        entry = self.lookup(key)
        if entry is not None:
            self._count("hits")
            return entry
        self._count("misses")
        self._count("waits")
        parent, lock = self.root.entry_dir(key).parent, KeyLock(self.lock_dir, key)  # the lock: its holder record

        def poll() -> Entry | None:
            _refresh_dir(parent)
            return self.lookup(key)

        start = time.monotonic()
        try:
            return wait_until(poll, timeout_s, key=key, holder=lock.read_holder)
        finally:
            self._count("lock_wait_s", time.monotonic() - start)

    # -- verify ------------------------------------------------------------------------------------------

    def verify(self, keys: Sequence[str] | None) -> VerifyReport:
        """Re-hash every copy of ``keys`` (all entries when None); see :meth:`KernelCache.verify`."""
        ok, corrupt, quarantined, seen = set(), {}, set(), set()
        for layout, read_only in self.search_order():
            if keys is None:
                found = list(layout.iter_entry_dirs())
            else:
                found = [(k, layout.entry_dir(k)) for k in keys if os.path.lexists(layout.entry_dir(k))]
            for key, path in found:
                seen.add(key)
                entry, why = self._check(layout, key, read_only=read_only, locked=False)
                if entry is not None:
                    ok.add(key)
                elif why is not None:
                    corrupt[key] = "; ".join(filter(None, (corrupt.get(key), why)))
                    if not read_only and not os.path.lexists(path):
                        quarantined.add(key)
        missing = tuple(k for k in keys or () if k not in seen)
        return VerifyReport(ok=tuple(sorted(ok)), corrupt=corrupt, missing=missing,
                            quarantined=tuple(sorted(quarantined)))


def _refresh_dir(path: Path) -> None:
    """List ``path`` to make an NFS client revalidate its cached view of the directory."""
    with contextlib.suppress(OSError):
        os.listdir(path)  # noqa: PTH208 - a cheap readdir is the point, not the entries
