"""Where things live under a cache root: paths, staging names, and the records kept beside the entries.

Plan records, facts, and stamps: what this host hashed an entry as (a hint: a missing, damaged, planted or
stale one costs a full hash, never a wrong answer).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from jitwarm.cache.entry import MANIFEST, Entry, FileRecord, is_safe_relpath, recheck_entry
from jitwarm.cache.errors import CacheWriteError
from jitwarm.cache.files import loads, make_dirs, read_file_stat, read_json, remove_tree, untrusted_reason, write_atomic
from jitwarm.cache.keys import is_key
from jitwarm.cache.locks import this_host

log = logging.getLogger("jitwarm.cache")

VERSION_DIR = "v1"
#: Tag of a staging directory that holds an unpacked bundle rather than one key's build.
BUNDLE_TAG = "bundle"

# <host>-<pid>-<tag>-<rand>; the host may contain dashes, so parse from the right.
_STAGING_RE = re.compile(r"(?P<host>.+)-(?P<pid>\d+)-(?P<tag>[0-9a-f]{64}|" + BUNDLE_TAG + r")-[0-9a-f]{8}")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
MAX_FACT_BYTES = 1 << 16
MAX_PLAN_RECORD_BYTES = 16 << 20
MAX_STAMP_BYTES = 1 << 20


class StagingName(NamedTuple):
    """The parsed name of a staging directory: who made it, and the key it builds (None: a bundle import)."""

    host: str
    pid: int
    key: str | None


class RootLayout:
    """Paths of one cache root (:mod:`jitwarm.cache.store.protocol`); directories are made 0777 if ``shared``."""

    def __init__(self, root: Path, *, shared: bool = False) -> None:
        self.root = root
        self.shared = shared
        self.dir_mode = 0o777 if shared else 0o755
        self.base = root / VERSION_DIR
        self.entries = self.base / "entries"
        self.staging = self.base / "staging"
        self.locks = self.base / "locks"
        self.plans = self.base / "plans"
        self.quarantine = self.base / "quarantine"
        self.stamps = self.base / "verified"
        self.facts = self.base / "facts"
        self._entry_dirs: dict[str, Path] = {}

    def ensure(self, path: Path) -> Path:
        """Create ``path`` (a directory of this root) and its missing parents with :attr:`dir_mode`."""
        make_dirs(path, self.dir_mode)
        return path

    def entry_dir(self, key: str) -> Path:
        """Return where the entry of ``key`` is (or would be) published."""
        found = self._entry_dirs.get(key)  # memoized: a lookup and a claim each ask, on the hook's hot path
        if found is None:
            found = self._entry_dirs.setdefault(key, self.entries.joinpath(key[:2], key))
        return found

    def stamp_path(self, entry_dir: Path, key: str) -> Path:
        """Where this root keeps the verification stamp of the entry directory ``entry_dir`` (any root's)."""
        where = hashlib.sha256(os.fsencode(entry_dir)).hexdigest()[:16]
        return self.stamps.joinpath(key[:2], f"{key}-{where}.json")  # one Path made, not two: a lookup's hot path

    def plan_path(self, plan_id: str) -> Path:
        """Return the path of a plan record; ValueError for a bad ``plan_id``."""
        return _json_file(self.plans, plan_id, "plan id")

    def make_staging_dir(self, tag: str) -> Path:
        """Create and return a fresh staging directory for ``tag`` (a key or ``BUNDLE_TAG``); OSError."""
        for tries_left in (2, 1, 0):  # staging/ exists only while in use: another process may remove it meanwhile
            path = self.staging / f"{this_host()}-{os.getpid()}-{tag}-{secrets.token_hex(4)}"
            self.ensure(self.staging)
            try:
                path.mkdir(mode=self.dir_mode)
                return path
            except FileNotFoundError:
                if not tries_left:
                    raise
        raise AssertionError("unreachable")

    def drop_staging(self, path: Path | None = None) -> None:
        """Remove the staging directory ``path`` (if any), then ``staging/`` if it is empty; never raises."""
        if path is not None:
            remove_tree(path)
        with contextlib.suppress(OSError):
            self.staging.rmdir()

    def quarantine_dir(self, name: str) -> Path:
        """Return a fresh, unique path in quarantine for a bad copy of ``name`` (a key, or ``shard-<kk>``)."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        return self.quarantine / f"{name}-{stamp}-{os.getpid()}-{secrets.token_hex(4)}"

    def iter_entry_dirs(self) -> Iterator[tuple[str, Path]]:
        """Yield ``(key, path)`` of every published entry directory (not a link), in key order."""
        for key, path in self.iter_entry_names():
            if key is not None and not path.is_symlink() and path.is_dir():
                yield key, path

    def iter_entry_names(self) -> Iterator[tuple[str | None, Path]]:
        """Yield ``(key, path)`` of each entry name, ``(None, path)`` of each shard that is no listable directory."""
        try:
            with os.scandir(self.entries) as it:
                shards = sorted((e.name, Path(e.path)) for e in it if _SHARD_RE.fullmatch(e.name))
        except OSError:
            return
        for name, shard in shards:
            try:
                if not stat.S_ISDIR(os.lstat(shard).st_mode):
                    yield None, shard
                    continue
                with os.scandir(shard) as it:
                    found = sorted(e.name for e in it if is_key(e.name) and e.name[:2] == name)
            except FileNotFoundError:
                continue
            except OSError:
                yield None, shard
                continue
            for key in found:
                yield key, shard / key

    def iter_staging(self) -> Iterator[tuple[StagingName | None, Path]]:
        """Yield every staging directory (not a link) with its parsed name (None when the name is not ours)."""
        try:
            with os.scandir(self.staging) as it:
                paths = sorted(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            return
        for path in paths:
            m = _STAGING_RE.fullmatch(path.name)
            name = StagingName(m["host"], int(m["pid"]), None if m["tag"] == BUNDLE_TAG else m["tag"]) if m else None
            yield name, path


def write_plan_record(layout: RootLayout, plan_id: str, record: Mapping[str, Any]) -> Path:
    """Atomically write ``record`` as ``<root>/v1/plans/<plan_id>.json``; ValueError, TypeError, CacheWriteError."""
    target = layout.plan_path(plan_id)
    data = json.dumps(dict(record), indent=1, sort_keys=True, allow_nan=False).encode("utf-8")
    try:
        write_atomic(layout.ensure(layout.plans) / target.name, data)
    except OSError as exc:
        raise CacheWriteError.of("write the plan record", exc, target) from exc
    return target


def write_fact(layout: RootLayout, name: str, value: str) -> None:
    """Write the fact ``name`` (a safe file name) of this root, atomically; OSError on failure."""
    path = _json_file(layout.facts, name, "fact name")
    write_atomic(layout.ensure(layout.facts) / path.name, json.dumps({"value": value}).encode(), durable=False)


def read_fact(layout: RootLayout, name: str, *, allow_shared: bool) -> str | None:
    """Return the fact ``name`` of this root, or None when there is none, it is unreadable or untrusted."""
    path = _json_file(layout.facts, name, "fact name")
    try:
        data, st = read_file_stat(path, MAX_FACT_BYTES)
        if not allow_shared and untrusted_reason(st):
            return None
        value = loads(data)["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


def _json_file(folder: Path, name: str, what: str) -> Path:
    """``folder/<name>.json``; ValueError unless ``name`` is a safe file name (1-128 of ``[A-Za-z0-9._-]``)."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise ValueError(f"bad {what} {name!r}: use 1-128 characters from [A-Za-z0-9._-], not starting with a dot "
                         "or dash")
    return folder / f"{name}.json"


def read_plan_record(layouts: Sequence[RootLayout], plan_id: str) -> dict[str, Any] | None:
    """Return the record ``plan_id`` from the first of ``layouts`` with a readable one (a bad one is logged)."""
    for layout in layouts:
        path = layout.plan_path(plan_id)
        try:
            data = read_json(path, MAX_PLAN_RECORD_BYTES)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable plan record %s: %s", path, getattr(exc, "strerror", None) or exc)
            continue
        if isinstance(data, dict):
            return data
        log.warning("ignoring plan record %s: not a JSON object", path)
    return None


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


def _read_stamp(path: Path | str, *, allow_shared: bool) -> Any:
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
        stamped = _stamp_entry(_read_stamp(root.stamp_path(path, key), allow_shared=allow_shared), path, key, read_only)
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
                useless = not os.path.lexists(_read_stamp(stamp, allow_shared=False)["path"])
            except OSError:
                continue
            except (ValueError, KeyError, TypeError, AttributeError):  # damaged, or of an older layout
                useless = True
            if useless:
                with contextlib.suppress(OSError):
                    stamp.unlink()
