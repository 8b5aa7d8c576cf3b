"""Cache entries: the ``entry.json`` manifest, and every file hash of the cache (seal, verify, unpack)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import CacheError, CacheWriteError, CorruptEntry
from jitwarm.cache.files import check_trusted, fsync_tree, loads, make_dirs, open_regular, read_file_stat, write_atomic
from jitwarm.cache.keys import FORMAT_VERSION, is_key, stored_preimage_key

#: The manifest of an entry; written last, so an entry without it was never published.
MANIFEST = "entry.json"
MAX_MANIFEST_BYTES = 16 << 20
#: A file of an entry (or of a unit) lies at most this many folders deep, its path at most this long: a
#: downloaded entry holding a file 1,200 folders deep failed every ``warm`` (``RecursionError``), now it is corrupt.
MAX_PATH_DEPTH, MAX_PATH_CHARS = 64, 4096
_CHUNK = 1 << 20

_SigItem = tuple[str, int, int, int, int]
#: ``(name, inode, size, mtime_ns, ctime_ns)`` of the manifest and every file, sorted, as hashed.
Signature = tuple[_SigItem, ...]


@dataclass(frozen=True)
class FileRecord:
    """One artifact file of an entry: its path relative to the entry, size and sha256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Entry:
    """A published, verified cache entry: ``files`` (sorted, no ``entry.json``) and what was hashed."""

    key: str
    path: Path
    files: tuple[str, ...]
    description: dict[str, Any] = field(compare=False, repr=False)
    preimage: dict[str, Any] = field(compare=False, repr=False)
    records: tuple[FileRecord, ...] = field(repr=False)
    created: float = field(repr=False)
    read_only: bool = field(default=False, compare=False)
    signature: Signature = field(default=(), compare=False, repr=False)

    def file(self, name: str) -> Path:
        """Return the path of artifact ``name``; KeyError if the entry has no such file."""
        if name not in self.files:
            raise KeyError(f"cache entry {self.key} has no file {name!r}; it has {list(self.files)}")
        return self.path / name

    @property
    def size_bytes(self) -> int:
        """Total size of the artifact files."""
        return sum(r.size for r in self.records)


def seal(staging: Path, key: str, preimage: dict[str, Any], *, shared: bool = False) -> Entry:
    """Hash a finished build directory and write its ``entry.json``; ``CacheError`` for no files or a link."""
    records, sig = [], {}
    found = _walk_files(staging, error=CacheError)
    for rel, st in found:  # all before any chmod: sealing a hard link made its other name, outside, 0444
        if st.st_nlink > 1:
            raise CacheError(f"the build left {staging / rel} with {st.st_nlink - 1} other hard link(s); a cache "
                             "entry holds files of its own")
    for rel, st in found:
        if rel == MANIFEST:
            raise CacheError(f"the build wrote {MANIFEST!r}, a name the cache reserves")
        (staging / rel).chmod(stored_mode(st.st_mode, shared=shared))
        digest, sig[rel] = _hash_file(staging / rel, rel)
        records.append(FileRecord(rel, sig[rel][2], digest))
    if not records:
        # Never publish an empty artifact (FlashInfer PR #4136).
        raise CacheError("the build wrote no files into its staging directory")
    doc = {"format": FORMAT_VERSION, "key": key, "preimage": preimage, "created": time.time(),
           "files": [asdict(r) for r in records]}
    manifest = json.dumps(doc, indent=1, sort_keys=True).encode("ascii")
    return _finish(staging, key, doc, records, sig, manifest, shared)


def is_private(mode: int) -> bool:
    """Whether neither group nor others may read a file of ``mode``."""
    return not mode & 0o044


def stored_mode(mode: int, *, shared: bool) -> int:
    """0444, or 0555 when executable; a private file stays so (0400, 0500) unless ``shared``."""
    stored = 0o555 if mode & 0o111 else 0o444
    return stored & 0o500 if is_private(mode) and not shared else stored


def seal_dirs(staging: Path, shared: bool) -> None:
    """Take write access for other users (and the group, unless ``shared``) off every directory."""
    strip = 0o002 if shared else 0o022
    for dirpath, _dirs, _files in os.walk(staging):
        Path(dirpath).chmod(stat.S_IMODE(os.lstat(dirpath).st_mode) & ~strip | 0o700)


def _finish(staging: Path, key: str, doc: dict[str, Any], records: list[FileRecord], sig: dict[str, _SigItem],
            manifest: bytes, shared: bool) -> Entry:
    """Seal the directories, write the manifest last and fsync the tree."""
    seal_dirs(staging, shared)
    write_atomic(staging / MANIFEST, manifest, durable=False, mode=0o444)
    fsync_tree(staging)
    sig[MANIFEST] = _sig_item(MANIFEST, os.lstat(staging / MANIFEST))
    return _entry(staging, key, doc, records, sig, read_only=False)


def verify_entry(path: Path, key: str, *, allow_shared: bool, read_only: bool = False) -> Entry:
    """Hash the entry directory at ``path`` for ``key`` and return it.

    Raises ``FileNotFoundError`` (no directory, or a file vanished), ``CacheError`` (untrusted), ``CorruptEntry``.
    """
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise CorruptEntry(f"{path} is {kind}, not an entry directory")
    check_trusted(path, "cache entry", allow_shared=allow_shared, st=st)
    try:
        try:
            data = read_file_stat(path / MANIFEST, MAX_MANIFEST_BYTES)[0]
        except FileNotFoundError:
            raise CorruptEntry(f"{path} has no {MANIFEST}") from None
        doc, records = parse_manifest(data, key, str(path / MANIFEST))
        on_disk = dict(_walk_files(path, error=CorruptEntry))
        for rel, fst in on_disk.items():
            check_trusted(path / rel, "cache entry file", allow_shared=allow_shared, st=fst)
        _same_files(str(path), {r.path for r in records} | {MANIFEST}, set(on_disk))
        sig = {MANIFEST: _sig_item(MANIFEST, on_disk[MANIFEST])}
        for rec in records:
            if on_disk[rec.path].st_size != rec.size:
                raise CorruptEntry(f"{path / rec.path}: size {on_disk[rec.path].st_size}, {MANIFEST} says {rec.size}")
            digest, sig[rec.path] = _hash_file(path / rec.path, rec.path)
            if digest != rec.sha256 or sig[rec.path][2] != rec.size:
                raise CorruptEntry(f"{path / rec.path}: sha256 does not match {MANIFEST}")
    except FileNotFoundError:
        raise
    except OSError as exc:  # e.g. a directory this user may not read
        raise CorruptEntry(f"{exc.filename or path}: cannot be read: {exc.strerror or exc}") from None
    return _entry(path, key, doc, records, sig, read_only=read_only)


def recheck_entry(stamped: Entry, *, allow_shared: bool, st: os.stat_result | None = None) -> Entry | None:
    """Return ``stamped`` if its files' stat signature is unchanged (reading none), else None; ``CacheError``."""
    try:
        st = st if st is not None else os.lstat(stamped.path)
        if not stat.S_ISDIR(st.st_mode):
            return None
        check_trusted(stamped.path, "cache entry", allow_shared=allow_shared, st=st)
        folders: list[tuple[str, os.stat_result]] = []
        found = _walk_files(stamped.path, error=OSError, folders=folders)  # a link or special file: not stamped
        if tuple(_sig_item(rel, fst) for rel, fst in found) != stamped.signature:
            return None
        # Exactly the folders the files lie in, each trusted: another user's folder lets them swap a file.
        holding = {rel[:at] for rel, _ in found for at, char in enumerate(rel) if char == "/"}
        if {rel for rel, _ in folders} != holding:
            return None
        for rel, fst in folders:
            check_trusted(f"{stamped.path}/{rel}", "cache entry directory", allow_shared=allow_shared, st=fst)
        for rel, fst in found:
            check_trusted(f"{stamped.path}/{rel}", "cache entry file", allow_shared=allow_shared, st=fst)
    except OSError:
        return None
    return stamped


def unchanged(entry: Entry) -> bool:
    """Return True while a fresh ``lstat`` of the manifest and every file of ``entry`` equals its signature."""
    where = os.fspath(entry.path)
    try:
        return bool(entry.signature) and all(_sig_item(item[0], os.lstat(f"{where}/{item[0]}")) == item
                                             for item in entry.signature)
    except OSError:
        return False


def _entry(path: Path, key: str, doc: dict[str, Any], records: list[FileRecord], sig: dict[str, _SigItem], *,
           read_only: bool) -> Entry:
    """The Entry of a checked manifest at ``path``."""
    ordered = sorted(records, key=lambda r: r.path)
    return Entry(key=key, path=path, files=tuple(r.path for r in ordered), description=doc["preimage"]["description"],
                 preimage=doc["preimage"], records=tuple(ordered), created=float(doc.get("created", 0.0)),
                 read_only=read_only, signature=tuple(sig[n] for n in sorted(sig)))


def _same_files(where: str, listed: set[str], found: set[str]) -> None:
    """CorruptEntry unless the files ``found`` are exactly those ``listed``."""
    if found != listed:
        missing, extra = sorted(listed - found), sorted(found - listed)
        raise CorruptEntry(f"{where}: files differ from {MANIFEST} (missing {missing}, unlisted {extra})")


def _sig_item(name: str, st: os.stat_result) -> _SigItem:
    """One element of a Signature."""
    return (name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def parse_manifest(data: bytes, key: str, where: str) -> tuple[dict[str, Any], list[FileRecord]]:
    """Return the document and file records of a manifest for ``key``; ``CorruptEntry`` for anything else."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptEntry(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = loads(data)  # bounded depth: 100,000 nested "[" must be a corrupt entry, not a RecursionError
        if not isinstance(doc, dict) or not isinstance(doc["preimage"], dict):
            raise TypeError("not an object")
        if not isinstance(doc["preimage"].get("description"), dict):
            raise TypeError("the preimage has no description object")
        created = doc.get("created", 0.0)
        if type(created) not in (int, float) or not math.isfinite(created):  # a bool is no number here
            raise TypeError("created is not a number")
        fmt, stored_key, preimage, files = doc["format"], doc["key"], doc["preimage"], doc["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntry(f"{where} is not a valid manifest: {str(exc)[:200]!r}") from None
    if type(fmt) is not int or fmt != FORMAT_VERSION:  # 1.0 and true equal 1 in Python, never in a manifest
        raise CorruptEntry(f"{where} has format {fmt!r}, expected {FORMAT_VERSION}")
    if stored_key != key:
        raise CorruptEntry(f"{where} is for key {stored_key!r}, not {key}")
    if stored_preimage_key(preimage) != key:
        raise CorruptEntry(f"{where}: the stored preimage does not hash to the key")
    if not isinstance(files, list) or not files:
        raise CorruptEntry(f"{where} lists no files")
    try:
        records = [FileRecord(item["path"], item["size"], item["sha256"]) for item in files]
    except (KeyError, TypeError):
        raise CorruptEntry(f"{where}: malformed file records") from None
    for rec in records:
        if not (is_safe_relpath(rec.path) and type(rec.size) is int and rec.size >= 0 and is_key(rec.sha256)):
            raise CorruptEntry(f"{where}: bad file record {rec}")
    if len({r.path for r in records} - {MANIFEST}) != len(records):
        raise CorruptEntry(f"{where}: duplicate or reserved file names")
    return doc, records


def unpack_entry(staging: Path, key: str, manifest: bytes, files: Mapping[str, bytes],
                 executable: Collection[str] = (), private: Collection[str] = (), *, shared: bool = False) -> Entry:
    """Check an entry received as bytes (``CorruptEntry``), then write it into ``staging``; ``CacheWriteError``."""
    where = f"remote entry {key}"
    doc, records = parse_manifest(manifest, key, f"{where} {MANIFEST}")
    _same_files(where, {r.path for r in records}, set(files))
    for rec in records:
        if len(files[rec.path]) != rec.size:
            raise CorruptEntry(f"{where}: {rec.path} has size {len(files[rec.path])}, {MANIFEST} says {rec.size}")
        if hashlib.sha256(files[rec.path]).hexdigest() != rec.sha256:
            raise CorruptEntry(f"{where}: {rec.path}: sha256 does not match {MANIFEST}")
    dir_mode = 0o777 if shared else 0o755
    sig, dest = {}, staging
    try:
        staging.mkdir(mode=dir_mode, exist_ok=True)  # the cache's staging dirs are made empty beforehand
        for rel in sorted(files):
            dest = staging / rel
            make_dirs(dest.parent, dir_mode)
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(files[rel])
                f.flush()
                os.fchmod(fd, stored_mode((0o111 if rel in executable else 0) | (0 if rel in private else 0o044),
                                          shared=shared))
                sig[rel] = _sig_item(rel, os.fstat(fd))
        dest = staging / MANIFEST
        return _finish(staging, key, doc, records, sig, manifest, shared)
    except OSError as exc:  # the caller removes staging
        raise CacheWriteError.of("write the downloaded entry to", exc, dest) from exc


def is_safe_relpath(rel: object) -> bool:
    """Return True for a normalized relative POSIX path without ``..``."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    if not rel.isascii():
        try:
            rel.encode("utf-8")  # a lone surrogate from JSON cannot become a file name
        except UnicodeEncodeError:
            return False
    # No empty, "." or ".." part is what "normalized" means (PurePosixPath says so at ten times the cost).
    parts = rel.split("/")
    return len(parts) <= MAX_PATH_DEPTH and len(rel) <= MAX_PATH_CHARS and all(p not in ("", ".", "..") for p in parts)


def _walk_files(root: Path, *, error: type[Exception],
               folders: list[tuple[str, os.stat_result]] | None = None) -> list[tuple[str, os.stat_result]]:
    """List regular files (and into ``folders``, folders) under ``root`` as (relative path, lstat); ``error``."""
    found: list[tuple[str, os.stat_result]] = []
    pending = [(os.fspath(root), "")]
    while pending:
        folder, prefix = pending.pop()
        with os.scandir(folder) as it:
            for item in it:
                st = item.stat(follow_symlinks=False)
                rel = prefix + item.name
                if stat.S_ISREG(st.st_mode):
                    found.append((rel, st))
                elif stat.S_ISDIR(st.st_mode):
                    pending.append((item.path, rel + "/"))
                    if folders is not None:
                        folders.append((rel, st))
                elif stat.S_ISLNK(st.st_mode):
                    raise error(f"{item.path} is a symlink; cache entries hold regular files only")
                else:
                    raise error(f"{item.path} is not a regular file or directory")
    return sorted(found)


def _hash_file(path: Path, rel: str) -> tuple[str, _SigItem]:
    """Hash a file without following a symlink; return the digest and its signature item."""
    h = hashlib.sha256()
    fd, _st = open_regular(path)  # never blocks: a FIFO swapped in after the listing is an OSError, not a hang
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        return h.hexdigest(), _sig_item(rel, os.fstat(fd))
