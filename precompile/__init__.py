"""What to build and when: serving config, capture shapes, warm plan, warm, capture hook and CLI."""

from __future__ import annotations

from jitwarm.precompile.config import ConfigError, ServingConfig
from jitwarm.precompile.plan import WarmPlan
from jitwarm.precompile.shapes import CaptureShape, capture_batch_sizes, capture_shapes, verify_lens_for

__all__ = ["CaptureShape", "ConfigError", "ServingConfig", "WarmPlan", "capture_batch_sizes",
           "capture_shapes", "verify_lens_for"]
