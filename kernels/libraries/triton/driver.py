"""Every use of Triton's driver and backend internals in jitwarm, in one place.

jitwarm's own Triton backend (:mod:`jitwarm.kernels.triton_backend`) and the replay of the server's Triton
kernels (:mod:`jitwarm.kernels.libraries.triton.backend`) reach past Triton's public API in four spots; a
Triton upgrade that moves one of them is fixed here and nowhere else:

- ``triton.runtime.driver.active`` / ``_active`` / ``set_active``: a build box without a GPU compiles under
  a driver that only reports the recorded target (:func:`reporting`);
- ``triton.backends.compiler.GPUTarget``: the target a compile is for (:func:`gpu_target`);
- ``triton.backends.nvidia.compiler.get_ptxas``: which ptxas Triton assembles an arch with (:func:`ptxas`);
- ``CompiledKernel._init_handles``: the module load Triton otherwise does at the first launch
  (:func:`load_module`), which would land inside a CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Threads per warp of every CUDA target Triton compiles for.
WARP_SIZE = 32


def gpu_target(arch: int) -> Any:
    """Triton's ``GPUTarget`` for CUDA ``sm_<arch>``."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, WARP_SIZE)


def ptxas(arch: int) -> Path:
    """The ptxas Triton assembles ``arch`` with (``ptxas-blackwell`` for arch >= 90 in Triton 3.9)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(arch).path)
    except ImportError:  # Triton before the arch-dependent ptxas choice
        from triton import knobs

        return Path(knobs.nvidia.ptxas.path)


def load_module(kernel: Any) -> None:
    """Load a ``CompiledKernel``'s module onto the current device now (``cuModuleLoadData``), not at its launch."""
    kernel._init_handles()


@contextlib.contextmanager
def reporting(target: dict[str, Any]) -> Iterator[None]:
    """Triton's active driver if its device is ``target``, else (a build box) one that only reports ``target``.

    Triton's ``preload`` asks the active driver for the current device and target and refuses a
    specialization recorded for another; nothing else of the driver is used before the compile.
    """
    from triton.runtime import driver

    try:
        if driver.active.get_current_target().__dict__ == target:
            yield
            return
    except Exception:  # noqa: BLE001 - no GPU, no driver: Triton raises RuntimeError or worse
        pass
    # Put back exactly what was active (None: resolved lazily again); reset_active() would build the default
    # driver right away, and on a box without a GPU that raises (runtime/driver.py, DriverConfig).
    previous = driver._active
    driver.set_active(_TargetOnlyDriver(target))
    try:
        yield
    finally:
        driver._active = previous


class _TargetOnlyDriver:
    """A Triton driver that reports a target and device 0, and nothing else: enough to compile, not to run."""

    def __init__(self, target: dict[str, Any]) -> None:
        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget(**target)

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> Any:
        return self._target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def get_device_interface(self) -> Any:
        import torch

        return torch.cuda

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_benchmarker(self) -> Any:
        raise RuntimeError("a target-only Triton driver cannot run kernels (jitwarm replays on a box without a GPU)")
