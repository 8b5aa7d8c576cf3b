"""The kernel correctness harness, one for every backend and target: constants, plans, inputs, checks.

:func:`check` runs one loaded kernel (``artifact(spec).load(cache)``: tvm_ffi or triton, ``cpu`` or ``sm_XY``)
and :mod:`jitwarm.kernels.reference` on the same random inputs, every output buffer poisoned first, and
raises AssertionError on a mismatch. The reference runs on CPU copies of the inputs (the definition), the
kernel on ``device``. The tests import this module (conftest.py puts tests/ on ``sys.path``); so do the worker
scripts under tests/workers/ that run on a GPU box, which put tests/ on ``sys.path`` themselves. It imports
no pytest, so a worker needs none.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from jitwarm.kernels import KernelSpec, VerifyLayout, dispatch, ops, reference
from jitwarm.kernels.artifacts import artifact
from jitwarm.kernels.spec import TokenMap, max_out_rows
from jitwarm.precompile import ServingConfig, WarmPlan

# -- constants ------------------------------------------------------------------------------------------

#: bs=60 of the incident (README.md): 6 draft tokens over 128 slots, ragged. Never the uniform path.
INCIDENT = VerifyLayout((3,) * 104 + (2,) * 24)
#: What an unwritten int32 plan element holds: every real one is >= -1, and this fits no 16-bit write.
POISON_INT = -77777
#: What an unwritten compressor row holds: no finite input makes NaN, it survives a read-modify-write,
#: and bfloat16 holds it exactly (a finite poison such as 1234.5 rounds in bfloat16).
POISON_FLOAT = float("nan")
#: The reference's defaults: every check passes them explicitly, so no backend's default is trusted.
EPS, THETA = 1e-6, 10000.0
#: Outputs in the kernel's dtype: float32 to a few ulp, bfloat16 to about two of its ulps (2**-7).
TOL = {"float32": {"rtol": 1e-5, "atol": 1e-5}, "bfloat16": {"rtol": 2e-2, "atol": 2e-2}}
#: The compressor state is float32 whatever the dtype: the kernels accumulate in float32 as the reference.
STATE_TOL = TOL["float32"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Random prefixes lie in [0, PREFIX_HIGH): fresh requests and positions past the first few blocks.
PREFIX_HIGH = 8192
#: Seeds per (spec, layout): norm_rope has no integer structure to explore and is the slowest interpreted.
SEEDS = {"plan": 3, "compressor": 3, "norm_rope": 2}


def seeds_for(spec: KernelSpec, layout: VerifyLayout) -> range:
    """:data:`SEEDS` seeds of their own for one spec and layout (inputs differ from spec to spec).

    One for a Triton kernel on the CPU: Triton's interpreter runs the same program as the GPU, in NumPy, thousands
    of times slower (two thirds of the host kernel tests' time with every seed); the GPU tests run every seed.
    """
    base = zlib.crc32(f"{spec.id} {layout.run_length()}".encode())
    return range(base, base + (1 if spec.backend == "triton" and spec.target == "cpu" else SEEDS[spec.family]))

# -- plans the correctness tests cover --------------------------------------------------------------------


def dspark_config(backend: str, target: str, dtype: str = "bfloat16") -> ServingConfig:
    """The DSpark-128 profile (README.md): 35 shapes, 30 specs per backend, target and dtype."""
    return ServingConfig(graph_max_bs=128, max_requests=128, draft_algorithm="DSPARK",
                         draft_tokens=6, ragged_verify_mode="compact", dtype=dtype,
                         backends=(backend,), targets=(target,))


def small_config(backend: str, target: str, dtype: str) -> ServingConfig:
    """A small compact plan (max bs 16, 4 draft tokens, ratios 4 and 8): 22 specs per dtype, 2 of them plan."""
    return ServingConfig(graph_max_bs=16, draft_algorithm="DSPARK", draft_tokens=4,
                         ragged_verify_mode="compact",
                         head_dim=64, rope_dim=32, num_q_heads=3, num_kv_heads=1, compress_ratios=(4, 8),
                         dtype=dtype, backends=(backend,), targets=(target,))


def spec_layouts(config: ServingConfig) -> dict[KernelSpec, list[VerifyLayout]]:
    """Each spec of ``config``'s warm plan with every layout that dispatches it, largest batch first."""
    plan = WarmPlan.build(config)
    layouts = {shape.bs: shape.layout for shape in plan.shapes}
    return {spec: list(dict.fromkeys(layouts[bs] for bs in plan.needed_by[spec])) for spec in plan.specs}


#: CI's second pass, on the dependency floors (.ci/run sets JITWARM_TEST_FLOOR=1 and selects the tests marked
#: ``floor``): the same tests on smaller matrices, since the kernels' arithmetic does not change with the library
#: (building, loading, calling do). Read once, at import (during collection): conftest's ``_isolated_env`` drops
#: every JITWARM_* variable while a test runs, and a session cache may first be built inside one.
FLOOR = os.environ.get("JITWARM_TEST_FLOOR") == "1"


def floor_config(backend: str, target: str, dtype: str) -> ServingConfig:
    """CI's floor pass (``JITWARM_TEST_FLOOR=1``): every family on the dependency floors, ragged and uniform, fast."""
    return ServingConfig(graph_max_bs=4, draft_algorithm="DSPARK", draft_tokens=3,
                         ragged_verify_mode="compact", head_dim=64, rope_dim=32, num_q_heads=3, num_kv_heads=1,
                         compress_ratios=(4,), dtype=dtype, backends=(backend,), targets=(target,))


def correctness_configs(backend: str, target: str) -> list[ServingConfig]:
    """The plans checked for one backend and target, each in bfloat16 and float32.

    On a GPU the DSpark-128 plan in both dtypes (tvm_ffi) and the small plan (triton). On the 2-core host, where
    each tvm_ffi spec is a g++ build of several seconds, the four-graph plan in both dtypes, with the incident's
    DSpark-128 specs added by :func:`correctness_cases`; for triton the small plan in float32 and the four-graph
    plan in bfloat16 (Triton's interpreter is too slow for DSpark sizes, and its bfloat16 path is the float32 one
    behind an upcast). The other DSpark-128 specs differ from those only in template constants (``max_len``,
    uniformity per bucket). CI's second pass on the dependency floors (``JITWARM_TEST_FLOOR=1``, .ci/run) checks
    the four-graph plan: the same tests, on the oldest tvm-ffi and Triton we support (the kernels' arithmetic
    does not change with the library; building, loading and calling do).
    """
    if FLOOR:
        return [floor_config(backend, target, dtype) for dtype in ("float32", "bfloat16")]
    if target == "cpu":
        if backend == "tvm_ffi":
            return [floor_config(backend, target, dtype) for dtype in ("bfloat16", "float32")]
        return [small_config(backend, target, "float32"), floor_config(backend, target, "bfloat16")]
    if backend == "tvm_ffi":
        return [dspark_config(backend, target, dtype) for dtype in ("bfloat16", "float32")]
    return [small_config(backend, target, dtype) for dtype in ("float32", "bfloat16")]


def incident_cases(backend: str, target: str) -> dict[KernelSpec, list[VerifyLayout]]:
    """The DSpark-128 bfloat16 specs the incident's layout (:data:`INCIDENT`, bs=60) dispatches, that layout first."""
    return {spec: [INCIDENT, *(layout for layout in layouts if layout != INCIDENT)]
            for spec, layouts in spec_layouts(dspark_config(backend, target)).items() if INCIDENT in layouts}


def correctness_cases(backend: str, target: str) -> dict[KernelSpec, list[VerifyLayout]]:
    """Every spec of :func:`correctness_configs` with the layouts it is checked on.

    A plan spec serves uniform and ragged layouts alike (the kernel chooses on the device), so it is checked
    on every layout that dispatches it; a compressor or norm_rope spec fixes uniformity and ``max_len`` itself
    and is checked on its largest layout. Plan specs do not depend on the dtype: both plans share them.

    On CI's floor pass (:data:`FLOOR`) one spec of each path is kept, the first of each (family, uniform, dtype):
    each family's source, in each dtype, ragged and uniform, is built, loaded and called on the oldest
    libraries; the other specs of a path differ only in template constants the library never sees.
    """
    cases: dict[KernelSpec, list[VerifyLayout]] = {}
    if backend == "tvm_ffi" and target == "cpu" and not FLOOR:
        cases.update(incident_cases(backend, target))
    for config in correctness_configs(backend, target):
        for spec, layouts in spec_layouts(config).items():
            cases[spec] = list(dict.fromkeys(cases.get(spec, []) + layouts))
    if FLOOR:
        firsts: dict[tuple, KernelSpec] = {}
        for spec in cases:
            firsts.setdefault((spec.family, spec.params_dict.get("uniform"), spec.params_dict.get("dtype")), spec)
        cases = {spec: cases[spec] for spec in firsts.values()}
    return {spec: layouts if spec.family == "plan" else layouts[:1] for spec, layouts in cases.items()}


# -- kernels ----------------------------------------------------------------------------------------------


def build_all(cache: Any, specs: Iterable[KernelSpec]) -> int:
    """Get or build ``specs`` in ``cache``, one compile per core at a time; return how many were built."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda s: artifact(s).get_or_build(cache), specs))
    return sum(r.outcome == "built" for r in results)


def get_kernel(cache: Any, spec: KernelSpec) -> Any:
    """Load ``spec`` through the one path (built into ``cache`` if missing) and preload it."""
    kernel = artifact(spec).load(cache)
    kernel.preload()
    return kernel


class _Stop(Exception):
    pass


def dispatched_spec(spec: KernelSpec, layout: VerifyLayout, device: str = "cpu") -> KernelSpec:
    """The spec the public op of ``spec``'s family asks the default dispatcher for, on ``layout``.

    The op gets valid tensors with ``spec``'s dims on ``device``; a miss hook records what it asks for and
    stops it there, so nothing is built, loaded or run. The spec must not be loaded in the dispatcher.
    """
    p, n, r = spec.params_dict, layout.num_tokens, layout.slots
    asked = []

    def stop(s: KernelSpec, shape: Any) -> None:
        asked.append((s, shape))
        raise _Stop

    lens, zeros = lens_of(layout, device), torch.zeros(r, dtype=torch.int32, device=device)
    dispatch.add_miss_hook(stop)
    try:
        with contextlib.suppress(_Stop):
            if spec.family == "plan":
                ops.plan(layout, lens, zeros, p["ratio"], backend=spec.backend)
            elif spec.family == "compressor":
                d, dtype = p["head_dim"], DTYPES[p["dtype"]]
                plan = reference.plan(layout, lens, zeros, p["ratio"])
                ops.compress(layout, torch.zeros(n, d, dtype=dtype, device=device),
                             torch.zeros(n, d, dtype=dtype, device=device), plan,
                             torch.zeros(r, 3, d, device=device), out_rows(layout, p["ratio"], d, p["dtype"], device),
                             p["ratio"], backend=spec.backend)
            else:
                d, dtype = p["head_dim"], DTYPES[p["dtype"]]
                ops.norm_rope(layout, torch.zeros(n, p["num_q_heads"], d, dtype=dtype, device=device),
                              torch.zeros(n, p["num_kv_heads"], d, dtype=dtype, device=device),
                              torch.zeros(n, dtype=torch.int32, device=device),
                              torch.ones(d, dtype=dtype, device=device), torch.ones(d, dtype=dtype, device=device),
                              rope_dim=p["rope_dim"], backend=spec.backend)
    finally:
        dispatch.remove_miss_hook(stop)
    assert len(asked) == 1 and asked[0][1] == layout, f"the op asked {asked} (a loaded spec is no miss)"
    return asked[0][0]


# -- inputs -----------------------------------------------------------------------------------------------


def lens_of(layout: VerifyLayout, device: str = "cpu") -> torch.Tensor:
    """``verify_lens`` of a layout as an int32 tensor."""
    return torch.tensor(layout.verify_lens, dtype=torch.int32, device=device)


def random_prefix(layout: VerifyLayout, gen: torch.Generator, high: int = PREFIX_HIGH, device: str = "cpu"
                  ) -> torch.Tensor:
    """Random ``prefix_lens`` in ``[0, high)``."""
    return torch.randint(0, high, (layout.slots,), generator=gen, dtype=torch.int32).to(device)


def closing_prefix(layout: VerifyLayout, gen: torch.Generator, ratio: int) -> torch.Tensor:
    """Random ``prefix_lens`` where request 0's last token closes a block, so the plan has a row to write."""
    prefix = random_prefix(layout, gen)
    first = layout.verify_lens[0]
    prefix[0] = ratio * ((int(prefix[0]) + first) // ratio + 1) - first
    return prefix


def poisoned_plan(layout: VerifyLayout, device: str = "cpu") -> TokenMap:
    """A preallocated plan whose every element is :data:`POISON_INT`."""
    r, n = layout.slots, layout.num_tokens
    return TokenMap(*(torch.full((size,), POISON_INT, dtype=torch.int32, device=device)
                      for size in (r + 1, n, n, n, 1, 1)))


def random_state(slots: int, head_dim: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """A compressor state mixing fresh requests (-inf, 0, 0) and partial blocks (max, sum > 0, acc)."""
    state = torch.empty(slots, 3, head_dim)
    state[:, 0] = torch.randn(slots, head_dim, generator=gen)
    state[:, 1] = torch.rand(slots, head_dim, generator=gen) * 2 + 0.25
    state[:, 2] = torch.randn(slots, head_dim, generator=gen)
    fresh = torch.rand(slots, generator=gen) < 0.5
    state[fresh, 0], state[fresh, 1], state[fresh, 2] = float("-inf"), 0.0, 0.0
    return state.to(device)


def randn(shape: tuple[int, ...], dtype: str, gen: torch.Generator, scale: float = 1.0, device: str = "cpu"
          ) -> torch.Tensor:
    """Random normal values in ``dtype``."""
    return (torch.randn(shape, generator=gen) * scale).to(DTYPES[dtype]).to(device)


def out_rows(layout: VerifyLayout, ratio: int, head_dim: int, dtype: str, device: str = "cpu") -> torch.Tensor:
    """A compressor output of :data:`POISON_FLOAT` with exactly the most rows the layout can write."""
    rows = max_out_rows(layout, ratio)
    return torch.full((rows, head_dim), POISON_FLOAT, dtype=DTYPES[dtype], device=device)


# -- checks -----------------------------------------------------------------------------------------------


def check(kernel: Any, layout: VerifyLayout, device: str, seed: int = 0) -> None:
    """Run ``kernel`` and the reference on random inputs of ``layout`` (from ``seed``); assert they agree."""
    gen = torch.Generator().manual_seed(seed)
    CHECKS[kernel.spec.family](kernel, layout, device, gen)


def check_plan(kernel: Any, layout: VerifyLayout, device: str, gen: torch.Generator) -> None:
    """Integer outputs: every poisoned element overwritten, every one exactly the reference's."""
    spec = kernel.spec
    lens, prefix = lens_of(layout), closing_prefix(layout, gen, spec["ratio"])
    out = poisoned_plan(layout, device)
    kernel.run(lens.to(device), prefix.to(device), *out)
    want = reference.plan(layout, lens, prefix, spec["ratio"])
    for name, got, ref in zip(want._fields, out, want, strict=True):
        got = got.cpu()
        assert not (got == POISON_INT).any(), f"{spec.id} {layout}: {name} has unwritten elements"
        bad = (got != ref).nonzero().flatten().tolist()
        assert not bad, (f"{spec.id} {layout}: {name}[{bad[0]}] is {int(got[bad[0]])}, want {int(ref[bad[0]])} "
                         f"({len(bad)} of {ref.numel()} differ)")
    assert int(want.uniform) == int(layout.uniform) and int(want.num_out) > 0


def check_compressor(kernel: Any, layout: VerifyLayout, device: str, gen: torch.Generator) -> None:
    """Two consecutive batches from a state of fresh requests and partial blocks, so blocks carry over.

    Rows the plan closes are written and match, rows past ``num_out`` keep their poison, states match.
    """
    spec = kernel.spec
    ratio, d, dtype = spec["ratio"], spec["head_dim"], str(spec["dtype"])
    lens, prefix = lens_of(layout), closing_prefix(layout, gen, ratio)
    state = random_state(layout.slots, d, gen)
    state_got = state.to(device, copy=True)
    n = layout.num_tokens
    for batch in range(2):
        p = reference.plan(layout, lens, prefix, ratio)
        kv, score = randn((n, d), dtype, gen), randn((n, d), dtype, gen, 2.0)
        out, out_got = out_rows(layout, ratio, d, dtype), out_rows(layout, ratio, d, dtype, device)
        kernel.run(kv.to(device), score.to(device), p.cu_lens.to(device), p.token_out_row.to(device), state_got,
                   out_got)
        reference.compress(layout, kv, score, p, state, out, ratio)
        what, rows, got = f"{spec.id} {layout} batch {batch}", int(p.num_out), out_got.cpu()
        assert rows > 0 or batch == 1, f"{what}: no block closes (the check would be vacuous)"
        assert not got[:rows].isnan().any(), f"{what}: a closed block's row was not written"
        assert got[rows:].isnan().all(), f"{what}: rows past num_out were written"
        torch.testing.assert_close(got[:rows], out[:rows], **TOL[dtype], msg=lambda m, w=what: f"{w} out: {m}")
        torch.testing.assert_close(state_got.cpu(), state, **STATE_TOL, msg=lambda m, w=what: f"{w} state: {m}")
        prefix = prefix + lens


def check_norm_rope(kernel: Any, layout: VerifyLayout, device: str, gen: torch.Generator) -> None:
    """In place on q and k (the inputs are the poison); positions from the reference plan of a random prefix."""
    spec = kernel.spec
    d, dtype, n = spec["head_dim"], str(spec["dtype"]), layout.num_tokens
    positions = reference.plan(layout, lens_of(layout), random_prefix(layout, gen), 4).token_pos
    q = randn((n, spec["num_q_heads"], d), dtype, gen)
    k = randn((n, spec["num_kv_heads"], d), dtype, gen, 3.0)
    qw, kw = randn((d,), dtype, gen), randn((d,), dtype, gen)
    q_got, k_got = q.to(device, copy=True), k.to(device, copy=True)
    kernel.run(q_got, k_got, positions.to(device), qw.to(device), kw.to(device), EPS, THETA)
    reference.norm_rope(layout, q, k, positions, qw, kw, spec["rope_dim"], EPS, THETA)
    for name, got, ref in (("q", q_got, q), ("k", k_got, k)):
        torch.testing.assert_close(got.cpu(), ref, **TOL[dtype],
                                   msg=lambda m, name=name: f"{spec.id} {layout} {name}: {m}")


CHECKS = {"plan": check_plan, "compressor": check_compressor, "norm_rope": check_norm_rope}
