"""Triton kernels of the three families: plan, compressor and norm_rope (docs/kernels.md, "The families").

Every spec param is a ``tl.constexpr`` and every run-time integer is in ``do_not_specialize``, so the compiled
variants are exactly the warm plan's specs (Triton would fork unplanned variants for ``num_tokens == 1`` or
``% 16 == 0``, ``specialize.cc`` ``handle_long_type``). Pointers are 16-byte aligned (``triton_launch`` checks);
arithmetic is float32 (bf16 upcast on load: ``TRITON_INTERPRET=1``'s bf16 arithmetic is wrong); offsets are
int32. ``triton_backend`` imports this file a second time for the interpreter, so it stays self-contained; its
digest and line numbers are in every key, so any edit here rebuilds every Triton entry.
"""

from __future__ import annotations

import triton
import triton.language as tl


# tl.sum/min/max/cumsum are @triton.jit functions decorated once at import, which the interpreter copy could
# not call; tl.reduce / tl.associative_scan with combine functions defined here work in both modes.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["num_reqs"])
def plan_kernel(verify_lens, prefix_lens, cu_lens, token_req, token_pos, token_out_row, num_out, uniform,
                num_reqs, RATIO: tl.constexpr, THREADS: tl.constexpr):
    """One program of ``THREADS`` lanes, one lane per request (``num_reqs <= THREADS``)."""
    r = tl.arange(0, THREADS)
    live = r < num_reqs
    lens = tl.load(verify_lens + r, mask=live, other=0)
    pre = tl.load(prefix_lens + r, mask=live, other=0)
    # Block-wide min/max decides uniform vs ragged on the device; Triton places the barriers of its
    # reductions and scans itself (the incident's hand-written reduction missed one).
    lo = tl.reduce(tl.where(live, lens, 2147483647), 0, _min)
    hi = tl.reduce(lens, 0, _max)
    is_uniform = lo == hi
    ends = tl.associative_scan(lens, 0, _add)
    if is_uniform:
        starts = r * hi
    else:
        starts = ends - lens
    tl.store(cu_lens + r + 1, ends, mask=live)
    tl.store(cu_lens + r, starts, mask=r == 0)
    # Positions pre .. pre+len-1 close floor((pre+len)/R) - floor(pre/R) blocks; rows go in token order.
    closes = (pre + lens) // RATIO - pre // RATIO
    row_base = tl.associative_scan(closes, 0, _add) - closes
    tl.store(num_out, tl.reduce(closes, 0, _add))
    tl.store(uniform, is_uniform.to(tl.int32))
    j = 0
    while j < hi:  # not range(hi): Triton < 3.9's interpreter cannot index with a tensor bound
        valid = live & (j < lens)
        t = starts + j
        pos = pre + j
        closing = (pos + 1) % RATIO == 0
        row = tl.where(closing, row_base + (pos + 1) // RATIO - pre // RATIO - 1, -1)
        tl.store(token_req + t, r, mask=valid)
        tl.store(token_pos + t, pos, mask=valid)
        tl.store(token_out_row + t, row, mask=valid)
        j += 1


@triton.jit
def compressor_kernel(kv, score, cu_lens, token_out_row, state, out,
                      RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      UNIFORM: tl.constexpr, MAX_LEN: tl.constexpr):
    """One program per request; its tokens are folded in order, unrolled ``MAX_LEN`` times.

    ``RATIO`` is part of the spec but the block boundaries come from ``token_out_row``; the uniform path
    indexes ``r * MAX_LEN + j`` and never reads ``cu_lens``.
    """
    r = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    if UNIFORM:
        start = r * MAX_LEN
        n = MAX_LEN
    else:
        start = tl.load(cu_lens + r)
        n = tl.load(cu_lens + r + 1) - start
    st = state + r * (3 * HEAD_DIM)
    m = tl.load(st + d, mask=dm, other=0.0)
    s = tl.load(st + HEAD_DIM + d, mask=dm, other=0.0)
    acc = tl.load(st + 2 * HEAD_DIM + d, mask=dm, other=0.0)
    for j in tl.static_range(MAX_LEN):
        valid = j < n
        t = start + j
        # Masks are built from vector compares: the interpreter turns a broadcast scalar bool into
        # int32, which tl.load/tl.store then reject as a mask (Triton 3.9).
        live_d = dm & (d * 0 + j < n)
        x = tl.load(kv + t * HEAD_DIM + d, mask=live_d, other=0.0).to(tl.float32)
        w = tl.load(score + t * HEAD_DIM + d, mask=live_d, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, w)
        live = m_new != float("-inf")  # all scores -inf so far: fold nothing rather than NaN
        scale = tl.where(live, tl.exp(m - m_new), 1.0)
        e = tl.where(live, tl.exp(w - m_new), 0.0)
        m = tl.where(valid, m_new, m)
        s = tl.where(valid, s * scale + e, s)
        acc = tl.where(valid, acc * scale + e * x, acc)
        row = tl.load(token_out_row + t, mask=valid, other=-1)
        closes = row >= 0
        mean = acc / tl.where(closes, s, 1.0)  # s is 0 on a fresh state; that lane is not stored
        tl.store(out + row * HEAD_DIM + d, mean.to(out.dtype.element_ty), mask=dm & (d * 0 + row >= 0))
        m = tl.where(closes, float("-inf"), m)
        s = tl.where(closes, 0.0, s)
        acc = tl.where(closes, 0.0, acc)
    tl.store(st + d, m, mask=dm)
    tl.store(st + HEAD_DIM + d, s, mask=dm)
    tl.store(st + 2 * HEAD_DIM + d, acc, mask=dm)


@triton.jit
def _norm_rope_heads(x_ptr, w_ptr, t, pos, num_tokens, eps, theta, NUM_HEADS: tl.constexpr,
                     BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     ROPE_DIM: tl.constexpr):
    """RMSNorm then NeoX rotation of the ``[NUM_HEADS, HEAD_DIM]`` heads of token ``t``, in place."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    half = ROPE_DIM // 2
    first = d < half
    in_rope = d < ROPE_DIM
    # The rotation partner of dim i < half is i + half and vice versa; it is loaded a second time rather
    # than shuffled between lanes.
    partner = tl.where(first, d + half, d - half)
    mask = (h < NUM_HEADS) & (d < HEAD_DIM) & (h * 0 + t < num_tokens)  # vector compare: see compressor
    base = x_ptr + t * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=mask & in_rope, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=in_rope, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 1, _add) / HEAD_DIM + eps)
    xn = x * rstd[:, None] * w
    xpn = xp * rstd[:, None] * wp
    # Angles must match the reference bit for bit (reference.py): inv_freq = theta ** (-2 i / ROPE_DIM)
    # in float64, rounded once to float32, times float32(pos) in one float32 multiply.
    i = tl.where(first, d, d - half).to(tl.float64)
    inv_freq = tl.exp2((-2.0 * i / ROPE_DIM) * tl.log2(tl.cast(theta, tl.float64))).to(tl.float32)
    angle = pos.to(tl.float32) * inv_freq
    y = tl.where(in_rope, xn * tl.cos(angle) + tl.where(first, -xpn, xpn) * tl.sin(angle), xn)
    tl.store(base + d, y.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def norm_rope_kernel(q, k, positions, q_weight, k_weight, num_tokens, eps, theta,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROPE_DIM: tl.constexpr,
                     NUM_Q_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr,
                     NUM_KV_HEADS: tl.constexpr, BLOCK_KH: tl.constexpr,
                     UNIFORM: tl.constexpr, MAX_LEN: tl.constexpr):
    """One program per ``MAX_LEN`` consecutive tokens (one request exactly when ``UNIFORM``)."""
    p = tl.program_id(0)
    for j in tl.static_range(MAX_LEN):
        t = p * MAX_LEN + j
        pos = tl.load(positions + t, mask=t < num_tokens, other=0)
        _norm_rope_heads(q, q_weight, t, pos, num_tokens, eps, theta, NUM_Q_HEADS, BLOCK_QH, HEAD_DIM,
                         BLOCK_D, ROPE_DIM)
        _norm_rope_heads(k, k_weight, t, pos, num_tokens, eps, theta, NUM_KV_HEADS, BLOCK_KH, HEAD_DIM,
                         BLOCK_D, ROPE_DIM)
