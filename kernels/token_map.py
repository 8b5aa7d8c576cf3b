"""TokenMap: the per-token tensors the plan kernel produces and the compressor and norm_rope kernels read."""

from __future__ import annotations

from typing import Any, NamedTuple

from jitwarm.kernels.layout import VerifyLayout


class TokenMap(NamedTuple):
    """Ragged verify layout and compression plan for one batch (docs/kernels.md, "plan").

    All fields are int32 tensors on the device of the ``verify_lens`` they were planned from. ``N`` is
    ``layout.num_tokens`` and ``R`` is ``layout.slots``. Pure container: importing this module imports
    no torch.

    Attributes
    ----------
    cu_lens
        ``[R + 1]``: exclusive prefix sum of ``verify_lens``; request ``r`` owns tokens
        ``cu_lens[r] .. cu_lens[r+1]``.
    token_req
        ``[N]``: the request of each token.
    token_pos
        ``[N]``: the position of each token, ``prefix_lens[r] + j``.
    token_out_row
        ``[N]``: for a token whose position closes a block of ``ratio`` positions
        (``(pos + 1) % ratio == 0``), its row in the compressed output, numbered in token order; else -1.
    num_out
        ``[1]``: number of compressed rows this batch writes.
    uniform
        ``[1]``: 1 when every request has the same length, decided on the device.

    """

    cu_lens: Any
    token_req: Any
    token_pos: Any
    token_out_row: Any
    num_out: Any
    uniform: Any


def max_out_rows(layout: VerifyLayout, ratio: int) -> int:
    """Return the most compressed rows one batch with ``layout`` can write, whatever its prefixes.

    A request of ``L`` tokens covers ``L`` consecutive positions, so it closes at most ``ceil(L / ratio)``
    blocks. ``out`` passed to ``compress`` must have at least this many rows.

    Examples
    --------
    >>> max_out_rows(VerifyLayout((3,) * 104 + (2,) * 24), 4)
    128

    """
    if ratio < 1:
        raise ValueError(f"ratio must be at least 1, got {ratio}")
    return sum(-(-n // ratio) for n in layout.verify_lens)
