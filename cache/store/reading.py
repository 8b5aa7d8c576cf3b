"""Reading one cache (invariants 3 to 5 of :mod:`.protocol`): verify-on-read, quarantine, claims, discard, verify."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from jitwarm.cache import settings
from jitwarm.cache.entry import Entry, Signature, unchanged, verify_entry
from jitwarm.cache.errors import CacheError, CorruptEntry
from jitwarm.cache.files import check_trusted, check_trusted_dir, write_atomic
from jitwarm.cache.keys import check_key
from jitwarm.cache.layout import RootLayout, stamped_entry, write_stamp
from jitwarm.cache.locks import KeyLock, SharedClaim
from jitwarm.cache.signing import check_local, signature_path

log = logging.getLogger("jitwarm.cache")

#: Refresh an entry's last use (its directory mtime) at most this often: well under prune's 600 s grace period.
TOUCH_INTERVAL_S = 60.0
#: A last use found younger than this is not touched again: TP ranks starting together touch an entry once.
RECENT_USE_S = 30.0
TOUCH_WAIT_S = 10.0


@dataclass(frozen=True)
class CacheStats:
    """Counters of one :class:`KernelCache` in this process (docs/cache.md, "Stats")."""

    hits: int = 0
    misses: int = 0
    builds: int = 0
    waits: int = 0
    lock_wait_s: float = 0.0
    corrupt: int = 0
    remote_hits: int = 0
    remote_misses: int = 0
    remote_uploads: int = 0
    lease_waits: int = 0
    remote_rejected: int = 0
    remote_errors: int = 0

    def to_json(self) -> dict[str, Any]:
        """Return the counters as a JSON-able dict."""
        return asdict(self)


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`KernelCache.verify`: ``corrupt`` maps a key (or a bad shard's path) to why."""

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


class CacheReader:
    """The entries of one root and its read-only layers; lookups raise only for an untrusted directory."""

    def __init__(self, layout: RootLayout, layers: Sequence[RootLayout], lock_dir: Path, *, read_only: bool,
                 allow_shared: bool) -> None:
        self.layout, self.root = layout, layout.root
        self.lock_dir = lock_dir
        self.read_only = read_only
        self.allow_shared = allow_shared
        self.search_order = [(layout, read_only), *((layer, True) for layer in layers)]
        self._counts: dict[str, float] = {f.name: 0 for f in fields(CacheStats)}
        self._counts_lock = threading.Lock()
        self._trust_key: tuple[bytes | None] | None = None
        # what this instance knows of the entries: a memo, always checked
        self._mutex = threading.Lock()
        self._verified: dict[Path, Entry] = {}
        self._rejected: set[tuple[Path, Signature]] = set()
        self._trusted: set[Path] = set()
        self._touched: dict[str, float] = {}
        self._last_use: dict[str, float] = {}  # the last uses found on disk, by key

    def trust_key(self) -> bytes | None:
        """The fleet key (``JITWARM_TRUST_KEY`` or ``_FILE``), read on first use; ``SettingError`` for a bad one."""
        if self._trust_key is None:
            self._trust_key = (settings.trust_key(),)
        return self._trust_key[0]

    def _count(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to the counter ``name`` (the one callable every tier counts through)."""
        with self._counts_lock:
            self._counts[name] += amount

    def stats(self) -> CacheStats:
        """Return this instance's counters."""
        with self._counts_lock:
            return CacheStats(**self._counts)  # type: ignore[arg-type]

    def lookup(self, key: str, *, locked: bool = False) -> Entry | None:
        """The verified entry of ``key`` from the root or a layer, or None; ValueError, ``CacheError`` (untrusted)."""
        check_key(key)
        for layout, read_only in self.search_order:
            with self._mutex:
                entry = self._verified.get(layout.entry_dir(key))
            if entry is None or not unchanged(entry):
                entry, _why = self.check_copy(layout, key, read_only=read_only, locked=locked, stamped=True)
            if entry is not None and not self._was_rejected(entry) and self._touch(entry, locked=locked):
                return entry
        return None

    @contextlib.contextmanager
    def claim(self, entry: Entry, *, timeout_s: float = 600.0) -> Iterator[Entry | None]:
        """``with cache.claim(entry) as claimed:``: ``entry`` kept from prune and quarantine while it is read.

        Yields None when its files are no longer the ones hashed. Discard or rebuild the key only after the
        block (they wait for this claim). ``LockTimeout``, ``CacheError`` (no flock here).
        """
        if self._was_rejected(entry):
            yield None
            return
        if entry.path != self.layout.entry_dir(entry.key):  # a layer's: nothing of this cache removes it
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

    def discard(self, entry: Entry, reason: str, *, timeout_s: float = 600.0) -> None:
        """Set aside an entry its caller cannot use: quarantined if unchanged, else (a layer's) skipped; LockTimeout."""
        with self._mutex:
            self._rejected.add((entry.path, entry.signature))
        if entry.read_only or self.read_only or entry.path != self.layout.entry_dir(entry.key):
            log.warning("rejected cache entry %s at %s: %s; it cannot be moved, so this cache skips it from now "
                        "on", entry.key, entry.path, reason)
            return
        with KeyLock(self.lock_dir, entry.key, shared=self.allow_shared) as lock:
            lock.acquire(timeout_s)
            if unchanged(entry):  # still the very entry the caller rejected, not a rebuild of its key
                self.forget(entry.path)
                move_aside(self.layout, entry.key, entry.path, reason)

    def verify(self, keys: Iterable[str] | None = None, *, repair: bool = False,
               stamped: bool = False) -> VerifyReport:
        """Re-hash every copy of ``keys`` (default: every entry and shard); ``repair``: quarantine corrupt ones.

        ``stamped``: a copy whose stamp still matches is not hashed again. ``CacheError`` for an untrusted directory.
        """
        wanted = None if keys is None else sorted({check_key(k) for k in keys})
        ok, corrupt, quarantined = set(), {}, set()
        for layout, read_only in self.search_order:
            found = list(layout.iter_entry_names()) if wanted is None else [(k, layout.entry_dir(k)) for k in wanted]
            for key, path in found:
                if key is None:
                    _entry, why = self.bad_shard(layout, path, read_only=read_only, repair=repair)
                else:
                    entry, why = self.check_copy(layout, key, read_only=read_only, locked=False, repair=repair,
                                                 stamped=stamped)
                    if entry is not None:
                        ok.add(key)
                if why is not None:
                    name = key or str(path)
                    corrupt[name] = "; ".join(filter(None, (corrupt.get(name), why)))
                    if repair and not read_only and not _lexists(path):
                        quarantined.add(name)
        missing = tuple(k for k in wanted or () if k not in ok and k not in corrupt)
        return VerifyReport(ok=tuple(sorted(ok)), corrupt=corrupt, missing=missing,
                            quarantined=tuple(sorted(quarantined)))

    def check_copy(self, layout: RootLayout, key: str, *, read_only: bool, locked: bool, stamped: bool = False,
                   repair: bool = True) -> tuple[Entry | None, str | None]:
        """Verify one copy: ``(entry, None)``, ``(None, why)`` when corrupt, or ``(None, None)`` (a miss).

        ``stamped``: a copy whose stamp matches its files is not hashed; ``repair=False`` writes nothing.
        """
        path = layout.entry_dir(key)
        self.forget(path)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None, None
        except OSError:  # ENOTDIR, EACCES: the shard is a file, or cannot be entered (or a top dir is broken)
            return self.bad_shard(layout, path.parent, read_only=read_only, repair=repair)
        self.check_root(layout)
        parent = os.path.dirname(path)  # noqa: PTH120 - a str, not one more Path, on the hook's hot path
        shard = os.lstat(parent)
        if not stat.S_ISDIR(shard.st_mode):  # a symlinked shard: the lstat above went through it
            return self.bad_shard(layout, path.parent, read_only=read_only, repair=repair)
        check_trusted(parent, "cache directory", allow_shared=self.allow_shared, st=shard)
        entry = stamped_entry(self.layout, path, key, allow_shared=self.allow_shared, read_only=read_only,
                              st=st) if stamped else None
        hashed = entry is None
        if hashed:
            try:
                entry = verify_entry(path, key, allow_shared=self.allow_shared, read_only=read_only)
            except (CorruptEntry, FileNotFoundError) as exc:
                if not os.path.lexists(path):
                    return None, None  # moved away (pruned, quarantined) while we read it: a plain miss
                why = str(exc) if isinstance(exc, CorruptEntry) else f"{exc.filename}: vanished from the entry"
                self._count("corrupt")
                quarantine(layout, self.lock_dir, key, path, why, read_only=read_only, repair=repair,
                           locked=locked, shared=self.allow_shared)
                return None, why
        if layout is not self.layout and self.allow_shared and (fleet_key := self.trust_key()) is not None:
            # a shared layer's entry under a fleet key: UntrustedEntry (exit 4) unless its signature verifies
            check_local(fleet_key, entry, signature_path(layout.base, key),
                        f"entry {key} of shared layer {layout.root}")
        self._remember(entry, stamp=hashed and repair, last_use=None if hashed else st.st_mtime)
        return entry, None

    def bad_shard(self, layout: RootLayout, shard: Path, *, read_only: bool,
                  repair: bool) -> tuple[Entry | None, str | None]:
        """``(None, why)`` for a shard path that is no usable directory (moved aside in the root), else a miss."""
        self.check_root(layout)  # an untrusted top directory raises here, before any shard is blamed
        why = shard_problem(shard)
        if why is not None:  # None also when it is gone meanwhile, or the problem is above it
            self._count("corrupt")
            quarantine(layout, self.lock_dir, f"shard-{shard.name}", shard, why, read_only=read_only,
                       repair=repair, shared=self.allow_shared)
        return None, why

    def _was_rejected(self, entry: Entry) -> bool:
        """Whether :meth:`discard` rejected this very entry (its path and signature)."""
        if not self._rejected:  # nearly always: no lock, no hash of the signature
            return False
        with self._mutex:
            return (entry.path, entry.signature) in self._rejected

    def check_root(self, layout: RootLayout) -> None:
        """Trust-check a root's top directories that exist, by what they resolve to, once per instance."""
        for path in (layout.root, layout.base, layout.entries):
            if path not in self._trusted:
                try:
                    check_trusted_dir(path, "cache root", allow_shared=self.allow_shared)
                except (FileNotFoundError, NotADirectoryError):
                    return
                self._trusted.add(path)

    def _remember(self, entry: Entry, *, stamp: bool = True, last_use: float | None = None) -> None:
        """Memoize a verified entry (``last_use``: its directory's mtime) and stamp it for the next processes."""
        with self._mutex:
            self._verified[entry.path] = entry
            if last_use is not None:
                self._last_use[entry.key] = last_use
        if stamp and not self.read_only:
            write_stamp(self.layout, entry)

    def forget(self, path: Path) -> None:
        """Drop what is known about the entry directory ``path`` (removed or replaced)."""
        with self._mutex:
            self._verified.pop(path, None)

    def _touch(self, entry: Entry, *, locked: bool = False) -> bool:
        """Set the entry directory's mtime as its last use under a claim (invariant 4), rate-limited; False if gone."""
        if entry.read_only:
            return True
        now = time.time()
        with self._mutex:
            if (now - self._touched.get(entry.key, 0.0) < TOUCH_INTERVAL_S
                    or now - self._last_use.get(entry.key, 0.0) < RECENT_USE_S):
                return True
            self._touched[entry.key] = now
        claim = SharedClaim(self.lock_dir, entry.key, create=not self.read_only, shared=self.allow_shared)
        with contextlib.suppress(CacheError):  # no usable lock (a read-only volume, no flock): touch unlocked
            if not locked:
                claim.acquire(TOUCH_WAIT_S)
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


def move_aside(layout: RootLayout, name: str, path: Path, reason: str) -> bool:
    """Rename ``path`` (we hold its lock) into quarantine with a ``.reason`` note; False (logged) if it cannot."""
    dest = layout.quarantine_dir(name)
    try:
        layout.ensure(layout.quarantine)
        try:
            path.rename(dest)
        except PermissionError:
            # Moving a directory rewrites its "..": our own unreadable (0000) one needs its write bit back.
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise
            path.chmod(0o700)
            path.rename(dest)
    except FileNotFoundError:
        return False
    except OSError as exc:  # another user's entry, a read-only volume: left, never used
        log.warning("%s could not be quarantined (%s): %s", path, exc.strerror or exc, reason)
        return False
    with contextlib.suppress(OSError):
        write_atomic(dest.with_name(dest.name + ".reason"), reason.encode(), durable=False)
    log.warning("quarantined %s to %s: %s", path, dest, reason)
    return True


def quarantine(layout: RootLayout, lock_dir: Path, name: str, path: Path, reason: str, *, read_only: bool,
               repair: bool, shared: bool, locked: bool = False) -> None:
    """Move a writable root's corrupt copy ``path`` (of key ``name``, or ``shard-<kk>``) aside, else log it.

    Unless ``locked``, its lock is only tried and the copy checked once more under it. Never raises, but for
    an untrusted entry.
    """
    if read_only or not repair:
        log.warning("corrupt cache copy %s%s: %s", path, f" in read-only {layout.root}" if read_only
                    else " (reported, not moved)", reason)
        return
    lock = KeyLock(lock_dir, name, shared=shared)
    try:
        if not locked and not lock.try_acquire():
            log.warning("%s (not quarantined: its lock is held): %s", path, reason)
            return
    except CacheError as exc:  # no lock dir (a read-only volume)
        log.warning("%s (not quarantined: %s): %s", path, exc.reason, reason)
        return
    with lock:
        if locked or _still_bad(path, name, shared):
            move_aside(layout, name, path, reason)


def _still_bad(path: Path, name: str, shared: bool) -> bool:
    """Whether the copy at ``path`` (a shard, or the entry of key ``name``) is still corrupt."""
    if name.startswith("shard-"):
        return shard_problem(path) is not None
    try:
        verify_entry(path, name, allow_shared=shared)
    except (CorruptEntry, OSError):
        return True
    return False


def shard_problem(shard: Path) -> str | None:
    """Why ``entries/<kk>`` cannot hold entries, or None (also when missing, or a directory above is the problem)."""
    try:
        st = os.lstat(shard)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{shard} is a symlink, not a shard directory"
    if not stat.S_ISDIR(st.st_mode):
        return f"{shard} is not a directory"
    try:
        os.scandir(shard).close()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{shard} cannot be read: {exc.strerror or exc}"
    if not os.access(shard, os.R_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return f"{shard} cannot be read: Permission denied"
    return None


def _lexists(path: Path) -> bool:
    """Whether something is at ``path``; True also when a shard in the way is not a directory."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        return exc.errno != errno.ENOTDIR or os.path.lexists(path.parent)
    return True
