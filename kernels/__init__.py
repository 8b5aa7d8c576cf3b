"""How one kernel is built, loaded and run: specs, families, the backend contract, the one path, dispatch.

The rules and the contract are pure Python; ``artifact`` and ``dispatch`` (which import the cache) and ``ops``
and ``reference`` (which import torch) are loaded on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from jitwarm.kernels.backend import (
    BACKEND_NAMES,
    BUILDABLE,
    Backend,
    CompileError,
    LoadedKernel,
    LoadError,
    SpecError,
    ToolchainError,
    backend,
)
from jitwarm.kernels.families import FAMILIES, Family, plan_threads, specs_for
from jitwarm.kernels.spec import DTYPES, KernelSpec, ModelDims, VerifyLayout
from jitwarm.kernels.target import Target, TargetError

_LAZY = {"Artifact": "artifacts", "KernelLoadError": "artifacts", "artifact": "artifacts",
         "dispatch": None, "ops": None, "reference": None}

__all__ = ["BACKEND_NAMES", "BUILDABLE", "DTYPES", "FAMILIES", "Backend", "CompileError", "Family", "KernelSpec",
           "LoadError", "LoadedKernel", "ModelDims", "SpecError", "Target", "TargetError", "ToolchainError",
           "VerifyLayout", "backend", "plan_threads", "specs_for", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"jitwarm.kernels.{_LAZY[name] or name}")
        return module if _LAZY[name] is None else getattr(module, name)
    raise AttributeError(f"module 'jitwarm.kernels' has no attribute {name!r}")
