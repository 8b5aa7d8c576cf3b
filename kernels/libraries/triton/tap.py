"""Triton's ``knobs.runtime.jit_cache_hook``, chained once for every subscriber (the recorder, the capture seal).

Triton calls it before each new specialization's compile; a hook that was there before is still called, after
the subscribers, and its answer is Triton's.
"""

from __future__ import annotations

import json
import types
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


def recording(add: Callable[[dict[str, Any]], None]) -> Any:
    """The recorder's subscriber: ``add(record)`` for each compile (the manifest's ``triton`` record body)."""

    def compile(*, repr: str, fn: Any, compile: dict[str, Any], **kwargs: Any) -> None:  # noqa: A002 - Triton's names
        add(record(fn.module, fn.name, repr, compile["specialization_data"]))

    return types.SimpleNamespace(compile=compile)


def record(module: str, qualname: str, repr_: str, specialization: str) -> dict[str, Any]:
    """The record of one Triton specialization, from what Triton hands its ``jit_cache_hook``."""
    from importlib.metadata import version

    target = json.loads(specialization).get("target", {})
    return {"kind": "triton", "kernel": f"{module}:{qualname}", "name": repr_,
            "target": f"sm_{target.get('arch')}" if target.get("backend") == "cuda" else str(target),
            "triton": version("triton"), "specialization": specialization}


def seal(refuse: Callable[..., None]) -> tuple[str, Callable[[], None]] | None:
    """Hand each compile Triton is about to make to ``refuse``, named by its kernel; (name, undo), or None."""

    def compile(*, key: Any = None, repr: str, fn: Any = None, **kwargs: Any) -> None:  # noqa: A002 - Triton's
        # Triton's repr leaves the constexprs out: two specializations of one kernel read alike, their keys do not
        refuse(f"Triton kernel {fn.module}:{fn.name} {repr}" if fn is not None else f"Triton kernel {repr}", str(key))

    undo = TAP.attach(types.SimpleNamespace(compile=compile))
    return None if undo is None else ("Triton compile", undo)
