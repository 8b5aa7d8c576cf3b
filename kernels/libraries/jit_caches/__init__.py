"""The JIT caches a server's libraries fill at start, one module a family (docs/kernels.md): capture only.

This package names no server: where a server moves a cache, its room says so (``ServerAdapter.cache_dirs``).
"""

from __future__ import annotations

_PACKAGE = "jitwarm.kernels.libraries.jit_caches"
#: library name -> module, in the order they are captured and reported.
MODULES = {"inductor": "inductor", "triton": "triton_dir", "vllm_compile": "vllm_compile",
           "vllm_modelinfo": "vllm_modelinfo", "tilelang": "tilelang", "deep_gemm": "deep_gemm", "cute_dsl": "cute_dsl",
           "flashinfer": "flashinfer", "ptx": "ptx"}
#: library name -> its kind (the backend name of its units' specs).
KIND_OF = {lib: "cuda_ptx_cache" if lib == "ptx" else f"{lib}_cache" for lib in MODULES}
KINDS = {KIND_OF[lib]: (f"{_PACKAGE}.{module}", ("capture",)) for lib, module in MODULES.items()}
