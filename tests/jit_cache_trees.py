"""Cache trees written in each JIT library's own layout and naming, for the families that cannot compile here.

None of these libraries runs on this box (no GPU, and TileLang, DeepGEMM, FlashInfer and CuTe DSL need one to
compile); each writer lays out the files as that library's release writes them (the module docstrings of
``jitwarm.kernels.libraries.jit_caches`` cite where): names, nesting, the file that commits a unit, the temporaries
and locks beside it. The bytes are made up. Triton's and Inductor's trees are written by the real libraries in
``test_jit_caches_real.py``; the writers here for them are the same layouts, for the cases that need a torn unit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: family -> the environment variable that points the library at a directory (the root given to the writer).
ENV = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR", "tilelang": "TILELANG_CACHE_DIR",
       "deep_gemm": "DG_JIT_CACHE_DIR", "cute_dsl": "SGLANG_CUTE_AOT_CACHE_DIR",
       "flashinfer": "FLASHINFER_WORKSPACE_BASE", "ptx": "CUDA_CACHE_PATH", "vllm_compile": "VLLM_CACHE_ROOT"}
ELF = b"\x7fELF" + bytes(60)


def cache_root(family: str, directory: Path) -> Path:
    """Where the library's cache is when its variable is ``directory`` (FlashInfer appends .cache/flashinfer)."""
    if family == "vllm_compile":
        return directory / "torch_compile_cache"  # vLLM's compile tree under VLLM_CACHE_ROOT
    return directory / ".cache" / "flashinfer" if family == "flashinfer" else directory


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def triton(root: Path, key: str = "OOF7HFPTBLHNHVYHTEAUHUZLGVQUZ5NPCK6H5B34MSOATRFR5CPQ", name: str = "add_one",
           *, group: bool = True) -> None:
    """A Triton key directory: the stages ``put`` one by one, then ``__grp__<name>.json`` with absolute paths."""
    d = root / key
    children = {f"{name}.cubin": ELF, f"{name}.ptx": ".version 8.7", f"{name}.json":
                json.dumps({"name": name, "target": {"backend": "cuda", "arch": 90, "warp_size": 32}})}
    for child, data in children.items():
        write(d / child, data)
    (d / f"tmp.pid_{os.getpid()}_0").mkdir(exist_ok=True)  # a put's leftover temp dir: not part of the unit
    if group:
        write(d / f"__grp__{name}.json", json.dumps({"child_paths": {c: str(d / c) for c in children}}))


def inductor(root: Path) -> None:
    """FX graph and AOTAutograd entries, a generated module, a C++ kernel with its .so; locks/ beside them."""
    write(root / "fxgraph" / "nr" / "fnrftgyjl23l27" / "x3tijdogguslbe", b"pickled graph")
    write(root / "aotautograd" / "ae43kozqu72hb" / "egiet5fnv7twr", b"pickled aot entry")
    write(root / "nu" / "cnuzvpm3hgka6oqixh2.py", "# generated output code")
    write(root / "ha" / "cha2vxhltf3ggcv4o6ch3.main.cpp", "extern \"C\" void kernel() {}")
    write(root / "ha" / "cha2vxhltf3ggcv4o6ch3.main.so", ELF)
    write(root / "locks" / "cha2vxhltf3ggcv4o6ch3.lock", b"")
    write(root / "nu" / ".cnuzvpm3hgka6oqixh2.py.1234.5678.tmp", b"a write_atomic in flight")


def tilelang(root: Path, key: str = "6f1b3c") -> None:
    """One kernel directory under ``<version>/<platform>-<machine>/kernels/``, its manifest.json last."""
    d = root / "0.1.15" / "linux-x86_64" / "kernels" / key
    files = {"device_kernel.cu": "__global__ void k() {}", "host_kernel.cu": "int main;", "kernel_lib.so": ELF,
             "params.json": "{}"}
    for name, data in files.items():
        write(d / name, data)
    write(d / "manifest.json", json.dumps({"version": 1, "files": {n: {"size": 1, "sha256": "0"} for n in files}}))
    (root / "0.1.15" / "linux-x86_64" / ".staging").mkdir(exist_ok=True)


def deep_gemm(root: Path, name: str = "sm90_fp8_gemm_1d2d", digest: str = "9f2c4e") -> None:
    """One ``cache/kernel.<name>.<hex>/`` directory; ``tmp/`` and sglang's ``locks/`` beside it."""
    d = root / "cache" / f"kernel.{name}.{digest}"
    write(d / "kernel.cu", "// Includes' hash value: 1234\n")
    write(d / "kernel.cubin", ELF)
    (root / "tmp").mkdir(exist_ok=True)
    write(root / "locks" / "group0.lock", b"")


def cute_dsl(root: Path, sha: str = "ab" * 32) -> None:
    """One ``<sha256>.o`` under its source-fingerprint directory, its ``.lock`` and an export's dot temp."""
    d = root / ("cd" * 32)
    write(d / f"{sha}.o", ELF)
    write(d / f"{sha}.lock", b"")
    write(d / f".{'ef' * 32}.tmp.o", b"an export in flight")


def flashinfer(root: Path, module: str = "batch_decode_with_kv_cache") -> None:
    """One ``<version>/<archs>/cached_ops/<name>/`` module directory built by ninja, its lock in cached_ops/tmp."""
    ops = root / "0.7.4" / "90" / "cached_ops"
    d = ops / module
    write(d / "build.ninja", "rule nvcc\n")
    write(d / ".ninja_log", "# ninja log v6\n")
    write(d / "decode.cuda.o", ELF)
    write(d / f"{module}.so", ELF)
    write(ops / "tmp" / f"{module}.lock", b"")


def ptx(root: Path) -> None:
    """The driver's ComputeCache: hashed entries in two levels of directories and the index naming them."""
    write(root / "5" / "c" / "5c7e1a0f3b2d9e84", b"sass for this gpu")
    write(root / "index", b"\x00index")


def vllm_compile(root: Path, digest: str = "3f9a0c1b2d") -> None:
    """One ``<hash>/rank_0_0/backbone/`` directory of vLLM's compile tree, ``computation_graph.py`` written last.

    (vLLM's own functions write such a tree in ``test_vllm_caches.py``; this one is hand-laid, with one env factor.)
    """
    d = root / digest / "rank_0_0" / "backbone"
    write(d / "cache_key_factors.json", json.dumps({"env": {"VLLM_TARGET_DEVICE": "cuda"}, "config_hash": "c0",
                                                    "code_hash": "c1", "compiler_hash": "c2"}))
    write(d / "computation_graph.py", "# the split graph\n")


WRITERS = {"inductor": inductor, "triton": triton, "tilelang": tilelang, "deep_gemm": deep_gemm, "cute_dsl": cute_dsl,
           "flashinfer": flashinfer, "ptx": ptx, "vllm_compile": vllm_compile}
