"""TokenMap: the per-token tensors the plan kernel produces and the compressor and norm_rope kernels read."""

from __future__ import annotations

from typing import Any, NamedTuple

from jitwarm.kernels.spec import VerifyLayout


class TokenMap(NamedTuple):
    """Ragged verify layout and compression plan of one batch, int32 tensors (docs/kernels.md, "plan")."""

    cu_lens: Any
    token_req: Any
    token_pos: Any
    token_out_row: Any
    num_out: Any
    uniform: Any


def max_out_rows(layout: VerifyLayout, ratio: int) -> int:
    """Return the most rows a batch with ``layout`` can write, whatever its prefixes: ``sum(ceil(L / r))``."""
    if ratio < 1:
        raise ValueError(f"ratio must be at least 1, got {ratio}")
    return sum(-(-n // ratio) for n in layout.verify_lens)
