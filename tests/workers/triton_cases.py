"""Triton test cases shared by the test files and the worker scripts: configs, kernels, reference checks.

Every check runs one loaded kernel and :mod:`jitwarm.kernels.reference` on the same random inputs on one
device, with every output buffer poisoned first, and raises AssertionError on a mismatch.
"""

from __future__ import annotations

from typing import Any

import torch

from jitwarm.kernels import KernelSpec, VerifyLayout, reference
from jitwarm.kernels import triton_backend as backend
from jitwarm.precompile.config import ServingConfig
from jitwarm.precompile.plan import WarmPlan

INCIDENT = VerifyLayout((3,) * 104 + (2,) * 24)  # bs=60, 6 draft tokens, 128 slots (DESIGN.md)
POISON_INT = -12345
POISON_FLOAT = 1234.5
EPS, THETA = 1e-6, 10000.0
TOL = {"float32": {"rtol": 1e-5, "atol": 1e-5}, "bfloat16": {"rtol": 2e-2, "atol": 2e-2}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def small_config(dtype: str, target: str) -> ServingConfig:
    """The small compact plan the correctness checks cover: every spec it needs is checked."""
    return ServingConfig(cuda_graph_max_bs_decode=16, speculative_algorithm="DSPARK", speculative_num_draft_tokens=4,
                         ragged_verify_mode="compact",
                         head_dim=64, rope_dim=32, num_q_heads=3, num_kv_heads=1, compress_ratios=(4, 8),
                         dtype=dtype, backends=("triton",), targets=(target,))


def dspark_config(target: str = "sm_90") -> ServingConfig:
    """The DSpark-style profile of DESIGN.md: 35 shapes, 30 specs per backend and target."""
    return ServingConfig(cuda_graph_max_bs_decode=128, max_running_requests=128, speculative_algorithm="DSPARK",
                         speculative_num_draft_tokens=6, ragged_verify_mode="compact", backends=("triton",),
                         targets=(target,))


def spec_cases(config: ServingConfig) -> list[tuple[KernelSpec, VerifyLayout]]:
    """Each spec of ``config``'s warm plan with the layout of the first (largest) shape that needs it."""
    return [(spec, layouts[0]) for spec, layouts in spec_layouts(config).items()]


def spec_layouts(config: ServingConfig) -> dict[KernelSpec, list[VerifyLayout]]:
    """Each spec of ``config``'s warm plan with every layout that dispatches it, largest batch first.

    A plan spec serves uniform and ragged layouts alike (its choice is made on the device), so its
    checks must cover both; compressor and norm_rope specs fix uniformity and max_len themselves.
    """
    plan = WarmPlan.build(config)
    layouts = {shape.bs: shape.layout for shape in plan.shapes}
    return {spec: list(dict.fromkeys(layouts[bs] for bs in plan.needed_by[spec])) for spec in plan.specs}


def get_kernel(cache: Any, spec: KernelSpec) -> Any:
    """Build (or find) ``spec`` in ``cache``, load it and preload it."""
    entry = cache.get_or_build(backend.description(spec), lambda staging: backend.build(spec, staging))
    kernel = backend.load(spec, entry)
    kernel.preload()
    return kernel


def check(kernel: Any, layout: VerifyLayout, device: str, seed: int = 0) -> None:
    """Run ``kernel`` and the reference on random inputs of ``layout``; assert they agree."""
    gen = torch.Generator().manual_seed(seed)
    {"plan": check_plan, "compressor": check_compressor, "norm_rope": check_norm_rope}[kernel.spec.family](
        kernel, layout, device, gen)


def _lens(layout: VerifyLayout, device: str, gen: torch.Generator, max_prefix: int = 300):
    lens = torch.tensor(layout.verify_lens, dtype=torch.int32)
    prefix = torch.randint(0, max_prefix, (layout.slots,), generator=gen, dtype=torch.int32)
    return lens.to(device), prefix.to(device)


def check_plan(kernel: Any, layout: VerifyLayout, device: str, gen: torch.Generator) -> None:
    """Plan outputs are integers: they must be exact, and every poisoned element overwritten."""
    lens, prefix = _lens(layout, device, gen)
    r, n = layout.slots, layout.num_tokens
    outs = [torch.full((size,), POISON_INT, dtype=torch.int32, device=device)
            for size in (r + 1, n, n, n, 1, 1)]
    kernel.run(lens, prefix, *outs)
    want = reference.plan(layout, lens, prefix, kernel.spec["ratio"])
    for name, got, ref in zip(want._fields, outs, want, strict=True):
        assert torch.equal(got.cpu(), ref.cpu()), f"{kernel.spec.id} {layout}: {name} {got} != {ref}"


def check_compressor(kernel: Any, layout: VerifyLayout, device: str, gen: torch.Generator) -> None:
    """Two consecutive batches, so partial blocks carry over in the state between calls."""
    spec = kernel.spec
    d, ratio, dtype = spec["head_dim"], spec["ratio"], DTYPES[str(spec["dtype"])]
    lens, prefix = _lens(layout, device, gen)
    r, n = layout.slots, layout.num_tokens
    state = torch.stack([torch.full((r, d), float("-inf")), torch.zeros(r, d), torch.zeros(r, d)], 1)
    state_ref, state_got = state.to(device), state.clone().to(device)
    for _ in range(2):
        kv = torch.randn(n, d, generator=gen).to(dtype).to(device)
        score = (2 * torch.randn(n, d, generator=gen)).to(dtype).to(device)
        p = reference.plan(layout, lens, prefix, ratio)
        rows = max(1, n)
        out_ref = torch.full((rows, d), POISON_FLOAT, dtype=dtype, device=device)
        out_got = out_ref.clone()
        reference.compress(layout, kv, score, p, state_ref, out_ref, ratio)
        kernel.run(kv, score, p.cu_lens, p.token_out_row, state_got, out_got)
        torch.testing.assert_close(out_got.float(), out_ref.float(), **TOL[str(spec["dtype"])],
                                   msg=lambda m: f"{spec.id} {layout} out: {m}")
        torch.testing.assert_close(state_got, state_ref, **TOL[str(spec["dtype"])],
                                   msg=lambda m: f"{spec.id} {layout} state: {m}")
        prefix = prefix + lens


def check_norm_rope(kernel: Any, layout: VerifyLayout, device: str, gen: torch.Generator) -> None:
    """In place on q and k; positions come from the reference plan of a random prefix."""
    spec = kernel.spec
    d, hq, hk = spec["head_dim"], spec["num_q_heads"], spec["num_kv_heads"]
    dtype = DTYPES[str(spec["dtype"])]
    lens, prefix = _lens(layout, device, gen, max_prefix=8192)
    positions = reference.plan(layout, lens, prefix, 4).token_pos
    n = layout.num_tokens
    q = torch.randn(n, hq, d, generator=gen).to(dtype).to(device)
    k = (3 * torch.randn(n, hk, d, generator=gen)).to(dtype).to(device)
    qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype).to(device)
    kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype).to(device)
    q_got, k_got = q.clone(), k.clone()
    reference.norm_rope(layout, q, k, positions, qw, kw, spec["rope_dim"], EPS, THETA)
    kernel.run(q_got, k_got, positions, qw, kw, EPS, THETA)
    for name, got, ref in (("q", q_got, q), ("k", k_got, k)):
        torch.testing.assert_close(got.float(), ref.float(), **TOL[str(spec["dtype"])],
                                   msg=lambda m, name=name: f"{spec.id} {layout} {name}: {m}")
