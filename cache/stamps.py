"""Verification stamps: what this host hashed an entry as, so a later process need not hash it again.

A stamp is a hint: one that is missing, damaged, planted or stale costs a full hash, never a wrong answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from jitwarm.cache.entry import MANIFEST, Entry, FileRecord, is_safe_relpath, recheck_entry
from jitwarm.cache.files import loads, read_file_stat, untrusted_reason, write_atomic
from jitwarm.cache.keys import is_key
from jitwarm.cache.layout import RootLayout

MAX_STAMP_BYTES = 1 << 20


def write_stamp(root: RootLayout, entry: Entry) -> None:
    """Keep what ``entry`` (of any root or layer) was verified as in the writable ``root``; never raises."""
    # Flat lists: they parse (and pass the depth check) fastest.
    doc = {"path": os.fspath(entry.path), "signature": [x for item in entry.signature for x in item],
           "files": [x for r in entry.records for x in (r.path, r.size, r.sha256)], "created": entry.created,
           "preimage": entry.preimage}
    path = root.stamp_path(entry.path, entry.key)
    with contextlib.suppress(OSError, ValueError):  # a stamp only saves the next process a hash
        body = json.dumps(doc, separators=(",", ":")).encode()
        data = hashlib.sha256(body).hexdigest().encode() + b"\n" + body
        if len(data) > MAX_STAMP_BYTES:
            return  # too large to keep twice: those entries are hashed on every first sight
        root.ensure(path.parent)
        write_atomic(path, data, durable=False)


def _read(path: Path | str, *, allow_shared: bool) -> Any:
    """The document of the stamp at ``path``; ValueError when it is damaged, OSError when it is not ours."""
    data, st = read_file_stat(path, MAX_STAMP_BYTES)
    if untrusted_reason(st) and not allow_shared:
        raise OSError(f"{path}: not this user's")
    digest, _, body = data.partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        raise ValueError(f"{path}: damaged")
    return loads(body)


def stamped_entry(root: RootLayout, path: Path, key: str, *, allow_shared: bool, read_only: bool,
                  st: os.stat_result | None = None) -> Entry | None:
    """The entry at ``path`` if ``root`` holds a stamp its files still match, else None; ``CacheError``."""
    try:
        stamped = _stamp_entry(_read(root.stamp_path(path, key), allow_shared=allow_shared), path, key, read_only)
    except (OSError, ValueError):
        return None
    return None if stamped is None else recheck_entry(stamped, allow_shared=allow_shared, st=st)


def _stamp_entry(doc: Any, path: Path, key: str, read_only: bool) -> Entry | None:
    """The entry a stamp document describes (not yet checked against the disk); None if not one of ``path``."""
    try:
        flat, listed = doc["signature"], doc["files"]
        if (doc["path"] != os.fspath(path) or type(flat) is not list or type(listed) is not list or len(flat) % 5
                or len(listed) % 3):
            return None
        # No conversions: only a signature equal to what lstat says is ever accepted (recheck_entry).
        signature = tuple(tuple(flat[i:i + 5]) for i in range(0, len(flat), 5))
        records = tuple(FileRecord(listed[i], listed[i + 1], listed[i + 2]) for i in range(0, len(listed), 3))
        preimage, created = doc["preimage"], float(doc["created"])
        files = tuple(r.path for r in records)
        sizes = {item[0]: item[2] for item in signature}
        if ([item[0] for item in signature] != sorted({*files, MANIFEST}) or len(files) + 1 != len(signature)
                or not all(is_safe_relpath(r.path) and sizes[r.path] == r.size and is_key(r.sha256) for r in records)
                or not isinstance(preimage.get("description"), dict)):
            return None
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
        return None
    return Entry(key=key, path=path, files=files, description=preimage["description"], preimage=preimage,
                 records=records, created=created, read_only=read_only, signature=signature)


def prune_stamps(root: RootLayout) -> None:
    """Delete the stamps naming an entry directory that is gone, and damaged ones; one not ours stays."""
    for folder, _dirs, names in os.walk(root.stamps):  # a symlinked shard is not followed
        for stamp in (Path(folder, name) for name in names if name.endswith(".json")):
            try:
                useless = not os.path.lexists(_read(stamp, allow_shared=False)["path"])
            except OSError:
                continue
            except (ValueError, KeyError, TypeError, AttributeError):  # damaged, or of an older layout
                useless = True
            if useless:
                with contextlib.suppress(OSError):
                    stamp.unlink()
