"""The JIT caches a server's libraries fill at start, one family each: captured from a run, stored, restored.

Each library resolves its own variables here; where a server moves a library's cache, or keeps one of its own
(vLLM's compile tree and model inspection, sglang's CuTe DSL objects), its room says so
(``jitwarm.precompile.servers``, ``ServerAdapter.cache_dirs``): this package names no server. Each family is one
module here (the table of kinds, modules and caches: docs/kernels.md), a :class:`~.units.Library` and the
backend of its kind, sharing :mod:`.backend`, :mod:`.units`, :mod:`.fingerprint`, :mod:`.restore` and
:mod:`.census`. Each kind can only ``capture``. Importing this package imports none of the libraries.
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
