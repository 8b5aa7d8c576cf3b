"""CUDA builds on a real GPU: every DSpark-128 spec against the reference, plan races, preload, capture.

Skipped without a CUDA device. The reference runs on CPU copies of the inputs (the definition), the
kernels on the GPU of the local arch (``sm_XY`` from ``dispatch.target_of``).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_fixtures import (
    INCIDENT,
    POISON_INT,
    TOL,
    build_all,
    dspark_plan,
    lens_of,
    out_rows,
    poisoned_plan,
    randn,
    random_prefix,
    random_state,
    spec_layouts,
)

from jitwarm.cache import KernelCache
from jitwarm.kernels import VerifyLayout, dispatch, ops, plan_threads, reference

pytestmark = [pytest.mark.gpu, pytest.mark.tvm_ffi,  # tvm_ffi: CI's floor pass reruns these
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = "cuda"


def gpu_cases():
    if not torch.cuda.is_available():
        return []
    target = dispatch.target_of(CUDA)
    cases = {}
    for dtype in ("bfloat16", "float32"):
        for spec, layout in spec_layouts(dspark_plan(dtype, target)).items():
            cases.setdefault(spec, layout)
    return list(cases.items())


CASES = gpu_cases()


@pytest.fixture(scope="module")
def gpu_cache(tmp_path_factory):
    cache = KernelCache(tmp_path_factory.mktemp("gpu-cache"), layers=())
    build_all(cache, [spec for spec, _ in CASES])
    previous = dispatch.set_cache(cache)
    yield cache
    dispatch.set_cache(previous)


def cuda(*xs):
    return [x.to(CUDA) for x in xs]


def check(spec, layout, gen):
    p = spec.params_dict
    lens, prefix = lens_of(layout), random_prefix(layout, gen)
    if spec.family == "plan":
        got = ops.plan(layout, *cuda(lens, prefix), p["ratio"], out=poisoned_plan(layout, CUDA))
        want = reference.plan(layout, lens, prefix, p["ratio"])
        for name, a, b in zip(want._fields, got, want, strict=True):
            assert torch.equal(a.cpu(), b), name
        return
    dtype, d = p["dtype"], p["head_dim"]
    n = layout.num_tokens
    if spec.family == "compressor":
        plan = reference.plan(layout, lens, prefix, p["ratio"])
        kv, score = randn((n, d), dtype, gen), randn((n, d), dtype, gen, 2.0)
        state, out = random_state(layout.slots, d, gen), out_rows(layout, p["ratio"], d, dtype)
        g_state, g_out = cuda(state, out)
        ops.compress(layout, *cuda(kv, score), type(plan)(*cuda(*plan)), g_state, g_out, p["ratio"])
        reference.compress(layout, kv, score, plan, state, out, p["ratio"])
        torch.testing.assert_close(g_out.cpu(), out, equal_nan=True, **TOL[dtype])
        torch.testing.assert_close(g_state.cpu(), state, **TOL["float32"])
        return
    pos = reference.plan(layout, lens, prefix, 4).token_pos
    q, k = randn((n, p["num_q_heads"], d), dtype, gen), randn((n, p["num_kv_heads"], d), dtype, gen)
    qw, kw = randn((d,), dtype, gen), randn((d,), dtype, gen)
    g_q, g_k = cuda(q, k)
    ops.norm_rope(layout, g_q, g_k, *cuda(pos, qw, kw), rope_dim=p["rope_dim"])
    reference.norm_rope(layout, q, k, pos, qw, kw, rope_dim=p["rope_dim"])
    torch.testing.assert_close(g_q.cpu(), q, **TOL[dtype])
    torch.testing.assert_close(g_k.cpu(), k, **TOL[dtype])


@pytest.mark.parametrize(("spec", "layout"), CASES, ids=[s.id.split("/", 3)[0] + "/" + s.id.split("/", 3)[3]
                                                         for s, _ in CASES])
def test_cuda_build_matches_reference(spec, layout, gpu_cache):
    check(spec, layout, torch.Generator().manual_seed(zlib.crc32(spec.id.encode())))
    assert dispatch.is_loaded(spec)


@pytest.mark.parametrize("ratio", [4, 128])
def test_incident_plan_exact_in_2000_runs_on_gpu(ratio, gpu_cache):
    gen = torch.Generator().manual_seed(ratio)
    lens = lens_of(INCIDENT, CUDA)
    out = poisoned_plan(INCIDENT, CUDA)
    for run in range(2000):
        prefix = torch.randint(0, 1 << 16, (INCIDENT.slots,), generator=gen, dtype=torch.int32)
        for t in out:
            t.fill_(POISON_INT if run % 2 else -1)
        got = ops.plan(INCIDENT, lens, prefix.to(CUDA), ratio, out=out)
        want = reference.plan(INCIDENT, lens.cpu(), prefix, ratio)
        assert int(got.uniform) == 0, f"run {run}: uniform path for the ragged layout"
        for name, a, b in zip(want._fields, got, want, strict=True):
            assert torch.equal(a.cpu(), b), f"run {run}: {name}"


@pytest.mark.parametrize("slots", [1, 33, 128, 200, 1024, 1025, 3000])
def test_plan_every_cta_size_on_gpu(slots, gpu_cache):
    layout = VerifyLayout(tuple(1 + (i * 7) % 6 for i in range(slots)))
    assert plan_threads(slots) <= 1024
    gen = torch.Generator().manual_seed(slots)
    for _ in range(20):
        prefix = torch.randint(0, 1 << 20, (slots,), generator=gen, dtype=torch.int32)
        got = ops.plan(layout, lens_of(layout, CUDA), prefix.to(CUDA), 4, out=poisoned_plan(layout, CUDA))
        want = reference.plan(layout, lens_of(layout), prefix, 4)
        for name, a, b in zip(want._fields, got, want, strict=True):
            assert torch.equal(a.cpu(), b), name


def test_preload_forces_every_loaded_module_onto_the_device(gpu_cache):
    for spec, _ in CASES:
        assert dispatch.ensure_loaded(spec).preload() == 1


def test_capture_after_preload_replays_correctly(gpu_cache):
    """Everything loaded and preloaded: a CUDA graph of plan -> compress -> norm_rope captures and replays."""
    layout, gen = INCIDENT, torch.Generator().manual_seed(9)
    for spec, _ in CASES:
        dispatch.ensure_loaded(spec).preload()
    torch.cuda.synchronize()
    lens, prefix = lens_of(layout), random_prefix(layout, gen)
    n, d = layout.num_tokens, 128
    kv, score = randn((n, d), "bfloat16", gen), randn((n, d), "bfloat16", gen)
    q, k = randn((n, 16, d), "bfloat16", gen), randn((n, 1, d), "bfloat16", gen)
    qw, kw = randn((d,), "bfloat16", gen), randn((d,), "bfloat16", gen)
    state0 = random_state(layout.slots, d, gen)
    g = dict(zip("lens prefix kv score q k qw kw state".split(), cuda(lens, prefix, kv, score, q, k, qw, kw,
                                                                       state0), strict=True))
    plan_out = poisoned_plan(layout, CUDA)
    out = out_rows(layout, 4, d, "bfloat16", CUDA)
    misses = dispatch.counters()["misses"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.plan(layout, g["lens"], g["prefix"], 4, out=plan_out)
        ops.compress(layout, g["kv"], g["score"], plan_out, g["state"], out, 4)
        ops.norm_rope(layout, g["q"], g["k"], plan_out.token_pos, g["qw"], g["kw"])
    assert dispatch.counters()["misses"] == misses
    g["state"].copy_(state0.to(CUDA))
    g["q"].copy_(q.to(CUDA))
    g["k"].copy_(k.to(CUDA))
    graph.replay()
    torch.cuda.synchronize()
    want = reference.plan(layout, lens, prefix, 4)
    state_ref, out_ref = state0.clone(), out_rows(layout, 4, d, "bfloat16")
    reference.compress(layout, kv, score, want, state_ref, out_ref, 4)
    reference.norm_rope(layout, q, k, want.token_pos, qw, kw)
    assert torch.equal(plan_out.token_out_row.cpu(), want.token_out_row)
    torch.testing.assert_close(out.cpu(), out_ref, equal_nan=True, **TOL["bfloat16"])
    torch.testing.assert_close(g["q"].cpu(), q, **TOL["bfloat16"])
    torch.testing.assert_close(g["k"].cpu(), k, **TOL["bfloat16"])
