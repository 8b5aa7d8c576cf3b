"""Triton's own cache directory (``TRITON_CACHE_DIR``), when jitwarm's cache manager is not serving Triton.

A unit is one key directory, complete when every file its ``__grp__`` file (written last) names is there
(``get_group``'s own test, runtime/cache.py), or holding only files Triton keeps alone (a launcher ``.so``,
``*.autotune.json``). Group files name absolute paths: stored with bare names, restored with the destination's.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import FamilyCount, Library, expand, regular_files, subdirs

GROUP = "__grp__"
_ALONE = (".so", ".autotune.json")


def resolve(environ: Mapping[str, str]) -> Path:
    """Triton's ``knobs.cache.dir`` in ``environ``."""
    if environ.get("TRITON_CACHE_DIR"):
        return Path(environ["TRITON_CACHE_DIR"])
    return expand(environ.get("TRITON_HOME") or "~") / ".triton" / "cache"


def _is_group(rel: str) -> bool:
    """Whether ``rel`` is a group file (Triton's commit record)."""
    return Path(rel).name.startswith(GROUP)


def _child_names(data: bytes) -> dict[str, str]:
    """A group file's children: Triton's name -> the file's bare name."""
    return {str(k): Path(str(v)).name for k, v in json.loads(data)["child_paths"].items()}


def served_by_jitwarm() -> bool:
    """Whether Triton's compiles go through jitwarm's cache manager here (then no Triton directory holds them)."""
    if os.environ.get("TRITON_CACHE_MANAGER", "").startswith("jitwarm."):
        return True
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    manager = getattr(getattr(knobs, "cache", None), "manager_class", None) if knobs is not None else None
    return str(getattr(manager, "__module__", "")).startswith("jitwarm.")


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The complete key directories of one Triton cache directory."""
    found: dict[str, tuple[str, ...]] = {}
    for key_dir in subdirs(root):
        if key_dir.name.startswith("tmp."):
            continue
        names = set(regular_files(key_dir))
        groups = sorted(n for n in names if n.startswith(GROUP))
        if not groups:
            if names and all(n.endswith(_ALONE) for n in names):
                found[key_dir.name] = tuple(sorted(f"{key_dir.name}/{n}" for n in names))
            continue
        members: set[str] = set(groups)
        try:
            for group in groups:
                members.update(_child_names((key_dir / group).read_bytes()).values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a group file Triton itself would call corrupt
        if members <= names:
            found[key_dir.name] = tuple(sorted(f"{key_dir.name}/{n}" for n in members))
    return found


def normalize(rel: str, data: bytes) -> bytes:
    """A group file with bare names (relocatable); any other file as it is."""
    if not _is_group(rel):
        return data
    return json.dumps({"child_paths": _child_names(data)}, sort_keys=True).encode()


def localize(rel: str, data: bytes, root: Path) -> bytes:
    """A stored group file with the destination's absolute paths, as Triton's ``put_group`` writes them."""
    if not _is_group(rel):
        return data
    where = root / Path(rel).parent
    names = json.loads(data)["child_paths"]
    return json.dumps({"child_paths": {k: str(where / v) for k, v in names.items()}}).encode()


def arch_of(root: Path, files: tuple[str, ...]) -> str | None:
    """``sm_XY`` from the compile's metadata file (``{"target": {"backend": "cuda", "arch": 90}}``)."""
    for rel in files:
        if rel.endswith(".json") and not _is_group(rel) and not rel.endswith(".autotune.json"):
            try:
                target = json.loads((root / rel).read_bytes()).get("target", {})
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(target, dict) and target.get("backend") == "cuda":
                return f"sm_{target.get('arch')}"
    return None


def _manager_served() -> list[tuple[str, str]]:
    """What jitwarm's Triton cache manager did in this process, if it is imported (imports nothing)."""
    manager = sys.modules.get("jitwarm.kernels.libraries.triton.cache")
    return manager.served() if manager is not None else []


class ManagerSignal:
    """Triton's compiles as jitwarm's cache manager answered them (served or compiled), when it serves them."""

    def __init__(self) -> None:
        self.start = len(_manager_served())

    def count(self, before: Mapping[str, Any], after: Mapping[str, Any],
              new: Mapping[str, Mapping[str, tuple[str, ...]]]) -> FamilyCount | None:
        """The manager's answers since the start; None when Triton's compiles do not go through it here."""
        done = _manager_served()
        if not (served_by_jitwarm() or done):
            return None
        since = done[self.start:]
        compiled = sorted(kernel for kernel, outcome in since if outcome == "compiled")
        return FamilyCount("triton", "jitwarm's Triton cache manager", sum(o == "served" for _, o in since),
                           len(compiled), tuple(compiled))


LIBRARY = Library(*named("triton"), resolve, units, ("triton", "arch"), is_commit=_is_group,
                  normalize=normalize, localize=localize, arch_of=arch_of, signal=ManagerSignal,
                  bypassed=served_by_jitwarm)
name, description, build, check, load = bind(LIBRARY)
