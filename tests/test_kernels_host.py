"""Host (cpu) tvm-ffi builds against the torch reference, for every spec of the DSpark-128 plans.

Both dtype plans (bfloat16, the default model, and float32) are built once per session into one cache;
each test runs the op that dispatches the spec on fresh random inputs with poisoned outputs and checks
that dispatch picked exactly the planned spec without building anything.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_fixtures import (  # kernel_cache, use_kernel_cache fixtures
    DTYPES,
    POISON_INT,
    TOL,
    dspark_cases,
    dspark_plan,
    kernel_cache_fixture,  # noqa: F401
    lens_of,
    out_rows,
    poisoned_plan,
    randn,
    random_prefix,
    random_state,
    use_kernel_cache_fixture,  # noqa: F401
)

from jitwarm.kernels import dispatch, ops, reference

# CI's floor pass reruns these on the lowest apache-tvm-ffi setup.py allows (0.1.11: sglang's and vLLM's pin).
pytestmark = pytest.mark.tvm_ffi

CASES = dspark_cases()


def test_dspark_plans_have_the_documented_specs():
    for dtype in ("bfloat16", "float32"):
        plan = dspark_plan(dtype)
        assert len(plan.shapes) == 35
        assert len(plan.specs) == 30
        assert plan.by_family() == {"norm_rope": 8, "compressor": 16, "plan": 6}
    assert len(CASES) == 54  # the 6 plan specs are shared by both dtypes


def check_plan(spec, layout, gen):
    lens, prefix = lens_of(layout), random_prefix(layout, gen)
    got = ops.plan(layout, lens, prefix, spec["ratio"], out=poisoned_plan(layout))
    want = reference.plan(layout, lens, prefix, spec["ratio"])
    for name, a, b in zip(want._fields, got, want, strict=True):
        assert torch.equal(a, b), f"{name} differs"
    assert int(got.num_out) > 0 or spec["ratio"] > 6
    assert int(got.uniform) == int(layout.uniform)


def check_compressor(spec, layout, gen):
    ratio, d, dtype = spec["ratio"], spec["head_dim"], spec["dtype"]
    lens, prefix = lens_of(layout), random_prefix(layout, gen)
    p = reference.plan(layout, lens, prefix, ratio)
    kv, score = randn((layout.num_tokens, d), dtype, gen), randn((layout.num_tokens, d), dtype, gen, 2.0)
    state = random_state(layout.slots, d, gen)
    out = out_rows(layout, ratio, d, dtype)
    state_ref, out_ref = state.clone(), out.clone()
    ops.compress(layout, kv, score, p, state, out, ratio)
    reference.compress(layout, kv, score, p, state_ref, out_ref, ratio)
    n = int(p.num_out)
    assert n > 0 or ratio > 6
    assert not out[:n].isnan().any(), "a closed block's row was not written"
    torch.testing.assert_close(out[:n], out_ref[:n], **TOL[dtype])
    assert out[n:].isnan().all(), "rows past num_out were written"
    torch.testing.assert_close(state, state_ref, **TOL["float32"])


def check_norm_rope(spec, layout, gen):
    d, dtype = spec["head_dim"], spec["dtype"]
    n = layout.num_tokens
    positions = reference.plan(layout, lens_of(layout), random_prefix(layout, gen), 4).token_pos
    q = randn((n, spec["num_q_heads"], d), dtype, gen)
    k = randn((n, spec["num_kv_heads"], d), dtype, gen)
    qw, kw = randn((d,), dtype, gen), randn((d,), dtype, gen)
    q_ref, k_ref = q.clone(), k.clone()
    ops.norm_rope(layout, q, k, positions, qw, kw, rope_dim=spec["rope_dim"], eps=1e-6, theta=10000.0)
    reference.norm_rope(layout, q_ref, k_ref, positions, qw, kw, rope_dim=spec["rope_dim"], eps=1e-6,
                        theta=10000.0)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])


CHECKS = {"plan": check_plan, "compressor": check_compressor, "norm_rope": check_norm_rope}


@pytest.mark.parametrize(("spec", "layout"), CASES, ids=[s.id.replace("tvm_ffi/cpu/", "") for s, _ in CASES])
def test_host_build_matches_reference(spec, layout, use_kernel_cache):
    builds_before = use_kernel_cache.cache.stats().builds
    gen = torch.Generator().manual_seed(zlib.crc32(spec.id.encode()))
    CHECKS[spec.family](spec, layout, gen)
    assert dispatch.is_loaded(spec), "the op dispatched another spec than the planner planned"
    assert use_kernel_cache.cache.stats().builds == builds_before, "dispatch built a spec the plan had built"


def test_session_cache_built_each_spec_once(kernel_cache):
    assert kernel_cache.builds == len(kernel_cache.specs) == 54
    print(f"\nbuilt {kernel_cache.builds} host specs in {kernel_cache.seconds:.1f} s")


def test_plan_poison_is_fully_overwritten(use_kernel_cache):
    layout = dspark_plan().shapes[0].layout
    p = ops.plan(layout, lens_of(layout), torch.full((layout.slots,), 3, dtype=torch.int32), 4,
                 out=poisoned_plan(layout))
    for name, t in zip(p._fields, p, strict=True):
        assert not (t == POISON_INT).any(), f"{name} has unwritten elements"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_ops_plan_allocates_int32_outputs_on_the_input_device(dtype, use_kernel_cache):
    layout = dspark_plan(dtype).shapes[0].layout
    p = ops.plan(layout, lens_of(layout), torch.zeros(layout.slots, dtype=torch.int32), 128)
    assert [t.shape[0] for t in p] == [layout.slots + 1] + [layout.num_tokens] * 3 + [1, 1]
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in p)
