"""Edge cases of the tvm_ffi host builds, through the public ops, against the reference: sizes, ratios,
positions, state across calls (the uniform compressor's unread ``cu_lens``: test_kernels_host.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import (
    EPS,
    STATE_TOL,
    THETA,
    TOL,
    lens_of,
    out_rows,
    poisoned_plan,
    randn,
    random_prefix,
    random_state,
)

from jitwarm.kernels import VerifyLayout, ops, reference


def run_all_ops(layout, prefix, gen, *, ratio=4, head_dim=128, rope_dim=64, hq=16, hk=1, dtype="float32",
                theta=THETA, eps=EPS):
    """Plan, compress and norm_rope one batch with kernels and reference; compare everything."""
    lens = lens_of(layout)
    p = ops.plan(layout, lens, prefix, ratio, out=poisoned_plan(layout))
    want = reference.plan(layout, lens, prefix, ratio)
    for name, a, b in zip(want._fields, p, want, strict=True):
        assert torch.equal(a, b), f"plan {name} differs"
    n = layout.num_tokens
    kv, score = randn((n, head_dim), dtype, gen), randn((n, head_dim), dtype, gen, 2.0)
    state, out = random_state(layout.slots, head_dim, gen), out_rows(layout, ratio, head_dim, dtype)
    state_ref, out_ref = state.clone(), out.clone()
    ops.compress(layout, kv, score, p, state, out, ratio)
    reference.compress(layout, kv, score, want, state_ref, out_ref, ratio)
    rows = int(want.num_out)
    torch.testing.assert_close(out[:rows], out_ref[:rows], **TOL[dtype])
    assert out[rows:].isnan().all()
    torch.testing.assert_close(state, state_ref, **STATE_TOL)
    q, k = randn((n, hq, head_dim), dtype, gen), randn((n, hk, head_dim), dtype, gen)
    qw, kw = randn((head_dim,), dtype, gen), randn((head_dim,), dtype, gen)
    q_ref, k_ref = q.clone(), k.clone()
    ops.norm_rope(layout, q, k, p.token_pos, qw, kw, rope_dim=rope_dim, eps=eps, theta=theta)
    reference.norm_rope(layout, q_ref, k_ref, want.token_pos, qw, kw, rope_dim=rope_dim, eps=eps, theta=theta)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])
    return want


def test_one_request(use_kernel_cache):
    gen = torch.Generator().manual_seed(1)
    layout = VerifyLayout((5,))
    want = run_all_ops(layout, torch.tensor([6], dtype=torch.int32), gen)
    assert want.token_out_row.tolist() == [-1, 0, -1, -1, -1]  # positions 6..10 close the block at 7


def test_every_length_one(use_kernel_cache):
    gen = torch.Generator().manual_seed(2)
    layout = VerifyLayout((1,) * 128)
    want = run_all_ops(layout, random_prefix(layout, gen), gen, dtype="bfloat16")
    assert int(want.uniform) == 1


def test_ratio_larger_than_any_position_writes_no_rows(use_kernel_cache):
    gen = torch.Generator().manual_seed(3)
    layout = VerifyLayout((3,) * 10 + (2,) * 5)
    want = run_all_ops(layout, random_prefix(layout, gen, high=900), gen, ratio=1000)
    assert int(want.num_out) == 0
    assert (want.token_out_row == -1).all()


@pytest.mark.parametrize("ratio", [4, 128])
def test_prefixes_straddling_block_boundaries(ratio, use_kernel_cache):
    gen = torch.Generator().manual_seed(ratio)
    layout = VerifyLayout((6, 5, 4, 3, 2, 1) * 4)
    # every offset around a block end: prefix = k * ratio - j for j in 0..5, straddling one boundary each
    prefix = torch.tensor([ratio * (1 + i) - (i % 7) for i in range(layout.slots)], dtype=torch.int32)
    want = run_all_ops(layout, prefix, gen, ratio=ratio)
    assert int(want.num_out) > 0


def test_block_boundary_rows_by_hand():
    layout = VerifyLayout((3, 2))
    p = reference.plan(layout, lens_of(layout), torch.tensor([3, 6], dtype=torch.int32), 4)
    assert p.token_pos.tolist() == [3, 4, 5, 6, 7]
    assert p.token_out_row.tolist() == [0, -1, -1, -1, 1]
    assert p.cu_lens.tolist() == [0, 3, 5] and p.token_req.tolist() == [0, 0, 0, 1, 1]
    assert int(p.num_out) == 2 and int(p.uniform) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_carried_across_two_calls_equals_one_call(dtype, use_kernel_cache):
    """Split each request's tokens over two batches; rows and final state match one batch exactly."""
    gen = torch.Generator().manual_seed(4)
    first, second = (3, 2, 4, 1, 5), (2, 4, 1, 5, 1)
    whole = VerifyLayout(tuple(a + b for a, b in zip(first, second, strict=True)))
    prefix0 = torch.tensor([3, 0, 126, 7, 1], dtype=torch.int32)
    d, ratio = 128, 4
    kv, score = randn((whole.num_tokens, d), dtype, gen), randn((whole.num_tokens, d), dtype, gen, 2.0)
    state0 = random_state(whole.slots, d, gen)

    def per_request_rows(layout, prefix, kv_part, score_part, state):
        p = ops.plan(layout, lens_of(layout), prefix, ratio)
        out = out_rows(layout, ratio, d, dtype)
        ops.compress(layout, kv_part, score_part, p, state, out, ratio)
        rows = [[] for _ in range(layout.slots)]
        for r, row in zip(p.token_req.tolist(), p.token_out_row.tolist(), strict=True):
            if row >= 0:
                rows[r].append(out[row])
        return rows

    state_one = state0.clone()
    one = per_request_rows(whole, prefix0, kv, score, state_one)
    # token index of each request's j-th token in the whole batch, split at `first`
    starts = [0]
    for n in whole.verify_lens:
        starts.append(starts[-1] + n)
    idx_a = torch.tensor([starts[r] + j for r, n in enumerate(first) for j in range(n)])
    idx_b = torch.tensor([starts[r] + first[r] + j for r, n in enumerate(second) for j in range(n)])
    state_two = state0.clone()
    rows_a = per_request_rows(VerifyLayout(first), prefix0, kv[idx_a], score[idx_a], state_two)
    rows_b = per_request_rows(VerifyLayout(second), prefix0 + torch.tensor(first, dtype=torch.int32),
                              kv[idx_b], score[idx_b], state_two)
    assert sum(len(r) for r in one) > 0
    for r in range(whole.slots):
        two = rows_a[r] + rows_b[r]
        assert len(two) == len(one[r])
        for a, b in zip(two, one[r], strict=True):
            assert torch.equal(a, b), f"request {r}: a carried block differs"
    assert torch.equal(state_two, state_one)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_positions_near_2_pow_20(dtype, use_kernel_cache):
    gen = torch.Generator().manual_seed(5)
    layout = VerifyLayout((3,) * 104 + (2,) * 24)
    prefix = (1 << 20) - 64 + torch.randint(0, 128, (layout.slots,), generator=gen, dtype=torch.int32)
    want = run_all_ops(layout, prefix, gen, dtype=dtype)
    assert int(want.token_pos.max()) > 1 << 20


@pytest.mark.parametrize("head_dim", [64, 256])
def test_head_dims(head_dim, use_kernel_cache):
    gen = torch.Generator().manual_seed(head_dim)
    layout = VerifyLayout((4,) * 6 + (3,) * 10)
    run_all_ops(layout, random_prefix(layout, gen), gen, head_dim=head_dim, rope_dim=64)


def test_one_head_and_partial_rotation(use_kernel_cache):
    gen = torch.Generator().manual_seed(6)
    layout = VerifyLayout((2,) * 7 + (1,))
    run_all_ops(layout, random_prefix(layout, gen), gen, hq=1, hk=1, rope_dim=32, theta=1e6, eps=1e-5)


def test_kernel_errors_pickle_by_the_error_root_rule():
    # Build workers hand these across a process pool: JitwarmError's one __reduce__ carries message and fields.
    import pickle

    from jitwarm.kernels.artifacts import KernelLoadError
    from jitwarm.kernels.backend import CompileError
    from jitwarm.kernels.spec import KernelSpec
    from jitwarm.precompile.hook import KernelLoadFailed

    spec = KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 4, "threads": 128})
    compiled = pickle.loads(pickle.dumps(CompileError("nvcc failed", "line 1\nline 2")))
    assert (compiled.summary, compiled.output, str(compiled)) == ("nvcc failed", "line 1\nline 2",
                                                                   "nvcc failed\nline 1\nline 2")
    for cls, field in ((KernelLoadError, "why"), (KernelLoadFailed, "load_reason")):
        again = pickle.loads(pickle.dumps(cls(spec, "bad elf")))
        assert type(again) is cls and again.spec == spec and getattr(again, field) == "bad elf"
        assert str(again) == str(cls(spec, "bad elf"))
