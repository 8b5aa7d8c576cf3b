"""Torch reference of the three kernel families: the definition every backend is tested against (docs/kernels.md).

Arithmetic is float32, rounded once to the output dtype; rotary angles match every backend bit for bit
(``inv_freq`` in float64 rounded once), only ``cos``/``sin`` differ (about 1 ulp).
"""

from __future__ import annotations

import torch

from jitwarm.kernels.spec import TokenMap, VerifyLayout

__all__ = ["TokenMap", "compress", "norm_rope", "plan", "rope_inv_freq"]


def plan(layout: VerifyLayout, verify_lens: torch.Tensor, prefix_lens: torch.Tensor, ratio: int) -> TokenMap:
    """Plan a ragged verify batch (``int32[R]`` lengths and prefixes): token offsets, positions, output rows."""
    dev = verify_lens.device
    lens = verify_lens.long()
    prefix = prefix_lens.long()
    cu = torch.zeros(lens.numel() + 1, dtype=torch.long, device=dev)
    cu[1:] = torch.cumsum(lens, 0)
    token_req = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens)
    token_pos = prefix[token_req] + torch.arange(int(cu[-1]), device=dev) - cu[token_req]
    closes = (token_pos + 1) % ratio == 0
    token_out_row = torch.where(closes, torch.cumsum(closes.long(), 0) - 1, -1)
    if token_req.numel() != layout.num_tokens:
        raise ValueError(f"verify_lens: sums to {token_req.numel()} tokens, the layout has "
                         f"{layout.num_tokens}")

    def i32(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.int32).reshape(-1)

    return TokenMap(i32(cu), i32(token_req), i32(token_pos), i32(token_out_row), i32(closes.sum()),
                i32(lens.min() == lens.max()))


def compress(layout: VerifyLayout, kv: torch.Tensor, score: torch.Tensor, p: TokenMap, state: torch.Tensor,
             out: torch.Tensor, ratio: int) -> None:
    """Fold each request's tokens into its online-softmax ``state`` (updated); write every block ``p`` closes.

    ``m' = max(m, score); c = exp(m - m'); w = exp(score - m'); s' = s c + w; a' = a c + x w`` (``c = 1, w = 0``
    while ``m'`` is -inf); a token with an output row writes ``a' / s'`` there and resets the state.
    """
    cu = p.cu_lens.long()
    lens = cu[1:] - cu[:-1]
    m, s, a = (state[:, i].clone() for i in range(3))
    max_len = int(lens.max()) if lens.numel() else 0
    for j in range(max_len):
        active = torch.nonzero(lens > j).squeeze(1)
        t = cu[active] + j
        x, sc = kv[t].float(), score[t].float()
        m0, s0, a0 = m[active], s[active], a[active]
        m_new = torch.maximum(m0, sc)
        live = m_new != float("-inf")
        c = torch.where(live, torch.exp(m0 - m_new), 1.0)
        w = torch.where(live, torch.exp(sc - m_new), 0.0)
        s0 = s0 * c + w
        a0 = a0 * c + x * w
        m0 = m_new
        rows = p.token_out_row[t].long()
        close = rows >= 0
        out[rows[close]] = (a0[close] / s0[close]).to(out.dtype)
        m0[close], s0[close], a0[close] = float("-inf"), 0.0, 0.0
        m[active], s[active], a[active] = m0, s0, a0
    state[:, 0], state[:, 1], state[:, 2] = m, s, a


def rope_inv_freq(rope_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Return ``float32[rope_dim // 2]``: ``theta ** (-2 i / rope_dim)`` in float64, rounded once."""
    vals = [theta ** ((-2.0 * i) / rope_dim) for i in range(rope_dim // 2)]
    return torch.tensor(vals, dtype=torch.float64).to(torch.float32).to(device)


def _norm_rope_(x: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, rope_dim: int, eps: float,
                theta: float) -> None:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    half = rope_dim // 2
    angle = positions.float()[:, None] * rope_inv_freq(rope_dim, theta, x.device)[None, :]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    x0, x1 = y[..., :half].clone(), y[..., half:rope_dim].clone()
    y[..., :half] = x0 * cos - x1 * sin
    y[..., half:rope_dim] = x1 * cos + x0 * sin
    x.copy_(y.to(x.dtype))


def norm_rope(layout: VerifyLayout, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
              q_weight: torch.Tensor, k_weight: torch.Tensor, rope_dim: int = 64, eps: float = 1e-6,
              theta: float = 10000.0) -> None:
    """RMSNorm over the head dim, then NeoX rotary embedding of the first ``rope_dim`` dims of ``q`` and ``k``.

    In place; ``positions`` is the plan's ``token_pos``; dims at and past ``rope_dim`` are only normed.
    """
    _norm_rope_(q, positions, q_weight, rope_dim, eps, theta)
    _norm_rope_(k, positions, k_weight, rope_dim, eps, theta)
