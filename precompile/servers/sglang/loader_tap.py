"""sglang's JIT loader, tapped once for every subscriber: the recorder, the ledger's count and the capture seal.

``load_jit`` builds a ``BuildSpec`` (compile/loader.py:115), looks the build up with ``_find_prebuilt`` and loads
what it finds (a hit); finding nothing, it takes ``_build_lock``, looks again (another rank may have built it),
and compiles only if that finds nothing (:135-160). All three are module globals looked up on each call, so
patching them there sees every ``load_jit``, whoever imported it by name (the kernel modules bind ``load_jit`` at
import: 219 call sites in 0.5.23, most imported before ``load_plugins()`` runs). A subscriber's methods:

- ``call(args, given)``: a ``load_jit(*args, **given)`` call (``given``: its keyword arguments not at their
  defaults), read from ``load_jit``'s frame when it constructs the ``BuildSpec`` (hit or miss);
- ``looked_up(spec, scope, found)``: a ``_find_prebuilt``, ``found`` the build's library or None;
- ``building(scope)``: ``_build_lock`` taken: the next look-up that finds nothing means a compile.

:func:`recording` is the recorder's subscriber: each call as a manifest record of kind ``sglang_jit``.

The tap is live only in a process that imported sglang already: importing it redirects the process's JIT caches
under ``SGLANG_CACHE_DIR`` (srt/environ.py:2308-2320), which a recording outside sglang must not do (issue #31).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from jitwarm.kernels.tap import Tap, replace, undo_all

#: The module of sglang's JIT loader (sglang/kernels/jit/utils/compile/loader.py).
LOADER = "sglang.kernels.jit.utils.compile.loader"


def loader() -> Any:
    """Sglang's loader module, in a process running sglang; None elsewhere (nothing imported for it)."""
    if "sglang" not in sys.modules:
        return None
    try:
        return importlib.import_module(LOADER)
    except Exception:  # noqa: BLE001 - a loader that does not import here runs no load_jit either
        return None


def _patch(tap: Tap) -> Callable[[], bool] | None:
    module = loader()
    names = ("BuildSpec", "_find_prebuilt", "_build_lock", "load_jit")
    if module is None or any(getattr(module, name, None) is None for name in names):
        return None
    build_spec_class, find, lock = module.BuildSpec, module._find_prebuilt, module._build_lock
    defaults = {name: p.default for name, p in inspect.signature(module.load_jit).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}

    def build_spec(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        if caller.f_code.co_name == "load_jit":
            seen = caller.f_locals
            given = {k: seen[k] for k, default in defaults.items() if k in seen and seen[k] != default}
            tap.emit("call", tuple(seen.get("args", ())), given)
        return build_spec_class(*args, **kwargs)

    def find_prebuilt(*args: Any, **kwargs: Any) -> Any:
        found = find(*args, **kwargs)
        # ``_find_prebuilt(*, spec, scope)`` (loader.py:204); positional too, should a release change that
        spec, scope = (kwargs.get(name, args[i] if len(args) > i else None) for i, name in enumerate(("spec", "scope")))
        tap.emit("looked_up", spec, scope, found)
        return found

    def build_lock(scope: Any, *args: Any, **kwargs: Any) -> Any:
        tap.emit("building", scope)
        return lock(scope, *args, **kwargs)

    for ours, original in ((find_prebuilt, find), (build_lock, lock)):
        ours.__wrapped__ = original  # type: ignore[attr-defined]
    return undo_all([replace(module, "BuildSpec", build_spec), replace(module, "_find_prebuilt", find_prebuilt),
                     replace(module, "_build_lock", build_lock)])


TAP = Tap(_patch)


def recording(add: Callable[[dict[str, Any]], None]) -> Any:
    """The recorder's subscriber: ``add(record)`` for each ``load_jit`` call, hit or miss.

    Under ``SGLANG_JIT_LOG_RESOURCE_USAGE``, HIP or SAIL, for that mode: the call is read where ``load_jit`` has
    rewritten its flags or sources.
    """
    return types.SimpleNamespace(call=lambda args, given: add(record(args, given)))


def record(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The record of one ``load_jit(*args, **kwargs)`` call, with the arch sglang builds it for now."""
    from importlib.metadata import version

    from sglang.kernels.jit.utils import get_jit_cuda_arch

    arch = get_jit_cuda_arch()
    call = {"args": [str(a) for a in args], **{k: _plain(v) for k, v in sorted(kwargs.items())}}
    module = "sgl_kernel_jit_" + "_".join(call["args"])  # BuildSpec.module_name (compile/spec.py:55-57)
    return {"kind": "sglang_jit", "module": module, "target": f"sm_{arch.major}{arch.minor}",
            "arch": {"major": arch.major, "minor": arch.minor, "suffix": getattr(arch, "suffix", "")},
            "sglang": version("sglang"), "call": call}


def _plain(value: Any) -> Any:
    """A load_jit argument as JSON (tuples of strings are lists; anything else its str)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
