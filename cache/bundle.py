"""Relocatable bundles: a tar of entries laid out as a cache root, and its validating, streaming unpacker.

Sizes are capped from the headers and members streamed in chunks (a 28 MB ``.tar.gz`` holding one 6 GiB
member ended in ``MemoryError``).
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from jitwarm.cache.bundle_headers import BoundedTar, HeaderRefused, Layout, members, name_problem
from jitwarm.cache.entry import (
    MAX_MANIFEST_BYTES,
    Entry,
    is_private,
    is_safe_relpath,
    seal_dirs,
    stored_mode,
    verify_entry,
)
from jitwarm.cache.errors import CacheError, CacheWriteError, CorruptEntry
from jitwarm.cache.files import loads, make_dirs, open_regular
from jitwarm.cache.keys import FORMAT_VERSION, is_key
from jitwarm.cache.layout import VERSION_DIR
from jitwarm.cache.signing import MAX_SIGNATURE_BYTES, SIGNATURES_DIR, check_local, signature_path

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
