"""The restore receipt: where a restore put each family's units, and the server's check that it looks there.

An init container and a server that share only a volume each resolve a library's cache from their own
environment: a restore into the init container's own ``$TMPDIR/torchinductor_<user>`` says "placed" and the
server compiles every module again. So the restore writes what it placed, and where, into the jitwarm cache root
(the volume both share); the server reads it at start and names both paths where its library looks elsewhere,
or where it does not find the units at the same path (another container's directory of the same name).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import NotReady
from jitwarm.cache.files import loads, read_file_stat, write_atomic
from jitwarm.kernels.libraries.jit_caches.units import Dirs

#: The receipt's file name in the jitwarm cache root.
RECEIPT = "restore-receipt.json"
VERSION = 1
#: A family's receipt names at most this many units' files (the check looks at each).
MAX_SHOWN = 1000
_MAX_BYTES = 16 << 20


class RestoredElsewhere(NotReady):
    """Under ``JITWARM_STRICT=1``: the server's library looks where the restore did not place the units (exit 5)."""


@dataclass
class FamilyRestore:
    """One family's restore: its destination ``root``, the server it was restored ``under``, outcome counts.

    ``files``: one file of each unit there, relative to the root (the one the library writes last).
    """

    root: str
    under: str = ""
    placed: int = 0
    present: int = 0
    kept: int = 0
    files: list[str] = field(default_factory=list)

    def note(self, outcome: str, file: str | None) -> None:
        """Count one unit's outcome; a placed or present one's ``file`` is named."""
        if outcome in ("placed", "present", "kept"):
            setattr(self, outcome, getattr(self, outcome) + 1)
        if outcome in ("placed", "present") and file is not None and len(self.files) < MAX_SHOWN:
            self.files.append(file)

    def as_json(self) -> dict[str, Any]:
        """The family's object in the receipt (and in ``prestart --json``)."""
        return {"root": self.root, "under": self.under, "placed": self.placed, "present": self.present,
                "kept": self.kept, "files": self.files}


def receipt_path(cache_root: Path) -> Path:
    """Where the receipt of restores into the caches of the jitwarm cache at ``cache_root`` is."""
    return cache_root / RECEIPT


def write(cache_root: Path, families: Mapping[str, FamilyRestore], plan_id: str) -> Path:
    """Write the receipt whole (a temporary renamed into place); OSError if it cannot be."""
    from jitwarm.cache.locks import this_host

    doc = {"v": VERSION, "written": time.time(), "host": this_host(), "pid": os.getpid(), "plan_id": plan_id,
           "families": {name: f.as_json() for name, f in sorted(families.items())}}
    path = receipt_path(cache_root)
    write_atomic(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    return path


def read(cache_root: Path) -> dict[str, Any] | None:
    """The receipt in ``cache_root``, or None when there is none or it is not one (never raises)."""
    try:
        data, _st = read_file_stat(receipt_path(cache_root), _MAX_BYTES)
        doc = loads(data)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("v") != VERSION or not isinstance(doc.get("families"), dict):
        return None
    return doc


@dataclass(frozen=True)
class Elsewhere:
    """A family restored where this process's library does not find it: both paths, and how many units it finds."""

    family: str
    placed_in: str
    looks_in: str | None
    found: int
    restored: int

    def line(self, receipt: Path) -> str:
        """The warning, naming both paths."""
        head = (f"jitwarm: restore: {self.family}: the restore placed {self.restored} unit(s) in {self.placed_in} "
                f"({receipt})")
        if self.looks_in is None:
            return f"{head}, but this server keeps no {self.family} cache (it is turned off here)"
        if not same_path(self.looks_in, self.placed_in):
            return (f"{head}, but this server's {self.family} cache is {self.looks_in}: it compiles them again. Give "
                    "both containers the same cache variables, pointing into the shared volume (docs/deployment.md, "
                    "Kubernetes)")
        return (f"{head}, and this server looks there but finds {self.found} of them: {self.looks_in} here is not "
                "the directory the restore wrote (each container has its own; put it on the shared volume: "
                "docs/deployment.md, Kubernetes)")

    def as_json(self) -> dict[str, Any]:
        """The family's object in the ledger's ``restored_elsewhere``."""
        return {"family": self.family, "placed_in": self.placed_in, "looks_in": self.looks_in, "found": self.found,
                "restored": self.restored}


def elsewhere(receipt: Mapping[str, Any], dirs: Dirs, server: str,
              environ: Mapping[str, str] | None = None) -> list[Elsewhere]:
    """The families of ``receipt`` this process (``server``'s, keeping caches as ``dirs`` says) would not find.

    A family restored under another server is not this one's to check. Never raises.
    """
    from jitwarm.kernels.libraries.jit_caches.census import library

    found = []
    for name, fam in sorted(receipt.get("families", {}).items()):
        try:
            under, placed_in = str(fam.get("under", "")), str(fam["root"])
            files = [str(f) for f in fam.get("files", [])]
            lib = library(name)
        except (KeyError, TypeError, AttributeError):
            continue
        if (under and server and under != server) or not files:
            continue
        root = lib.root(environ, dirs)
        there = 0 if root is None else sum(1 for rel in files if os.path.lexists(root / rel))
        if root is None or not same_path(str(root), placed_in) or there < len(files):
            found.append(Elsewhere(name, placed_in, None if root is None else str(root), there, len(files)))
    return found


def same_path(a: str, b: str) -> bool:
    """Whether two absolute paths name one directory here (as written, or through links)."""
    return os.path.normpath(a) == os.path.normpath(b) or os.path.realpath(a) == os.path.realpath(b)
