"""Run every tvm-ffi kernel family once on a GPU, for compute-sanitizer (memcheck, racecheck, synccheck).

Usage on a GPU box (the cache comes from ``$JITWARM_CACHE_DIR``; run once plainly to build, then under
the sanitizer so that no nvcc runs inside it)::

    python kernel_sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python kernel_sanitize.py

Shapes: the incident's ragged layout, a uniform one, one request, and more requests than CTA threads,
with outputs sized exactly to what the layout allows, so any out-of-bounds access is reported.
"""

from __future__ import annotations

import sys

import torch

from jitwarm.kernels import VerifyLayout, ops
from jitwarm.kernels.token_map import max_out_rows

LAYOUTS = [
    VerifyLayout((3,) * 104 + (2,) * 24),
    VerifyLayout((6,) * 128),
    VerifyLayout((5,)),
    VerifyLayout(tuple(1 + i % 4 for i in range(3000))),
]


def run(layout: VerifyLayout, dtype: torch.dtype, head_dim: int, heads: int) -> None:
    """Plan, compress and norm_rope one batch with exactly sized tensors."""
    dev = "cuda"
    lens = torch.tensor(layout.verify_lens, dtype=torch.int32, device=dev)
    prefix = torch.randint(0, 1 << 20, (layout.slots,), dtype=torch.int32, device=dev)
    n = layout.num_tokens
    p = ops.plan(layout, lens, prefix, 4)
    kv, score = torch.randn(n, head_dim, device=dev, dtype=dtype), torch.randn(n, head_dim, device=dev, dtype=dtype)
    state = torch.zeros(layout.slots, 3, head_dim, device=dev)
    state[:, 0] = float("-inf")
    out = torch.empty(max_out_rows(layout, 4), head_dim, device=dev, dtype=dtype)
    ops.compress(layout, kv, score, p, state, out, 4)
    q = torch.randn(n, heads, head_dim, device=dev, dtype=dtype)
    k = torch.randn(n, 1, head_dim, device=dev, dtype=dtype)
    w = torch.randn(head_dim, device=dev, dtype=dtype)
    ops.norm_rope(layout, q, k, p.token_pos, w, w, rope_dim=64)


def main() -> int:
    for layout in LAYOUTS:
        run(layout, torch.bfloat16, 128, 16)
    run(LAYOUTS[0], torch.float32, 256, 1)
    run(LAYOUTS[2], torch.float32, 64, 2)
    torch.cuda.synchronize()
    print("kernel_sanitize: all launches completed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
