"""DeepGEMM's JIT cache (``DG_JIT_CACHE_DIR``): the FP8 GEMMs, minutes cold (sglang PR #18823).

Where (sgl-deep-gemm 0.2.3.post2, sglang 0.5.23's pin, whose JIT is deep_jit: ``DiskCache::from_env`` in
include/deep_jit/cache/disk.hpp, with the prefix ``DG``): ``DG_JIT_CACHE_DIR``, else ``DJ_JIT_CACHE_DIR``, a
``:``-separated list whose first path is the one written (the others are read-only lookup roots), else
``$HOME/.dj``. sglang overwrites ``DG_JIT_CACHE_DIR`` and vLLM sets it when unset, each under its own cache
directory (their rooms say where).

A unit is one entry directory ``cache/<kernel name>.<digest>/`` (deep_jit's key: an FNV-1a hex digest of the
compiler's signature, the options and the generated code with its headers): deep_jit compiles into
``tmp/<uuid>/``, writes and fsyncs the completion marker ``.committed`` last, and renames the whole directory
into place (``DiskCacheEntry::commit``); a lookup is a hit exactly when ``.committed`` is there. So a unit is
complete when it holds ``.committed``, and the marker goes with its unit, restored last (the kind of marker
sglang #32124 asks for). Older DeepGEMM releases (csrc/jit/compiler.hpp: ``kernel.<name>.<digest>/`` with
``kernel.cu`` and ``kernel.cubin``, no marker, default ``$HOME/.deep_gemm``) are listed too. Units are looked
for at any depth below the root (sglang has kept a subdirectory per process, PR #27604), never under ``tmp/``
or ``locks/`` (sglang's precompile locks, compile_utils.py:130-138).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, expand, regular_files, subdirs

#: deep_jit's completion marker (disk.hpp ``kCommitFileName``), written last into the entry before its rename.
COMMITTED = ".committed"
#: What an older DeepGEMM's loader asserts in a ``kernel.*`` directory (kernel_runtime.hpp).
REQUIRED = ("kernel.cu", "kernel.cubin")
_SKIP = ("tmp", "locks")


def resolve(environ: Mapping[str, str]) -> Path:
    """The directory DeepGEMM's JIT writes in ``environ``."""
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


LIBRARY = Library("deep_gemm", "deep_gemm_cache", resolve, units, ("deep_gemm", "nvcc", "arch"),
                  is_commit=lambda rel: rel.endswith(f"/{COMMITTED}"))
name, description, build, check, load = bind(LIBRARY)
