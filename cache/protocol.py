"""The cache protocol: lookup, get-or-build, publish, verify-on-read, quarantine, claims, discard.

The question the cache answers: "give me the files a build of this description produces", built at most
once per host (once per fleet with a remote tier), and never anything half-written, corrupt, or planted by
another user. It knows nothing of kernels: a description is plain JSON, a build a callable that writes files.

Keys. ``key = sha256(canonical JSON of {"format": 1, "description": ...})`` (:mod:`jitwarm.cache.keys`). The
description names everything the bytes depend on; nothing else reaches the key.

Layout (:class:`~jitwarm.cache.layout.RootLayout`)::

    <root>/v1/entries/<kk>/<key>/   the artifact files and entry.json (size and sha256 of each), written last
    <root>/v1/staging/<host>-<pid>-<key>-<rand>/   a build in flight; staging/ exists only while one is
    <root>/v1/locks/<key>.lock      flock: exclusive to write the entry dir, shared to read it (a claim)
    <root>/v1/verified/<kk>/        stamps: what this host hashed each entry as (a hint, never the truth)
    <root>/v1/quarantine/           corrupt or rejected copies, with a .reason note

Read-only layers (``JITWARM_CACHE_PATH``) have the same layout and are searched after the root.

Invariants.
1. An entry directory appears by one ``rename`` from staging, after every file was hashed into its
   ``entry.json``: a reader sees all of it or none of it.
2. Whatever writes an entry directory (build, download, import, quarantine, discard, prune) holds the key's
   exclusive lock; a build runs only under it, so at most once per key per lock dir.
3. An entry is returned only after this process hashed its files, or while their stat signature (inode,
   size, mtime, ctime of every file, and the listing) still equals what this host hashed (its stamp).
4. A reader holds a shared claim while it reads; prune and quarantine only try-lock, so they keep a claimed
   entry. Prune also keeps an entry used within its grace period (a lookup touches an entry under a claim).
5. A corrupt copy is a miss: moved to quarantine in the root (under its lock, after looking once more),
   skipped in a layer. Nothing here raises for corrupt content; an untrusted directory raises.
6. Every wait has a deadline (``LockTimeout``); every file read is bounded and never blocks.

Known gaps. Exactly-once holds per lock dir: two hosts with their own lock dirs on one shared root may both
build a key (the second rename loses and is dropped). NFS can hide a fresh rename for a moment: we look
again, then serve our own staged copy. Inside its own claim a thread must not build or discard that key
(flock SH and EX conflict within a process: it waits until its deadline). The stat signature trusts that
an attacker who can rewrite a file and restore its ctime is already root.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from jitwarm.cache.entry import Entry, Signature, seal, unchanged, verify_entry
from jitwarm.cache.errors import BuildError, CacheError, CacheWriteError, CorruptEntry, RootNotWritable
from jitwarm.cache.files import check_trusted, check_trusted_dir, fsync_dir, remove_tree
from jitwarm.cache.keys import keyed
from jitwarm.cache.layout import RootLayout
from jitwarm.cache.locks import (
    KeyLock,
    LockHolder,
    OnWait,
    SharedClaim,
    ready_lock_dir,
    wait_until,
)
from jitwarm.cache.maintenance import move_aside, quarantine_shard, shard_problem, sweep_staging
from jitwarm.cache.remote.fleet import Fleet, LocalSteps
from jitwarm.cache.stamps import stamped_entry, write_stamp

log = logging.getLogger("jitwarm.cache")

BuildFn = Callable[[Path], None]
#: Refresh an entry's last use (its directory mtime) at most this often per cache instance: well under prune's
#: grace period (``JITWARM_PRUNE_GRACE_S``, 600 s), so an entry a lookup returned is not pruned for minutes.
TOUCH_INTERVAL_S = 60.0
#: An entry whose last use a fresh instance finds younger than this is not touched again: TP ranks that start
#: together touch each entry once, not once each.
RECENT_USE_S = 30.0
#: How long a touch waits for a prune that holds the key's lock (it then finds the entry gone, or kept).
TOUCH_WAIT_S = 10.0
# NFS can hide a just-renamed directory from other clients for a moment (DeepEP #683): look again.
NFS_RETRY_DELAYS_S = (0.02, 0.05, 0.1, 0.2)


class LocalCache:
    """One writable root (or a read-only one) plus read-only layers: the protocol above, top to bottom.

    :meth:`lookup` raises ``CacheError`` only for a directory other users can write; quarantine, stamps and
    touches are best effort and never raise. :class:`~jitwarm.cache.KernelCache` checks keys and the
    read-only flag before calling in.
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
        self._last_use: dict[str, float] = {}  # the last-use stamps found on disk, by key

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
                entry, _why = self.check_copy(layout, key, read_only=read_only, locked=locked, stamped=True)
            if entry is not None and not self._was_rejected(entry) and self._touch(entry, locked=locked):
                return entry
        return None

    def check_copy(self, layout: RootLayout, key: str, *, read_only: bool, locked: bool, stamped: bool = False,
                   repair: bool = True) -> tuple[Entry | None, str | None]:
        """Verify one copy: ``(entry, None)``, ``(None, why)`` when corrupt (quarantined or skipped), or a miss.

        ``stamped``: accept a copy whose stamp matches its files without hashing them; ``repair=False``
        (``verify`` that only looks) writes nothing.
        """
        path = layout.entry_dir(key)
        self.forget(path)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None, None
        except OSError:  # ENOTDIR, EACCES: the shard is a file, or cannot be entered (or a top dir is broken)
            self.check_root(layout)
            return self.bad_shard(layout, path.parent, read_only=read_only, repair=repair)
        if not self._shard_is_trusted_dir(layout, path):  # a symlinked shard: the lstat above went through it
            return self.bad_shard(layout, path.parent, read_only=read_only, repair=repair)
        if stamped and (entry := stamped_entry(self.root, path, key, allow_shared=self.allow_shared,
                                                read_only=read_only, st=st)) is not None:
            self._known(entry, st)
            return entry, None
        try:
            entry = verify_entry(path, key, allow_shared=self.allow_shared, read_only=read_only)
        except (CorruptEntry, FileNotFoundError) as exc:
            if not os.path.lexists(path):
                return None, None  # moved away (pruned, quarantined) while we read it: a plain miss
            why = str(exc) if isinstance(exc, CorruptEntry) else f"{exc.filename}: vanished from the entry"
            self._count("corrupt")
            if read_only or not repair:
                log.warning("corrupt cache entry %s%s: %s", key, " in read-only " + str(layout.root)
                            if read_only else " (reported, not moved)", why)
            else:
                self._quarantine_corrupt(key, why, locked=locked)
            return None, why
        self._remember(entry, stamp=repair)
        return entry, None

    def bad_shard(self, layout: RootLayout, shard: Path, *, read_only: bool,
                  repair: bool) -> tuple[Entry | None, str | None]:
        """A shard path that is no usable directory: every key in it is corrupt until it is moved aside."""
        why = shard_problem(shard)
        if why is None:
            return None, None  # gone meanwhile, or the problem is above it (v1 or entries): a miss
        self._count("corrupt")
        if read_only or not repair:
            log.warning("corrupt cache shard%s: %s", f" in read-only {layout.root}" if read_only else "", why)
        else:
            quarantine_shard(layout, self.lock_dir, shard, why, shared=self.allow_shared)
        return None, why

    def _shard_is_trusted_dir(self, layout: RootLayout, path: Path) -> bool:
        """Trust-check the root's top dirs and the shard of ``path``; False when the shard is no directory."""
        self.check_root(layout)
        parent = os.path.dirname(path)  # noqa: PTH120 - a str, not one more Path, on the hook's hot path
        shard = os.lstat(parent)
        if not stat.S_ISDIR(shard.st_mode):
            return False
        check_trusted(parent, "cache directory", allow_shared=self.allow_shared, st=shard)
        return True

    def _was_rejected(self, entry: Entry) -> bool:
        """Whether :meth:`discard` rejected this very entry (its path and signature)."""
        if not self._rejected:  # nearly always: no lock, no hash of the signature
            return False
        with self._mutex:
            return (entry.path, entry.signature) in self._rejected

    def _known(self, entry: Entry, st: os.stat_result) -> None:
        """Memoize an entry accepted by its stamp; ``st``: its directory, whose mtime is its last use."""
        with self._mutex:
            self._verified[entry.path] = entry
            self._last_use[entry.key] = st.st_mtime

    def check_root(self, layout: RootLayout) -> None:
        """Trust-check a root's top directories that exist, by what they resolve to, once per instance."""
        if layout.entries in self._trusted:  # the last of the three: all of them passed
            return
        for path in (layout.root, layout.base, layout.entries):
            if path in self._trusted:
                continue
            try:
                check_trusted_dir(path, "cache root", allow_shared=self.allow_shared)
            except (FileNotFoundError, NotADirectoryError):
                return
            self._trusted.add(path)

    def _remember(self, entry: Entry, *, stamp: bool = True) -> None:
        """Memoize an entry whose files this instance has just hashed, and stamp it for the next processes."""
        with self._mutex:
            self._verified[entry.path] = entry
        if stamp and not self.read_only:
            write_stamp(self.root, entry)

    def forget(self, path: Path) -> None:
        """Drop what is known about the entry directory ``path`` (it was removed or replaced)."""
        with self._mutex:
            self._verified.pop(path, None)

    def _touch(self, entry: Entry, *, locked: bool = False) -> bool:
        """Stamp the entry directory's mtime as its last use (works on noatime mounts), rate-limited.

        The touch runs under the key's shared claim, so it and a prune's check-and-remove (under the
        exclusive lock) cannot interleave: either the prune sees this use and keeps the entry (its grace
        period), or it removed the entry first and this returns False (the lookup calls it a miss). With
        ``locked`` we hold the key exclusively already (a claim would wait for ourselves).
        """
        if entry.read_only:
            return True
        now = time.time()
        with self._mutex:
            if (now - self._touched.get(entry.key, 0.0) < TOUCH_INTERVAL_S
                    or now - self._last_use.get(entry.key, 0.0) < RECENT_USE_S):
                return True
            self._touched[entry.key] = now
        claim = SharedClaim(self.lock_dir, entry.key, create=not self.read_only, shared=self.allow_shared)
        try:
            if not locked:
                claim.acquire(TOUCH_WAIT_S)
        except CacheError:  # no usable lock here (a read-only volume, no flock): touch unlocked, best effort
            pass
        try:
            os.utime(entry.path)
        except FileNotFoundError:
            self.forget(entry.path)
            return False
        except OSError:
            pass
        finally:
            claim.release()
        return True

    # -- quarantine and discard ----------------------------------------------------------------------

    def _quarantine_corrupt(self, key: str, reason: str, *, locked: bool) -> None:
        """Move the root's corrupt copy of ``key`` aside; never raises.

        Unless ``locked`` (we hold the key), try-lock it: a held lock is a builder (it quarantines the copy
        itself) or a reader's claim; then verify once more, since another process may have replaced it.
        """
        if locked:
            self._move_to_quarantine(key, reason)
            return
        lock = KeyLock(self.lock_dir, key, shared=self.allow_shared)
        try:
            if not lock.try_acquire():
                log.warning("corrupt cache entry %s (not quarantined: its lock is held): %s", key, reason)
                return
        except CacheError as exc:
            log.warning("corrupt cache entry %s (not quarantined: %s): %s", key, exc.reason, reason)
            return
        with lock:
            with contextlib.suppress(CorruptEntry, OSError):
                verify_entry(self.root.entry_dir(key), key, allow_shared=self.allow_shared)
                return
            self._move_to_quarantine(key, reason)

    def _move_to_quarantine(self, key: str, reason: str) -> None:
        """Rename the root's entry of ``key`` into quarantine with a ``.reason`` note (we hold its lock)."""
        path = self.root.entry_dir(key)
        self.forget(path)
        move_aside(self.root, key, path, reason)

    def discard(self, entry: Entry, reason: str, timeout_s: float) -> None:
        """Reject an entry its caller could not use: quarantine the root's if unchanged, else skip it from now on."""
        with self._mutex:
            self._rejected.add((entry.path, entry.signature))
        if entry.read_only or self.read_only or entry.path != self.root.entry_dir(entry.key):
            log.warning("rejected cache entry %s at %s: %s; it cannot be moved, so this cache skips it from now "
                        "on", entry.key, entry.path, reason)
            return
        with KeyLock(self.lock_dir, entry.key, shared=self.allow_shared) as lock:
            lock.acquire(timeout_s)
            if unchanged(entry):  # still the very entry the caller rejected, not a rebuild of its key
                self._move_to_quarantine(entry.key, reason)

    @contextlib.contextmanager
    def claim(self, entry: Entry, timeout_s: float) -> Iterator[Entry | None]:
        """Hold a shared lock on ``entry``'s key while the caller reads it; see :meth:`KernelCache.claim`."""
        if self._was_rejected(entry):
            yield None
            return
        if entry.path != self.root.entry_dir(entry.key):  # a layer's: nothing of this cache removes it
            yield entry if unchanged(entry) else None
            return
        claim = SharedClaim(self.lock_dir, entry.key, create=not self.read_only, shared=self.allow_shared)
        claim.acquire(timeout_s)
        try:
            if unchanged(entry):  # still there, the very files that were hashed: nothing can remove them now
                yield entry
            else:
                claim.release()  # before yielding: the caller may get or build the key again in the block
                yield None
        finally:
            claim.release()

    # -- 2-7. get or build ---------------------------------------------------------------------------

    def get_or_build(self, key: str, description: Mapping[str, Any], build: BuildFn, timeout_s: float,
                     on_wait: OnWait | None, fleet: Fleet | None) -> tuple[Entry, str]:
        """Steps 2-7 after a lock-free miss: lock, look again, build (or the fleet's), publish, release.

        Returns ``(entry, outcome)``; a waiter stops waiting as soon as the holder's entry is visible.
        """
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

        lock = KeyLock(self.lock_dir, key, shared=self.allow_shared)
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
            self.root.drop_staging()  # the staged dir was published or removed: no empty staging/ is left
            lock.release()                                                                 # 7. release

    def prepare_root(self) -> None:
        """Create and trust-check the root's top directories and the lock dir (nothing exists before a write)."""
        try:
            self.root.ensure(self.root.entries)
            ready_lock_dir(self.lock_dir, shared=self.allow_shared)
        except OSError as exc:
            raise RootNotWritable.of("create the cache root", exc, exc.filename or self.root.root,
                                     "set JITWARM_CACHE_DIR to a writable directory, or use "
                                     "KernelCache(read_only=True) for lookups") from exc
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
        """Build into a fresh staging dir, seal and publish it (we hold the key's lock).

        ValueError when ``key`` is not ``description``'s (a caller's precomputed key is checked here, before
        anything is built); ``BuildError`` otherwise, with no staging dir left.
        """
        actual, preimage = keyed(description)
        if actual != key:
            raise ValueError(f"key {key} is not the key of this description ({actual}); pass cache.key(description)")
        # Our lock on the key proves no live builder of it; clear what dead ones of this host left.
        sweep_staging(self.root, self.lock_dir, only_key=key, shared=self.allow_shared)
        staging = self.new_staging(key)
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
            self.root.drop_staging(staging)
            raise

    def new_staging(self, tag: str) -> Path:
        """Create a fresh, empty staging directory of the root for ``tag`` (a key or ``BUNDLE_TAG``)."""
        try:
            return self.root.make_staging_dir(tag)
        except OSError as exc:
            raise CacheWriteError.of("create the staging directory", exc, self.root.staging) from exc

    def _publish(self, staged: Entry, *, keep_fallback: bool) -> Entry:
        """Rename a sealed, downloaded or unpacked entry into place (we hold the lock); return the published entry.

        A rename keeps inodes and times, so an unchanged signature proves the published entry is what was
        hashed. Losing the race (EEXIST/ENOTEMPTY: another host with its own lock dir) is success: verify the
        winner and drop ours. A winner that stays invisible (NFS, DeepEP #683) means serving our own staged
        copy (as DeepEP PR #684 does; prune removes it once we are gone), or ``CacheError`` without
        ``keep_fallback``.
        """
        final = self.root.entry_dir(staged.key)
        for _attempt in range(2):
            try:
                self.root.ensure(final.parent)
                staged.path.rename(final)
            except OSError as exc:
                # EACCES/EPERM over an existing entry: a corrupt one that could not be quarantined (another
                # user's in a shared root) sits there; like a lost race, look again, then serve our own copy.
                lost = exc.errno in (errno.EEXIST, errno.ENOTEMPTY) or (
                    exc.errno in (errno.EACCES, errno.EPERM) and os.path.lexists(final))
                if not lost:
                    raise CacheWriteError.of("publish the cache entry", exc, final) from exc
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
        """Publish a verified bundle entry under its lock; False if the key is available already. LockTimeout."""
        if self.lookup(staged.key) is not None:
            return False
        with KeyLock(self.lock_dir, staged.key, shared=self.allow_shared) as lock:
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
        parent = self.root.entry_dir(key).parent
        lock = KeyLock(self.lock_dir, key, shared=self.allow_shared)  # for its holder record

        def poll() -> Entry | None:
            _refresh_dir(parent)
            return self.lookup(key)

        start = time.monotonic()
        try:
            return wait_until(poll, timeout_s, key=key, holder=lock.read_holder)
        finally:
            self._count("lock_wait_s", time.monotonic() - start)



def _refresh_dir(path: Path) -> None:
    """List ``path`` to make an NFS client revalidate its cached view of the directory."""
    with contextlib.suppress(OSError):
        os.listdir(path)  # noqa: PTH208 - a cheap readdir is the point, not the entries
