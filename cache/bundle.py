"""Relocatable bundles: a tar of entries laid out as a cache root, and its validating, streaming unpacker.

Sizes are capped from the headers and members streamed in chunks (a 28 MB ``.tar.gz`` holding one 6 GiB
member ended in ``MemoryError``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from jitwarm.cache.bundle_headers import BoundedTar, HeaderRefused, Layout, members, name_problem
from jitwarm.cache.entry import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Entry,
    is_private,
    is_safe_relpath,
    seal_dirs,
    stored_mode,
    verify_entry,
)
from jitwarm.cache.errors import CacheError, CacheWriteError, CorruptEntry
from jitwarm.cache.files import loads, make_dirs, open_regular, read_file_stat
from jitwarm.cache.keys import FORMAT_VERSION, is_key
from jitwarm.cache.layout import VERSION_DIR
from jitwarm.cache.locks import left_by_dead_process, this_host
from jitwarm.cache.signing import MAX_SIGNATURE_BYTES, SIGNATURES_DIR, check_local, signature_file, signature_path

#: Optional first member: ``{"format": 1, "keys": [...], "about": {...}}``. ``about`` (optional too) is the
#: exporter's own JSON object, what the bundle is for; the cache carries it unread and the import hands it back.
BUNDLE_MANIFEST = "bundle.json"
_READ_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error)
_CHUNK = 1 << 20


class BundleHead(NamedTuple):
    """What ``bundle.json`` says: the bundle's ``keys`` and the exporter's ``about`` (None: a bundle without one)."""

    keys: list[str]
    about: dict[str, Any] | None = None


class Unpacked(NamedTuple):
    """An unpacked bundle: its verified ``entries`` by key, and ``bundle.json``'s ``about`` (None: none)."""

    entries: dict[str, Entry]
    about: dict[str, Any] | None = None


@dataclass(frozen=True)
class ImportReport:
    """Result of :meth:`KernelCache.import_bundle`: keys ``imported``, those ``present``, their descriptions.

    ``about``: the exporter's object from ``bundle.json`` (None for a bundle that carries none).
    """

    imported: tuple[str, ...] = ()
    present: tuple[str, ...] = ()
    descriptions: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    about: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key of the bundle."""
        return tuple(sorted((*self.imported, *self.present)))

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return {"imported": list(self.imported), "present": list(self.present)}


def write_bundle(entries: list[Entry], path: Path, *, trust_key: bytes | None = None,
                 about: Mapping[str, Any] | None = None) -> Path:
    """Write ``entries`` (signed with ``trust_key``; ``about`` in ``bundle.json``) to a tar at ``path`` atomically.

    Raises CacheWriteError, CacheError; TypeError or ValueError for an ``about`` that is not a JSON object.
    """
    if path.exists() and not path.is_file():
        # The rename below replaces what is there: as root, `export ... /dev/null` replaced the device node.
        why = "it is a directory" if path.is_dir() else "it is not a regular file (a device, FIFO or socket)"
        raise CacheWriteError("write the bundle", str(path), why)
    sweep_export_temps(path)
    tmp = path.with_name(f".{path.name}.{this_host()}~{os.getpid()}~{secrets.token_hex(4)}.tmp")
    try:
        with tarfile.open(tmp, "w:gz" if is_gzip_name(path.name) else "w", format=tarfile.PAX_FORMAT) as tar:
            write_members(tar, entries, trust_key, about)
        tmp.replace(path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):  # an entry file's read error is a CacheError (_Source): this is the bundle's
            raise CacheWriteError.of("write the bundle", exc, path) from exc
        raise
    return path


def sweep_export_temps(path: Path) -> list[str]:
    """Remove the temporaries a killed export of ``path`` on this host left beside it; return their names.

    Only a dead process's, this user's regular files: a live export's, or another host's, are left (a SIGKILLed
    export left a 463 MB temporary that nothing removed).
    """
    removed = []
    with contextlib.suppress(OSError), os.scandir(path.parent) as found:
        for item in found:
            middle = item.name.removeprefix(f".{path.name}.").removesuffix(".tmp")
            parts = middle.rsplit("~", 2)
            if (middle == item.name or not item.name.endswith(".tmp") or len(parts) != 3
                    or not left_by_dead_process(parts[0], parts[1])):
                continue
            with contextlib.suppress(OSError):
                st = item.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    os.unlink(item.path)  # noqa: PTH108 - a scandir entry's path
                    removed.append(item.name)
    return removed


def is_gzip_name(name: str) -> bool:
    """Whether a bundle of this name is gzip'd (``.gz``, ``.tgz``)."""
    return name.endswith((".gz", ".tgz"))


def write_members(tar: tarfile.TarFile, entries: list[Entry], trust_key: bytes | None,
                  about: Mapping[str, Any] | None = None) -> None:
    """Add ``bundle.json`` (with ``about``), then each entry's files, its ``entry.json`` last, then its signature."""
    doc: dict[str, Any] = {"format": FORMAT_VERSION, "keys": [e.key for e in entries]}
    if about is not None:
        if not isinstance(about, Mapping):
            raise TypeError(f"a bundle's about is a JSON object, not {type(about).__name__}")
        doc["about"] = dict(about)
    head = json.dumps(doc, sort_keys=True, allow_nan=False).encode()
    if len(head) > MAX_MANIFEST_BYTES:  # the import refuses a larger one: never write a bundle that cannot be read
        raise CacheError(f"{BUNDLE_MANIFEST} would be {len(head)} bytes, over the {MAX_MANIFEST_BYTES} an import reads")
    _add(tar, BUNDLE_MANIFEST, head, 0o444, 0)
    for entry in entries:
        where, mtime = f"{VERSION_DIR}/entries/{entry.key[:2]}/{entry.key}", int(entry.created)
        executable, private = [], []
        for rel in entry.files:
            with contextlib.closing(_Source(entry.path / rel)) as src:
                if src.mode & 0o111:
                    executable.append(rel)
                if is_private(src.mode):
                    private.append(rel)
                _add(tar, f"{where}/{rel}", src, stored_mode(src.mode, shared=False), mtime)
        try:
            manifest, _st = read_file_stat(entry.path / MANIFEST, MAX_MANIFEST_BYTES)
        except OSError as exc:
            raise _export_error(entry.path / MANIFEST, exc) from None
        _add(tar, f"{where}/{MANIFEST}", manifest, 0o444, mtime)
        if trust_key is not None:
            sig = signature_file(trust_key, entry.key, manifest, executable, private)
            _add(tar, signature_path(Path(VERSION_DIR), entry.key).as_posix(), sig, 0o444, mtime)


def unpack_bundle(path: Path, staging: Path, *, shared: bool = False, max_file_bytes: int,
                  max_bytes: int, sha256: str | None = None, trust_key: bytes | None = None) -> Unpacked:
    """Check every member header of the bundle at ``path``, then unpack it under ``staging``; return its entries.

    ``CacheError`` for a bad archive or entry, ``CacheWriteError``; ``sha256``: the pin; ``trust_key``: an
    unsigned entry is ``UntrustedEntry`` (exit 4).
    """
    try:
        fd, _st = open_regular(path)
    except OSError as exc:
        raise CacheError(f"cannot read bundle {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as raw:
        if sha256 is not None:
            _check_pin(path, file_sha256(raw), sha256)
        try:
            with BoundedTar.open(fileobj=raw, mode="r:*") as tar:
                checked = list(_checked_members(path, tar, max_file_bytes, max_bytes))
                staged, listed = _unpack(path, tar, checked, staging, shared)
        except HeaderRefused as exc:
            raise CacheError(f"refusing bundle {path}: {exc}; nothing was imported") from None
        except _READ_ERRORS as exc:
            raise CacheError(f"cannot read bundle {path}: {_read_problem(exc)}") from exc
    return staged_entries(path, staging, staged, listed, shared=shared, trust_key=trust_key)


def _read_problem(exc: BaseException) -> str:
    """One line for why a bundle could not be read (tarfile's ``r:*`` lists each compression it tried)."""
    text = str(exc)
    if isinstance(exc, tarfile.ReadError) and text.startswith("file could not be opened successfully"):
        return "not a tar archive (plain, gzip, bz2 or xz)"
    return text.splitlines()[0] if text.strip() else type(exc).__name__


def unpack_stream(raw: Any, where: str, staging: Path, *, shared: bool = False, max_file_bytes: int,
                  max_bytes: int, sha256: str | None = None, trust_key: bytes | None = None) -> Unpacked:
    """:func:`unpack_bundle` for a stream read once (``raw.read``); the caller drops ``staging`` on an error."""
    hashing = _Hashing(raw)
    try:
        with BoundedTar.open(fileobj=hashing, mode="r|*") as tar:
            staged, listed = _unpack(where, tar, _checked_members(where, tar, max_file_bytes, max_bytes), staging,
                                     shared)
        hashing.drain()
    except HeaderRefused as exc:
        raise CacheError(f"refusing bundle {where}: {exc}; nothing was imported") from None
    except _READ_ERRORS as exc:
        raise CacheError(f"cannot read bundle {where}: {_read_problem(exc)}") from exc
    if sha256 is not None:
        _check_pin(where, hashing.digest.hexdigest(), sha256)
    return staged_entries(where, staging, staged, listed, shared=shared, trust_key=trust_key)


def staged_entries(where: Any, staging: Path, staged: dict[str, Path], head: BundleHead | None, *, shared: bool,
                   trust_key: bytes | None) -> Unpacked:
    """Verify each entry dir unpacked under ``staging`` (and its signature); return them by key, with ``about``."""
    if not staged:
        raise CacheError(f"bundle {where} holds no entries")
    listed = None if head is None else head.keys
    if listed is not None and sorted(listed) != sorted(staged):
        # A tar cut at a member boundary reads as a shorter, valid archive: the key list catches it.
        raise CacheError(f"bundle {where}: {BUNDLE_MANIFEST} lists {len(listed)} entries but the archive "
                         f"holds {len(staged)}; it is incomplete or was altered")
    entries = {}
    for key, entry_dir in sorted(staged.items()):
        private = _write(entry_dir, _private_files, entry_dir, shared)
        _write(entry_dir, seal_dirs, entry_dir, shared)
        try:
            # The unpacked files are ours, written with safe modes; this is their one hash.
            entries[key] = verify_entry(entry_dir, key, allow_shared=True)
        except CorruptEntry as exc:
            raise CacheError(f"bundle {where}: entry {key} does not verify: {exc}") from None
        if trust_key is not None:  # before anything is published: UntrustedEntry (exit 4)
            check_local(trust_key, entries[key], signature_path(staging, key), f"entry {key} of bundle {where}",
                        private)
    return Unpacked(entries, None if head is None else head.about)


def _private_files(entry_dir: Path, shared: bool) -> list[str]:
    """The files the tar kept private (they are signed so); in a shared root, then readable by the group too."""
    private = []
    for dirpath, _dirs, names in os.walk(entry_dir):
        for name in names:
            path = Path(dirpath, name)
            mode = path.lstat().st_mode
            if is_private(mode):
                private.append(path.relative_to(entry_dir).as_posix())
                if shared:
                    path.chmod(stored_mode(mode, shared=True))
    return private


def _checked_members(where: Any, tar: tarfile.TarFile, max_file_bytes: int,
                     max_bytes: int) -> Iterator[tuple[tarfile.TarInfo, str]]:
    """Yield (member, name in staging) of each regular file; CacheError for an unsafe one.

    Every refusal is the bundle's (exit 4), found here rather than as a write error while it is unpacked: a
    100,000-character name or a file where another member's folder goes failed as a write (exit 1).
    """
    seen, layout = set(), Layout()
    total = 0
    for m in members(tar):
        name = m.name
        rel = _staged_name(name) if m.isreg() else None
        why = name_problem(name)
        if why is not None:
            pass
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
        elif m.isreg() and rel is None:
            why = (f"is neither {BUNDLE_MANIFEST}, {VERSION_DIR}/entries/<kk>/<key>/<file> nor "
                   f"{VERSION_DIR}/{SIGNATURES_DIR}/<kk>/<key>.json")
        elif rel in seen:
            why = "appears twice"
        elif m.size > max_file_bytes:
            why = f"is {m.size} bytes, over the cap of {max_file_bytes} (JITWARM_BUNDLE_MAX_FILE_BYTES)"
        elif total + m.size > max_bytes:
            why = f"takes the bundle over its cap of {max_bytes} bytes (JITWARM_BUNDLE_MAX_BYTES)"
        elif m.isreg() and name.startswith(f"{VERSION_DIR}/{SIGNATURES_DIR}/") and m.size > MAX_SIGNATURE_BYTES:
            why = f"is {m.size} bytes, over the {MAX_SIGNATURE_BYTES} of a signature"
        elif rel is not None:
            why = layout.clash(rel)
        if why is not None:
            raise CacheError(f"refusing bundle {where}: member {name[:200]!r} {why}; nothing was imported")
        if rel is not None:
            seen.add(rel)
            total += m.size
            yield m, rel


def _staged_name(name: str) -> str | None:
    """Where a file member goes in staging, or None."""
    if name == BUNDLE_MANIFEST:
        return name
    rel = name.removeprefix(f"{VERSION_DIR}/")
    parts = rel.split("/")
    if len(parts) == 3 and parts[0] == SIGNATURES_DIR and parts[2].endswith(".json"):
        key = parts[2].removesuffix(".json")
        return rel if is_key(key) and parts[1] == key[:2] and name.startswith(f"{VERSION_DIR}/") else None
    ok = len(parts) >= 4 and parts[0] == "entries" and is_key(parts[2]) and parts[1] == parts[2][:2]
    return rel if ok else None


def _unpack(where: Any, tar: tarfile.TarFile, members: Iterable[tuple[tarfile.TarInfo, str]], staging: Path,
            shared: bool) -> tuple[dict[str, Path], BundleHead | None]:
    """Stream each checked member into ``staging``; return the entry dirs and what ``bundle.json`` says."""
    dir_mode = 0o777 if shared else 0o755
    _write(staging, make_dirs, staging, dir_mode)
    staged, listed = {}, None
    for member, rel in members:
        if rel.startswith("entries/"):
            kk, key = rel.split("/")[1:3]
            staged[key] = staging / "entries" / kk / key
        src = tar.extractfile(member)
        if src is None:
            raise CacheError(f"cannot read bundle member {member.name!r}")
        with src:
            if rel == BUNDLE_MANIFEST:
                listed = _listed_keys(where, member, src)
            else:
                _stream_member(src, member, staging / rel, dir_mode, shared)
    return staged, listed


def _listed_keys(where: Any, member: tarfile.TarInfo, src: Any) -> BundleHead:
    """Return what ``bundle.json`` says; reject a large or malformed one, or another cache format."""
    if member.size > MAX_MANIFEST_BYTES:
        raise CacheError(f"bundle member {BUNDLE_MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    return read_head(where, src.read(member.size))


def read_head(where: Any, data: bytes) -> BundleHead:
    """Parse ``bundle.json``'s bytes; CacheError for a malformed one or another cache format."""
    try:
        doc = loads(data)
        fmt, keys, about = doc["format"], doc["keys"], doc.get("about")
        if not isinstance(keys, list) or not all(is_key(k) for k in keys):
            raise TypeError("keys")
        if about is not None and not isinstance(about, dict):
            raise TypeError("about")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CacheError(f"bundle {where}: {BUNDLE_MANIFEST} is malformed") from None
    if fmt != FORMAT_VERSION:
        raise CacheError(f"bundle {where} has cache format {fmt!r}; this jitwarm reads {FORMAT_VERSION}")
    return BundleHead(keys, about)


def _stream_member(src: Any, member: tarfile.TarInfo, dest: Path, dir_mode: int, shared: bool) -> None:
    """Copy one file member to the new file ``dest`` in chunks."""
    _write(dest.parent, make_dirs, dest.parent, dir_mode)
    fd = _write(dest, os.open, dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        while chunk := src.read(_CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[_write(dest, os.write, fd, view):]
        _write(dest, os.fchmod, fd, stored_mode(member.mode, shared=False))  # _private_files reads, then widens it
    finally:
        os.close(fd)


def _write(where: Path, fn: Callable[..., Any], *args: Any) -> Any:
    """Run one write step on ``where``; OSError becomes CacheWriteError."""
    try:
        return fn(*args)
    except OSError as exc:
        raise CacheWriteError.of("write the imported bundle to", exc, exc.filename or where) from exc


def _check_pin(where: Any, digest: str, sha256: str) -> None:
    """Refuse a bundle whose sha256 is not the pinned one."""
    if digest != sha256.lower():
        raise CacheError(f"bundle {where} has sha256 {digest}, not the pinned {sha256.lower()}: refused "
                         "before importing anything")


def _export_error(path: Path, exc: OSError) -> CacheError:
    """An entry file that cannot be exported (a CacheError: an OSError is the bundle's write error)."""
    return CacheError(f"cannot export cache entry file {path}: {exc.strerror or exc}")


class _Source:
    """An entry file being exported (``mode``, ``size``): its read errors, a shrinking file too, are CacheErrors."""

    def __init__(self, path: Path) -> None:
        try:
            fd, st = open_regular(path)
        except OSError as exc:
            raise _export_error(path, exc) from None
        self._f, self._path = os.fdopen(fd, "rb"), path
        self.mode, self.size, self._left = st.st_mode, st.st_size, st.st_size

    def read(self, size: int = -1) -> bytes:
        try:
            data = self._f.read(size)
        except OSError as exc:
            raise _export_error(self._path, exc) from None
        want = self._left if size < 0 else min(size, self._left)
        self._left -= len(data)
        if len(data) < want:  # tarfile would call this an OSError, which reads as the bundle's write error
            raise CacheError(f"cannot export cache entry file {self._path}: it shrank while it was read")
        return data

    def close(self) -> None:
        self._f.close()


def _add(tar: tarfile.TarFile, name: str, data: bytes | _Source, mode: int, mtime: int) -> None:
    """Add one regular file member with neutral ownership, from bytes or streamed from a :class:`_Source`."""
    info = tarfile.TarInfo(name)
    if isinstance(data, bytes):
        info.size, fileobj = len(data), io.BytesIO(data)
    else:
        info.size, fileobj = data.size, data
    info.mode, info.mtime = mode, mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, fileobj)


def file_sha256(f: Any) -> str:
    """Return the sha256 of the open binary file ``f`` from its start; rewinds it."""
    f.seek(0)
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
    f.seek(0)
    return digest.hexdigest()


class _Hashing:
    """A stream read once (``tarfile`` ``r|``) and the sha256 of every byte it handed out (``digest``)."""

    def __init__(self, raw: Any) -> None:
        self._raw, self.digest = raw, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self.digest.update(data)
        return data

    def drain(self) -> None:
        """Read what the tar reader left: it is part of the digest."""
        while self.read(_CHUNK):
            pass
