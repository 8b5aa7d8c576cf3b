"""Files another process may touch: bounded reads that never block, atomic writes, and the trust rule.

Every open goes through :func:`open_regular` (a planted FIFO blocked waiters past their deadline), every JSON
document through :func:`loads` (100,000 nested ``[`` raised ``RecursionError`` out of lookups).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import CacheError, UntrustedPath

HOW_TO_ALLOW = "pass KernelCache(allow_shared=True) or set JITWARM_ALLOW_SHARED=1 to accept it"

#: JSON documents the cache reads nest at most this deep (a manifest holds a description inside a preimage).
MAX_JSON_DEPTH = 72
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """Open ``path`` to read, never blocking or following a link: ``(fd, fstat)``; OSError (``EINVAL``: not a file)."""
    fd = os.open(path, _FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_file_stat(path: str | os.PathLike[str], max_bytes: int) -> tuple[bytes, os.stat_result]:
    """The bytes and ``fstat`` of the file ``path``; OSError as :func:`open_regular`, ``EFBIG`` over ``max_bytes``."""
    fd, st = open_regular(path)
    try:
        if st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", os.fspath(path))
        chunks, left = [], max_bytes + 1
        want = min(left, st.st_size + 1)  # the size as stat'ed, plus one to see a file that grew
        while left > 0 and (chunk := os.read(fd, want)):
            chunks.append(chunk)
            left -= len(chunk)
            want = min(left, 1 << 20)
        if left <= 0:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", os.fspath(path))
        return b"".join(chunks), st
    finally:
        os.close(fd)


def loads(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON that nests at most ``max_depth`` deep; ValueError otherwise (never ``RecursionError``)."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    level, depth = [doc], 0
    while level:  # one nesting level at a time, iteratively: the depth check must not recurse either
        depth += 1
        if depth > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
        inner: list[Any] = []
        for value in level:
            children = value.values() if type(value) is dict else value if type(value) is list else ()
            inner.extend(child for child in children if type(child) is dict or type(child) is list)
        level = inner
    return doc


def read_json(path: str | os.PathLike[str], max_bytes: int) -> Any:
    """:func:`read_file_stat` then :func:`loads`; OSError or ValueError."""
    return loads(read_file_stat(path, max_bytes)[0])


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries to stable storage; best effort (some NFS servers refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def refresh_dir(path: Path) -> None:
    """List ``path`` to make an NFS client revalidate its cached view of the directory (DeepEP #683)."""
    with contextlib.suppress(OSError):
        os.listdir(path)  # noqa: PTH208 - a cheap readdir is the point, not the entries


def fsync_tree(root: Path) -> None:
    """Fsync every regular file and directory under ``root``, children before parents."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(Path(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_atomic(path: Path, data: bytes, *, durable: bool = True, mode: int = 0o644) -> None:
    """Replace ``path`` by ``data`` atomically (fsync'd with ``durable``); OSError, and no temporary file left."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def make_dirs(path: Path, mode: int = 0o755) -> None:
    """Create ``path`` and missing parents, each with ``mode`` less the umask (``os.makedirs``: parents 0777).

    Iterative: a file 1,200 folders deep in a downloaded entry made the recursive form raise ``RecursionError``.
    """
    missing = []
    while not path.is_dir() and path.parent != path:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=mode)


def remove_tree(path: Path) -> bool:
    """Delete a directory tree if it exists (another process may be removing it too); True when it is gone."""
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def directory_size(path: Path) -> int:
    """Sum the sizes of the regular files under ``path`` (0 if it vanished meanwhile)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += Path(dirpath, name).lstat().st_size
    return total


def untrusted_reason(st: os.stat_result) -> str | None:
    """Why another user could change what ``st`` describes; None when only we or root can (``/tmp`` is fine)."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid}) or root"
    if st.st_mode & stat.S_IWOTH:
        if not stat.S_ISDIR(st.st_mode):
            return "it is writable by every user"
        if not st.st_mode & stat.S_ISVTX:
            return "it is writable by every user and has no sticky bit"
    return None


def check_trusted(path: Path | str, what: str, *, allow_shared: bool, st: os.stat_result | None = None) -> None:
    """Unless ``allow_shared``, UntrustedPath if ``path`` itself (``lstat``, or ``st``) is untrusted."""
    if allow_shared:
        return
    reason = untrusted_reason(st if st is not None else os.lstat(path))
    if reason is not None:
        raise UntrustedPath(f"refusing {what} {path}: {reason}", HOW_TO_ALLOW)


def check_trusted_dir(path: Path, what: str, *, allow_shared: bool) -> None:
    """Check a top directory (a root, a layer, a lock dir) by what it resolves to (this user's or root's link).

    Raises ``UntrustedPath``, ``CacheError`` (no directory) or FileNotFoundError (none, or dangling).
    """
    st = os.lstat(path)
    shown = path
    if stat.S_ISLNK(st.st_mode):
        if not allow_shared and st.st_uid not in (os.geteuid(), 0):
            raise UntrustedPath(f"refusing {what} {path}: it is a symlink owned by uid {st.st_uid}, not by this user "
                                f"(uid {os.geteuid()}) or root", HOW_TO_ALLOW)
        st = path.stat()
        shown = f"{path} (a symlink to {os.path.realpath(path)})"
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"refusing {what} {shown}: it is not a directory")
    check_trusted(shown, what, allow_shared=allow_shared, st=st)


#: Symbolic links followed while a path is walked from ``/`` (Linux's own limit, ``MAXSYMLINKS``).
MAX_LINKS = 40


def check_walk(path: Path, what: str, *, allow_shared: bool) -> None:
    """UntrustedPath unless every component of ``path`` that exists, from ``/`` down, is this user's or root's.

    Each folder must pass :func:`untrusted_reason` (``allow_shared`` lifts that) and each symbolic link on the
    way be this user's or root's (always: ``/var/run -> /run`` is root's); a link's target is walked the same
    way from ``/``. A sticky folder such as ``/tmp`` is a passage: only the owner of a name in it can replace the
    name, so what lies in it must itself be this user's or root's. The walk stops at the first missing
    component (the caller creates the rest, see :func:`make_trusted_dirs`). Restoring as root wrote 21 files
    through another user's link to a root-only folder that the library's variable named a parent of.

    Raises ``UntrustedPath`` (exit 2) naming the component and its owner or mode, or a component that is no
    folder, or a loop of links.
    """
    uid = os.geteuid()
    pending = list(reversed(Path(os.path.abspath(path)).parts[1:]))  # noqa: PTH100 - no link resolved here
    current, links = "/", 0
    while pending:
        name = pending.pop()
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)  # noqa: PTH120 - current is resolved: its parent is real
            continue
        step = os.path.join(current, name)  # noqa: PTH118
        try:
            st = os.lstat(step)
        except FileNotFoundError:
            return
        except OSError as exc:  # a folder this user may not search: nothing can be restored through it
            raise UntrustedPath(f"refusing {what} {path}: cannot look at {step}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (uid, 0):
                raise UntrustedPath(f"refusing {what} {path}: {step} is a symlink owned by uid {st.st_uid}, not by "
                                    f"this user (uid {uid}) or root")
            links += 1
            if links > MAX_LINKS:
                raise UntrustedPath(f"refusing {what} {path}: more than {MAX_LINKS} symlinks on the way (a loop)")
            target = os.readlink(step)  # noqa: PTH115 - a str, walked part by part
            if target.startswith("/"):
                current = "/"
            pending.extend(reversed(Path(target).parts[1:] if target.startswith("/") else Path(target).parts))
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UntrustedPath(f"refusing {what} {path}: {step} is not a directory")
        reason = None if allow_shared else untrusted_reason(st)
        if reason is not None:
            raise UntrustedPath(f"refusing {what} {path}: {step} (mode {stat.S_IMODE(st.st_mode):04o}) {reason[3:]}",
                                HOW_TO_ALLOW)
        current = step


def make_trusted_dirs(path: Path, *, allow_shared: bool) -> None:
    """Create the missing folders of ``path`` (whose existing part passed :func:`check_walk`) one by one.

    A folder that appears meanwhile (another user made it in a sticky parent) must be a folder this user or root
    owns, not a link: UntrustedPath otherwise; OSError for a failed ``mkdir``.
    """
    missing = []
    while not os.path.lexists(path) and path.parent != path:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            st = os.lstat(folder)
            reason = ("it is not a folder" if not stat.S_ISDIR(st.st_mode)
                      else None if allow_shared else untrusted_reason(st))
            if reason is not None:
                raise UntrustedPath(f"refusing {folder}: {reason} (made by another process meanwhile)",
                                    HOW_TO_ALLOW if stat.S_ISDIR(st.st_mode) else None) from None
