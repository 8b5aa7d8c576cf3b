"""A Triton JIT compile inside an armed capture guard with the third-party seal: it must raise, naming it.

No GPU here: a stub driver (current device 0, target sm_90) lets Triton's real JIT path reach its
compile step, which is where ``knobs.runtime.jit_cache_hook`` runs. Prints one JSON line.
"""

import json

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from jitwarm.precompile import CompileDuringCaptureError, capture_guard


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


class StubDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise NotImplementedError

    def map_python_to_cpp_type(self, ty):
        return ty

    def is_active(self):
        return True


triton.runtime.driver.set_active(StubDriver())
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
