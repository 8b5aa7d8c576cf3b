"""Host kernels against the torch reference, one parametrized set over the backends on target cpu.

``tvm_ffi``/cpu is the C++ build (g++); ``triton``/cpu is the real Triton kernels under Triton's interpreter
(``triton_backend``'s interpreter copy, scoped to its own module, see
``test_triton_backend.test_interpreter_copy_does_not_leak``, so it shares the process with compiled Triton).
Each backend checks every spec of ``kernel_checks.correctness_cases``: for tvm_ffi the four-graph plan in
both dtypes and the DSpark-128 bfloat16 specs the incident's layout dispatches (22 specs: each is a g++ build of
seconds on two cores), for the interpreter the small plan in float32 and the four-graph plan in bfloat16 (31;
its DSpark sizes would take minutes), from the session's cache of that
backend (built once, ``kernel_caches``), with ``kernel_checks.check``; the public op must dispatch exactly the
planned spec.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import (
    DTYPES,
    FLOOR,
    check,
    correctness_cases,
    dispatched_spec,
    dspark_config,
    get_kernel,
    lens_of,
    seeds_for,
)

from jitwarm.kernels import ModelDims, VerifyLayout, ops, reference
from jitwarm.precompile import WarmPlan

BACKENDS = ("tvm_ffi", "triton")
#: CI's floor pass (``-m floor``) reruns the tvm_ffi ones on the lowest apache-tvm-ffi setup.py allows (0.1.11).
MARKS = {"tvm_ffi": [pytest.mark.tvm_ffi, pytest.mark.floor], "triton": []}
CASES = {backend: correctness_cases(backend, "cpu") for backend in BACKENDS}
# tvm_ffi: 3 plan specs (2 of the incident), 4 + 4 float32 and bfloat16 others of the four-graph plan, and the
# incident's 3 bfloat16 ones; triton: 2 plan specs, 7 norm_rope and 14 compressor in float32 (the small plan),
# 4 and 4 in bfloat16 (the four-graph plan)
COUNTS = {"tvm_ffi": 3 + (4 + 4) + (4 + 4 + 3), "triton": 2 + (7 + 14) + (4 + 4)}
if FLOOR:  # CI's floor pass: kernel_checks.floor_config for both, one spec per family, uniformity and dtype
    COUNTS = {"tvm_ffi": 1 + 2 * (2 + 2), "triton": 1 + 2 * (2 + 2)}


def per_backend(*extra):
    """``pytest.param(backend, *extra)`` for each host backend, with its marks."""
    return [pytest.param(b, *extra, marks=MARKS[b], id=b) for b in BACKENDS]


def test_dspark_plans_have_the_documented_specs():
    for dtype in DTYPES:
        plan = WarmPlan.build(dspark_config("tvm_ffi", "cpu", dtype))
        assert (len(plan.shapes), len(plan.specs)) == (35, 30)
        assert plan.by_family() == {"norm_rope": 8, "compressor": 16, "plan": 6}


@pytest.mark.parametrize("backend", per_backend())
def test_cases_cover_every_family_and_path(backend):
    cases = CASES[backend]
    paths = {(s.family, s.params_dict.get("uniform"), s.params_dict.get("dtype")) for s in cases}
    assert paths == {("plan", None, None)} | {(f, u, d) for f in ("compressor", "norm_rope") for u in (0, 1)
                                              for d in DTYPES}
    assert len(cases) == COUNTS[backend]  # the plan specs are shared by both dtypes
    assert all(len(layouts) > 1 for s, layouts in cases.items() if s.family == "plan")


@pytest.mark.parametrize("backend", per_backend())
def test_session_cache_built_each_spec_once(kernel_caches, backend):
    built = kernel_caches(backend, "cpu")
    assert built.builds == len(built.specs) == COUNTS[backend]
    print(f"\nbuilt {built.builds} {backend} host specs in {built.seconds:.1f} s")


@pytest.mark.parametrize(("spec", "layouts"), [
    pytest.param(spec, layouts, marks=MARKS[backend], id=spec.id.replace("/cpu/", ":"))
    for backend, cases in CASES.items() for spec, layouts in cases.items()])
def test_kernel_matches_reference(kernel_caches, spec, layouts):
    """Plan specs on every layout that dispatches them (uniform and ragged), the others on the largest."""
    cache = kernel_caches(spec.backend, "cpu").cache
    builds = cache.stats().builds
    kernel = get_kernel(cache, spec)
    for layout in layouts:
        for seed in seeds_for(spec, layout):
            check(kernel, layout, "cpu", seed)
    assert dispatched_spec(spec, layouts[0]) == spec, "the op dispatches another spec than the planner planned"
    assert cache.stats().builds == builds, "the session cache lacked a planned spec"


class PoisonedCuLens:
    """A compressor kernel that is handed ``cu_lens`` of garbage: a uniform spec must compute offsets itself."""

    def __init__(self, kernel):
        self.kernel, self.spec = kernel, kernel.spec

    def run(self, kv, score, cu_lens, *rest):
        self.kernel.run(kv, score, torch.full_like(cu_lens, -(1 << 30)), *rest)


@pytest.mark.parametrize("backend", per_backend())
def test_uniform_compressor_never_reads_cu_lens(kernel_caches, backend):
    uniform = [s for s in CASES[backend] if s.family == "compressor" and s["uniform"] and s["ratio"] == 4]
    spec = max(uniform, key=lambda s: (s["max_len"], s["dtype"] == "bfloat16"))  # the longest requests
    (layout,) = CASES[backend][spec]
    kernel = PoisonedCuLens(get_kernel(kernel_caches(backend, "cpu").cache, spec))
    for seed in seeds_for(spec, layout):
        check(kernel, layout, "cpu", seed)


def test_ops_dispatch_to_the_triton_backend_on_cpu():
    """The public ops pick the triton spec from the same rule and run it through the cache (tvm_ffi's ops:
    test_kernels_edges.py)."""
    layout = VerifyLayout((2,) * 3 + (1,) * 5)
    lens = lens_of(layout)
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


@pytest.mark.tvm_ffi
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_ops_plan_allocates_int32_outputs_on_the_input_device(dtype, use_kernel_cache):
    layout = WarmPlan.build(dspark_config("tvm_ffi", "cpu", dtype)).shapes[0].layout
    p = ops.plan(layout, lens_of(layout), torch.zeros(layout.slots, dtype=torch.int32), 128)
    assert [t.shape[0] for t in p] == [layout.slots + 1] + [layout.num_tokens] * 3 + [1, 1]
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in p)
