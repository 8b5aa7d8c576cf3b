"""Writing a bundle: ``jitwarm export``'s tar of entries, laid out as a cache root, ``bundle.json`` first.

The tar is written to a temporary beside the bundle and renamed over it: a reader sees the old bundle or the
whole new one. A killed export's temporary is swept by the next export of the same name (:func:`sweep_export_temps`).
The format and its reading are :mod:`jitwarm.cache.bundle`'s.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import stat
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jitwarm.cache.bundle import BUNDLE_MANIFEST
from jitwarm.cache.entry import MANIFEST, MAX_MANIFEST_BYTES, Entry, is_private, stored_mode
from jitwarm.cache.errors import CacheError, CacheWriteError
from jitwarm.cache.files import open_regular, read_file_stat
from jitwarm.cache.keys import FORMAT_VERSION
from jitwarm.cache.layout import VERSION_DIR
from jitwarm.cache.locks import left_by_dead_process, this_host
from jitwarm.cache.signing import signature_file, signature_path


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
