"""The plan kernel's block reductions: the incident's ragged shape thousands of times, every CTA size.

The incident's second cause was a missing barrier in the plan kernel's min/max reduction, which took the
uniform fast path for ``[3]*104 + [2]*24``. On the host the CTA is emulated phase by phase; on a GPU
(``tests/test_kernels_cuda.py``) the same test runs on real warps.
"""

from __future__ import annotations

import pytest
import torch
from kernel_fixtures import (  # kernel_cache, use_kernel_cache fixtures
    INCIDENT,
    kernel_cache_fixture,  # noqa: F401
    lens_of,
    poisoned_plan,
    use_kernel_cache_fixture,  # noqa: F401
)

from jitwarm.kernels import VerifyLayout, ops, plan_threads, reference

RUNS = 2000


def assert_plan_equal(got, want, what=""):
    for name, a, b in zip(want._fields, got, want, strict=True):
        assert torch.equal(a, b), f"{what}: {name} differs"


@pytest.mark.parametrize("ratio", [4, 128])
def test_incident_shape_exact_in_consecutive_runs(ratio, use_kernel_cache):
    gen = torch.Generator().manual_seed(ratio)
    lens = lens_of(INCIDENT)
    out = poisoned_plan(INCIDENT)
    for run in range(RUNS):
        prefix = torch.randint(0, 1 << 16, (INCIDENT.slots,), generator=gen, dtype=torch.int32)
        for t in out:
            t.fill_(-1 if run % 2 else 12345)  # stale values from the last run must not survive
        got = ops.plan(INCIDENT, lens, prefix, ratio, out=out)
        want = reference.plan(INCIDENT, lens, prefix, ratio)
        assert int(got.uniform) == 0, f"run {run}: uniform path taken for the ragged incident layout"
        assert_plan_equal(got, want, f"run {run}")


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
