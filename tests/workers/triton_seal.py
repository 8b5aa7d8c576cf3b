"""A Triton JIT compile inside an armed capture guard with the third-party seal: it must raise, naming it.

No GPU here: a stub driver (current device 0, target sm_90) lets Triton's real JIT path reach its
compile step, which is where ``knobs.runtime.jit_cache_hook`` runs. Prints one JSON line.
"""

import json

import gpu_stub
import torch
import triton
import triton.language as tl

from jitwarm.precompile import CompileDuringCaptureError, capture_guard


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


gpu_stub.install()
result = {}
try:
    with capture_guard(seal_third_party=True):
        add_one.warmup(torch.float32, 1024, BLOCK=256, grid=(4,))
    result["outcome"] = "compiled"
except CompileDuringCaptureError as exc:
    result["outcome"] = "CompileDuringCaptureError"
    result["message"] = str(exc)
previous = triton.knobs.runtime.jit_cache_hook
result["hook_restored"] = previous is None
try:  # outside the guard the same call must reach the compiler (no seal left behind)
    add_one.warmup(torch.float32, 1024, BLOCK=256, grid=(4,))
    result["after"] = "compiled"
except Exception as exc:  # noqa: BLE001
    result["after"] = f"{type(exc).__name__}: {exc}"[:200]
print(json.dumps(result))
