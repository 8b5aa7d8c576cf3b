"""Properties of the torch reference (the definition), checked against plain-Python restatements."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from kernel_checks import INCIDENT, lens_of, random_prefix

from jitwarm.kernels import VerifyLayout, reference
from jitwarm.kernels.spec import max_out_rows

LAYOUTS = [INCIDENT, VerifyLayout((1,)), VerifyLayout((6,) * 5), VerifyLayout((1, 5, 2, 7, 3))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
@pytest.mark.parametrize("ratio", [1, 4, 7, 128])
def test_plan_matches_its_definition(layout, ratio):
    gen = torch.Generator().manual_seed(ratio)
    prefix = random_prefix(layout, gen, high=300)
    p = reference.plan(layout, lens_of(layout), prefix, ratio)
    cu, req, pos, rows = [0], [], [], []
    for r, n in enumerate(layout.verify_lens):
        cu.append(cu[-1] + n)
        for j in range(n):
            req.append(r)
            pos.append(int(prefix[r]) + j)
            closes = (pos[-1] + 1) % ratio == 0
            rows.append(sum(x >= 0 for x in rows) if closes else -1)
    assert p.cu_lens.tolist() == cu and p.token_req.tolist() == req and p.token_pos.tolist() == pos
    assert p.token_out_row.tolist() == rows
    assert p.num_out.tolist() == [sum(x >= 0 for x in rows)]
    assert p.uniform.tolist() == [int(layout.uniform)]
    assert all(t.dtype == torch.int32 for t in p)
    assert int(p.num_out) <= max_out_rows(layout, ratio)


def test_max_out_rows_is_a_tight_bound():
    layout = VerifyLayout((3, 5, 1))
    assert max_out_rows(layout, 4) == 1 + 2 + 1
    worst = torch.tensor([3, 3, 3], dtype=torch.int32)  # (3+1)%4: the first token of each closes a block
    assert int(reference.plan(layout, lens_of(layout), worst, 4).num_out) == 4
    with pytest.raises(ValueError):
        max_out_rows(layout, 0)


def naive_blocks(kv, score, lens, prefix, ratio):
    """Closed blocks per request from a fresh state: softmax(score)-weighted mean of each block's tokens."""
    out, t = [], 0
    for n, p0 in zip(lens, prefix, strict=True):
        block, rows = [], []
        for j in range(n):
            block.append(t + j)
            if (p0 + j + 1) % ratio == 0:
                w = torch.softmax(score[block].double(), dim=0)
                rows.append((w * kv[block].double()).sum(0))
                block = []
        out.append(rows)
        t += n
    return out


def test_compress_from_fresh_state_is_the_blockwise_softmax_mean():
    gen = torch.Generator().manual_seed(0)
    layout, ratio, d = VerifyLayout((6, 5, 4, 3)), 3, 8
    prefix = torch.tensor([0, 3, 6, 9], dtype=torch.int32)  # every request starts at a block boundary
    p = reference.plan(layout, lens_of(layout), prefix, ratio)
    n = layout.num_tokens
    kv, score = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen) * 3
    state = torch.tensor([float("-inf"), 0.0, 0.0]).repeat(layout.slots, d, 1).transpose(1, 2).contiguous()
    out = torch.full((max_out_rows(layout, ratio), d), float("nan"))
    reference.compress(layout, kv, score, p, state, out, ratio)
    want = naive_blocks(kv, score, layout.verify_lens, prefix.tolist(), ratio)
    pairs = list(zip(p.token_out_row.tolist(), p.token_req.tolist(), strict=True))
    got = [[out[row] for row, r in pairs if row >= 0 and r == q]
           for q in range(layout.slots)]
    for a, b in zip(got, want, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x.double(), y, rtol=1e-5, atol=1e-6)
    # requests 1 and 3 end mid-block: their state holds the partial block; 0 and 2 are fresh again
    assert math.isinf(state[0, 0, 0]) and state[0, 1].eq(0).all()
    assert state[1, 1].gt(0).all()


def test_compress_is_stable_for_huge_scores():
    layout = VerifyLayout((4,))
    p = reference.plan(layout, lens_of(layout), torch.tensor([0], dtype=torch.int32), 4)
    kv = torch.randn(4, 8)
    score = torch.full((4, 8), 1e4)
    state = torch.tensor([float("-inf"), 0.0, 0.0]).repeat(1, 8, 1).transpose(1, 2).contiguous()
    out = torch.zeros(1, 8)
    reference.compress(layout, kv, score, p, state, out, 4)
    torch.testing.assert_close(out[0], kv.mean(0))


def test_norm_rope_at_position_zero_is_rmsnorm_and_rotation_keeps_pair_norms():
    gen = torch.Generator().manual_seed(1)
    layout = VerifyLayout((2, 2))
    q, k = torch.randn(4, 3, 16, generator=gen), torch.randn(4, 1, 16, generator=gen)
    w = torch.rand(16, generator=gen) + 0.5
    zero_q, zero_k = q.clone(), k.clone()
    reference.norm_rope(layout, zero_q, zero_k, torch.zeros(4, dtype=torch.int32), w, w, rope_dim=8)
    rms = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(zero_q, rms)
    rot_q, rot_k = q.clone(), k.clone()
    reference.norm_rope(layout, rot_q, rot_k, torch.tensor([1, 50, 1000, 1 << 20], dtype=torch.int32), w, w,
                        rope_dim=8)
    assert torch.equal(rot_q[..., 8:], zero_q[..., 8:])  # dims at and past rope_dim are only normed
    pair = lambda x: x[..., :4].pow(2) + x[..., 4:8].pow(2)  # noqa: E731  (i pairs with i + rope_dim/2)
    torch.testing.assert_close(pair(rot_q), pair(zero_q))
    assert not torch.allclose(rot_q[..., :8], zero_q[..., :8])


def test_rope_inv_freq_is_float64_pow_rounded_once():
    inv = reference.rope_inv_freq(64, 10000.0)
    assert inv.dtype == torch.float32 and inv[0] == 1.0 and (inv[1:] < inv[:-1]).all()
    for i in (1, 17, 31):
        assert inv[i].item() == torch.tensor(10000.0 ** ((-2.0 * i) / 64), dtype=torch.float64).float().item()


def test_reference_modules_import_no_torch_at_package_import():
    code = ("import sys, jitwarm.kernels, jitwarm.kernels.spec, jitwarm.kernels.dispatch\n"
            "bad = [m for m in ('torch', 'tvm_ffi', 'triton') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
