"""Triton kernels on a CUDA device: AOT build for the local arch, load, preload, reference checks, capture.

Skipped without CUDA. The kernels are built exactly as on a CPU build box (``triton.compile`` for the
device's ``sm_XX``), loaded from the cache entry, preloaded, and only then launched.
"""

from __future__ import annotations

import pytest
import torch
from workers.triton_cases import (
    INCIDENT,
    POISON_INT,
    check,
    dspark_config,
    get_kernel,
    small_config,
    spec_cases,
    spec_layouts,
)

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec, VerifyLayout, ops, reference
from jitwarm.kernels import triton_backend as backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = {spec: layouts for dtype in ("float32", "bfloat16")
         for spec, layouts in spec_layouts(small_config(dtype, "sm_90")).items()}
DSPARK = spec_cases(dspark_config("sm_90"))


def _id(spec: KernelSpec) -> str:
    return spec.id.replace("/triton/sm_90/", ":")


def _local(spec: KernelSpec) -> KernelSpec:
    major, minor = torch.cuda.get_device_capability()
    return KernelSpec(spec.family, spec.backend, f"sm_{major}{minor}", spec.params)


@pytest.fixture(scope="session")
def gpu_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-gpu-cache")
    return KernelCache(root, layers=(), lock_dir=root / "locks")


@pytest.mark.parametrize(("spec", "layouts"), SMALL.items(), ids=[_id(s) for s in SMALL])
def test_small_plan_matches_reference(gpu_cache, spec, layouts):
    kernel = get_kernel(gpu_cache, _local(spec))
    for layout in layouts if spec.family == "plan" else layouts[:1]:
        for seed in range(3):
            check(kernel, layout, "cuda", seed)


@pytest.mark.parametrize(("spec", "layout"), DSPARK, ids=[_id(s) for s, _ in DSPARK])
def test_dspark_plan_matches_reference(gpu_cache, spec, layout):
    check(get_kernel(gpu_cache, _local(spec)), layout, "cuda", seed=1)


@pytest.mark.parametrize("ratio", [4, 128])
def test_plan_incident_layout_thousands_of_times(gpu_cache, ratio):
    """The incident's missing barrier picked the uniform path for this exact shape, sometimes."""
    kernel = get_kernel(gpu_cache, _local(KernelSpec("plan", "triton", "sm_90",
                                                     {"ratio": ratio, "threads": 128})))
    lens = torch.tensor(INCIDENT.verify_lens, dtype=torch.int32, device="cuda")
    prefix = torch.randint(0, 4096, (INCIDENT.slots,), dtype=torch.int32, device="cuda")
    want = reference.plan(INCIDENT, lens, prefix, ratio)
    outs = [torch.empty_like(t) for t in want]
    uniform_seen = torch.zeros(1, dtype=torch.int32, device="cuda")
    mismatches = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(3000):
        for t in outs:
            t.fill_(POISON_INT)
        kernel.run(lens, prefix, *outs)
        uniform_seen += outs[5]
        mismatches += torch.stack([(a != b).sum() for a, b in zip(outs, want, strict=True)]).sum().int()
    assert (int(uniform_seen), int(mismatches)) == (0, 0)


def test_capture_after_preload_replays_correctly(gpu_cache):
    layout = VerifyLayout((3,) * 104 + (2,) * 24)
    model = dict(head_dim=128, dtype="bfloat16")
    plan_k = get_kernel(gpu_cache, _local(KernelSpec("plan", "triton", "sm_90",
                                                     {"ratio": 4, "threads": 128})))
    comp_k = get_kernel(gpu_cache, _local(KernelSpec("compressor", "triton", "sm_90", {
        "ratio": 4, **model, "uniform": 0, "max_len": 3})))
    norm_k = get_kernel(gpu_cache, _local(KernelSpec("norm_rope", "triton", "sm_90", {
        **model, "rope_dim": 64, "num_q_heads": 16, "num_kv_heads": 1, "uniform": 0, "max_len": 3})))
    r, n, d = layout.slots, layout.num_tokens, 128
    dev, bf16 = "cuda", torch.bfloat16
    lens = torch.tensor(layout.verify_lens, dtype=torch.int32, device=dev)
    prefix = torch.zeros(r, dtype=torch.int32, device=dev)
    p = [torch.empty(size, dtype=torch.int32, device=dev) for size in (r + 1, n, n, n, 1, 1)]
    kv, score = torch.empty(n, d, dtype=bf16, device=dev), torch.empty(n, d, dtype=bf16, device=dev)
    state = torch.empty(r, 3, d, device=dev)
    out = torch.empty(n, d, dtype=bf16, device=dev)
    q, k = torch.empty(n, 16, d, dtype=bf16, device=dev), torch.empty(n, 1, d, dtype=bf16, device=dev)
    qw, kw = torch.ones(d, dtype=bf16, device=dev), torch.ones(d, dtype=bf16, device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        plan_k.run(lens, prefix, *p)
        comp_k.run(kv, score, p[0], p[3], state, out)
        norm_k.run(q, k, p[2], qw, kw, 1e-6, 10000.0)
    for step in range(3):
        prefix.copy_(torch.randint(0, 1000, (r,), dtype=torch.int32))
        for t in (kv, score, q, k):
            t.copy_(torch.randn(t.shape, dtype=torch.float32))
        state.copy_(torch.stack([torch.full((r, d), float("-inf")), torch.zeros(r, d), torch.zeros(r, d)], 1))
        out.fill_(0.0)
        q_ref, k_ref, state_ref, out_ref = q.clone(), k.clone(), state.clone(), out.clone()
        graph.replay()
        torch.cuda.synchronize()
        want = reference.plan(layout, lens, prefix, 4)
        assert all(torch.equal(a, b) for a, b in zip(p, want, strict=True)), step
        reference.compress(layout, kv, score, want, state_ref, out_ref, 4)
        reference.norm_rope(layout, q_ref, k_ref, want.token_pos, qw, kw, 64, 1e-6, 10000.0)
        for got, ref in ((out, out_ref), (state, state_ref), (q, q_ref), (k, k_ref)):
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_run_inside_capture_without_preload_raises(gpu_cache):
    spec = _local(KernelSpec("plan", "triton", "sm_90", {"ratio": 8, "threads": 32}))
    entry = gpu_cache.get_or_build(backend.description(spec), lambda staging: backend.build(spec, staging))
    fresh = backend.load(spec, entry)  # loaded, never preloaded
    lens = torch.ones(4, dtype=torch.int32, device="cuda")
    outs = [torch.empty(size, dtype=torch.int32, device="cuda") for size in (5, 4, 4, 4, 1, 1)]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="not preloaded"), torch.cuda.graph(graph):
        fresh.run(lens, lens, *outs)
    fresh.run(lens, lens, *outs)  # outside capture it loads on demand
    torch.cuda.synchronize()
    assert outs[0].tolist() == [0, 1, 2, 3, 4]


def test_ops_dispatch_to_triton_on_gpu():
    """The public ops on CUDA tensors pick the local sm_XX triton spec and run it through the cache."""
    layout = VerifyLayout((3,) * 10 + (2,) * 6)
    dev = "cuda"
    lens = torch.tensor(layout.verify_lens, dtype=torch.int32, device=dev)
    prefix = torch.randint(0, 100, (layout.slots,), dtype=torch.int32, device=dev)
    p = ops.plan(layout, lens, prefix, ratio=4, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(p, reference.plan(layout, lens, prefix, 4), strict=True))
    n, d = layout.num_tokens, 128
    kv, score = torch.randn(n, d, device=dev), torch.randn(n, d, device=dev)
    state = torch.stack([torch.full((16, d), float("-inf")), torch.zeros(16, d), torch.zeros(16, d)], 1).to(dev)
    out = torch.zeros(n, d, device=dev)
    state_ref, out_ref = state.clone(), out.clone()
    ops.compress(layout, kv, score, p, state, out, ratio=4, backend="triton")
    reference.compress(layout, kv, score, p, state_ref, out_ref, 4)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5)
    q, k = torch.randn(n, 4, d, device=dev), torch.randn(n, 1, d, device=dev)
    w = torch.ones(d, device=dev)
    q_ref, k_ref = q.clone(), k.clone()
    ops.norm_rope(layout, q, k, p.token_pos, w, w, 64, backend="triton")
    reference.norm_rope(layout, q_ref, k_ref, p.token_pos, w, w, 64)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
