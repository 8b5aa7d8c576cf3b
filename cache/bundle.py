"""Relocatable bundles: a tar of entries laid out as a cache root, and its validating, streaming unpacker.

``bundle.json`` first, then ``v1/entries/<kk>/<key>/<file>`` (``entry.json`` last of each) and, exported
with a fleet key, ``v1/signatures/<kk>/<key>.json`` (:mod:`jitwarm.cache.signing`), so ``tar xf bundle.tar
-C /opt/layer`` makes a working layer; bundles of the older layout (no ``v1/``) still import. Sizes are
capped from the headers and members streamed in chunks (a 28 MB ``.tar.gz`` holding one 6 GiB member
ended in ``MemoryError``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jitwarm.cache.entry import MANIFEST, MAX_MANIFEST_BYTES, Entry, is_safe_relpath, seal_dirs, verify_entry
from jitwarm.cache.errors import CacheError, CacheWriteError, CorruptEntry
from jitwarm.cache.files import loads, make_dirs, open_regular, read_file_stat
from jitwarm.cache.keys import FORMAT_VERSION, is_key
from jitwarm.cache.layout import VERSION_DIR
from jitwarm.cache.signing import MAX_SIGNATURE_BYTES, SIGNATURES_DIR, check_local, signature_file, signature_path

#: Optional first member: ``{"format": 1, "keys": [...]}``.
BUNDLE_MANIFEST = "bundle.json"
#: A bundle with more members than this is refused (each costs memory while the headers are checked).
MAX_MEMBERS = 1_000_000
_READ_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error)
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ImportReport:
    """Result of :meth:`KernelCache.import_bundle`: keys ``imported``, and those ``present`` already."""

    imported: tuple[str, ...] = ()
    present: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key of the bundle."""
        return tuple(sorted((*self.imported, *self.present)))

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return asdict(self)


def write_bundle(entries: list[Entry], path: Path, *, trust_key: bytes | None = None) -> Path:
    """Write ``entries`` to a tar at ``path`` (gzip'd for ``.gz``/``.tgz``), atomically, owners zeroed.

    ``trust_key``: each entry's signature goes in too (:func:`write_members`). Raises ``CacheWriteError``
    when ``path`` is no regular file (a device, a FIFO) or cannot be written (no partial file is left),
    ``CacheError`` when an entry file cannot be read.
    """
    if path.is_dir():
        raise CacheWriteError("write the bundle", str(path), "it is a directory")
    if path.exists() and not path.is_file():
        # The rename below replaces what is there: as root, `export ... /dev/null` replaced the device node.
        raise CacheWriteError("write the bundle", str(path), "it is not a regular file (a device, FIFO or socket)")
    mode = "w:gz" if is_gzip_name(path.name) else "w"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with tarfile.open(tmp, mode, format=tarfile.PAX_FORMAT) as tar:
            write_members(tar, entries, trust_key)
        tmp.replace(path)
    except OSError as exc:  # every read error of an entry file is a CacheError (_Source): this is the bundle's
        _unlink(tmp)
        raise CacheWriteError.of("write the bundle", exc, path) from exc
    except BaseException:
        _unlink(tmp)
        raise
    return path


def is_gzip_name(name: str) -> bool:
    """Whether a bundle of this name is gzip'd (``.gz``, ``.tgz``)."""
    return name.endswith((".gz", ".tgz"))


def write_members(tar: tarfile.TarFile, entries: list[Entry], trust_key: bytes | None) -> None:
    """Add ``bundle.json``, then each entry's files, its ``entry.json`` last, then its signature (with a key).

    The manifest is read once and both written and signed from those bytes; the executable files signed are
    the ones written with mode 0555 (docs/cache.md, "What each tier trusts").
    """
    head = json.dumps({"format": FORMAT_VERSION, "keys": [e.key for e in entries]}).encode()
    _add(tar, BUNDLE_MANIFEST, len(head), io.BytesIO(head), 0o444, 0)
    for entry in entries:
        where = f"{VERSION_DIR}/entries/{entry.key[:2]}/{entry.key}"
        executable = []
        for rel in entry.files:
            src = entry.path / rel
            fd, st = _open_source(src)
            if st.st_mode & 0o111:
                executable.append(rel)
            with os.fdopen(fd, "rb") as f:
                _add(tar, f"{where}/{rel}", st.st_size, _Source(f, src, st.st_size),
                     0o555 if st.st_mode & 0o111 else 0o444, int(entry.created))
        try:
            manifest, _st = read_file_stat(entry.path / MANIFEST, MAX_MANIFEST_BYTES)
        except OSError as exc:
            raise CacheError(f"cannot export cache entry file {entry.path / MANIFEST}: {exc.strerror or exc}") from None
        _add(tar, f"{where}/{MANIFEST}", len(manifest), io.BytesIO(manifest), 0o444, int(entry.created))
        if trust_key is not None:
            sig = signature_file(trust_key, entry.key, manifest, executable)
            name = signature_path(Path(VERSION_DIR), entry.key).as_posix()
            _add(tar, name, len(sig), io.BytesIO(sig), 0o444, int(entry.created))


def unpack_bundle(path: Path, staging: Path, *, shared: bool = False, max_file_bytes: int,
                  max_bytes: int, sha256: str | None = None, trust_key: bytes | None = None) -> dict[str, Entry]:
    """Validate every member of the bundle at ``path``, unpack it under ``staging`` and verify each entry.

    Nothing is written until every header has passed (:func:`_check_members`); files are streamed by this
    code, never ``tarfile.extract``. Returns each key's verified entry under ``staging``. ``CacheError`` for
    a bad archive or entry, ``CacheWriteError`` for a failed write. ``sha256``: the file must hash to it
    (hashed on the descriptor it is then read from, so a file swapped after the check is never imported).
    ``trust_key``: every entry must carry its signature under that key, else ``UntrustedEntry`` (exit 4).
    """
    dir_mode = 0o777 if shared else 0o755
    try:
        fd, _st = open_regular(path)
    except OSError as exc:
        raise CacheError(f"cannot read bundle {path}: {exc.strerror or exc}") from exc
    listed = None
    with os.fdopen(fd, "rb") as raw:
        if sha256 is not None and (digest := file_sha256(raw)) != sha256.lower():
            raise CacheError(f"bundle {path} has sha256 {digest}, not the pinned {sha256.lower()}: refused "
                             "before importing anything")
        try:
            with tarfile.open(fileobj=raw, mode="r:*") as tar:
                files = _check_members(path, tar, max_file_bytes=max_file_bytes, max_bytes=max_bytes)
                _write(staging, make_dirs, staging, dir_mode)  # made empty beforehand by the cache
                for member, rel in files:
                    listed = _unpack_member(path, tar, member, rel, staging, dir_mode) or listed
        except _READ_ERRORS as exc:
            raise CacheError(f"cannot read bundle {path}: {exc}") from exc
    return staged_entries(path, staging, [rel for _member, rel in files], listed, shared=shared, trust_key=trust_key)


def unpack_stream(raw: Any, where: str, staging: Path, *, shared: bool = False, max_file_bytes: int,
                  max_bytes: int, sha256: str | None = None, trust_key: bytes | None = None) -> dict[str, Entry]:
    """:func:`unpack_bundle` for a bundle read once front to back (an object's body): ``raw.read(n)`` only.

    Each member is checked as its header arrives and streamed into ``staging``, which the caller drops on
    any error, so a bad member still publishes nothing. ``sha256`` is computed over every byte read (the
    tar's end padding included) and compared before any entry is returned. ``where`` names the bundle.
    """
    hashing = _Hashing(raw)
    dir_mode = 0o777 if shared else 0o755
    _write(staging, make_dirs, staging, dir_mode)  # made empty beforehand by the cache
    rels: list[str] = []
    listed, seen, total = None, set(), 0
    try:
        with tarfile.open(fileobj=hashing, mode="r|*") as tar:
            for count, member in enumerate(tar, 1):
                rel = _member_rel(where, member, count, seen, total, max_file_bytes, max_bytes)
                if rel is None:
                    continue
                seen.add(rel)
                total += member.size
                rels.append(rel)
                listed = _unpack_member(where, tar, member, rel, staging, dir_mode) or listed
        hashing.drain()
    except _READ_ERRORS as exc:
        raise CacheError(f"cannot read bundle {where}: {exc}") from exc
    if sha256 is not None and (digest := hashing.hexdigest()) != sha256.lower():
        raise CacheError(f"bundle {where} has sha256 {digest}, not the pinned {sha256.lower()}: refused "
                         "before importing anything")
    return staged_entries(where, staging, rels, listed, shared=shared, trust_key=trust_key)


def _unpack_member(where: Any, tar: tarfile.TarFile, member: tarfile.TarInfo, rel: str, staging: Path,
                   dir_mode: int) -> list[str] | None:
    """Stream one checked member into staging; ``bundle.json`` is read instead (its keys are returned)."""
    if rel == BUNDLE_MANIFEST:
        return _check_bundle_manifest(where, _read_small(tar, member))
    _stream_member(tar, member, staging / rel, dir_mode)
    return None


def staged_entries(where: Any, staging: Path, rels: list[str], listed: list[str] | None, *, shared: bool,
                   trust_key: bytes | None) -> dict[str, Entry]:
    """Verify each entry unpacked under ``staging`` (and with ``trust_key`` its signature); return them by key."""
    staged = {}
    for rel in rels:
        parts = rel.split("/")
        if parts[0] == "entries":
            staged[parts[2]] = staging / "entries" / parts[1] / parts[2]
    if not staged:
        raise CacheError(f"bundle {where} holds no entries")
    if listed is not None and sorted(listed) != sorted(staged):
        # A tar cut at a member boundary reads as a shorter, valid archive: the key list catches it.
        raise CacheError(f"bundle {where}: {BUNDLE_MANIFEST} lists {len(listed)} entries but the archive "
                         f"holds {len(staged)}; it is incomplete or was altered")
    entries = {}
    for key, entry_dir in sorted(staged.items()):
        _write(entry_dir, seal_dirs, entry_dir, shared)
        try:
            # The unpacked files are ours, written with safe modes; this is their one hash.
            entries[key] = verify_entry(entry_dir, key, allow_shared=True)
        except CorruptEntry as exc:
            raise CacheError(f"bundle {where}: entry {key} does not verify: {exc}") from None
        if trust_key is not None:  # before anything is published: UntrustedEntry (exit 4)
            check_local(trust_key, entries[key], signature_path(staging, key), f"entry {key} of bundle {where}")
    return entries


def _check_members(path: Path, tar: tarfile.TarFile, *, max_file_bytes: int,
                   max_bytes: int) -> list[tuple[tarfile.TarInfo, str]]:
    """Return (member, name in staging) of the regular files; CacheError for the first unsafe member (as read)."""
    seen: set[str] = set()
    files, total = [], 0
    for count, m in enumerate(tar, 1):
        rel = _member_rel(path, m, count, seen, total, max_file_bytes, max_bytes)
        if rel is not None:
            seen.add(rel)
            files.append((m, rel))
            total += m.size
    return files


def _member_rel(where: Any, m: tarfile.TarInfo, count: int, seen: set[str], total: int, max_file_bytes: int,
                max_bytes: int) -> str | None:
    """The staging name of a regular file member (None: a directory); CacheError for an unsafe one."""
    name = m.name
    why = None
    if count > MAX_MEMBERS:
        why = f"is beyond {MAX_MEMBERS} members"
    elif name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        why = "is an absolute path"
    elif any(p == ".." for p in name.replace("\\", "/").split("/")):
        why = "contains '..'"
    elif m.issym() or m.islnk():
        why = f"is a {'symbolic' if m.issym() else 'hard'} link"
    elif not (m.isreg() or m.isdir()):
        why = "is a device, FIFO or other special file"
    elif not is_safe_relpath(name.rstrip("/") if m.isdir() else name):
        why = "is not a normalized relative path"
    elif m.isreg() and _staged_name(name) is None:
        why = (f"is neither {BUNDLE_MANIFEST}, {VERSION_DIR}/entries/<kk>/<key>/<file> nor "
               f"{VERSION_DIR}/{SIGNATURES_DIR}/<kk>/<key>.json")
    elif m.isreg() and _staged_name(name) in seen:
        why = "appears twice"
    elif m.size > max_file_bytes:
        why = f"is {m.size} bytes, over the cap of {max_file_bytes} (JITWARM_BUNDLE_MAX_FILE_BYTES)"
    elif total + m.size > max_bytes:
        why = f"takes the bundle over its cap of {max_bytes} bytes (JITWARM_BUNDLE_MAX_BYTES)"
    elif m.isreg() and name.startswith(f"{VERSION_DIR}/{SIGNATURES_DIR}/") and m.size > MAX_SIGNATURE_BYTES:
        why = f"is {m.size} bytes, over the {MAX_SIGNATURE_BYTES} of a signature"
    if why is not None:
        raise CacheError(f"refusing bundle {where}: member {name[:200]!r} {why}; nothing was imported")
    return _staged_name(name) if m.isreg() else None


def _staged_name(name: str) -> str | None:
    """Where a file member goes in staging: ``bundle.json``, ``entries/<kk>/<key>/<file>``, ``signatures/...``."""
    if name == BUNDLE_MANIFEST:
        return name
    rel = name.removeprefix(f"{VERSION_DIR}/")
    parts = rel.split("/")
    if len(parts) == 3 and parts[0] == SIGNATURES_DIR and parts[2].endswith(".json"):
        key = parts[2].removesuffix(".json")
        return rel if is_key(key) and parts[1] == key[:2] and name.startswith(f"{VERSION_DIR}/") else None
    ok = len(parts) >= 4 and parts[0] == "entries" and is_key(parts[2]) and parts[1] == parts[2][:2]
    return rel if ok else None


def _read_small(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """Read ``bundle.json`` (at most :data:`MAX_MANIFEST_BYTES`)."""
    if member.size > MAX_MANIFEST_BYTES:
        raise CacheError(f"bundle member {BUNDLE_MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    f = tar.extractfile(member)
    if f is None:
        raise CacheError(f"cannot read bundle member {member.name!r}")
    with f:
        return f.read(member.size)


def _stream_member(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, dir_mode: int) -> None:
    """Copy one file member to the new file ``dest`` in chunks (a failed write: CacheWriteError)."""
    src = tar.extractfile(member)
    if src is None:
        raise CacheError(f"cannot read bundle member {member.name!r}")
    _write(dest.parent, make_dirs, dest.parent, dir_mode)
    fd = _write(dest, os.open, dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with src:
            while chunk := src.read(_CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[_write(dest, os.write, fd, view):]
        _write(dest, os.fchmod, fd, 0o555 if member.mode & 0o111 else 0o444)
    finally:
        os.close(fd)


def _write(where: Path, fn: Callable[..., Any], *args: Any) -> Any:
    """Run one write step on ``where``; its OSError becomes a CacheWriteError naming the file and the reason."""
    try:
        return fn(*args)
    except OSError as exc:
        raise CacheWriteError.of("write the imported bundle to", exc, exc.filename or where) from exc


def _check_bundle_manifest(path: Any, data: bytes) -> list[str]:
    """Return the keys ``bundle.json`` lists; reject a malformed one or another cache format."""
    try:
        doc = loads(data)
        fmt, keys = doc["format"], doc["keys"]
        if not isinstance(keys, list) or not all(is_key(k) for k in keys):
            raise TypeError("keys")
    except (ValueError, KeyError, TypeError):
        raise CacheError(f"bundle {path}: {BUNDLE_MANIFEST} is malformed") from None
    if fmt != FORMAT_VERSION:
        raise CacheError(f"bundle {path} has cache format {fmt!r}; this jitwarm reads {FORMAT_VERSION}")
    return keys


def _open_source(src: Path) -> tuple[int, os.stat_result]:
    try:
        return open_regular(src)
    except OSError as exc:
        raise CacheError(f"cannot export cache entry file {src}: {exc.strerror or exc}") from None


class _Source:
    """An entry file being exported: its read errors are CacheErrors, so that any OSError is the bundle's."""

    def __init__(self, f: io.BufferedReader, path: Path, size: int) -> None:
        self._f, self._path, self._left = f, path, size

    def read(self, size: int = -1) -> bytes:
        try:
            data = self._f.read(size)
        except OSError as exc:
            raise CacheError(f"cannot export cache entry file {self._path}: {exc.strerror or exc}") from None
        want = self._left if size < 0 else min(size, self._left)
        self._left -= len(data)
        if len(data) < want:  # tarfile would call this an OSError, which reads as the bundle's write error
            raise CacheError(f"cannot export cache entry file {self._path}: it shrank while it was read")
        return data


def _add(tar: tarfile.TarFile, name: str, size: int, data: Any, mode: int, mtime: int) -> None:
    """Add one regular file member with neutral ownership, streaming ``size`` bytes from ``data``."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, data)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def file_sha256(f: Any) -> str:
    """Return the sha256 of the open binary file ``f`` from its start (as ``sha256sum`` prints it); rewinds it."""
    f.seek(0)
    digest = hashlib.sha256()
    while chunk := f.read(1 << 20):
        digest.update(chunk)
    f.seek(0)
    return digest.hexdigest()


class _Hashing:
    """A stream read once (``tarfile`` ``r|``): the sha256 of every byte it hands out."""

    def __init__(self, raw: Any) -> None:
        self._raw, self._digest = raw, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._digest.update(data)
        return data

    def drain(self) -> None:
        """Read what the tar reader left (its end blocks and padding): they are part of the digest."""
        while self.read(_CHUNK):
            pass

    def hexdigest(self) -> str:
        return self._digest.hexdigest()
