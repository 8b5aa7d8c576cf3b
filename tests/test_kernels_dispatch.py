"""Dispatch and argument validation: the loaded-module table, miss hooks, and ValueErrors before any run."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import INCIDENT, lens_of, out_rows, random_state

from jitwarm.kernels import (
    FAMILIES,
    KernelSpec,
    ModelDims,
    SpecError,
    Target,
    VerifyLayout,
    backend,
    dispatch,
    ops,
    reference,
)

# CI's floor pass reruns the ones marked floor (what calls a loaded module) on the lowest apache-tvm-ffi setup.py
# allows (0.1.11: sglang's and vLLM's pin).
pytestmark = pytest.mark.tvm_ffi


def test_backend_registry_and_device_targets():
    assert backend("tvm_ffi").__name__ == "jitwarm.kernels.tvm_backend" and backend("triton").name == "triton"
    with pytest.raises(SpecError, match="unknown kernel backend"):
        backend("nope")
    assert dispatch.target_of("cpu") == "cpu" and Target.of_device(torch.device("cpu")) == Target("cpu")
    with pytest.raises(ValueError, match="meta"):
        Target.of_device("meta")


def test_miss_hook_sees_the_spec_and_can_forbid_the_load(use_kernel_cache):
    layout = VerifyLayout((2, 1, 2))
    spec = KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 5, "threads": 32})
    assert FAMILIES["plan"].specs_for(layout, ModelDims(compress_ratios=(5,)), "tvm_ffi", "cpu") == (spec,)
    seen = []

    class Forbidden(RuntimeError):
        pass

    def forbid(s, shape):
        seen.append((s, shape))
        raise Forbidden(s.id)

    dispatch.add_miss_hook(forbid)
    try:
        with pytest.raises(Forbidden):
            ops.plan(layout, lens_of(layout), torch.zeros(3, dtype=torch.int32), 5)
        assert seen == [(spec, layout)]
        assert not dispatch.is_loaded(spec)
    finally:
        dispatch.remove_miss_hook(forbid)
    dispatch.remove_miss_hook(forbid)  # removing twice is fine

    calls = []

    def record(s, shape):
        calls.append(s)

    dispatch.add_miss_hook(record)
    try:
        before = dispatch.counters()
        first = dispatch.ensure_loaded(spec, shape=layout)
        assert dispatch.ensure_loaded(spec) is first  # a hit returns the same module, no hook
        assert calls == [spec]
        after = dispatch.counters()
        assert after["loads"] - before["loads"] == 1 and after["misses"] - before["misses"] == 1
        assert spec in dispatch.loaded_specs()
    finally:
        dispatch.remove_miss_hook(record)
    p = ops.plan(layout, lens_of(layout), torch.tensor([3, 4, 8], dtype=torch.int32), 5)
    assert p.token_out_row.tolist() == [-1, 0, 1, -1, 2]  # positions 3 4 | 4 | 8 9, ratio 5


@pytest.mark.floor
def test_loaded_kernel_contract(use_kernel_cache):
    spec = use_kernel_cache.specs[0]
    kernel = dispatch.ensure_loaded(spec)
    assert kernel.spec == spec
    assert kernel.preload() == 0  # host build: nothing to force onto a device
    assert callable(kernel.run)


# -- validation -----------------------------------------------------------------------------------------

N, R = INCIDENT.num_tokens, INCIDENT.slots


def plan_args(**over):
    args = {"layout": INCIDENT, "verify_lens": lens_of(INCIDENT),
            "prefix_lens": torch.zeros(R, dtype=torch.int32),
            "ratio": 4}
    args.update(over)
    return args


def compress_args(**over):
    p = reference.plan(INCIDENT, lens_of(INCIDENT), torch.zeros(R, dtype=torch.int32), 4)
    args = {"layout": INCIDENT, "kv": torch.randn(N, 128), "score": torch.randn(N, 128), "p": p,
            "state": random_state(R, 128, torch.Generator().manual_seed(0)),
            "out": out_rows(INCIDENT, 4, 128, "float32"), "ratio": 4}
    args.update(over)
    return args


def norm_rope_args(**over):
    args = {"layout": INCIDENT, "q": torch.randn(N, 16, 128), "k": torch.randn(N, 1, 128),
            "positions": torch.arange(N, dtype=torch.int32), "q_weight": torch.randn(128),
            "k_weight": torch.randn(128), "rope_dim": 64, "eps": 1e-6, "theta": 10000.0}
    args.update(over)
    return args


PLAN_BAD = {
    "layout": plan_args(layout=(3,) * 104),
    "verify_lens": plan_args(verify_lens=lens_of(INCIDENT).long()),
    "prefix_lens": plan_args(prefix_lens=torch.zeros(R + 1, dtype=torch.int32)),
    "ratio": plan_args(ratio=0),
}
COMPRESS_BAD = {
    "kv": compress_args(kv=torch.randn(N, 128, dtype=torch.float16)),
    "score": compress_args(score=torch.randn(N, 64)),
    "state": compress_args(state=torch.zeros(R, 2, 128)),
    "out": compress_args(out=torch.zeros(3, 128)),
    "p.cu_lens": compress_args(p=reference.plan(VerifyLayout((2,) * 180), lens_of(VerifyLayout((2,) * 180)),
                                                torch.zeros(180, dtype=torch.int32), 4)),
    "p": compress_args(p=(1, 2, 3)),
}
NORM_ROPE_BAD = {
    "q": norm_rope_args(q=torch.randn(N + 1, 16, 128)),
    "k": norm_rope_args(k=torch.randn(N, 1, 128, dtype=torch.bfloat16)),
    "positions": norm_rope_args(positions=torch.arange(N)),
    "q_weight": norm_rope_args(q_weight=torch.randn(64)),
    "k_weight": norm_rope_args(k_weight=torch.randn(256)[::2]),
    "rope_dim": norm_rope_args(rope_dim=63),
    "eps": norm_rope_args(eps=float("nan")),
    "theta": norm_rope_args(theta=-1.0),
}
CASES = ([("plan", name, a) for name, a in PLAN_BAD.items()]
         + [("compress", name, a) for name, a in COMPRESS_BAD.items()]
         + [("norm_rope", name, a) for name, a in NORM_ROPE_BAD.items()])


@pytest.mark.parametrize(("op", "arg", "args"), CASES, ids=[f"{op}-{arg}" for op, arg, _ in CASES])
def test_bad_argument_raises_value_error_naming_it_before_any_kernel(op, arg, args):
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    loads = dispatch.counters()["misses"]
    with pytest.raises(ValueError, match=rf"^{arg.replace('.', '[.]')}\b"):
        getattr(ops, op)(**args)
    for k, v in before.items():
        assert torch.equal(args[k], v) or (v.isnan().all() and args[k].isnan().all()), f"{k} was modified"
    assert dispatch.counters()["misses"] == loads, "a kernel was looked up before validation finished"


def test_non_contiguous_and_wrong_device_are_rejected():
    q = torch.randn(16, N, 128).transpose(0, 1)
    with pytest.raises(ValueError, match="^q: must be contiguous"):
        ops.norm_rope(**norm_rope_args(q=q))
    with pytest.raises(ValueError, match="^kv: device meta"):
        ops.compress(**compress_args(kv=torch.empty(N, 128, device="meta")))
    with pytest.raises(ValueError, match="^score: on meta"):
        ops.compress(**compress_args(score=torch.empty(N, 128, device="meta")))
    with pytest.raises(ValueError, match="^backend"):
        ops.plan(**plan_args(), backend="cuda-magic")


@pytest.mark.floor
def test_the_c_abi_checks_its_arguments_too(use_kernel_cache):
    """A direct ``run`` with a bad tensor raises instead of reading out of bounds."""
    spec = FAMILIES["plan"].specs_for(INCIDENT, ModelDims(compress_ratios=(4,)), "tvm_ffi", "cpu")[0]
    kernel = dispatch.ensure_loaded(spec)
    lens = lens_of(INCIDENT)
    outs = [torch.empty(n, dtype=torch.int32) for n in (R + 1, N, N, N, 1, 1)]
    with pytest.raises(ValueError, match="cu_lens"):
        kernel.run(lens, lens, torch.empty(R, dtype=torch.int32), *outs[1:])
    with pytest.raises(ValueError, match="prefix_lens"):
        kernel.run(lens, lens.float(), *outs)


@pytest.mark.floor
def test_the_c_abi_takes_a_tensor_without_elements_whatever_its_strides(use_kernel_cache):
    """torch (and so ops.py) calls a tensor without elements contiguous whatever its strides; so must the module.

    tvm-ffi 0.1.11 (pinned by sglang 0.5.23 and vLLM 0.33.0) rejects one in TensorView::IsContiguous, 0.1.12 and
    later accept it: csrc/common.cuh checks numel first, so every version behaves alike.
    """
    spec = FAMILIES["compressor"].specs_for(INCIDENT, ModelDims(dtype="float32", compress_ratios=(128,)), "tvm_ffi",
                                            "cpu")[0]
    kernel = dispatch.ensure_loaded(spec)
    p = reference.plan(INCIDENT, lens_of(INCIDENT), torch.zeros(R, dtype=torch.int32), 128)
    assert int(p.num_out) == 0  # positions 0..2 close no block of 128: no row is written
    kv, score = torch.randn(N, 128), torch.randn(N, 128)
    state = random_state(R, 128, torch.Generator().manual_seed(3))
    state_ref = state.clone()
    out = torch.empty(128, 0).t()
    assert out.shape == (0, 128) and out.stride() == (1, 1) and out.is_contiguous()
    kernel.run(kv, score, p.cu_lens, p.token_out_row, state, out)
    reference.compress(INCIDENT, kv, score, p, state_ref, torch.empty(0, 128), 128)
    torch.testing.assert_close(state, state_ref)
    with pytest.raises(ValueError, match="out: must be contiguous"):  # with elements, strides still count
        kernel.run(kv, score, p.cu_lens, p.token_out_row, state, torch.empty(128, 2).t())
