"""Durable file operations: fsync'd writes, atomic replace, directory creation and removal."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or create in it) to stable storage; best effort."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        # Some filesystems (and some NFS servers) refuse fsync on a directory; the rename is still atomic.
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


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
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a mix.

    The bytes go to a uniquely named temporary file in the same directory, then ``os.replace`` moves it
    over ``path`` (atomic on POSIX, including NFS). With ``durable`` the file and directory are fsync'd.

    Raises
    ------
    OSError
        The directory is missing or not writable; no temporary file is left behind.

    """
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
    """Create ``path`` and missing parents, each with ``mode`` (masked by the umask)."""
    missing = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=mode)


def remove_tree(path: Path) -> bool:
    """Delete a directory tree if it exists; True when it is gone afterwards."""
    # ignore_errors: another process may be removing the same tree (a concurrent prune or sweep).
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
