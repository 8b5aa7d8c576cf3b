"""Where things live under a cache root: paths, staging names, plan records, and the trust check on what is there."""

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

