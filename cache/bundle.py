"""Relocatable bundles: a tar of entries with relative paths, its validating unpacker, and ImportReport."""

from __future__ import annotations

import io
import json
import os
import secrets
import tarfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jitwarm.cache.durable import make_dirs
from jitwarm.cache.entry import MANIFEST, Entry, is_safe_relpath, seal_dirs, verify_entry
from jitwarm.cache.errors import CacheError, CorruptEntry
from jitwarm.cache.keys import FORMAT_VERSION, is_key

#: Optional first member: ``{"format": 1, "keys": [...]}``.
BUNDLE_MANIFEST = "bundle.json"
_READ_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error)


@dataclass(frozen=True)
class ImportReport:
    """Result of :meth:`KernelCache.import_bundle`.

    Attributes
    ----------
    imported : tuple of str
        Keys published into the writable root by this import.
    present : tuple of str
        Keys of the bundle that were already available (root or layer), left as they were.

    """

    imported: tuple[str, ...] = ()
    present: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key of the bundle."""
        return tuple(sorted((*self.imported, *self.present)))

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return asdict(self)


def write_bundle(entries: list[Entry], path: Path) -> Path:
    """Write ``entries`` to a tar at ``path`` (gzip'd for ``.gz``/``.tgz``), atomically.

    Members are ``bundle.json`` then ``entries/<kk>/<key>/<file>`` for every file and ``entry.json``;
    owner and group are zeroed and modes are 0444/0555, so the archive says nothing about this host.
    """
    mode = "w:gz" if path.name.endswith((".gz", ".tgz")) else "w"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with tarfile.open(tmp, mode, format=tarfile.PAX_FORMAT) as tar:
            head = json.dumps({"format": FORMAT_VERSION, "keys": [e.key for e in entries]}).encode()
            _add(tar, BUNDLE_MANIFEST, head, 0o444, 0)
            for entry in entries:
                for rel in sorted((*entry.files, MANIFEST)):
                    src = entry.path / rel
                    with open(src, "rb") as f:
                        data = f.read()
                    mode_bits = 0o555 if src.lstat().st_mode & 0o111 else 0o444
                    name = f"entries/{entry.key[:2]}/{entry.key}/{rel}"
                    _add(tar, name, data, mode_bits, int(entry.created))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def unpack_bundle(path: Path, staging: Path, *, shared: bool = False) -> dict[str, Entry]:
    """Validate every member of the bundle at ``path``, unpack it under ``staging`` and verify each entry.

    Nothing is written until every member has passed: relative normalized names only, no ``..``, no
    symlinks, hard links, devices or FIFOs, no duplicates, only ``bundle.json`` and
    ``entries/<kk>/<key>/...``. Files are written by this code (``tarfile.extract`` is not used), and
    directories are sealed as a build's are (``shared``: the root's ``allow_shared``).

    Returns
    -------
    dict of str to Entry
        Each key and its unpacked entry under ``staging``, fully verified (each file hashed once): it is
        published by a rename, without hashing again.

    Raises
    ------
    CacheError
        Any problem with the archive or an entry; ``staging`` may hold partial files for the caller to
        remove, and nothing has been published.

    """
    dir_mode = 0o777 if shared else 0o755
    try:
        with tarfile.open(path, "r:*") as tar:
            members = tar.getmembers()
            files = _check_members(path, members)
            staging.mkdir(mode=dir_mode)
            listed = None
            for member, rel in files:
                data = _read_member(tar, member)
                if rel == BUNDLE_MANIFEST:
                    listed = _check_bundle_manifest(path, data)
                    continue
                dest = staging / rel
                make_dirs(dest.parent, dir_mode)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                dest.chmod(0o555 if member.mode & 0o111 else 0o444)
    except _READ_ERRORS as exc:
        raise CacheError(f"cannot read bundle {path}: {exc}") from exc
    staged = {}
    for _member, rel in files:
        parts = rel.split("/")
        if parts[0] == "entries":
            staged[parts[2]] = staging / "entries" / parts[1] / parts[2]
    if not staged:
        raise CacheError(f"bundle {path} holds no entries")
    if listed is not None and sorted(listed) != sorted(staged):
        # A tar cut at a member boundary reads as a shorter, valid archive: the key list catches it.
        raise CacheError(f"bundle {path}: {BUNDLE_MANIFEST} lists {len(listed)} entries but the archive "
                         f"holds {len(staged)}; it is incomplete or was altered")
    entries = {}
    for key, entry_dir in sorted(staged.items()):
        seal_dirs(entry_dir, shared)
        try:
            # The unpacked files are ours, written with safe modes; this is their one hash.
            entries[key] = verify_entry(entry_dir, key, allow_shared=True)
        except CorruptEntry as exc:
            raise CacheError(f"bundle {path}: entry {key} does not verify: {exc}") from None
    return entries


def _check_members(path: Path, members: list[tarfile.TarInfo]) -> list[tuple[tarfile.TarInfo, str]]:
    """Return (member, name) of the regular files, or raise CacheError for the first unsafe member."""
    seen, files = set(), []
    for m in members:
        name = m.name
        why = None
        if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
            why = "is an absolute path"
        elif any(p == ".." for p in name.replace("\\", "/").split("/")):
            why = "contains '..'"
        elif m.issym() or m.islnk():
            why = f"is a {'symbolic' if m.issym() else 'hard'} link"
        elif not (m.isreg() or m.isdir()):
            why = "is a device, FIFO or other special file"
        elif not is_safe_relpath(name.rstrip("/") if m.isdir() else name):
            why = "is not a normalized relative path"
        elif name in seen:
            why = "appears twice"
        elif m.isreg() and not _allowed_file(name):
            why = f"is neither {BUNDLE_MANIFEST} nor entries/<kk>/<key>/<file>"
        if why is not None:
            raise CacheError(f"refusing bundle {path}: member {name!r} {why}; nothing was imported")
        seen.add(name)
        if m.isreg():
            files.append((m, name))
    return files


def _allowed_file(name: str) -> bool:
    """Return True for ``bundle.json`` or ``entries/<kk>/<key>/<relative file>``."""
    if name == BUNDLE_MANIFEST:
        return True
    parts = name.split("/")
    return (len(parts) >= 4 and parts[0] == "entries" and is_key(parts[2]) and parts[1] == parts[2][:2])


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """Read one regular member in full."""
    f = tar.extractfile(member)
    if f is None:
        raise CacheError(f"cannot read member {member.name!r}")
    with f:
        return f.read()


def _check_bundle_manifest(path: Path, data: bytes) -> list[str]:
    """Return the keys ``bundle.json`` lists; reject a malformed one or another cache format."""
    try:
        doc = json.loads(data)
        fmt, keys = doc["format"], doc["keys"]
        if not isinstance(keys, list) or not all(is_key(k) for k in keys):
            raise TypeError("keys")
    except (ValueError, KeyError, TypeError):
        raise CacheError(f"bundle {path}: {BUNDLE_MANIFEST} is malformed") from None
    if fmt != FORMAT_VERSION:
        raise CacheError(f"bundle {path} has cache format {fmt!r}; this jitwarm reads {FORMAT_VERSION}")
    return keys


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int, mtime: int) -> None:
    """Add one regular file member with neutral ownership."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))
