"""TileLang's kernel cache (``TILELANG_CACHE_DIR``): the DeepSeek-V4 MHC prenorm and fp8 attention kernels.

Where (tilelang/env.py): ``TILELANG_CACHE_DIR``, else ``~/.tilelang/cache``; under sglang
``<SGLANG_CACHE_DIR>/tilelang``, the redirect whose comment says the burst is otherwise "invisible to anyone
warming, mounting or baking SGLANG_CACHE_DIR" (srt/environ.py:2313-2316).

A unit is one kernel directory ``<version>/<platform>-<machine>/kernels/<key>/`` (tilelang/cache/
kernel_cache.py, ``_get_cache_path``): TileLang writes it in ``.staging`` and renames the whole directory
into place, its ``manifest.json`` (size and sha256 of every file) written last. Complete: the manifest is
there, and so is every file it lists, ``kernel_lib.so`` and ``params.json`` among them (``_get_required_files``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.libraries.jit_caches.backend import bind
from jitwarm.kernels.libraries.jit_caches.units import SGLANG, Library, regular_files, sglang_base, subdirs

MANIFEST = "manifest.json"
REQUIRED = ("kernel_lib.so", "params.json")


def resolve(environ: Mapping[str, str], server: str) -> Path:
    """TileLang's ``env.TILELANG_CACHE_DIR`` in ``environ``."""
    if environ.get("TILELANG_CACHE_DIR"):
        return Path(environ["TILELANG_CACHE_DIR"])
    if server == SGLANG:
        return Path(sglang_base(environ)) / "tilelang"
    return Path("~/.tilelang/cache").expanduser()


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
                try:
                    listed = set(json.loads((key_dir / MANIFEST).read_bytes())["files"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # no manifest yet: TileLang has not finished it
                if not (listed | set(REQUIRED)) <= names:
                    continue
                unit = key_dir.relative_to(root).as_posix()
                found[unit] = tuple(sorted(f"{unit}/{n}" for n in names))
    return found


def _manifest_last(files: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(files, key=lambda rel: (rel.endswith("/" + MANIFEST), rel)))


LIBRARY = Library("tilelang", "tilelang_cache", resolve, units, ("tilelang", "torch", "nvcc", "arch"),
                  commit_last=_manifest_last)
name, description, build, check, load = bind(LIBRARY)
