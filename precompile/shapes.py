"""Capture shapes: sglang's batch-size ladders and the verify_lens each captured batch carries."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jitwarm.kernels import VerifyLayout
from jitwarm.precompile.config import ServingConfig


@dataclass(frozen=True)
class CaptureShape:
    """One CUDA graph the server captures: its batch size and the verify layout it is captured with."""

    bs: int
    layout: VerifyLayout

    @property
    def num_tokens(self) -> int:
        """Tokens in the captured batch."""
        return self.layout.num_tokens


def _ladder(top: int, tiers: list[Iterable[int]]) -> list[int]:
    sizes = [b for tier in tiers for b in tier if b <= top]
    if top not in sizes:
        sizes.append(top)
    return sorted(set(sizes))


def capture_batch_sizes(config: ServingConfig) -> list[int]:
    """Return the batch sizes sglang captures for ``config``, ascending.

    Mirrors sglang's ladder generator: an explicit ``--cuda-graph-bs`` list wins; else
    ``--disable-cuda-graph-padding`` gives every size up to the max; else the speculative or the plain
    tiers. ``--max-running-requests`` cuts every ladder (and is appended, like the max, when missing).
    """
    top = config.max_bs
    if config.cuda_graph_bs is not None:
        return sorted({b for b in config.cuda_graph_bs if b <= top} | {top})
    if config.disable_cuda_graph_padding:
        return list(range(1, top + 1))
    if config.speculative:
        tiers = [range(1, 9), range(10, 33, 2), range(40, 65, 4), range(72, 257, 8), range(272, top + 1, 16)]
    else:
        tiers = [(1, 2, 4, 8, 12), range(16, 257, 8), range(272, 512, 16), range(512, top + 1, 32)]
    return _ladder(top, tiers)


def verify_lens_for(config: ServingConfig, bs: int) -> tuple[int, ...]:
    """Return the ``verify_lens`` a batch of ``bs`` requests is captured with.

    ``static`` and ``cap-accept`` verify a full block per request; ``compact`` spreads
    ``bs * num_draft_tokens`` tokens over ``min(tokens, max_bs)`` slots exactly as sglang's
    ``build_capture_verify_lens`` does. Without speculative decoding each request has one token.
    """
    if not config.speculative:
        return (1,) * bs
    draft = config.speculative_num_draft_tokens
    if config.ragged_verify_mode != "compact":
        return (draft,) * bs
    num_tokens = bs * draft
    slots = min(num_tokens, config.max_bs)
    base = num_tokens // slots
    rem = num_tokens - base * slots
    return (base + 1,) * rem + (base,) * (slots - rem)


def capture_shapes(config: ServingConfig) -> list[CaptureShape]:
    """Return every shape the server captures, in capture order (largest batch first)."""
    return [CaptureShape(bs, VerifyLayout(verify_lens_for(config, bs)))
            for bs in reversed(capture_batch_sizes(config))]
