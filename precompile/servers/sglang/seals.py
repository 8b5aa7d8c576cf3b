"""sglang's ``load_jit`` sealed inside capture: a compile or a module load there raises, naming the module."""

from __future__ import annotations

import sys
from typing import Any

from jitwarm.kernels.capture import CompileDuringCaptureError, stream_is_capturing

#: The module of sglang's JIT loader (sglang/kernels/jit/utils/compile/loader.py).
LOADER = "sglang.kernels.jit.utils.compile.loader"


def seal(undo: list[Any]) -> None:
    """Seal sglang's JIT loader where every ``load_jit`` call passes, whoever imported it by name.

    Kernel modules bind ``load_jit`` at import, so wrapping it would miss them; the loader looks up
    ``_find_prebuilt`` (a hit: a dlopen follows) and ``_build_lock`` (a compile) as module globals on each call
    (loader.py:135, :158). The load is refused at the lookup: sglang catches any exception of the dlopen itself
    and rebuilds (loader.py:136-145).
    """
    loader = sys.modules.get(LOADER)
    if loader is None:  # never imported: no load_jit can run in this process without importing it first
        return
    find, lock = getattr(loader, "_find_prebuilt", None), getattr(loader, "_build_lock", None)

    def find_prebuilt(*args: Any, **kwargs: Any) -> Any:
        found = find(*args, **kwargs)
        if found is not None and _guarded():
            raise _refusal("load", found)
        return found

    def build_lock(scope: Any, *args: Any, **kwargs: Any) -> Any:
        if _guarded():
            raise _refusal("compile", scope)
        return lock(scope, *args, **kwargs)

    for name, original, sealed in (("_find_prebuilt", find, find_prebuilt), ("_build_lock", lock, build_lock)):
        if original is not None:
            sealed.__wrapped__ = original  # type: ignore[attr-defined]
            undo.append(lambda n=name, f=original: setattr(loader, n, f))
            setattr(loader, name, sealed)


def _guarded() -> bool:
    """True while the capture guard is armed or the current stream captures."""
    from jitwarm.precompile import guard

    return guard.is_armed() or stream_is_capturing()


def _refusal(what: str, path: Any) -> CompileDuringCaptureError:
    """The refusal of a ``load_jit`` module's load or compile, named by its build path."""
    parts = getattr(path, "parts", ())  # <cache>/<tag>/<module>/build-<key>[/deps-<key>/<module>.so]
    module = next((p for p in reversed(parts) if p.startswith("sgl_kernel_jit_") and not p.endswith(".so")), "?")
    return CompileDuringCaptureError(f"sglang load_jit module {module} ({what} of {path})",
                                     hint=CompileDuringCaptureError.THIRD_PARTY_HINT)
