"""Kernels on a CUDA device, one parametrized set over the backends for the local arch ``sm_XY``.

``tvm_ffi`` builds with nvcc, ``triton`` with ``triton.compile`` exactly as on a CPU build box. Each backend's
specs (``kernel_checks.correctness_cases``: the DSpark-128 plans, and for triton also the small plan its
interpreter runs on the host) are built once per session into ``kernel_caches(backend, sm_XY)``, spread over
the cores, then loaded, preloaded and only then launched: every spec against the reference, the incident's
plan race, preload, a captured CUDA graph. The reference runs on CPU copies of the inputs (the definition).

Skipped without a CUDA device; the cases are still collected (for sm_90) and each one skips with the reason.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import (
    INCIDENT,
    POISON_INT,
    STATE_TOL,
    TOL,
    check,
    closing_prefix,
    correctness_cases,
    dispatched_spec,
    get_kernel,
    lens_of,
    out_rows,
    poisoned_plan,
    randn,
    random_prefix,
    random_state,
    seeds_for,
)

from jitwarm.kernels import KernelSpec, VerifyLayout, dispatch, ops, plan_threads, reference, triton_backend
from jitwarm.kernels.artifacts import artifact

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
CUDA = "cuda"
TARGET = dispatch.target_of(CUDA) if HAS_CUDA else "sm_90"
BACKENDS = ("tvm_ffi", "triton")
#: CI's floor pass (``-m floor``) reruns the tvm_ffi ones on the lowest apache-tvm-ffi setup.py allows (0.1.11).
MARKS = {"tvm_ffi": [pytest.mark.tvm_ffi, pytest.mark.floor], "triton": []}
CASES = {backend: correctness_cases(backend, TARGET) for backend in BACKENDS}
#: Back-to-back plan launches on the incident layout, cycling over this many random prefixes.
INCIDENT_RUNS, INCIDENT_PREFIXES = 3000, 100


def per_backend():
    return [pytest.param(b, marks=MARKS[b], id=b) for b in BACKENDS]


def use(kernel_caches, backend):
    """The backend's session cache for this arch, made the dispatcher's for this test (conftest unsets it)."""
    built = kernel_caches(backend, TARGET)
    dispatch.set_cache(built.cache)
    return built


def cuda(*xs):
    return [x.to(CUDA) for x in xs]


@pytest.mark.parametrize(("spec", "layouts"), [
    pytest.param(spec, layouts, marks=MARKS[backend], id=spec.id.replace(f"/{TARGET}/", ":"))
    for backend, cases in CASES.items() for spec, layouts in cases.items()])
def test_kernel_matches_reference(kernel_caches, spec, layouts):
    """Plan specs on every layout that dispatches them (uniform and ragged), the others on the largest."""
    kernel = get_kernel(kernel_caches(spec.backend, TARGET).cache, spec)
    for layout in layouts:
        for seed in seeds_for(spec, layout):
            check(kernel, layout, CUDA, seed)
    torch.cuda.synchronize()
    assert dispatched_spec(spec, layouts[0], CUDA) == spec, "the op dispatches another spec than the planner planned"


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("backend", per_backend())
def test_incident_plan_exact_in_consecutive_runs(kernel_caches, backend, ratio):
    """The incident's missing barrier picked the uniform path for this exact shape, sometimes: launch the plan
    back to back (no sync in between), fresh poison and a new prefix each run, count mismatches on the device."""
    kernel = get_kernel(kernel_caches(backend, TARGET).cache,
                        KernelSpec("plan", backend, TARGET, {"ratio": ratio, "threads": 128}))
    gen = torch.Generator().manual_seed(ratio)
    prefixes = [closing_prefix(INCIDENT, gen, ratio) for _ in range(INCIDENT_PREFIXES)]
    wants = [cuda(*reference.plan(INCIDENT, lens_of(INCIDENT), p, ratio)) for p in prefixes]
    prefixes = cuda(*prefixes)
    lens, out = lens_of(INCIDENT, CUDA), poisoned_plan(INCIDENT, CUDA)
    mismatches = torch.zeros((), dtype=torch.int64, device=CUDA)
    uniform_seen = torch.zeros((), dtype=torch.int64, device=CUDA)
    for run in range(INCIDENT_RUNS):
        for t in out:
            t.fill_(POISON_INT)
        kernel.run(lens, prefixes[run % INCIDENT_PREFIXES], *out)
        want = wants[run % INCIDENT_PREFIXES]
        mismatches += sum((a != b).sum() for a, b in zip(out, want, strict=True))
        uniform_seen += out.uniform.sum()
    assert (int(uniform_seen), int(mismatches)) == (0, 0)


@pytest.mark.tvm_ffi
@pytest.mark.parametrize("slots", [1, 33, 128, 200, 1024, 1025, 3000])
def test_plan_every_cta_size_on_gpu(kernel_caches, slots):
    """tvm_ffi only: its plan loops over requests past 1024 threads; triton's refuses more than its lanes."""
    use(kernel_caches, "tvm_ffi")
    layout = VerifyLayout(tuple(1 + (i * 7) % 6 for i in range(slots)))
    assert plan_threads(slots) <= 1024
    gen = torch.Generator().manual_seed(slots)
    for _ in range(20):
        prefix = torch.randint(0, 1 << 20, (slots,), generator=gen, dtype=torch.int32)
        got = ops.plan(layout, lens_of(layout, CUDA), prefix.to(CUDA), 4, out=poisoned_plan(layout, CUDA))
        want = reference.plan(layout, lens_of(layout), prefix, 4)
        for name, a, b in zip(want._fields, got, want, strict=True):
            assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("backend", per_backend())
def test_preload_forces_every_loaded_module_onto_the_device(kernel_caches, backend):
    use(kernel_caches, backend)
    for spec in CASES[backend]:
        assert dispatch.ensure_loaded(spec).preload() == 1, spec.id


@pytest.mark.parametrize("backend", per_backend())
def test_capture_after_preload_replays_correctly(kernel_caches, backend):
    """Everything loaded and preloaded: a CUDA graph of plan -> compress -> norm_rope through the public ops
    captures with no dispatch miss, and replays correctly on new inputs three times."""
    use(kernel_caches, backend)
    for spec in CASES[backend]:
        dispatch.ensure_loaded(spec).preload()
    torch.cuda.synchronize()
    layout, gen = INCIDENT, torch.Generator().manual_seed(9)
    n, d, dtype = layout.num_tokens, 128, "bfloat16"
    lens = lens_of(layout)
    g = dict(zip("lens prefix kv score q k qw kw state".split(), cuda(
        lens, random_prefix(layout, gen), randn((n, d), dtype, gen), randn((n, d), dtype, gen),
        randn((n, 16, d), dtype, gen), randn((n, 1, d), dtype, gen), randn((d,), dtype, gen),
        randn((d,), dtype, gen), random_state(layout.slots, d, gen)), strict=True))
    plan_out, out = poisoned_plan(layout, CUDA), out_rows(layout, 4, d, dtype, CUDA)
    misses = dispatch.counters()["misses"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.plan(layout, g["lens"], g["prefix"], 4, out=plan_out, backend=backend)
        ops.compress(layout, g["kv"], g["score"], plan_out, g["state"], out, 4, backend=backend)
        ops.norm_rope(layout, g["q"], g["k"], plan_out.token_pos, g["qw"], g["kw"], backend=backend)
    assert dispatch.counters()["misses"] == misses, "a kernel was looked up for the first time inside capture"
    for step in range(3):
        new = {"prefix": closing_prefix(layout, gen, 4), "kv": randn((n, d), dtype, gen),
               "score": randn((n, d), dtype, gen, 2.0), "q": randn((n, 16, d), dtype, gen),
               "k": randn((n, 1, d), dtype, gen, 3.0), "qw": randn((d,), dtype, gen), "kw": randn((d,), dtype, gen),
               "state": random_state(layout.slots, d, gen)}
        for name, value in new.items():
            g[name].copy_(value)
        for t in plan_out:
            t.fill_(POISON_INT)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.plan(layout, lens, new["prefix"], 4)
        for name, a, b in zip(want._fields, plan_out, want, strict=True):
            assert torch.equal(a.cpu(), b), f"step {step}: plan {name}"
        state, out_ref = new["state"].clone(), out_rows(layout, 4, d, dtype)
        reference.compress(layout, new["kv"], new["score"], want, state, out_ref, 4)
        rows = int(want.num_out)
        assert rows > 0 and out[rows:].isnan().all(), f"step {step}: rows past num_out were written"
        torch.testing.assert_close(out[:rows].cpu(), out_ref[:rows], **TOL[dtype])
        torch.testing.assert_close(g["state"].cpu(), state, **STATE_TOL)
        q, k = new["q"].clone(), new["k"].clone()
        reference.norm_rope(layout, q, k, want.token_pos, new["qw"], new["kw"])
        torch.testing.assert_close(g["q"].cpu(), q, **TOL[dtype])
        torch.testing.assert_close(g["k"].cpu(), k, **TOL[dtype])


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_triton_run_inside_capture_without_preload_raises(kernel_caches):
    """triton only: a loaded, never preloaded cubin refuses to load its module inside capture."""
    spec = KernelSpec("plan", "triton", TARGET, {"ratio": 8, "threads": 32})
    fresh = triton_backend.load(spec, artifact(spec).get_or_build(kernel_caches("triton", TARGET).cache).entry)
    lens = torch.ones(4, dtype=torch.int32, device=CUDA)
    outs = [torch.empty(size, dtype=torch.int32, device=CUDA) for size in (5, 4, 4, 4, 1, 1)]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="not preloaded"), torch.cuda.graph(graph):
        fresh.run(lens, lens, *outs)
    fresh.run(lens, lens, *outs)  # outside capture it loads on demand
    torch.cuda.synchronize()
    assert outs[0].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("backend", per_backend())
def test_ops_run_on_the_device(kernel_caches, backend):
    """The public ops on CUDA tensors (float32) pick the local sm_XY spec and run it from the session cache."""
    built = use(kernel_caches, backend)
    builds = built.cache.stats().builds
    layout, gen = VerifyLayout((3,) * 10 + (2,) * 6), torch.Generator().manual_seed(11)
    lens, prefix = lens_of(layout), random_prefix(layout, gen)
    p = ops.plan(layout, *cuda(lens, prefix), ratio=4, backend=backend)
    want = reference.plan(layout, lens, prefix, 4)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(p, want, strict=True))
    n, d = layout.num_tokens, 128
    kv, score = randn((n, d), "float32", gen), randn((n, d), "float32", gen, 2.0)
    state, out = random_state(layout.slots, d, gen), out_rows(layout, 4, d, "float32")
    g_state, g_out = cuda(state, out)
    ops.compress(layout, *cuda(kv, score), p, g_state, g_out, ratio=4, backend=backend)
    reference.compress(layout, kv, score, want, state, out, 4)
    torch.testing.assert_close(g_out.cpu(), out, equal_nan=True, **TOL["float32"])
    torch.testing.assert_close(g_state.cpu(), state, **STATE_TOL)
    q, k = randn((n, 16, d), "float32", gen), randn((n, 1, d), "float32", gen)
    w = randn((d,), "float32", gen)
    g_q, g_k = cuda(q, k)
    ops.norm_rope(layout, g_q, g_k, p.token_pos, *cuda(w, w), 64, backend=backend)
    reference.norm_rope(layout, q, k, want.token_pos, w, w, 64)
    torch.testing.assert_close(g_q.cpu(), q, **TOL["float32"])
    torch.testing.assert_close(g_k.cpu(), k, **TOL["float32"])
    assert built.cache.stats().builds == builds, "the op built a spec the session cache should hold"
