"""sglang's JIT loader as jitwarm sees it: tapped once, for the recorder, the ledger's count and the seal.

``load_jit`` builds a ``BuildSpec`` (compile/loader.py:115), looks the build up with ``_find_prebuilt`` and loads
what it finds (a hit); finding nothing, it takes ``_build_lock``, looks again (another rank may have built it),
and compiles only if that finds nothing (:135-160). All three are module globals looked up on each call, so
patching them there sees every ``load_jit``, whoever imported it by name. A subscriber's methods:

- ``call(args, given)``: a ``load_jit(*args, **given)`` call (``given``: keyword arguments not at their defaults);
- ``looked_up(spec, scope, found)``: a ``_find_prebuilt``, ``found`` the build's library or None;
- ``building(scope)``: ``_build_lock`` taken: the next look-up that finds nothing means a compile.

The tap is live only in a process that imported sglang already: importing it redirects the process's JIT caches
under ``SGLANG_CACHE_DIR`` (srt/environ.py:2308-2320), which a recording outside sglang must not do.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jitwarm.kernels.libraries.jit_caches.units import FamilyCount
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
    """Patch the loader's three globals to emit to ``tap``; their undo, or None without a usable loader."""
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
    """The recorder's subscriber: ``add(record)`` for each ``load_jit`` call, hit or miss."""
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


def seal(refuse: Callable[[str], None]) -> tuple[str, Callable[[], None]] | None:
    """Hand each ``load_jit`` load or compile to ``refuse``; (its name, its undo), or None without sglang here."""
    def looked_up(spec: Any, scope: Any, found: Any) -> None:
        # At the look-up, not at the load or the build: sglang catches any exception of the dlopen itself and
        # rebuilds (loader.py:136-145), and a miss under SGLANG_CRASH_ON_JIT_COMPILE never takes the build lock.
        what = f"load of {found}" if found is not None else f"compile of {scope}"
        refuse(f"sglang load_jit module {module_name(spec, found or scope)} ({what})")

    undo = TAP.attach(types.SimpleNamespace(looked_up=looked_up))
    return None if undo is None else ("sglang load_jit", undo)


def module_name(spec: Any, path: Any) -> str:
    """``BuildSpec.module_name`` (compile/spec.py:55-57), else the name in ``path`` (``<tag>/<module>/build-<key>``)."""
    name = getattr(spec, "module_name", None)
    if isinstance(name, str):
        return name
    parts = Path(str(path)).parts if path is not None else ()
    return next((p for p in reversed(parts) if p.startswith("sgl_kernel_jit_") and not p.endswith(".so")), "?")


class LoaderCalls:
    """What each ``load_jit`` of this process did since :meth:`install`: ``served`` or ``compiled``, per build.

    Each build directory (``<cache>/<tag>/<module>/build-<key>``, compile/cache.py:322-325) is one state.
    """

    def __init__(self) -> None:
        self.scopes: dict[str, str] = {}
        self.watched = False
        #: sglang's JIT cache (``SGLANG_JIT_CACHE_DIR``) and the builds in it at install (restored ones among them).
        self.root: Path | None = None
        self.present: int | None = None
        self._lock = threading.Lock()

    def install(self) -> LoaderCalls:
        """Subscribe to the loader tap when this process runs sglang (nothing is imported for it otherwise)."""
        if not TAP.subscribe(self):
            return self
        cache = getattr(loader(), "cache", None)  # compile/cache.py, as the loader imports it
        if cache is not None and hasattr(cache, "cache_root"):
            self.root = Path(cache.cache_root())
            self.present = len([p for p in self.root.glob("*/*/build-*/deps-*") if p.is_dir()])  # published builds
        self.watched = True
        return self

    def remove(self) -> None:
        """Stop counting (the tap puts the loader's own functions back when nobody else listens)."""
        TAP.unsubscribe(self)

    def looked_up(self, spec: Any, scope: Any, found: Any) -> None:
        """A look-up of ``scope``: found, it is served; not found behind the build lock, it is compiled."""
        with self._lock:
            if found is not None:  # first look or behind the lock (another rank built it): served
                self.scopes[str(scope)] = "served"
            elif self.scopes.get(str(scope)) == "building":
                self.scopes[str(scope)] = "compiled"

    def building(self, scope: Any) -> None:
        """The build lock of ``scope`` taken: the next look-up that finds nothing means a compile."""
        with self._lock:
            self.scopes[str(scope)] = "building"

    def count(self) -> FamilyCount:
        """The ``load_jit`` family's count: builds served, builds compiled (named ``<module> build-<key>``)."""
        with self._lock:
            scopes = dict(self.scopes)
        compiled = sorted(f"{module_name(None, s)} {Path(s).name or '?'}" for s, state in scopes.items()
                          if state == "compiled")
        signal = "sglang's loader" if self.watched else "sglang's loader: sglang not running here"
        return FamilyCount("load_jit", signal, sum(s == "served" for s in scopes.values()), len(compiled),
                           tuple(compiled), self.present, str(self.root) if self.root else None)
