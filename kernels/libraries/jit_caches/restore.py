"""Put one captured unit where its library looks: wholly there or absent, verified, never over the library's own file.

A unit that is a directory of its own and absent there is staged beside it and renamed into place; otherwise each
file is hard-linked into place (never replacing one) with the commit record last, and a failure removes what
this call placed. A file already there with other bytes, written by this user or root, is the library's own
compile and is kept; one another user wrote (or every user may write) is replaced atomically, never kept. Every
byte is hashed against the entry's manifest on the way. The destination is walked from ``/`` first
(:func:`check_destination`).

Temporaries are ``.jitwarm-<name>~<host>~<pid>~<random>[.tmp]``: the next restore into that directory removes
those of its host whose process is gone; another host's are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from jitwarm.cache import settings
from jitwarm.cache.entry import is_private
from jitwarm.cache.errors import JitwarmError, UntrustedPath
from jitwarm.cache.files import check_walk, fsync_dir, make_trusted_dirs, untrusted_reason
from jitwarm.cache.locks import left_by_dead_process, this_host
from jitwarm.kernels.backend import LoadError
from jitwarm.kernels.libraries.jit_caches.units import Files, Library, unit_folders

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Placed:
    """What restoring one unit did: ``placed`` it, found it ``present``, or ``kept`` the library's own ``differing``."""

    outcome: str
    dest: Path
    differing: str | None = None


def place(library: Library, unit: str, files: Files, source: Path, root: Path) -> Placed:
    """Restore ``unit`` (``files`` as stored under ``source``, an entry's directory) into the cache at ``root``.

    Raises
    ------
    LoadError
        A file of the entry does not hash to its recorded digest (the entry is corrupt).
    UntrustedPath
        :func:`check_destination` refused the destination (exit 2; nothing written).
    JitwarmError
        The destination cannot be written (a full disk, a directory not writable: exit 1); nothing of the unit
        is left there by this call.

    """
    unit_dir = root if unit == "." else root / unit
    check_destination(root, files)
    try:
        done = _rename_dir(library, unit, files, source, root, unit_dir) if (
            library.unit_is_dir and _empty_or_absent(unit_dir)) else None
        if done is None:
            done = _link_files(library, files, source, root, unit_dir)
    except OSError as exc:
        raise JitwarmError(f"{library.name}: cannot restore {unit} into {root}: {exc.strerror or exc}") from None
    if done.outcome == "placed" and library.settle is not None:
        library.settle(root, unit, tuple(files))
    return done


def check_destination(root: Path, files: Files) -> None:
    """UntrustedPath unless restoring ``files`` under ``root`` writes only through this user's or root's folders.

    Every component from ``/`` to ``root`` is walked (:func:`~jitwarm.cache.files.check_walk`: another user's
    link or folder, or a folder anyone can write, above the library's cache let root's files be written into a
    root-only folder). Below ``root``: no link, no folder of another user or writable by others
    (``JITWARM_ALLOW_SHARED=1`` accepts those folders, never a link), and nothing but a regular file where a file
    goes (a FIFO would hang the restore). A regular file another user wrote is no reason to refuse:
    it is replaced (:func:`_link_files`).
    """
    shared = settings.allow_shared()
    check_walk(root, "to restore into", allow_shared=shared)
    for path, is_file in [(root / f, False) for f in unit_folders(files)] + [(root / rel, True) for rel in files]:
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        hint = None  # only a setting that changes the outcome: JITWARM_ALLOW_SHARED accepts a folder, nothing else
        if stat.S_ISLNK(st.st_mode):
            reason = "it is a link jitwarm did not place"
        elif is_file:
            reason = None if stat.S_ISREG(st.st_mode) else "it is not a regular file"
        elif not stat.S_ISDIR(st.st_mode):
            reason = "it is not a folder"
        else:
            reason = None if shared else untrusted_reason(st)
            hint = "set JITWARM_ALLOW_SHARED=1 for a cache folder others may write"
        if reason is not None:
            raise UntrustedPath(f"refusing to restore into {path}: {reason}", hint)


def _empty_or_absent(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False


def _rename_dir(library: Library, unit: str, files: Files, source: Path, root: Path, unit_dir: Path
                ) -> Placed | None:
    """Stage the whole directory beside ``unit_dir`` and rename it there; None when the library made it meanwhile."""
    make_trusted_dirs(unit_dir.parent, allow_shared=settings.allow_shared())
    sweep(unit_dir.parent)
    stage = unit_dir.parent / _temporary(unit_dir.name)
    stage.mkdir()
    try:
        for rel in library.commit_last(files):
            _write(library, rel, files[rel], source, root, stage / (rel if unit == "." else rel[len(unit) + 1:]))
        for dirpath, _dirs, _files in os.walk(stage):
            fsync_dir(Path(dirpath))
        try:
            stage.rename(unit_dir)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return None  # the library (or another restore) made it first: compare file by file
            raise
        fsync_dir(unit_dir.parent)
        return Placed("placed", unit_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _link_files(library: Library, files: Files, source: Path, root: Path, unit_dir: Path) -> Placed:
    """Place each file without replacing any, the commit record last; undo this call's files on failure."""
    placed: list[Path] = []
    try:
        for rel in library.commit_last(files):
            dest = root / rel
            if not os.path.lexists(dest) and _link_new(library, rel, files[rel], source, root, dest):
                placed.append(dest)
            elif _planted(dest):
                _replace(library, rel, files[rel], source, root, dest)
                placed.append(dest)
            elif _stored_digest(library, root, rel) != files[rel]:
                _undo(placed)
                return Placed("kept", unit_dir, rel)
        fsync_dir(unit_dir if unit_dir.is_dir() else root)
    except (LoadError, OSError, UntrustedPath):
        _undo(placed)
        raise
    return Placed("placed" if placed else "present", unit_dir)


def _link_new(library: Library, rel: str, digest: str, source: Path, root: Path, dest: Path) -> bool:
    """Write ``rel`` beside ``dest`` and hard-link it there; False when a file appeared there meanwhile."""
    make_trusted_dirs(dest.parent, allow_shared=settings.allow_shared())
    sweep(dest.parent)
    tmp = dest.parent / (_temporary(dest.name) + ".tmp")
    try:
        _write(library, rel, digest, source, root, tmp)
        os.link(tmp, dest)  # never replaces: a file the library wrote meanwhile stays
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _planted(dest: Path) -> bool:
    """Whether the file at ``dest`` is another user's, or one every user may write: never the library's own."""
    try:
        return untrusted_reason(dest.lstat()) is not None
    except FileNotFoundError:
        return False


def _replace(library: Library, rel: str, digest: str, source: Path, root: Path, dest: Path) -> None:
    """Write ``rel`` beside ``dest`` and rename it over the planted file there; UntrustedPath if this user cannot.

    In a sticky folder only the name's owner (or root) may replace it: a user who is neither refuses the restore.
    """
    tmp = dest.parent / (_temporary(dest.name) + ".tmp")
    try:
        _write(library, rel, digest, source, root, tmp)
        try:
            tmp.replace(dest)  # atomic: a reader sees the planted file or ours, never a mix
        except PermissionError as exc:
            owner = dest.lstat().st_uid
            raise UntrustedPath(f"refusing to restore into {dest}: a file of uid {owner} is there, which this user "
                                f"cannot replace ({exc.strerror})") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


_PREFIX = ".jitwarm-"


def _temporary(name: str) -> str:
    """A temporary's name beside ``name``: this host's and this process's."""
    return f"{_PREFIX}{name}~{this_host()}~{os.getpid()}~{uuid.uuid4().hex[:8]}"  # a host name may hold dots


def sweep(folder: Path) -> list[str]:
    """Remove the temporaries a killed restore on this host left in ``folder`` (once a process); return their names."""
    if folder in _swept:
        return []
    _swept.add(folder)
    removed = []
    try:
        with os.scandir(folder) as it:
            names = [e.name for e in it if e.name.startswith(_PREFIX)]
    except OSError:
        return []
    for name in names:
        parts = name.removesuffix(".tmp").rsplit("~", 3)
        if len(parts) != 4 or not left_by_dead_process(parts[1], parts[2]):
            continue
        path = folder / name
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(name)
    return removed


_swept: set[Path] = set()


def _write(library: Library, rel: str, digest: str, source: Path, root: Path, dest: Path) -> None:
    """Copy the entry's ``rel`` to ``dest`` (made durable), hashing it against ``digest``; LoadError if it differs."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    src = source / rel
    h = hashlib.sha256()
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(src, "rb") as f, os.fdopen(fd, "wb") as out:
        if library.localize is not None:  # the whole file, checked before localize rewrites its paths
            data = f.read()
            if hashlib.sha256(data).hexdigest() != digest:
                raise LoadError(f"{library.name}: the cache entry's {rel} does not match its recorded sha256")
            try:
                out.write(library.localize(rel, data, root))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:  # the recorded bytes, not its format
                raise LoadError(f"{library.name}: the cache entry's {rel} is not a file {library.name} wrote: "
                                f"{type(exc).__name__}: {exc}") from None
            h = hashlib.sha256(data)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if h.hexdigest() != digest:
        raise LoadError(f"{library.name}: the cache entry's {rel} does not match its recorded sha256")
    # The library's modes: 0644 (0755 to run), owner-only for a file the entry keeps private.
    mode = src.stat().st_mode
    dest.chmod((0o755 if mode & 0o111 else 0o644) & (0o700 if is_private(mode) else 0o777))


def _stored_digest(library: Library, root: Path, rel: str) -> str | None:
    try:
        return hashlib.sha256(library.stored_bytes(root, rel)).hexdigest()
    except (OSError, ValueError):
        return None  # a directory or an unreadable file where the unit's file goes: not the same


def _undo(placed: list[Path]) -> None:
    for path in reversed(placed):
        with contextlib.suppress(OSError):
            path.unlink()
