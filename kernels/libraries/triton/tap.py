"""Triton's ``knobs.runtime.jit_cache_hook``, chained once for every subscriber (the recorder, the capture seal).

Triton calls the hook right before a compile this process has not done yet (``JITFunction._do_compile``, once per
specialization), with ``key``, ``repr``, ``fn`` and ``compile``; a subscriber's ``compile(**those)`` sees each one.
A hook that was there before the tap (someone else's) is still called, after the subscribers, and its answer is
Triton's. A compile inside :func:`..driver.private_cache` (jitwarm's own builds) passes no hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jitwarm.kernels.tap import Tap, replace


def _patch(tap: Tap) -> Callable[[], bool] | None:
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = knobs.runtime
    previous = runtime.jit_cache_hook

    def jit_cache_hook(**kwargs: Any) -> Any:
        tap.emit("compile", **kwargs)
        return previous(**kwargs) if previous else None

    return replace(runtime, "jit_cache_hook", jit_cache_hook)


TAP = Tap(_patch)
