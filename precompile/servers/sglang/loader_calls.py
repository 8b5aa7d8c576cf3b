"""sglang's ``load_jit`` calls as the start-up ledger counts them: served from sglang's cache, or compiled now.

``load_jit`` looks its build up with ``_find_prebuilt``; found, it loads it (a hit); not found, it takes
``_build_lock``, looks again (another rank may have built it) and compiles only if that finds nothing
(compile/loader.py:135-160); :mod:`.loader_tap` hands both calls to its subscribers, the capture seal among them.
:class:`LoaderCalls` is the ledger's ``load_jit`` watcher; each build directory
(``<cache>/<tag>/<module>/build-<key>``, compile/cache.py:322-325) is one state, named by module and key.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from jitwarm.kernels.libraries.jit_caches.units import FamilyCount
from jitwarm.precompile.servers.sglang.loader_tap import TAP, loader


class LoaderCalls:
    """What each ``load_jit`` of this process did since :meth:`install`: ``served`` or ``compiled``, per build."""

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
            self.present = len(builds(self.root))
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
            elif self.scopes.get(str(scope)) == "building":  # not found behind the lock: load_jit compiles
                self.scopes[str(scope)] = "compiled"

    def building(self, scope: Any) -> None:
        """The build lock of ``scope`` taken: the next look-up that finds nothing means a compile."""
        with self._lock:
            self.scopes[str(scope)] = "building"

    def count(self) -> FamilyCount:
        """The ``load_jit`` family's count: builds served, builds compiled (named ``<module> build-<key>``)."""
        with self._lock:
            scopes = dict(self.scopes)
        compiled = sorted(module_key(s) for s, state in scopes.items() if state == "compiled")
        signal = "sglang's loader" if self.watched else "sglang's loader: sglang not running here"
        return FamilyCount("load_jit", signal, sum(s == "served" for s in scopes.values()), len(compiled),
                           tuple(compiled), self.present, str(self.root) if self.root else None)


def builds(root: Path) -> list[Path]:
    """The published builds under sglang's JIT cache: ``<tag>/<module>/build-<key>/deps-<key>/`` (compile/cache.py)."""
    return [p for p in root.glob("*/*/build-*/deps-*") if p.is_dir()]


def module_key(scope: str) -> str:
    """``<module> build-<key>`` of a build directory ``<cache>/<tag>/<module>/build-<key>``."""
    parts = Path(scope).parts
    module = next((p for p in reversed(parts) if p.startswith("sgl_kernel_jit_")), "?")
    return f"{module} {parts[-1] if parts else '?'}"
