"""Shared helpers for the kernel tests: the DSpark-128 plans, one built cache per session, random inputs.

Import the fixtures into a test module: ``from kernel_fixtures import kernel_cache_fixture`` (and
``use_kernel_cache_fixture``) make the ``kernel_cache`` and ``use_kernel_cache`` fixtures available.
The cache is built once per process whatever module asks first (module-level memo), with the compiles
spread over the cores.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec, ModelDims, VerifyLayout, dispatch, reference
from jitwarm.kernels.token_map import TokenMap, max_out_rows
from jitwarm.precompile import ServingConfig, WarmPlan

DSPARK = {"cuda_graph_max_bs_decode": 128, "max_running_requests": 128, "speculative_algorithm": "DSPARK",
          "speculative_num_draft_tokens": 6, "ragged_verify_mode": "compact"}
INCIDENT = VerifyLayout((3,) * 104 + (2,) * 24)
POISON_INT = -77777
TOL = {"float32": {"rtol": 1e-5, "atol": 1e-5}, "bfloat16": {"rtol": 2e-2, "atol": 2e-2}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: CUDA builds cannot be tested")


@functools.cache
def dspark_plan(dtype: str = "bfloat16", target: str = "cpu") -> WarmPlan:
    """The DSpark-128 warm plan (35 shapes, 30 specs) for one dtype and target."""
    return WarmPlan.build(ServingConfig(**DSPARK, dtype=dtype, targets=(target,)))


def spec_layouts(plan: WarmPlan) -> dict[KernelSpec, VerifyLayout]:
    """Each spec of ``plan`` with the layout of the first (largest) shape that needs it."""
    by_bs = {shape.bs: shape.layout for shape in plan.shapes}
    return {spec: by_bs[plan.needed_by[spec][0]] for spec in plan.specs}


def dspark_cases() -> list[tuple[KernelSpec, VerifyLayout]]:
    """Every spec of the bfloat16 and the float32 DSpark-128 host plans (54 unique), with a layout."""
    cases: dict[KernelSpec, VerifyLayout] = {}
    for dtype in ("bfloat16", "float32"):
        for spec, layout in spec_layouts(dspark_plan(dtype)).items():
            cases.setdefault(spec, layout)
    return list(cases.items())


@dataclass
class BuiltCache:
    """The session's kernel cache and what building it cost."""

    cache: KernelCache
    specs: tuple[KernelSpec, ...]
    seconds: float
    builds: int


_SESSION: dict[str, BuiltCache] = {}


def build_all(cache: KernelCache, specs: list[KernelSpec]) -> None:
    """Get or build ``specs`` through the cache, one compile per core at a time."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(lambda s: dispatch.ensure_built(s, cache), specs))


@pytest.fixture(scope="session", name="kernel_cache")
def kernel_cache_fixture(tmp_path_factory) -> BuiltCache:
    """One cache per session holding every DSpark-128 host spec (bfloat16 and float32)."""
    if "dspark" not in _SESSION:
        cache = KernelCache(tmp_path_factory.mktemp("kernel-cache"), layers=())
        specs = [spec for spec, _ in dspark_cases()]
        start = time.perf_counter()
        build_all(cache, specs)
        seconds = time.perf_counter() - start
        _SESSION["dspark"] = BuiltCache(cache, tuple(specs), seconds, cache.stats().builds)
    return _SESSION["dspark"]


@pytest.fixture(name="use_kernel_cache")
def use_kernel_cache_fixture(kernel_cache):
    """Make the session cache dispatch's default for the test, and restore the previous one after."""
    previous = dispatch.set_cache(kernel_cache.cache)
    yield kernel_cache
    dispatch.set_cache(previous)


# -- inputs ---------------------------------------------------------------------------------------------


def lens_of(layout: VerifyLayout, device: str = "cpu") -> torch.Tensor:
    """``verify_lens`` of a layout as an int32 tensor."""
    return torch.tensor(layout.verify_lens, dtype=torch.int32, device=device)


def random_prefix(layout: VerifyLayout, gen: torch.Generator, high: int = 5000, device: str = "cpu"
                  ) -> torch.Tensor:
    """Random non-negative ``prefix_lens``, never all zero."""
    return torch.randint(1, high, (layout.slots,), generator=gen, dtype=torch.int32).to(device)


def poisoned_plan(layout: VerifyLayout, device: str = "cpu") -> TokenMap:
    """A preallocated plan whose every element is a value no kernel writes."""
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
    """Random normal values (never zeros) in ``dtype``."""
    return (torch.randn(shape, generator=gen) * scale).to(DTYPES[dtype]).to(device)


def model_of(spec: KernelSpec) -> ModelDims:
    """Model dims that make the family's ``specs_for`` give back ``spec``."""
    p = spec.params_dict
    keys = ("head_dim", "rope_dim", "num_q_heads", "num_kv_heads", "dtype")
    kw = {k: p[k] for k in keys if k in p}
    if "ratio" in p:
        kw["compress_ratios"] = (p["ratio"],)
    return ModelDims(**kw)


def ref_plan(layout: VerifyLayout, lens: torch.Tensor, prefix: torch.Tensor, ratio: int) -> TokenMap:
    """The reference plan (alias kept short for the tests)."""
    return reference.plan(layout, lens, prefix, ratio)


def out_rows(layout: VerifyLayout, ratio: int, head_dim: int, dtype: str, device: str = "cpu"
             ) -> torch.Tensor:
    """A NaN-poisoned compressor output with the most rows the layout can write."""
    rows = max_out_rows(layout, ratio)
    return torch.full((rows, head_dim), float("nan"), dtype=DTYPES[dtype], device=device)
