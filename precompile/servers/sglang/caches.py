"""Where sglang keeps the JIT libraries' caches (sglang 0.5.23, the room's ``VERSION``; file:line of its wheel).

Importing sglang runs ``redirect_third_party_caches`` (``srt/environ.py:2308-2320``), which sets each library's
unset variable under ``SGLANG_CACHE_DIR`` (:1383); its DeepGEMM wrapper overwrites ``DG_JIT_CACHE_DIR``
(:1373); the CuTe DSL objects are sglang's own (``SGLANG_CUTE_AOT_CACHE_DIR``, empty turns it off, :1387). The
room gives each library the environment sglang's process has, and the library resolves its own variable in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

#: The variables ``redirect_third_party_caches`` sets when unset -> their directory under ``SGLANG_CACHE_DIR``.
REDIRECTED = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor", "CUDA_CACHE_PATH": "nv",
              "TILELANG_CACHE_DIR": "tilelang", "FLASHINFER_WORKSPACE_BASE": ""}
#: The variables beside ``SGLANG_CACHE_DIR`` that sglang reads for the caches it moves or owns.
CACHE_VARIABLES = ("SGLANG_CACHE_DIR", "SGLANG_DG_CACHE_DIR", "SGLANG_CUTE_AOT_CACHE_DIR")


def cache_dirs(environ: Mapping[str, str], *, own_only: bool = False) -> dict[str, Path | None]:
    """Each library's cache directory in an sglang process with ``environ`` (None: off); ``own_only``: its own."""
    from jitwarm.kernels import kinds
    from jitwarm.kernels.libraries.jit_caches.units import expand

    base = expand(environ.get("SGLANG_CACHE_DIR") or "~/.cache/sglang")  # os.path.expanduser, as sglang's own
    cute = environ.get("SGLANG_CUTE_AOT_CACHE_DIR", str(base / "cute_aot"))
    own = {"cute_dsl": expand(cute) if cute else None}
    if own_only:
        return own
    seen = {**{var: str(base / sub) for var, sub in REDIRECTED.items()}, **environ}
    seen["DG_JIT_CACHE_DIR"] = environ.get("SGLANG_DG_CACHE_DIR") or str(base / "deep_gemm")
    # every library with a variable of its own resolves it in the environment sglang gives it
    return {**{k.family: k.resolve(seen) for k in kinds.caches() if k.variable}, **own}


def unloadable(units: Mapping[str, list[str]], captured: Mapping[str, str] | None = None) -> list[str]:
    """Why this node's sglang will not load restored units although they are there: nothing known."""
    return []
