"""CUDA builds with nvcc, no GPU needed: sm_90 specs of each family, and the other supported arches."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from kernel_checks import FLOOR, build_all

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec, dispatch, tvm_backend

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc not found on PATH: CUDA builds cannot be tested")
# floor: CI's floor pass reruns these on the oldest tvm-ffi, whose CUDA headers nvcc compiles.
pytestmark = [pytest.mark.nvcc, needs_nvcc, pytest.mark.tvm_ffi, pytest.mark.floor]


def cuda_specs(target: str) -> list[KernelSpec]:
    return [
        KernelSpec("plan", "tvm_ffi", target, {"ratio": 4, "threads": 128}),
        KernelSpec("compressor", "tvm_ffi", target,
                   {"ratio": 4, "head_dim": 128, "dtype": "bfloat16", "uniform": 0, "max_len": 3}),
        KernelSpec("norm_rope", "tvm_ffi", target, {"head_dim": 128, "rope_dim": 64, "num_q_heads": 16,
                                                    "num_kv_heads": 1, "dtype": "bfloat16", "uniform": 0,
                                                    "max_len": 3}),
    ]


SM90 = cuda_specs("sm_90")
OTHER_ARCHES = [KernelSpec("plan", "tvm_ffi", t, {"ratio": 4, "threads": 128}) for t in ("sm_100", "sm_120")]
#: What is built and checked: every family and arch, but on CI's floor pass one sm_90 build, since every family
#: includes the same tvm-ffi headers (csrc/common.cuh) and the arch is nvcc's flag, not the library's.
BUILT = SM90[:1] if FLOOR else SM90 + OTHER_ARCHES


@pytest.fixture(scope="module")
def cuda_cache(tmp_path_factory):
    cache = KernelCache(tmp_path_factory.mktemp("cuda-cache"), layers=())
    assert build_all(cache, BUILT) == cache.stats().builds == len(BUILT)
    return cache


def find_cuobjdump() -> str | None:
    import triton

    hits = sorted(Path(triton.__file__).parent.rglob("cuobjdump"))
    return str(hits[0]) if hits else None


@pytest.mark.parametrize("spec", BUILT, ids=lambda s: f"{s.family}-{s.target}")
def test_cuda_build_exports_the_expected_functions(spec, cuda_cache):
    entry = dispatch.ensure_built(spec, cuda_cache)
    assert entry.files == ("kernel.json", "kernel.so")
    kernel = tvm_backend.load(spec, entry)  # loading needs no GPU; running does
    for name in tvm_backend.EXPORTS:
        assert kernel.module.implements_function(name), name
    assert str(kernel.module["spec_id"]()) == spec.id
    syms = subprocess.run(["nm", "-D", "--defined-only", str(entry.path / "kernel.so")], capture_output=True,
                          text=True, check=True).stdout
    assert {f"__tvm_ffi_{n}" for n in tvm_backend.EXPORTS} <= {line.split()[-1] for line in syms.splitlines()}
    tc = entry.description["toolchain"]
    arch = spec.target.removeprefix("sm_")
    assert tc["arch"] == spec.target and f"arch=compute_{arch},code=sm_{arch}" in tc["flags"]
    assert tc["compiler"].startswith("Cuda compilation tools")


@pytest.mark.parametrize("spec", BUILT, ids=lambda s: f"{s.family}-{s.target}")
def test_cubin_is_for_exactly_the_target_arch(spec, cuda_cache):
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (triton's wheel ships one): cannot list the embedded cubins")
    entry = dispatch.ensure_built(spec, cuda_cache)
    listing = subprocess.run([tool, "--list-elf", str(entry.path / "kernel.so")], capture_output=True,
                             text=True, check=True).stdout
    arches = {line.rsplit(".", 2)[-2] for line in listing.splitlines() if line.strip()}
    assert arches == {spec.target}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less failure mode of preload")
def test_preload_without_a_gpu_reaches_the_cuda_runtime(cuda_cache):
    kernel = tvm_backend.load(SM90[0], dispatch.ensure_built(SM90[0], cuda_cache))
    with pytest.raises(RuntimeError, match="CUDA"):
        kernel.preload()


def test_cuda_and_cpu_descriptions_differ_only_where_they_should():
    cpu = tvm_backend.description(KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 4, "threads": 128}))
    sm90 = tvm_backend.description(SM90[0])
    assert cpu["params"] == sm90["params"] and cpu["sources"] == tvm_backend.description(
        KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 4, "threads": 128}))["sources"]
    assert cpu["toolchain"]["flags"] != sm90["toolchain"]["flags"]
    assert sm90["toolchain"]["host_compiler"] == cpu["toolchain"]["compiler"]
