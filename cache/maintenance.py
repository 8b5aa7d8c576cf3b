"""Upkeep of a root: prune (LRU, age, grace period) and the sweep of dead builders' staging dirs."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jitwarm.cache.files import directory_size, remove_tree
from jitwarm.cache.layout import RootLayout, prune_stamps
from jitwarm.cache.locks import KeyLock, pid_alive, ready_lock_dir, this_host

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
