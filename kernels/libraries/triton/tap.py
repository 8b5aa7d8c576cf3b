"""Triton's ``knobs.runtime.jit_cache_hook``, chained once for every subscriber (the recorder, the capture seal).

Triton calls it before each new specialization's compile; a hook that was there before is still called, after
the subscribers, and its answer is Triton's.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Mapping
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


def record_problem(kind: Any, record: Mapping[str, Any]) -> str | None:
    """Why ``record`` is not a ``triton`` record (a kernel as ``module:qualname``, Triton's data as a string)."""
    del kind
    missing = next((f for f in ("kernel", "target", "specialization") if f not in record), None)
    if missing is not None:
        return f"a triton record needs {missing!r}"
    kernel, data = record["kernel"], record["specialization"]
    if not (isinstance(kernel, str) and ":" in kernel and isinstance(data, str)):
        return ("a triton record names its kernel as 'module:qualname' and carries Triton's specialization data as a "
                "string")
    return None


def spec_of(kind: Any, record: Mapping[str, Any]) -> Any:
    """The spec that replays a ``triton`` record."""
    from jitwarm.kernels.spec import KernelSpec

    return KernelSpec(record["kernel"], kind.name, record["target"], {"specialization": record["specialization"]})


def record_of(kind: Any, spec: Any) -> dict[str, Any]:
    """The ``triton`` record body of a replayed spec."""
    del kind
    return {"kind": "triton", "kernel": spec.family, "target": spec.target,
            "specialization": spec.params_dict["specialization"]}


def seal(refuse: Callable[..., None]) -> tuple[str, Callable[[], None]] | None:
    """Hand each compile Triton is about to make to ``refuse``, named by its kernel; (name, undo), or None."""

    def compile(*, key: Any = None, repr: str, fn: Any = None, **kwargs: Any) -> None:  # noqa: A002 - Triton's
        # Triton's repr leaves the constexprs out: two specializations of one kernel read alike, their keys do not
        refuse(f"Triton kernel {fn.module}:{fn.name} {repr}" if fn is not None else f"Triton kernel {repr}", str(key))

    undo = TAP.attach(types.SimpleNamespace(compile=compile))
    return None if undo is None else ("Triton compile", undo)
