"""FlashInfer's JIT cache (``FLASHINFER_WORKSPACE_BASE``/.cache/flashinfer): its ``cached_ops`` modules.

Where (flashinfer/jit/env.py): ``FLASHINFER_WORKSPACE_BASE`` (default: home) ``/.cache/flashinfer``, each
module in ``<version>/<sorted archs>/cached_ops/<name>/``; under sglang the base is ``SGLANG_CACHE_DIR``
itself (srt/environ.py:2318-2319).

A unit is one module directory: ninja builds it in place under ``cached_ops/tmp/<name>.lock``
(flashinfer/jit/core.py, ``build_and_load``), so it is complete when ``<name>.so`` is there and no build
holds that lock. The whole directory (``build.ninja``, ninja's log, the objects, the ``.so``) is the unit: the
JIT path's freshness is ninja's, which reads them all. ``cubins/`` holds FlashInfer's downloaded cubins,
verified by their own checksums: not units here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.libraries.jit_caches.backend import bind
from jitwarm.kernels.libraries.jit_caches.units import SGLANG, Library, lock_held, sglang_base, subdirs, tree_files


def resolve(environ: Mapping[str, str], server: str) -> Path:
    """FlashInfer's ``FLASHINFER_CACHE_DIR`` in ``environ``."""
    base = environ.get("FLASHINFER_WORKSPACE_BASE")
    if not base:
        base = sglang_base(environ) if server == SGLANG else str(Path("~").expanduser())
    return Path(base) / ".cache" / "flashinfer"


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The complete module directories under ``root``."""
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
                found[unit] = tuple(f"{unit}/{rel}" for rel in tree_files(module))
    return found


def _so_last(files: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(files, key=lambda rel: (rel.endswith(".so"), rel)))


LIBRARY = Library("flashinfer", "flashinfer_cache", resolve, units, ("flashinfer", "nvcc", "arch"),
                  commit_last=_so_last)
name, description, build, check, load = bind(LIBRARY)
