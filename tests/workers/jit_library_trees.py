"""Child process: a JIT library's real wheel lays out its own cache tree and says where and what it is, as JSON.

Run as ``python jit_library_trees.py LIBRARY ACTION`` with the library's test wheels first on ``PYTHONPATH``
(tests/jit_cache_wheels.py) and its cache variable in the environment. What the library cannot do here (no GPU)
is stood in for and named below; every path, key, file name and write is the library's own.

- ``flashinfer build``: FlashInfer's own ``gen_act_and_mul_module("silu")`` and ``gen_batch_decode_module``
  generate two modules' sources and ``JitSpec``; ``spec.build()`` writes ``build.ninja`` and runs the real
  ninja, with ``FLASHINFER_NVCC`` and ``CXX`` (FlashInfer's own knobs) set by the caller to a stand-in compiler:
  nvcc takes 40 s on the smaller module here and the link needs ``libcuda``, which no GPU-less box has.
- ``flashinfer where``: FlashInfer's cache directory, the modules' paths, ``is_compiled``; no build.
- ``tilelang write KEYS``: TileLang's default cache class (``TVMFFIKernelCache``) keys a real TIR ``PrimFunc``
  with ``_generate_key`` and saves it with ``_save_kernel_to_disk`` (staging directory, rename), a stand-in for
  the compiled kernel (its sources, an exported library's bytes, its params), since compiling needs CUDA.
- ``tilelang verdicts``: for every key directory under TileLang's cache, each backend cache class's own
  ``_is_complete_cache_dir``. After ``write``, a line on stdin naming another cache directory asks the same
  process for that directory's verdicts (one import of TileLang, about 8 s here, for both), and for the cache
  directory TileLang uses when ``TILELANG_CACHE_DIR`` is unset (read only: nothing is made there).

- ``cute DIR KEYS``: sglang's own ``JITPersistentCache`` (kernels/jit/cute_aot_cache.py) in ``DIR``
  stores one compiled function per key, exported by a stand-in for CuTe's compiled function (``export_to_c``
  writes an object's bytes); ``DIR`` stands for the source-fingerprint directory, whose name needs
  ``cutlass.__version__`` (tests/jit_cache_trees.py says why cutlass is not installed).

FlashInfer's package ``__init__`` imports its GPU kernels' Python bindings (pynvml, cuda-python); only
``flashinfer.jit`` is needed, so the package is entered without running its ``__init__``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path


def flashinfer_jit():
    spec = importlib.util.find_spec("flashinfer")
    package = types.ModuleType("flashinfer")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["flashinfer"] = package
    from flashinfer.jit import activation, core
    from flashinfer.jit import env as jit_env

    return jit_env, core, activation


def flashinfer(action: str) -> dict:
    import torch

    jit_env, core, activation = flashinfer_jit()
    from flashinfer.jit.attention import modules

    specs = [activation.gen_act_and_mul_module("silu"),  # one generated source, flat in generated/
             modules.gen_batch_decode_module(torch.float16, torch.float16, torch.float16, torch.int32, 128, 128, 0,
                                             False, False)]  # generated/<uri>/: three sources and a config header
    if action == "build":
        for spec in specs:
            spec.build(verbose=False, need_lock=True)
    return {"cache_dir": str(jit_env.FLASHINFER_CACHE_DIR), "workspace": str(jit_env.FLASHINFER_WORKSPACE_DIR),
            "modules": [{"name": spec.name, "build_dir": str(spec.build_dir), "library": str(spec.jit_library_path),
                         "lock": str(spec.lock_path), "sources": [str(s) for s in spec.sources],
                         "is_compiled": spec.is_compiled} for spec in specs]}


def tilelang(action: str, keys: list[str]) -> dict:
    import tilelang.language as T  # noqa: N812 - TileLang's own spelling
    from tilelang import env
    from tilelang.cache import _dispatch_map

    out: dict = {"cache_dir": str(env.TILELANG_CACHE_DIR)}
    if action == "write":
        cache = _dispatch_map["tvm_ffi"]

        @T.prim_func
        def add_one(a: T.Tensor((128,), "float32"), b: T.Tensor((128,), "float32")):
            with T.Kernel(1, threads=128) as _:
                for i in T.Parallel(128):
                    b[i] = a[i] + 1.0

        written = {}
        for tag in keys:
            key = cache._generate_key(add_one, [1], "tvm_ffi", (tag,), "cuda -arch=sm_90")
            cache._save_kernel_to_disk(key, _kernel(tag))
            written[tag] = cache._get_cache_path(key)
        out["written"] = written
        out["namespace"] = cache._get_cache_namespace()
    else:
        out["verdicts"] = tilelang_verdicts()
    return out


def tilelang_verdicts() -> dict:
    from tilelang import env
    from tilelang.cache import _dispatch_map

    root = Path(env.TILELANG_CACHE_DIR) / _dispatch_map["tvm_ffi"]._get_cache_namespace() / "kernels"
    return {entry.path: {name: cache._is_complete_cache_dir(entry.path) for name, cache in _dispatch_map.items()}
            for entry in os.scandir(root) if entry.is_dir()}


def cute(directory: str, keys: list[str]) -> dict:
    # The module's top level imports only the standard library; sglang's package __init__ (torch, transformers,
    # its cache redirects) is not needed to run it, so it is loaded from the wheel's file under its own name.
    [base] = importlib.util.find_spec("sglang").submodule_search_locations
    path = Path(base) / "kernels" / "jit" / "cute_aot_cache.py"
    spec = importlib.util.spec_from_file_location("sglang_cute_aot_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    JITPersistentCache = module.JITPersistentCache  # noqa: N806 - sglang's class

    class Compiled:
        def __init__(self, key):
            self.key = key

        def export_to_c(self, object_file_path, function_name):
            with open(object_file_path, "wb") as f:
                f.write(b"\x7fELF" + f"{function_name}:{self.key}".encode())

    cache = JITPersistentCache(Path(directory))
    for key in keys:
        cache[(key, 128)] = Compiled(key)
    return {"objects": {key: str(cache.cache_path / f"{cache._key_to_hash((key, 128))}.o") for key in keys}}


def _kernel(tag: str):
    """The compiled kernel TileLang would save: sources, an exportable library, params (stand-in, no CUDA)."""

    class Executable:
        def export_library(self, path, **kwargs):
            with open(path, "wb") as f:
                f.write(b"\x7fELF" + tag.encode() * 16)

    adapter = types.SimpleNamespace(get_host_source=lambda: f"// host source {tag}\n",
                                    get_exportable_executable=Executable)
    return types.SimpleNamespace(kernel_source=f"// device source {tag}\n", adapter=adapter, params=[tag, 1],
                                 artifact=None)


if __name__ == "__main__":
    library, action = sys.argv[1], sys.argv[2]
    if library == "cute":
        result = cute(action, sys.argv[3:])
    else:
        result = flashinfer(action) if library == "flashinfer" else tilelang(action, sys.argv[3:])
    print(json.dumps(result), flush=True)
    if library == "tilelang" and action == "write":
        line = sys.stdin.readline().strip()
        if line:
            os.environ["TILELANG_CACHE_DIR"] = line  # tilelang.env reads it at each use
            verdicts = tilelang_verdicts()
            del os.environ["TILELANG_CACHE_DIR"]
            from tilelang import env

            print(json.dumps({"verdicts": verdicts, "default_cache_dir": str(env.TILELANG_CACHE_DIR)}), flush=True)
