"""Whether a CUDA-graph capture is running, and the error a miss raises then (sglang #33356, #33795)."""

from __future__ import annotations

import sys
from typing import Any

from jitwarm.kernels.spec import KernelSpec


class CompileDuringCaptureError(RuntimeError):
    """A kernel was about to be compiled or loaded while the guard was armed or a stream was capturing."""

    PLAN_HINT = ("Add it to the warm plan (capture flags that produce this shape, or --cuda-graph-bs with this "
                 "batch size), run `jitwarm warm` with those flags, and call CaptureHook(plan)() before capture.")
    THIRD_PARTY_HINT = ("Record the server's kernels (JITWARM_RECORD=manifest.jsonl with the jitwarm sglang plugin), "
                        "replay them (`jitwarm warm --manifest manifest.jsonl`) and give the capture hook the "
                        "manifest, or run this kernel once for this shape before capture, so its compile and module "
                        "load happen outside the graph.")

    def __init__(self, what: str, detail: str = "", hint: str = PLAN_HINT) -> None:
        super().__init__(f"{what} would be compiled or loaded during CUDA-graph capture{detail}. {hint}")


def stream_is_capturing() -> bool:
    """True when torch is loaded, CUDA is initialized here and the current stream is capturing.

    ``is_initialized`` is a flag (``is_available`` asks the driver); asking an uninitialized process for its
    stream would initialize CUDA, which fails in a forked child.
    """
    torch = sys.modules.get("torch")  # never import torch just to learn that nothing is captured
    if torch is None or not torch.cuda.is_initialized():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def describe_miss(spec: KernelSpec, shape: Any) -> str:
    """Name the kernel and the shape that asked for it, for the error message."""
    params = ", ".join(f"{k}={v}" for k, v in spec.params)
    where = f" for shape {shape!r}" if shape is not None else ""
    return f"kernel {spec.family} [{spec.backend}, {spec.target}] ({params}){where}"
