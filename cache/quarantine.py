"""Moving what failed verification out of the way: a corrupt entry, or a shard path that is no directory.

Both moves are renames into ``<root>/v1/quarantine/`` with a ``.reason`` note beside, and both are made under a
lock, after looking once more, so that a good entry (or shard) another process has just put in place is
never moved: an entry under its key's lock (:func:`move_entry`, whose caller holds it), a shard under the
lock named ``shard-<kk>`` (:func:`quarantine_shard`, try-locked). A move that fails (another user's entry
in a shared root, a read-only volume) is logged and leaves the thing where it is: it is still never used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from jitwarm.cache.errors import CacheError
from jitwarm.cache.files import write_atomic
from jitwarm.cache.layout import RootLayout
from jitwarm.cache.locks import KeyLock

log = logging.getLogger("jitwarm.cache")


def move_aside(layout: RootLayout, name: str, path: Path, reason: str) -> bool:
    """Rename ``path`` to ``quarantine/<name>-<utc>-<pid>-<rand>`` with a ``.reason`` note; False if it could not.

    The caller holds the lock that guards ``path`` (see the module docstring).
    """
    dest = layout.quarantine_dir(name)
    try:
        layout.ensure(layout.quarantine)
        try:
            path.rename(dest)
        except PermissionError:
            # Moving a directory to another parent rewrites its "..": our own unreadable (0000) entry or shard
            # needs its owner's write bit back first. Another user's is left where it is.
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise
            path.chmod(0o700)
            path.rename(dest)
    except FileNotFoundError:
        return False
    except OSError as exc:  # e.g. another user's entry in a shared root, a read-only volume: leave it, still unused
        log.warning("%s could not be quarantined (%s): %s", path, exc.strerror or exc, reason)
        return False
    with contextlib.suppress(OSError):
        write_atomic(dest.with_name(dest.name + ".reason"), reason.encode(), durable=False)
    log.warning("quarantined %s to %s: %s", path, dest, reason)
    return True


def shard_problem(shard: Path) -> str | None:
    """Why ``entries/<kk>`` cannot hold entries (not a directory, a symlink, unreadable), or None when it can."""
    try:
        st = os.lstat(shard)
    except OSError:  # missing, or a directory above it is the problem (not for this shard to answer)
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{shard} is a symlink, not a shard directory"
    if not stat.S_ISDIR(st.st_mode):
        return f"{shard} is not a directory"
    try:
        with os.scandir(shard):
            pass
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{shard} cannot be read: {exc.strerror or exc}"
    if not os.access(shard, os.R_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return f"{shard} cannot be read: Permission denied"
    return None


def quarantine_shard(layout: RootLayout, lock_dir: Path, shard: Path, reason: str, *, shared: bool = False) -> bool:
    """Move a bad shard path of the writable root aside, so every key of that shard can be built again.

    Try-locks ``shard-<kk>`` (a held lock means another process is on it) and checks the shard once more
    under it: only the process that moved the bad one away can have made a new shard since. Never raises.
    """
    lock = KeyLock(lock_dir, f"shard-{shard.name}", shared=shared)
    try:
        if not lock.try_acquire():
            return False
    except CacheError as exc:  # no lock dir (a read-only volume): nothing can be moved there either
        log.warning("not quarantining %s (%s): %s", shard, exc, reason)
        return False
    try:
        return shard_problem(shard) is not None and move_aside(layout, f"shard-{shard.name}", shard, reason)
    finally:
        lock.release()
