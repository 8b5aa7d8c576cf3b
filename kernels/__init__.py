"""Kernel families: specialization rules, sources, build, load and dispatch of jitwarm's JIT kernels.

The rules (``VerifyLayout``, ``KernelSpec``, ``FAMILIES``) are pure Python. ``ops`` and ``reference``
import torch and are loaded on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from jitwarm.kernels.layout import VerifyLayout
from jitwarm.kernels.rules import FAMILIES, Family, plan_threads, specs_for
from jitwarm.kernels.spec import BACKENDS, DTYPES, KernelSpec, ModelDims, is_valid_target

__all__ = ["BACKENDS", "DTYPES", "FAMILIES", "Family", "KernelSpec", "ModelDims", "VerifyLayout",
           "is_valid_target", "ops", "plan_threads", "reference", "specs_for"]

_LAZY = ("ops", "reference")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"jitwarm.kernels.{name}")
    raise AttributeError(f"module 'jitwarm.kernels' has no attribute {name!r}")
