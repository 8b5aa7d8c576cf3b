"""Where things live under a cache root, and how staging directories are named and recognised."""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from jitwarm.cache.durable import make_dirs
from jitwarm.cache.keys import is_key
from jitwarm.cache.locks import this_host

#: Top folder of the current on-disk format.
VERSION_DIR = "v1"
#: Tag of a staging directory that holds an unpacked bundle rather than one key's build.
BUNDLE_TAG = "bundle"

# <host>-<pid>-<tag>-<rand>; the host may contain dashes, so parse from the right.
_STAGING_RE = re.compile(r"(?P<host>.+)-(?P<pid>\d+)-(?P<tag>[0-9a-f]{64}|" + BUNDLE_TAG + r")-[0-9a-f]{8}")
_PLAN_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class StagingName:
    """The parsed name of a staging directory: who made it, and for which key (or a bundle)."""

    host: str
    pid: int
    tag: str

    @property
    def key(self) -> str | None:
        """The key being built, or None for a bundle import."""
        return self.tag if is_key(self.tag) else None


class RootLayout:
    """Paths of one cache root (see DESIGN.md, "Cache").

    Layout::

        <root>/v1/entries/<kk>/<key>/     published entries, entry.json written last
        <root>/v1/staging/<host>-<pid>-<key|bundle>-<rand>/   builds and imports in progress
        <root>/v1/locks/<key>.lock        default lock dir (JITWARM_LOCK_DIR moves it)
        <root>/v1/plans/<plan_id>.json    plan completion records
        <root>/v1/quarantine/             entries that failed verification

    Nothing here touches the filesystem except :meth:`ensure`, and the ``iter_*`` methods, which only read.
    With ``shared`` (``allow_shared``), directories are created ``0777`` minus the umask, so a team umask
    of ``002`` makes them group-writable; otherwise ``0755`` minus the umask.
    """

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

    def ensure(self, path: Path) -> Path:
        """Create ``path`` (a directory of this root) and its missing parents with :attr:`dir_mode`."""
        make_dirs(path, self.dir_mode)
        return path

    def entry_dir(self, key: str) -> Path:
        """Return where the entry of ``key`` is (or would be) published."""
        return self.entries / key[:2] / key

    def plan_path(self, plan_id: str) -> Path:
        """Return the path of a plan record, checking that ``plan_id`` is a safe file name.

        Raises
        ------
        ValueError
            ``plan_id`` is empty, too long, starts with a dot or holds characters outside
            ``[A-Za-z0-9._-]``.

        """
        if not isinstance(plan_id, str) or _PLAN_ID_RE.fullmatch(plan_id) is None:
            raise ValueError(f"bad plan id {plan_id!r}: use 1-128 characters from [A-Za-z0-9._-], "
                             "not starting with a dot or dash")
        return self.plans / f"{plan_id}.json"

    def new_staging_dir(self, tag: str) -> Path:
        """Return a fresh, not yet created, staging path for ``tag`` (a key or ``BUNDLE_TAG``)."""
        return self.staging / f"{this_host()}-{os.getpid()}-{tag}-{secrets.token_hex(4)}"

    def quarantine_dir(self, key: str) -> Path:
        """Return a fresh, unique path in quarantine for a bad copy of ``key``."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        return self.quarantine / f"{key}-{stamp}-{os.getpid()}-{secrets.token_hex(4)}"

    def iter_entry_dirs(self) -> Iterator[tuple[str, Path]]:
        """Yield ``(key, path)`` of every published entry directory, in key order."""
        for shard in _sorted_dirs(self.entries):
            if len(shard.name) != 2:
                continue
            for entry in _sorted_dirs(shard):
                if is_key(entry.name) and entry.name[:2] == shard.name:
                    yield entry.name, entry

    def iter_staging(self) -> Iterator[tuple[StagingName | None, Path]]:
        """Yield every staging directory with its parsed name (None when the name is not ours)."""
        for path in _sorted_dirs(self.staging):
            m = _STAGING_RE.fullmatch(path.name)
            yield (StagingName(m["host"], int(m["pid"]), m["tag"]) if m else None), path


def _sorted_dirs(path: Path) -> list[Path]:
    """List the subdirectories of ``path`` (not following links); empty if it does not exist."""
    try:
        with os.scandir(path) as it:
            return sorted(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []
