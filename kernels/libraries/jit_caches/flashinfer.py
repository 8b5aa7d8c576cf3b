"""FlashInfer's JIT cache (``FLASHINFER_WORKSPACE_BASE``/.cache/flashinfer): its ``cached_ops`` modules.

A unit is one ``<version>/<archs>/cached_ops/<name>/``, complete with ``<name>.so`` while no build holds
``cached_ops/tmp/<name>.lock`` (flashinfer/jit/core.py), with everything ninja reads for it: FlashInfer runs
ninja before it loads a JIT-built ``.so``, so the unit takes the sources it generated under ``generated/``, and
a restore gives each file the time ninja logged (:func:`settle`), else ninja builds again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, expand, lock_held, subdirs, tree_files

#: Ninja's own files in the module directory (dot-files, which the shared listing leaves out).
NINJA_FILES = (".ninja_log", ".ninja_deps")


def resolve(environ: Mapping[str, str]) -> Path:
    """FlashInfer's ``FLASHINFER_CACHE_DIR`` in ``environ``."""
    return Path(environ.get("FLASHINFER_WORKSPACE_BASE") or expand("~")) / ".cache" / "flashinfer"


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The complete modules under ``root``, each with its generated sources."""
    found: dict[str, tuple[str, ...]] = {}
    for version in subdirs(root):
        for arch in subdirs(version):
            ops = arch / "cached_ops"
            if not ops.is_dir():
                continue
            for module in subdirs(ops):
                if module.name == "tmp" or not (module / f"{module.name}.so").is_file():
                    continue
                if lock_held(ops / "tmp" / f"{module.name}.lock"):
                    continue
                unit = module.relative_to(root).as_posix()
                files = {f"{unit}/{rel}" for rel in tree_files(module)}
                files |= {f"{unit}/{n}" for n in NINJA_FILES if _regular(module / n)}
                files |= {p.relative_to(root).as_posix() for p in _generated(arch, module)}
                found[unit] = tuple(sorted(files))
    return found


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _generated(arch: Path, module: Path) -> set[Path]:
    """The files under ``arch/generated/`` the module's build reads: those ``build.ninja`` names, its own folder."""
    gen = arch / "generated"
    own = gen / module.name
    found = {own / rel for rel in tree_files(own)} if own.is_dir() and not own.is_symlink() else set()
    try:
        text = (module / "build.ninja").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return found
    prefix = f"{gen}/"
    for line in text.splitlines():
        if line.startswith("build ") and ":" in line:
            for word in line.split(":", 1)[1].split():
                if word.startswith(prefix) and _regular(Path(word)):
                    found.add(Path(word))
    return found


def logged_mtimes(log: Path) -> dict[str, int]:
    """Ninja's ``.ninja_log`` (v5 and later): each output's path -> the mtime (ns) ninja recorded for it, last wins."""
    found: dict[str, int] = {}
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return found
    for line in lines[1:]:  # "# ninja log vN", then start, end, mtime, output, command hash
        fields = line.split("\t")
        if len(fields) == 5 and fields[2].isdigit():
            found[fields[3]] = int(fields[2])
    return found


def settle(root: Path, unit: str, files: tuple[str, ...]) -> None:
    """Give a restored module the times ninja logged, sources the earliest; nothing when it has no log."""
    logged = logged_mtimes(root / unit / ".ninja_log")
    if not logged:
        return
    earliest = min(logged.values())
    for rel in files:
        path = root / rel
        mtime = logged.get(str(path), logged.get(os.path.realpath(path)))  # ninja logs resolved paths
        if mtime is None and not rel.startswith(f"{unit}/"):
            mtime = earliest  # a generated source: no newer than anything built from it
        if mtime is not None:
            with contextlib.suppress(OSError):
                os.utime(path, ns=(mtime, mtime), follow_symlinks=False)


LIBRARY = Library(*named("flashinfer"), resolve, units, ("flashinfer", "nvcc", "arch"),
                  unit_is_dir=False, is_commit=lambda rel: rel.endswith(".so"), settle=settle)
name, description, build, check, load = bind(LIBRARY)
