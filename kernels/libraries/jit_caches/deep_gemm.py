"""DeepGEMM's JIT cache (``DG_JIT_CACHE_DIR``): the FP8 GEMMs, minutes cold (sglang PR #18823).

Where: ``DG_JIT_CACHE_DIR``, else ``$HOME/.deep_gemm`` (csrc/jit/compiler.hpp); sglang overrides it with
``SGLANG_DG_CACHE_DIR``, default ``<SGLANG_CACHE_DIR>/deep_gemm`` (srt/environ.py:1373), exported as
``DG_JIT_CACHE_DIR`` when its wrapper is imported (srt/layers/deep_gemm_wrapper/compile_utils.py:51).

A unit is one kernel directory ``kernel.<name>.<hex digest>`` (DeepGEMM's key: the name, the NVCC or NVRTC
signature, the flags with ``sm_XY`` and the generated code with its headers' hash): DeepGEMM compiles into
``tmp/<uuid>/``, fsyncs and renames the whole directory into place (compiler.hpp). It is complete when it
holds ``kernel.cu`` and ``kernel.cubin``, what DeepGEMM's loader asserts (kernel_runtime.hpp). It is looked for
at any depth below the root (sglang has kept a subdirectory per process, PR #27604), never under ``tmp/`` or
``locks/`` (sglang's precompile locks, compile_utils.py:130-138). sglang 0.5.23 writes no completion marker
(#32124 asks for one); when it does, it is to be listed here as a unit of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.libraries.jit_caches.backend import bind
from jitwarm.kernels.libraries.jit_caches.units import (
    SGLANG,
    VLLM,
    Library,
    regular_files,
    sglang_base,
    subdirs,
    vllm_root,
)

REQUIRED = ("kernel.cu", "kernel.cubin")
_SKIP = ("tmp", "locks")


def resolve(environ: Mapping[str, str], server: str) -> Path:
    """The directory DeepGEMM's JIT uses in ``environ`` (sglang's override first, when under sglang)."""
    if server == SGLANG:
        return Path(environ.get("SGLANG_DG_CACHE_DIR") or Path(sglang_base(environ)) / "deep_gemm")
    if environ.get("DG_JIT_CACHE_DIR"):
        return Path(environ["DG_JIT_CACHE_DIR"])
    if server == VLLM:  # vLLM sets DG_JIT_CACHE_DIR to it when unset (utils/deep_gemm.py:281-285)
        return vllm_root(environ) / "deep_gemm"
    return Path("~").expanduser() / ".deep_gemm"


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The complete ``kernel.*`` directories under ``root``."""
    found: dict[str, tuple[str, ...]] = {}
    pending = [root]
    while pending:
        folder = pending.pop()
        for sub in subdirs(folder):
            if folder == root and sub.name in _SKIP:
                continue
            if not sub.name.startswith("kernel."):
                pending.append(sub)
                continue
            names = set(regular_files(sub))
            if set(REQUIRED) <= names:
                unit = sub.relative_to(root).as_posix()
                found[unit] = tuple(sorted(f"{unit}/{n}" for n in names))
    return found


LIBRARY = Library("deep_gemm", "deep_gemm_cache", resolve, units, ("deep_gemm", "nvcc", "arch"))
name, description, build, check, load = bind(LIBRARY)
