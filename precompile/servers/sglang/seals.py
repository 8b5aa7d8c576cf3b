"""sglang's ``load_jit`` sealed inside capture: a compile or a module load there is refused, naming the module."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from jitwarm.precompile.servers.sglang.loader_tap import TAP


class _Seal:
    """The loader tap's subscriber: each look-up is a load (found) or the compile that follows (not found)."""

    def __init__(self, refuse: Callable[[str], None]) -> None:
        self.refuse = refuse

    def looked_up(self, spec: Any, scope: Any, found: Any) -> None:
        # At the look-up, not at the load or the build: sglang catches any exception of the dlopen itself and
        # rebuilds (loader.py:136-145), and a miss under SGLANG_CRASH_ON_JIT_COMPILE never takes the build lock.
        what = f"load of {found}" if found is not None else f"compile of {scope}"
        self.refuse(f"sglang load_jit module {module_name(spec, found or scope)} ({what})")


def seal(refuse: Callable[[str], None]) -> tuple[str, Callable[[], None]] | None:
    """Hand each ``load_jit`` load or compile to ``refuse``; (its name, its undo), or None without sglang here."""
    subscriber = _Seal(refuse)
    if not TAP.subscribe(subscriber):
        return None
    return "sglang load_jit", lambda: TAP.unsubscribe(subscriber)


def module_name(spec: Any, path: Any) -> str:
    """``BuildSpec.module_name`` (compile/spec.py:55-57), else the name in ``path`` (``<tag>/<module>/build-<key>``)."""
    name = getattr(spec, "module_name", None)
    if isinstance(name, str):
        return name
    parts = Path(str(path)).parts if path is not None else ()
    return next((p for p in reversed(parts) if p.startswith("sgl_kernel_jit_") and not p.endswith(".so")), "?")
