"""The real wheels of the JIT libraries sglang 0.5.23 pins, installed without their dependencies, once per machine.

sglang 0.5.23 requires ``flashinfer_python[cu13]==0.7.2``, ``tilelang==0.1.12``, ``sgl-deep-gemm==0.2.3.post2``
and ``nvidia-cutlass-dsl[cu13]==4.8.0`` (its wheel's METADATA). The layout tests use each library's own key,
path and writer functions where they import without a GPU (tests/jit_cache_trees.py says which):

- ``flashinfer``: flashinfer-python 0.7.2 (65 MB wheel) and the ninja wheel (0.2 MB) it requires; its
  ``flashinfer.jit`` imports on a CPU torch with the interpreter's tvm_ffi, jinja2 and filelock.
- ``tilelang``: tilelang 0.1.12 (50 MB) with what its import asks for: apache-tvm-ffi 0.1.11 (it requires
  ``<=0.1.11``; the interpreter has a newer one, which tilelang's bundled TVM refuses to load twice over),
  z3-solver (29 MB; its ``libz3`` is loaded at import), ml_dtypes, cloudpickle, torch-c-dlpack-ext, psutil, tqdm.
- ``deep_gemm``: sgl-deep-gemm 0.2.3.post2 (4.7 MB), for the cache code it ships as headers
  (``include/deep_jit/cache/disk.hpp``); ``import deep_gemm`` itself cannot run here (below).

Not installed: nvidia-cutlass-dsl 4.8.0's ``cutlass`` package is in its CUDA library wheels (libs-cu13 92 MB,
libs-cu12 as large, both required), about 190 MB to download and 480 MB installed, only for
``cutlass.__version__`` in sglang's CuTe cache fingerprint; the CuTe DSL tree is written by sglang's own cache
class from the sglang wheel instead.

Each set lives under ``$JITWARM_TEST_WHEELS`` (default ``~/.cache/jitwarm-test-wheels``) in a directory named
by the hash of its packages, installed into a staging directory and renamed into place whole, one pip at a time
per set (a file lock): tests/wheels.py.
"""

from __future__ import annotations

from pathlib import Path

from wheels import WheelUnavailable, install_once

#: set -> the pinned packages; the first names the import that proves the set is installed.
SETS = {
    "flashinfer": ("flashinfer-python==0.7.2", "ninja==1.13.2"),
    "tilelang": ("tilelang==0.1.12", "apache-tvm-ffi==0.1.11", "z3-solver==4.15.4.0", "ml_dtypes==0.7.0",
                 "cloudpickle==3.1.3", "torch-c-dlpack-ext==0.1.5", "psutil==7.2.2", "tqdm==4.70.1"),
    "deep_gemm": ("sgl-deep-gemm==0.2.3.post2",),
}
#: set -> a file the complete install holds.
MARKER = {"flashinfer": "flashinfer/jit/core.py", "tilelang": "tilelang/cache/kernel_cache.py",
          "deep_gemm": "deep_gemm/include/deep_jit/cache/disk.hpp"}


def install(name: str) -> Path:
    """Install set ``name`` once per machine (tests/wheels.py); return its directory (first on ``PYTHONPATH``)."""
    return install_once(name, SETS[name], MARKER[name])


def installed(name: str) -> Path:
    """Body of a session fixture: the set's directory, or skip saying why it cannot be installed."""
    import pytest

    try:
        return install(name)
    except WheelUnavailable as exc:
        pytest.skip(str(exc))
