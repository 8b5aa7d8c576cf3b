"""The cache protocol: lookup, get-or-build, publish, verify-on-read, quarantine, claims, discard.

It answers "give me the files a build of this description produces": built at most once per host (per
fleet with a remote tier), never half-written, corrupt, or planted by another user. A description is plain
JSON, a build a callable that writes files; the key is ``sha256(canonical JSON of {"format": 1,
"description": ...})`` (:mod:`jitwarm.cache.keys`). Layout (:class:`~jitwarm.cache.layout.RootLayout`;
read-only layers, ``JITWARM_CACHE_PATH``, have the same and are searched after the root)::

    <root>/v1/entries/<kk>/<key>/  the artifact files and entry.json (size and sha256 of each), written last
    <root>/v1/staging/<host>-<pid>-<key>-<rand>/  a build in flight; staging/ exists only while one is
    <root>/v1/locks/<key>.lock     flock: exclusive to write the entry dir, shared to read it (a claim)
    <root>/v1/verified/<kk>/       stamps: what this host hashed each entry as (a hint, never the truth)
    <root>/v1/quarantine/          corrupt or rejected copies, with a .reason note

Invariants.
1. An entry directory appears by one ``rename`` from staging, after every file was hashed into its
   ``entry.json``: a reader sees all of it or none of it.
2. Whatever writes an entry directory (build, download, import, quarantine, discard, prune) holds the key's
   exclusive lock, so a build runs at most once per key per lock dir.
3. An entry is returned only after this process hashed its files, or while their stat signature (inode,
   size, mtime, ctime of every file, and the listing) equals what this host hashed (its stamp).
4. A reader holds a shared claim; prune and quarantine only try-lock, so they keep a claimed entry, and
   prune keeps one used within its grace period (a lookup touches it under a claim).
5. A corrupt copy is a miss: quarantined in the root (under its lock, after a second look), skipped in a
   layer. Corrupt content never raises; an untrusted directory does.
6. Every wait has a deadline (``LockTimeout``); every file read is bounded and never blocks.

Known gaps. Exactly-once holds per lock dir: two hosts with their own lock dirs on one shared root may both
build a key (the second rename loses). NFS can hide a fresh rename for a moment: we look again, then serve
our staged copy. A thread must not build or discard a key inside its own claim of it (flock SH and EX
conflict within a process: it waits out its deadline). The stat signature trusts that whoever can rewrite
a file and restore its ctime is already root.

Reads are :class:`~.reading.CacheReader`'s; get-or-build is :class:`LocalCache`'s, below.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from jitwarm.cache.entry import Entry, seal, unchanged, verify_entry
from jitwarm.cache.errors import BuildError, CacheError, CacheWriteError, RootNotWritable
from jitwarm.cache.files import fsync_dir, refresh_dir, remove_tree
from jitwarm.cache.keys import check_key, key_of, key_preimage, keyed
from jitwarm.cache.locks import KeyLock, LockHolder, OnWait, ready_lock_dir, wait_until
from jitwarm.cache.maintenance import sweep_staging
from jitwarm.cache.remote.fleet import LocalSteps
from jitwarm.cache.store.reading import CacheReader

if TYPE_CHECKING:
    from jitwarm.cache.remote import Fleet

log = logging.getLogger("jitwarm.cache")

BuildFn = Callable[[Path], None]
#: A reservation's steps: yields the staging dir, returns ``(entry, outcome)``.
Steps = Generator[Path, None, tuple[Entry, str]]
# NFS can hide a just-renamed directory from other clients for a moment (DeepEP #683): look again.
NFS_RETRY_DELAYS_S = (0.02, 0.05, 0.1, 0.2)

Outcome = Literal["hit", "built", "waited", "downloaded"]


class CacheResult(NamedTuple):
    """The entry, and how this call got it: ``"built"`` ran ``build``, ``"waited"`` for another's build."""

    entry: Entry
    outcome: Outcome


class LocalCache(CacheReader):
    """The protocol above on one root and its layers; ``read_only``: a miss in ``get_or_build`` raises."""

    _fleet: Fleet | None = None  # the remote tier (KernelCache), whose lease a build here holds

    def key(self, description: Mapping[str, Any]) -> str:
        """The key of ``description`` (sha256 of its canonical JSON preimage); TypeError if not plain JSON."""
        return key_of(description)

    def key_preimage(self, description: Mapping[str, Any]) -> dict[str, Any]:
        """Return the exact object hashed into the key (kept in ``entry.json`` to explain misses); TypeError."""
        return key_preimage(description)

    def get_or_build(self, description: Mapping[str, Any], build: BuildFn, timeout_s: float = 600.0,
                     on_wait: OnWait | None = None, *, key: str | None = None) -> Entry:
        """Return the entry of ``description``, running ``build(staging_dir)`` here if no process has.

        ``build`` writes regular files (no links, no ``entry.json``). ``timeout_s`` bounds the wait for another
        holder, not our build; ``on_wait(holder)`` is called once when we wait; ``key``: precomputed.

        Raises ``LockTimeout`` (another holder kept the key past ``timeout_s``), ``BuildError`` (``build`` raised
        or wrote nothing usable: nothing is published), ``CacheError`` (a miss in a read-only cache, an
        untrusted directory, ``CacheWriteError``, a required remote's ``RemoteUnavailable``), TypeError or
        ValueError (not plain JSON; a wrong ``key``).
        """
        return self.get_or_build_ex(description, build, timeout_s, on_wait, key=key).entry

    def get_or_build_ex(self, description: Mapping[str, Any], build: BuildFn, timeout_s: float = 600.0,
                        on_wait: OnWait | None = None, *, key: str | None = None, missed: bool = False
                        ) -> CacheResult:
        """:meth:`get_or_build` returning ``CacheResult``; ``missed``: the caller just looked ``key`` up in vain."""
        reservation = self.reserve(description, timeout_s, on_wait, key=key, missed=missed)
        if reservation.staging is not None:
            try:
                build(reservation.staging)
            except BaseException as exc:
                reservation.fail(exc)
            reservation.publish()
        return CacheResult(*reservation.result)

    def reserve(self, description: Mapping[str, Any], timeout_s: float = 600.0, on_wait: OnWait | None = None, *,
                key: str | None = None, missed: bool = False) -> Reservation:
        """The entry of ``description`` (``result``), else its build reserved to the caller (:class:`Reservation`).

        Raises as :meth:`get_or_build` does before a build.
        """
        key = key_of(description) if key is None else check_key(key)
        entry = None if missed else self.lookup(key)                          # 1. lock-free lookup
        if entry is not None:
            self._count("hits")
            return Reservation(None, (entry, "hit"))
        if self.read_only:
            raise CacheError(f"cache miss for key {key} in a read-only cache ({self.root})", "build it with a "
                             "writable KernelCache, or import a bundle (KernelCache.import_bundle)")
        self._count("misses")
        return Reservation(self._reserving(key, description, timeout_s, on_wait))

    def wait_for(self, key: str, timeout_s: float) -> Entry:
        """Wait until another process publishes ``key`` and return it; never builds. ``LockTimeout``."""
        key = check_key(key)
        entry = self.lookup(key)
        if entry is not None:
            self._count("hits")
            return entry
        self._count("misses")
        self._count("waits")
        parent = self.layout.entry_dir(key).parent
        lock = KeyLock(self.lock_dir, key, shared=self.allow_shared)  # for its holder record

        def poll() -> Entry | None:
            refresh_dir(parent)
            return self.lookup(key)

        start = time.monotonic()
        try:
            return wait_until(poll, timeout_s, key=key, holder=lock.read_holder)
        finally:
            self._count("lock_wait_s", time.monotonic() - start)

    def _reserving(self, key: str, description: Mapping[str, Any], timeout_s: float, on_wait: OnWait | None
                   ) -> Steps:
        """Steps 2-7 after a lock-free miss: return ``(entry, outcome)``, or yield a staging dir under the lock.

        Sent None, it publishes what was built; thrown the build's exception, ``BuildError``; closed, nothing.
        """
        self._prepare_root()
        waited, found = False, []

        def note_wait(holder: LockHolder | None) -> None:
            nonlocal waited
            waited = True
            self._count("waits")
            if on_wait is not None:
                on_wait(holder)

        def published() -> bool:  # a waiter stops once the holder's entry shows
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
            if self._fleet is None:
                return (yield from self._build(key, description)), "built"                 # 4-6. build
            steps = LocalSteps(new_staging=lambda: self.new_staging(key),
                               publish=lambda staged: self._publish(staged, keep_fallback=True),
                               build=lambda: self._build(key, description))
            left = max(0.0, timeout_s - (time.monotonic() - start))
            return (yield from self._fleet.get_or_build(key, steps, left, None if waited else on_wait))  # or fleet's
        finally:
            self.layout.drop_staging()  # no empty staging/ is left
            lock.release()                                                                 # 7. release

    def _prepare_root(self) -> None:
        """Create and trust-check the root's top directories and the lock dir."""
        try:
            self.layout.ensure(self.layout.entries)
            ready_lock_dir(self.lock_dir, shared=self.allow_shared)
        except OSError as exc:
            hint = "set JITWARM_CACHE_DIR to a writable directory, or use KernelCache(read_only=True) for lookups"
            raise RootNotWritable.of("create the cache root", exc, exc.filename or self.layout.root, hint) from exc
        self.check_root(self.layout)

    def _look_again(self, key: str, *, retry: bool) -> Entry | None:
        """Look up under the lock; with ``retry``, a few more times (NFS attribute caching)."""
        entry = self.lookup(key, locked=True)
        for delay in NFS_RETRY_DELAYS_S if retry and entry is None else ():
            time.sleep(delay)
            refresh_dir(self.layout.entry_dir(key).parent)
            entry = self.lookup(key, locked=True)
            if entry is not None:
                break
        return entry

    def _build(self, key: str, description: Mapping[str, Any]) -> Generator[Path, None, Entry]:
        """Yield a staging dir to build into, then seal and publish it; ValueError (wrong key), ``BuildError``."""
        actual, preimage = keyed(description)
        if actual != key:
            raise ValueError(f"key {key} is not the key of this description ({actual}); pass cache.key(description)")
        # Our lock on the key proves no live builder of it; clear what dead ones of this host left.
        sweep_staging(self.layout, self.lock_dir, only_key=key, shared=self.allow_shared)
        staging = self.new_staging(key)
        self._count("builds")
        try:
            try:
                yield staging                                                              # 4. build
            except Exception as exc:
                raise BuildError(key, f"{type(exc).__name__}: {exc}") from exc
            try:
                sealed = seal(staging, key, preimage, shared=self.layout.shared)             # 5. seal
            except (CacheError, OSError) as exc:
                raise BuildError(key, str(exc)) from exc
            return self._publish(sealed, keep_fallback=True)                               # 6. rename
        except BaseException:
            self.layout.drop_staging(staging)
            raise

    def new_staging(self, tag: str) -> Path:
        """Create a fresh, empty staging directory for ``tag`` (a key or ``BUNDLE_TAG``); CacheWriteError."""
        try:
            return self.layout.make_staging_dir(tag)
        except OSError as exc:
            raise CacheWriteError.of("create the staging directory", exc, self.layout.staging) from exc

    def _publish(self, staged: Entry, *, keep_fallback: bool) -> Entry:
        """Rename a staged entry into place (we hold the lock); return what is published.

        A lost race is success; a winner that stays invisible (NFS, DeepEP #683) means serving our staged copy
        (DeepEP PR #684), or ``CacheError`` without ``keep_fallback``.
        """
        final = self.layout.entry_dir(staged.key)
        for _attempt in range(2):
            try:
                self.layout.ensure(final.parent)
                staged.path.rename(final)
            except OSError as exc:
                # EACCES/EPERM over an existing entry: another user's corrupt one sits there; a lost race too.
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
            if not unchanged(entry):  # a rename keeps inodes and times
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
        # An entry there already is found without the lock: a reader's claim would hold the import up.
        there = any(os.path.lexists(layout.entry_dir(staged.key)) for layout, _ in self.search_order)
        if there and self.lookup(staged.key) is not None:
            return False
        with KeyLock(self.lock_dir, staged.key, shared=self.allow_shared) as lock:
            lock.acquire(timeout_s)
            if self.lookup(staged.key, locked=True) is not None:
                return False
            self._publish(staged, keep_fallback=False)
            return True


class Reservation:
    """One key got (``result``) or reserved: then the key's lock (and fleet lease) is held for ``staging``.

    :meth:`publish`, :meth:`fail` or :meth:`abandon` ends it and releases the lock, as being collected does.
    Triton's compile is one that ``get_group`` starts and ``put_group`` ends (kernels/libraries/triton/cache.py).
    """

    def __init__(self, steps: Steps | None, result: tuple[Entry, str] | None = None) -> None:
        self._steps = steps
        self.result = result
        self.staging: Path | None = None
        if steps is not None:
            try:
                self.staging = next(steps)
            except StopIteration as done:
                self.result, self._steps = done.value, None

    def publish(self) -> tuple[Entry, str]:
        """Seal and publish what ``staging`` holds; ``(entry, outcome)``. ``BuildError``, ``CacheError``."""
        steps, self._steps, self.staging = self._ongoing(), None, None
        try:
            steps.send(None)
        except StopIteration as done:
            self.result = done.value
            return done.value
        steps.close()
        raise RuntimeError("a reservation asked for a second build")

    def fail(self, exc: BaseException) -> None:
        """The build raised ``exc``: nothing is published; raises ``BuildError`` from it, or a ``BaseException``."""
        steps, self._steps, self.staging = self._ongoing(), None, None
        steps.throw(exc)
        raise RuntimeError("a failed build was published")  # the steps always raise what was thrown in

    def abandon(self) -> None:
        """Drop the reservation, publishing nothing (idempotent)."""
        steps, self._steps, self.staging = self._steps, None, None
        if steps is not None:
            steps.close()

    def _ongoing(self) -> Steps:
        if self._steps is None:
            raise RuntimeError("this reservation has ended")
        return self._steps
