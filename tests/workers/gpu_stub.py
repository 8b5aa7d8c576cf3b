"""The one mock of the test suite's Triton workers: a GPU that is only a target.

A Triton driver that reports device 0 and target sm_90 lets Triton's real JIT run through its compile (and
its cache lookups) on a box without a GPU; anything that would touch a device is not reached.
"""

import torch
import triton
from triton.backends.compiler import GPUTarget


class TargetOnlyDriver:
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


def install() -> None:
    """Make the target-only driver Triton's active driver in this process."""
    triton.runtime.driver.set_active(TargetOnlyDriver())
