"""Triton kernels under Triton's interpreter (target cpu) agree with the torch reference on every spec.

The cpu target runs the real kernels through ``triton_backend``'s interpreter copy, which is scoped to
its own module (``test_triton_backend.test_interpreter_copy_does_not_leak``), so these tests share the
process with compiled-Triton tests safely. bfloat16 arithmetic is upcast to float32 inside the kernels.
"""

from __future__ import annotations

import pytest
import torch
from workers.triton_cases import INCIDENT, check, check_compressor, get_kernel, small_config, spec_layouts

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec, ModelDims, VerifyLayout, ops, reference

CASES: dict[KernelSpec, list[VerifyLayout]] = {}
for _dtype in ("float32", "bfloat16"):
    CASES.update(spec_layouts(small_config(_dtype, "cpu")))  # plan specs do not depend on the dtype


@pytest.fixture(scope="session")
def cpu_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-cpu-cache")
    return KernelCache(root, layers=(), lock_dir=root / "locks")


def test_small_plan_covers_every_family_and_path():
    families = {(s.family, s.params_dict.get("uniform"), s.params_dict.get("dtype")) for s in CASES}
    assert families >= {("plan", None, None), ("compressor", 0, "float32"), ("compressor", 1, "bfloat16"),
                        ("norm_rope", 0, "bfloat16"), ("norm_rope", 1, "float32")}
    assert len(CASES) == 2 + 2 * (7 + 14)


@pytest.mark.parametrize(("spec", "layouts"), CASES.items(),
                         ids=[s.id.replace("/triton/cpu/", ":") for s in CASES])
def test_kernel_matches_reference(cpu_cache, spec, layouts):
    """Plan specs on every layout that dispatches them (uniform and ragged); the others on the largest."""
    kernel = get_kernel(cpu_cache, spec)
    for layout in layouts if spec.family == "plan" else layouts[:1]:
        for seed in range(2 if spec.family == "norm_rope" else 3):
            check(kernel, layout, "cpu", seed)


@pytest.mark.parametrize("ratio", [4, 128])
def test_plan_on_the_incident_layout(cpu_cache, ratio):
    """bs=60 of the incident: ragged [3]*104+[2]*24 must never take the uniform path."""
    kernel = get_kernel(cpu_cache, KernelSpec("plan", "triton", "cpu", {"ratio": ratio, "threads": 128}))
    for seed in range(25):
        check(kernel, INCIDENT, "cpu", seed)


def test_uniform_compressor_never_reads_cu_lens(cpu_cache):
    layout = VerifyLayout((3,) * 8)
    spec = KernelSpec("compressor", "triton", "cpu", {"ratio": 4, "head_dim": 64, "dtype": "float32",
                                                      "uniform": 1, "max_len": 3})
    kernel = get_kernel(cpu_cache, spec)

    class PoisonedCuLens:
        spec = kernel.spec

        def run(self, kv, score, cu_lens, *rest):
            kernel.run(kv, score, torch.full_like(cu_lens, -(1 << 30)), *rest)

    check_compressor(PoisonedCuLens(), layout, "cpu", torch.Generator().manual_seed(7))


def test_ops_dispatch_to_the_triton_backend_on_cpu():
    """The public ops pick the triton spec from the same rule and run it through the cache."""
    layout = VerifyLayout((2,) * 3 + (1,) * 5)
    lens = torch.tensor(layout.verify_lens, dtype=torch.int32)
    prefix = torch.tensor([0, 3, 7, 1, 2, 9, 15, 4], dtype=torch.int32)
    p = ops.plan(layout, lens, prefix, ratio=4, backend="triton")
    for got, want in zip(p, reference.plan(layout, lens, prefix, 4), strict=True):
        assert torch.equal(got, want)
    model = ModelDims(head_dim=32, rope_dim=16, num_q_heads=2, num_kv_heads=1, dtype="float32")
    q, k = torch.randn(layout.num_tokens, 2, 32), torch.randn(layout.num_tokens, 1, 32)
    w = torch.ones(32)
    q_ref, k_ref = q.clone(), k.clone()
    ops.norm_rope(layout, q, k, p.token_pos, w, w, model.rope_dim, backend="triton")
    reference.norm_rope(layout, q_ref, k_ref, p.token_pos, w, w, model.rope_dim)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
