"""Every use of Triton's driver and backend internals in jitwarm, so a Triton upgrade is fixed here alone."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jitwarm.kernels.backend import LoadError

#: Threads per warp of every CUDA target Triton compiles for.
WARP_SIZE = 32
#: Triton's knobs and active driver are process-global: every change of them in jitwarm holds this lock.
LOCK = threading.RLock()


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


@contextlib.contextmanager
def private_cache(directory: str) -> Iterator[None]:
    """Under :data:`LOCK`, Triton's own file cache in ``directory``; no manager, override, IR dump or hook."""
    from triton import knobs

    with LOCK, knobs.cache.scope(), knobs.runtime.scope(), knobs.compilation.scope():
        knobs.cache.dir = directory
        knobs.cache.manager_class = None
        knobs.runtime.jit_cache_hook = None
        knobs.compilation.override = False
        knobs.compilation.dump_ir = False
        yield


def load_module(kernel: Any) -> None:
    """Load a ``CompiledKernel``'s module onto the current device now (``cuModuleLoadData``), not at its launch."""
    kernel._init_handles()


@contextlib.contextmanager
def reporting(target: dict[str, Any]) -> Iterator[None]:
    """Triton's active driver if its device is ``target``, else (a build box) one that only reports ``target``."""
    from triton.runtime import driver

    try:
        active = driver.active.get_current_target().__dict__ == target
    except Exception:  # noqa: BLE001 - no GPU, no driver: Triton raises RuntimeError or worse
        active = False
    if active:  # outside the try: an error of the block is the caller's, never a reason to yield again
        yield
        return
    # Put back exactly what was active: reset_active() builds the default driver, which raises without a GPU.
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


# Triton's cache keeps each compile as a group file naming its files (runtime/cache.py, FileCacheManager.put_group).
GROUP_PREFIX = "__grp__"


def write_group(directory: Path, group: str, children: list[str]) -> Path:
    """Write Triton's group file for ``group`` into ``directory``, its children named relative to it."""
    path = directory / (GROUP_PREFIX + group)
    path.write_text(json.dumps({"child_paths": {c: c for c in sorted(children)}}, sort_keys=True))
    return path


def read_group(directory: Path, group: str) -> dict[str, Path]:
    """The children of ``group`` in ``directory`` as paths, or LoadError when the group or a child is missing."""
    try:
        children = json.loads((directory / (GROUP_PREFIX + group)).read_text())["child_paths"]
        paths = {str(c): directory / Path(str(c)).name for c in children}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LoadError(f"{directory}: no readable Triton group {group!r}: {exc}") from exc
    missing = [c for c, p in paths.items() if not p.is_file()]
    if missing or group not in paths:
        raise LoadError(f"{directory}: Triton group {group!r} lacks {missing or [group]}")
    return paths
