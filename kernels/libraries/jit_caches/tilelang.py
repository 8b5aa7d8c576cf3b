"""TileLang's kernel cache (``TILELANG_CACHE_DIR``): the DeepSeek-V4 MHC prenorm and fp8 attention kernels.

A unit is one ``<version>/<platform>-<machine>/kernels/<key>/`` (tilelang/cache/kernel_cache.py), renamed into
place whole; complete with its ``manifest.json`` and every file it lists (0.1.15 on), or, in 0.1.12 (sglang
0.5.23's pin), with the files of one execution backend (``_get_complete_cache_files``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, expand, regular_files, subdirs

MANIFEST = "manifest.json"
_SOURCES = ("device_kernel.cu", "host_kernel.cu", "params.pkl")
#: TileLang 0.1.12's complete sets, one per execution backend's cache class (without a manifest).
COMPLETE = (frozenset({*_SOURCES, "executable.so"}), frozenset({*_SOURCES, "kernel_lib.so"}),
            frozenset({*_SOURCES, "kernel.cubin", "kernel.py"}),
            frozenset({"device_kernel.py", "host_kernel.py", "kernel.py", "params.pkl", "launcher_lib.so"}))


def resolve(environ: Mapping[str, str]) -> Path:
    """TileLang's ``env.TILELANG_CACHE_DIR`` in ``environ``."""
    if environ.get("TILELANG_CACHE_DIR"):
        return Path(environ["TILELANG_CACHE_DIR"])
    return expand("~/.tilelang/cache")


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The complete kernel directories under ``root``."""
    found: dict[str, tuple[str, ...]] = {}
    for version in subdirs(root):
        for host in subdirs(version):
            kernels = host / "kernels"
            if not kernels.is_dir():
                continue
            for key_dir in subdirs(kernels):
                names = set(regular_files(key_dir))
                if not _complete(key_dir, names):
                    continue
                unit = key_dir.relative_to(root).as_posix()
                found[unit] = tuple(sorted(f"{unit}/{n}" for n in names))
    return found


def _complete(key_dir: Path, names: set[str]) -> bool:
    if MANIFEST not in names:
        return any(complete <= names for complete in COMPLETE)
    try:
        listed = json.loads((key_dir / MANIFEST).read_bytes())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # unreadable: TileLang itself rejects the entry
    return isinstance(listed, dict) and bool(listed) and set(listed) <= names


LIBRARY = Library(*named("tilelang"), resolve, units, ("tilelang", "torch", "nvcc", "arch"),
                  is_commit=lambda rel: rel.endswith(f"/{MANIFEST}"))
name, description, build, check, load = bind(LIBRARY)
