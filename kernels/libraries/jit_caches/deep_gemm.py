"""DeepGEMM's JIT cache (``DG_JIT_CACHE_DIR``): the FP8 GEMMs, minutes cold (sglang PR #18823).

sgl-deep-gemm 0.2.3.post2 (deep_jit, include/deep_jit/cache/disk.hpp): a unit is an entry directory holding
the ``.committed`` marker, written last before its rename (a lookup hits exactly then), restored last; older
releases' ``kernel.<name>.<digest>/`` with ``kernel.cu`` and ``kernel.cubin`` too. At any depth (sglang keeps a
subdirectory per process, PR #27604), never under ``tmp/`` or ``locks/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, expand, regular_files, subdirs

#: deep_jit's completion marker (disk.hpp ``kCommitFileName``), written last into the entry before its rename.
COMMITTED = ".committed"
#: What an older DeepGEMM's loader asserts in a ``kernel.*`` directory (kernel_runtime.hpp).
REQUIRED = ("kernel.cu", "kernel.cubin")
_SKIP = ("tmp", "locks")


def resolve(environ: Mapping[str, str]) -> Path:
    """The directory DeepGEMM's JIT writes in ``environ`` (``DiskCache::from_env``).

    ``DG_JIT_CACHE_DIR``, else ``DJ_JIT_CACHE_DIR``: a ``:``-separated list whose first path is the one written
    (the others are read-only lookup roots); else ``$HOME/.dj``.
    """
    for var in ("DG_JIT_CACHE_DIR", "DJ_JIT_CACHE_DIR"):  # Env::get: the library's prefix, then deep_jit's own
        if environ.get(var):
            return Path(environ[var].split(":")[0])
    return Path(environ.get("HOME") or expand("~")) / ".dj"


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The committed entry directories (and older releases' complete ``kernel.*`` directories) under ``root``."""
    found: dict[str, tuple[str, ...]] = {}
    pending = [root]
    while pending:
        folder = pending.pop()
        for sub in subdirs(folder):
            if folder == root and sub.name in _SKIP:
                continue
            names = set(regular_files(sub))
            committed = (sub / COMMITTED).is_file() and not (sub / COMMITTED).is_symlink()
            if committed:
                names.add(COMMITTED)
            elif not (sub.name.startswith("kernel.") and set(REQUIRED) <= names):
                pending.append(sub)
                continue
            unit = sub.relative_to(root).as_posix()
            found[unit] = tuple(sorted(f"{unit}/{n}" for n in names))
    return found


LIBRARY = Library(*named("deep_gemm"), resolve, units, ("deep_gemm", "nvcc", "arch"),
                  is_commit=lambda rel: rel.endswith(f"/{COMMITTED}"))
name, description, build, check, load = bind(LIBRARY)
