"""What to build and when; the planning half imports no torch, the rest is loaded on first access."""

from __future__ import annotations

import importlib
from typing import Any

from jitwarm.precompile.config import ConfigError, ServingConfig
from jitwarm.precompile.plan import CaptureShape, WarmPlan, capture_batch_sizes, capture_shapes, verify_lens_for

_LAZY = {
    "warm": "warming", "warm_specs": "warming", "start_warm": "warming", "WarmReport": "warming",
    "WarmHandle": "warming", "SpecResult": "warming",
    "CaptureHook": "hook", "HookReport": "hook", "capture_ladder": "hook", "KernelsNotReady": "hook",
    "WarmTimeout": "hook", "KernelLoadFailed": "hook", "TorchDevice": "hook",
    "capture_guard": "guard", "CompileDuringCaptureError": "guard", "ThirdPartySeal": "guard",
    "record": "recorder", "Recorder": "recorder",
}

__all__ = ["CaptureShape", "ConfigError", "ServingConfig", "WarmPlan", "capture_batch_sizes", "capture_shapes",
           "verify_lens_for", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"jitwarm.precompile.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jitwarm.precompile' has no attribute {name!r}")
