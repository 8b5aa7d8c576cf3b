"""Stand-in for a server's own Triton kernels (importable by name, as sglang's are): what record and replay see.

``fill_lens`` is shaped like sglang's ragged-verify helpers: one compile per power-of-two ``BLOCK`` bucket of
the batch sizes. ``scaled_copy`` sits behind ``@triton.heuristics``, so replay must find the JITFunction
under the wrapper.
"""

import triton
import triton.language as tl


@triton.jit
def fill_lens(out_ptr, n, value, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full((BLOCK,), value, tl.int32), mask=offs < n)


@triton.heuristics({"EVEN": lambda args: args["n"] % args["BLOCK"] == 0})
@triton.jit
def scaled_copy(dst_ptr, src_ptr, n, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs) * scale)
    else:
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n) * scale, mask=offs < n)


def warm_up(buckets=(1, 4, 64)):
    """What a server's warmup does: one launch per batch-size bucket (here Triton's warmup: compile, no launch).

    ``SERVER_KERNELS_BUCKETS=1,2,4,...`` replaces the buckets (the benchmarks use more kernels).
    """
    import os

    import torch

    if os.environ.get("SERVER_KERNELS_BUCKETS"):
        buckets = [int(b) for b in os.environ["SERVER_KERNELS_BUCKETS"].split(",")]
    for bs in buckets:
        fill_lens.warmup(torch.int32, bs, 6, BLOCK=triton.next_power_of_2(bs), grid=(1,))
    scaled_copy.warmup(torch.float32, torch.float32, 1000, 0.5, BLOCK=128, grid=(8,))
