"""Put one captured unit where its library looks: wholly there or absent, verified, never over the library's own file.

Two ways, chosen by what is at the destination:

- The unit is a directory of its own (:attr:`~.units.Library.unit_is_dir`) and it is absent (or an empty
  directory, as Triton's manager leaves one): its files are written into a staging directory beside it, made
  durable, and renamed into place in one step, as DeepGEMM and TileLang publish their own.
- Otherwise (the unit's files share a directory with other units, as Inductor's do, or the library made the
  directory already): each file is written to a dot-file beside its destination and hard-linked into place,
  which never replaces an existing file; the library's commit record goes last (Triton's group file, the
  ``.so`` Inductor builds from its ``.cpp``). Until it is there the library sees no unit; a failure part-way
  removes the files this call placed.

Once placed, a library's :attr:`~.units.Library.settle` gives the files what its build tool reads beside
their bytes: a restore writes every file anew (now), and FlashInfer's ninja rebuilds an output newer than the
time it logged for it.

A destination file that exists already is compared with the unit's (as the unit stores it): the same bytes
count as present; different bytes are the library's own compile and are kept (the unit is not restored, and the
caller is told which file differed). Every byte copied is hashed against the entry's manifest on the way.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import JitwarmError
from jitwarm.kernels.backend import LoadError
from jitwarm.kernels.libraries.jit_caches.units import Files, Library

_CHUNK = 1 << 20


class RestoreFailed(JitwarmError):
    """A unit could not be written where its library looks (a full disk, a directory not writable: exit 1)."""


@dataclass(frozen=True)
class Placed:
    """What restoring one unit did: ``placed`` it, found it ``present`` already, or ``kept`` the library's own.

    ``differing``: the file that differed when the library's own was kept.
    """

    outcome: str
    dest: Path
    differing: str | None = None


def place(library: Library, unit: str, files: Files, source: Path, root: Path) -> Placed:
    """Restore ``unit`` (``files`` as stored under ``source``, an entry's directory) into the cache at ``root``.

    Raises
    ------
    LoadError
        A file of the entry does not hash to its recorded digest (the entry is corrupt).
    RestoreFailed
        The destination cannot be written; nothing of the unit is left there by this call.

    """
    unit_dir = root if unit == "." else root / unit
    done = None
    if library.unit_is_dir and _empty_or_absent(unit_dir):
        done = _rename_dir(library, unit, files, source, root, unit_dir)
    if done is None:
        done = _link_files(library, unit, files, source, root, unit_dir)
    if done.outcome == "placed" and library.settle is not None:
        library.settle(root, unit, tuple(files))  # e.g. the times FlashInfer's ninja logged (flashinfer.settle)
    return done


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
    try:
        unit_dir.parent.mkdir(parents=True, exist_ok=True)
        stage = unit_dir.parent / f".jitwarm-{unit_dir.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        stage.mkdir()
    except OSError as exc:
        raise RestoreFailed(f"{library.name}: cannot restore {unit} into {root}: {exc.strerror or exc}") from None
    try:
        for rel in library.commit_last(tuple(files)):
            inner = rel if unit == "." else rel[len(unit) + 1:]
            _write(library, rel, files[rel], source, root, stage / inner)
        _fsync_dirs(stage)
        try:
            stage.rename(unit_dir)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return None  # the library (or another restore) made it first: compare file by file
            raise
        _fsync(unit_dir.parent)
        return Placed("placed", unit_dir)
    except OSError as exc:
        raise RestoreFailed(f"{library.name}: cannot restore {unit} into {root}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _link_files(library: Library, unit: str, files: Files, source: Path, root: Path, unit_dir: Path) -> Placed:
    """Place each file without replacing any, the commit record last; undo this call's files on failure."""
    placed: list[Path] = []
    try:
        for rel in library.commit_last(tuple(files)):
            dest = root / rel
            if os.path.lexists(dest):
                if _stored_digest(library, root, rel) == files[rel]:
                    continue
                _undo(placed)
                return Placed("kept", unit_dir, rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.parent / f".jitwarm-{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            try:
                _write(library, rel, files[rel], source, root, tmp)
                try:
                    os.link(tmp, dest)  # never replaces: a file the library wrote meanwhile stays
                except FileExistsError:
                    if _stored_digest(library, root, rel) != files[rel]:
                        _undo(placed)
                        return Placed("kept", unit_dir, rel)
                    continue
                placed.append(dest)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        _fsync(unit_dir if unit_dir.is_dir() else root)
    except LoadError:
        _undo(placed)
        raise
    except OSError as exc:
        _undo(placed)
        raise RestoreFailed(f"{library.name}: cannot restore {unit} into {root}: {exc.strerror or exc}") from None
    return Placed("placed" if placed else "present", unit_dir)


def _write(library: Library, rel: str, digest: str, source: Path, root: Path, dest: Path) -> None:
    """Copy the entry's ``rel`` to ``dest`` (made durable), hashing it against ``digest``; LoadError if it differs."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    src = source / rel
    executable = src.stat().st_mode & 0o111
    h = hashlib.sha256()
    if library.localize is not None:
        data = src.read_bytes()
        h.update(data)
        _check(library, rel, digest, h)
        payload = library.localize(rel, data, root)
        with open(dest, "xb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
    else:
        with open(src, "rb") as f, open(dest, "xb") as out:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
            _check(library, rel, digest, h)
            out.flush()
            os.fsync(out.fileno())
    dest.chmod(0o755 if executable else 0o644)


def _check(library: Library, rel: str, digest: str, h: Any) -> None:
    if h.hexdigest() != digest:
        raise LoadError(f"{library.name}: the cache entry's {rel} does not match its recorded sha256")


def _stored_digest(library: Library, root: Path, rel: str) -> str | None:
    try:
        return hashlib.sha256(library.stored_bytes(root, rel)).hexdigest()
    except (OSError, ValueError):
        return None  # a directory or an unreadable file where the unit's file goes: not the same


def _undo(placed: list[Path]) -> None:
    for path in reversed(placed):
        with contextlib.suppress(OSError):
            path.unlink()


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dirs(root: Path) -> None:
    for dirpath, _dirs, _files in os.walk(root):
        _fsync(Path(dirpath))
