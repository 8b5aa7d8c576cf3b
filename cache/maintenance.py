"""Upkeep of a root: prune, the sweep of dead builders' staging dirs, quarantine, and verify."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jitwarm.cache.entry import verify_entry
from jitwarm.cache.errors import CacheError, CorruptEntry
from jitwarm.cache.files import directory_size, remove_tree, write_atomic
from jitwarm.cache.layout import RootLayout
from jitwarm.cache.locks import KeyLock, pid_alive, ready_lock_dir, this_host
from jitwarm.cache.stamps import prune_stamps

if TYPE_CHECKING:
    from jitwarm.cache.store import CacheReader

log = logging.getLogger("jitwarm.cache")


@dataclass(frozen=True)
class PruneReport:
    """Result of :meth:`KernelCache.prune`: ``removed`` keys (least recently used first), and those kept."""

    removed: tuple[str, ...] = ()
    freed_bytes: int = 0
    skipped_locked: tuple[str, ...] = ()
    skipped_recent: tuple[str, ...] = ()
    staging_removed: tuple[str, ...] = ()
    quarantine_removed: tuple[str, ...] = ()
    remaining_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return asdict(self)


def sweep_staging(layout: RootLayout, lock_dir: Path, *, only_key: str | None = None, shared: bool = False
                  ) -> list[str]:
    """Remove staging dirs of dead processes of this host whose key is not locked (``only_key``: we hold it)."""
    removed = []
    for name, path in layout.iter_staging():
        if name is None or name.host != this_host() or (only_key and name.key != only_key) or pid_alive(name.pid):
            continue
        lock = KeyLock(lock_dir, name.key, shared=shared) if name.key is not None and only_key is None else None
        if lock is not None and not lock.try_acquire():
            continue
        with lock or contextlib.nullcontext():
            if remove_tree(path):
                removed.append(path.name)
                log.info("removed staging dir %s of dead process %d", path, name.pid)
    layout.drop_staging()
    return removed


def prune_root(layout: RootLayout, lock_dir: Path, *, max_bytes: int | None, older_than_s: float | None,
               grace_s: float = 0.0, shared: bool = False) -> PruneReport:
    """Remove entries of one writable root, least recently used first (:meth:`KernelCache.prune`); ValueError."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, not {max_bytes}")
    if os.path.lexists(lock_dir):
        ready_lock_dir(lock_dir, shared=shared)  # refuse an untrusted lock dir first
    staging_removed = sweep_staging(layout, lock_dir, shared=shared)
    now = time.time()
    candidates = []
    for key, path in layout.iter_entry_dirs():
        with contextlib.suppress(FileNotFoundError):
            candidates.append((os.lstat(path).st_mtime, key, path, directory_size(path)))
    total = before = sum(size for *_rest, size in candidates)
    done: dict[str, list[str]] = {"removed": [], "locked": [], "recent": []}
    for mtime, key, path, size in sorted(candidates):
        if (older_than_s is None or now - mtime <= older_than_s) and (max_bytes is None or total <= max_bytes):
            continue  # neither too old nor over the size
        outcome = "recent" if now - mtime < grace_s else _remove_entry(layout, lock_dir, key, path, grace_s, shared)
        done[outcome].append(key)
        total -= size if outcome == "removed" else 0
    quarantine_removed = _prune_quarantine(layout, now - older_than_s) if older_than_s is not None else []
    prune_stamps(layout)
    return PruneReport(removed=tuple(done["removed"]), freed_bytes=before - total,
                       skipped_locked=tuple(done["locked"]), skipped_recent=tuple(done["recent"]),
                       staging_removed=tuple(staging_removed), quarantine_removed=tuple(quarantine_removed),
                       remaining_bytes=total)


def _remove_entry(layout: RootLayout, lock_dir: Path, key: str, path: Path, grace_s: float, shared: bool) -> str:
    """Move one entry out under its lock (its last use read again) and delete it; return the outcome."""
    trash = None
    with KeyLock(lock_dir, key, shared=shared) as lock:
        if not lock.try_acquire():
            log.info("prune: keeping %s, its lock is held", key)
            return "locked"
        try:
            if time.time() - os.lstat(path).st_mtime < grace_s:
                return "recent"
            trash = layout.make_staging_dir(key)
            path.replace(trash)  # over the empty dir made for it: a reader sees all of the entry or none
        except FileNotFoundError:
            pass  # removed meanwhile
        except OSError as exc:  # e.g. another user's entry in a shared root
            log.warning("prune: cannot remove %s: %s", path, exc)
            layout.drop_staging(trash)
            return "locked"
    layout.drop_staging(trash)
    return "removed"


def _prune_quarantine(layout: RootLayout, cutoff: float) -> list[str]:
    """Delete quarantined copies (and their .reason notes) last modified before ``cutoff``."""
    removed = []
    try:
        items = sorted(os.scandir(layout.quarantine), key=lambda e: e.name)
    except FileNotFoundError:
        return removed
    for item in items:
        with contextlib.suppress(OSError):
            if item.stat(follow_symlinks=False).st_mtime >= cutoff:
                continue
            if item.is_dir(follow_symlinks=False):
                remove_tree(Path(item.path))
            else:
                Path(item.path).unlink()
            removed.append(item.name)
    return removed


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


def verify_copies(local: CacheReader, keys: Sequence[str] | None, *, repair: bool,
                  stamped: bool = False) -> VerifyReport:
    """Hash every copy of ``keys`` in the root and each layer (every entry and shard when None)."""
    ok, corrupt, quarantined = set(), {}, set()
    for layout, read_only in local.search_order:
        found = list(layout.iter_entry_names()) if keys is None else [(k, layout.entry_dir(k)) for k in keys]
        for key, path in found:
            if key is None:
                _entry, why = local.bad_shard(layout, path, read_only=read_only, repair=repair)
            else:
                entry, why = local.check_copy(layout, key, read_only=read_only, locked=False, repair=repair,
                                              stamped=stamped)
                if entry is not None:
                    ok.add(key)
            if why is not None:
                name = key or str(path)
                corrupt[name] = "; ".join(filter(None, (corrupt.get(name), why)))
                if repair and not read_only and not _lexists(path):
                    quarantined.add(name)
    missing = tuple(k for k in keys or () if k not in ok and k not in corrupt)
    return VerifyReport(ok=tuple(sorted(ok)), corrupt=corrupt, missing=missing, quarantined=tuple(sorted(quarantined)))


def _lexists(path: Path) -> bool:
    """Whether something is at ``path``; True also when a shard in the way is not a directory."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        return exc.errno != errno.ENOTDIR or os.path.lexists(path.parent)
    return True
