"""The trust check: refuse cache directories and files that other users can write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from jitwarm.cache.errors import CacheError

_HOW_TO_ALLOW = "pass KernelCache(allow_shared=True) or set JITWARM_ALLOW_SHARED=1 to accept it"


def untrusted_reason(st: os.stat_result) -> str | None:
    """Return why another user could change what ``st`` describes, or None when only we (or root) can.

    A directory that is world-writable with the sticky bit (``/tmp`` style) is fine: others can add
    names but not replace ours. A world-writable file is never fine. An owner other than us or root
    can rewrite the object whatever its mode.
    """
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid}) or root"
    if st.st_mode & stat.S_IWOTH:
        if not stat.S_ISDIR(st.st_mode):
            return "it is writable by every user"
        if not st.st_mode & stat.S_ISVTX:
            return "it is writable by every user and has no sticky bit"
    return None


def check_trusted(path: Path, what: str, *, allow_shared: bool, st: os.stat_result | None = None) -> None:
    """Raise CacheError when ``path`` fails :func:`untrusted_reason`, unless ``allow_shared``.

    The cache holds shared libraries that get loaded into the server, so a directory another user can
    write is a code-injection path (see DESIGN.md, "Trust").

    Parameters
    ----------
    path : Path
        What to check; it must exist (or ``st`` must be given).
    what : str
        How to name it in the message, e.g. ``"cache root"`` or ``"cache entry"``.
    allow_shared : bool
        Skip the check.
    st : os.stat_result, optional
        An ``lstat`` already taken.

    Raises
    ------
    CacheError
        Saying which path, why, and how to allow it.

    """
    if allow_shared:
        return
    reason = untrusted_reason(st if st is not None else os.lstat(path))
    if reason is not None:
        raise CacheError(f"refusing {what} {path}: {reason}; {_HOW_TO_ALLOW}")
