"""The JIT caches a server fills at start, one family each: captured from a run, stored as entries, restored.

Beside the kernels jitwarm builds or replays, a server's libraries compile into caches of their own (sglang
points them all under ``SGLANG_CACHE_DIR``, srt/environ.py:2308-2320; vLLM keeps torch.compile's, with the
Inductor and Triton directories it uses, under ``VLLM_CACHE_ROOT/torch_compile_cache``, and DeepGEMM's under
``VLLM_CACHE_ROOT/deep_gemm``). Each family is one module here,
a :class:`~.units.Library` and the backend of its kind, all sharing :mod:`.backend`:

========================  ====================  =============================================================
kind                      module                the cache
========================  ====================  =============================================================
``inductor_cache``        :mod:`.inductor`      ``TORCHINDUCTOR_CACHE_DIR``: FX graphs, AOTAutograd, code
``triton_cache``          :mod:`.triton_dir`    ``TRITON_CACHE_DIR``, when jitwarm's manager does not serve it
``vllm_compile_cache``    :mod:`.vllm_compile`  ``VLLM_CACHE_ROOT/torch_compile_cache``: vLLM's graphs, AOT artifacts
``tilelang_cache``        :mod:`.tilelang`      ``TILELANG_CACHE_DIR``
``deep_gemm_cache``       :mod:`.deep_gemm`     ``DG_JIT_CACHE_DIR`` (sglang: ``SGLANG_DG_CACHE_DIR``)
``cute_dsl_cache``        :mod:`.cute_dsl`      ``SGLANG_CUTE_AOT_CACHE_DIR``
``flashinfer_cache``      :mod:`.flashinfer`    ``FLASHINFER_WORKSPACE_BASE``/.cache/flashinfer
``cuda_ptx_cache``        :mod:`.ptx`           ``CUDA_CACHE_PATH``: the driver's PTX cache
========================  ====================  =============================================================

Shared mechanics: :mod:`.units` (a cache as a directory of complete file groups), :mod:`.fingerprint` (what
the node must match), :mod:`.restore` (atomic placement), :mod:`.census` (the units present now, and what a
run added). Each kind can only ``capture``: a unit comes from a run, never from a build here. Importing this
package imports none of the libraries.
"""

from __future__ import annotations

_PACKAGE = "jitwarm.kernels.libraries.jit_caches"
#: library name -> module, in the order they are captured and reported.
MODULES = {"inductor": "inductor", "triton": "triton_dir", "vllm_compile": "vllm_compile", "tilelang": "tilelang",
           "deep_gemm": "deep_gemm", "cute_dsl": "cute_dsl", "flashinfer": "flashinfer", "ptx": "ptx"}
#: library name -> its kind (the backend name of its units' specs).
KIND_OF = {"inductor": "inductor_cache", "triton": "triton_cache", "vllm_compile": "vllm_compile_cache",
           "tilelang": "tilelang_cache",
           "deep_gemm": "deep_gemm_cache", "cute_dsl": "cute_dsl_cache", "flashinfer": "flashinfer_cache",
           "ptx": "cuda_ptx_cache"}
KINDS = {KIND_OF[lib]: (f"{_PACKAGE}.{module}", ("capture",)) for lib, module in MODULES.items()}
