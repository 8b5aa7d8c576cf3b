"""The plan kernel's block reductions: the incident's ragged shape over and over, every CTA size.

The incident's second cause was a missing barrier in the plan kernel's min/max reduction, which took the
uniform fast path for ``[3]*104 + [2]*24``. On the host the CTA is emulated phase by phase (tvm_ffi) or
interpreted (triton); on a GPU (``tests/test_kernels_gpu.py``) the same tests run on real warps.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import FLOOR, INCIDENT, check_plan, get_kernel, lens_of, poisoned_plan

from jitwarm.kernels import KernelSpec, VerifyLayout, ops, plan_threads, reference

#: Consecutive runs on the incident layout: the interpreter runs the kernel about 100 times slower. On the host
#: the CTA is emulated phase by phase, so repetition explores inputs, not schedules: the GPU test runs 2000.
INCIDENT_RUNS = {"tvm_ffi": 200 if FLOOR else 500, "triton": 25}


def assert_plan_equal(got, want, what=""):
    for name, a, b in zip(want._fields, got, want, strict=True):
        assert torch.equal(a, b), f"{what}: {name} differs"


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("backend", [pytest.param("tvm_ffi", marks=pytest.mark.tvm_ffi), "triton"])
def test_incident_shape_exact_in_consecutive_runs(kernel_caches, backend, ratio):
    """Each run: fresh poison, a new random prefix; exact outputs and never the uniform path."""
    spec = KernelSpec("plan", backend, "cpu", {"ratio": ratio, "threads": 128})
    kernel = get_kernel(kernel_caches(backend, "cpu").cache, spec)
    gen = torch.Generator().manual_seed(ratio)
    for _ in range(INCIDENT_RUNS[backend]):
        check_plan(kernel, INCIDENT, "cpu", gen)


LAYOUTS = {
    "R=1": VerifyLayout((4,)),
    "R=33-ragged": VerifyLayout((1, 2) * 16 + (6,)),
    "R=64-uniform": VerifyLayout((3,) * 64),
    "R=200-ragged": VerifyLayout(tuple(1 + (i * 7) % 6 for i in range(200))),
    "R=512-ragged-last": VerifyLayout((2,) * 511 + (1,)),
    "R=1024-ragged-first": VerifyLayout((5,) + (4,) * 1023),
    "R=1025": VerifyLayout(tuple(1 + i % 3 for i in range(1025))),
    "R=3000": VerifyLayout(tuple(1 + (i * 5) % 4 for i in range(3000))),
    "R=3000-uniform": VerifyLayout((2,) * 3000),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_cta_size_and_more_requests_than_threads(name, use_kernel_cache):
    layout = LAYOUTS[name]
    threads = plan_threads(layout.slots)
    assert threads == min(1024, max(32, 1 << (layout.slots - 1).bit_length()))
    gen = torch.Generator().manual_seed(layout.slots)
    lens = lens_of(layout)
    for ratio in (4, 128):
        for _ in range(3):
            prefix = torch.randint(0, 1 << 20, (layout.slots,), generator=gen, dtype=torch.int32)
            got = ops.plan(layout, lens, prefix, ratio, out=poisoned_plan(layout))
            assert_plan_equal(got, reference.plan(layout, lens, prefix, ratio), f"{name} ratio {ratio}")
            assert int(got.uniform) == int(layout.uniform)


def test_uniform_flag_is_decided_from_device_data_not_the_spec(use_kernel_cache):
    # Two layouts with the same spec (threads=128, ratio=4): the branch comes from the reduction.
    uniform, ragged = VerifyLayout((3,) * 128), INCIDENT
    zeros = torch.zeros(128, dtype=torch.int32)
    assert int(ops.plan(uniform, lens_of(uniform), zeros, 4).uniform) == 1
    assert int(ops.plan(ragged, lens_of(ragged), zeros, 4).uniform) == 0
