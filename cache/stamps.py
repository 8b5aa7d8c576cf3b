"""Verification stamps: the stat signature of an entry this host hashed, kept in the writable root.

A stamp lets a later process accept an entry without reading its files again while every file's inode,
size, mtime and ctime are still those that were hashed (see docs/cache.md, "What is verified, and when").
Stamps live in ``<root>/v1/verified/<kk>/<key>-<where>.json``, where only this user can write; a stamp is a
hint: one that is missing, unreadable, planted or stale costs a full hash, never a wrong answer.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from jitwarm.cache.bounded import loads, read_file_stat, read_json
from jitwarm.cache.durable import write_atomic
from jitwarm.cache.entry import Entry, recheck_entry
from jitwarm.cache.errors import CorruptEntry
from jitwarm.cache.layout import MAX_FACT_BYTES, RootLayout, untrusted_reason


def write_stamp(root: RootLayout, entry: Entry) -> None:
    """Keep the signature of ``entry`` (of any root or layer) in the writable ``root``; best effort, never raises."""
    path = root.stamp_path(entry.path, entry.key)
    with contextlib.suppress(OSError):  # a stamp only saves the next process a hash
        root.ensure(path.parent)
        doc = {"path": os.fspath(entry.path), "signature": entry.signature}
        write_atomic(path, json.dumps(doc).encode(), durable=False)


def stamped_entry(root: RootLayout, path: Path, key: str, *, allow_shared: bool, read_only: bool) -> Entry | None:
    """The entry at ``path`` when ``root`` holds a stamp whose signature its files still match, else None.

    See :func:`jitwarm.cache.entry.recheck_entry`; a stamp that is not ours (another owner), not a regular
    file, too large or malformed is ignored. Raises ``CacheError`` only for an untrusted entry.
    """
    try:
        data, st = read_file_stat(root.stamp_path(path, key), MAX_FACT_BYTES)
        if untrusted_reason(st) and not allow_shared:
            return None
        doc = loads(data)
        signature = tuple(tuple(item) for item in doc["signature"])
        if doc["path"] != os.fspath(path):
            return None
        return recheck_entry(path, key, signature, allow_shared=allow_shared, read_only=read_only)
    except (OSError, ValueError, KeyError, TypeError, CorruptEntry):
        return None


def prune_stamps(root: RootLayout) -> None:
    """Delete the stamps of entry directories that are gone (a stale one only costs a file); never raises."""
    for shard in _subdirs(root.stamps):
        try:
            with os.scandir(shard) as it:
                stamps = [item.path for item in it if item.name.endswith(".json")]
        except OSError:
            continue
        for stamp in stamps:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                if not os.path.lexists(read_json(stamp, MAX_FACT_BYTES)["path"]):
                    Path(stamp).unlink()


def _subdirs(path: Path) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [item.path for item in it if item.is_dir(follow_symlinks=False)]
    except OSError:
        return []
