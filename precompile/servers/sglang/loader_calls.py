"""sglang's ``load_jit`` calls as the start-up ledger counts them: served from sglang's cache, or compiled now.

``load_jit`` looks its build up with ``_find_prebuilt``; found, it loads it (a hit); not found, it takes
``_build_lock``, looks again (another rank may have built it) and compiles only if that finds nothing
(compile/loader.py:135-160). Both are module globals looked up on each call, where the capture seal watches too
(:mod:`.seals`). :class:`LoaderCalls` is the ledger's ``load_jit`` watcher; each build directory
(``<cache>/<tag>/<module>/build-<key>``, compile/cache.py:322-325) is one state, named by module and key.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from jitwarm.precompile.ledger import FamilyCount
from jitwarm.precompile.servers.sglang.seals import LOADER


class LoaderCalls:
    """What each ``load_jit`` of this process did since :meth:`install`: ``served`` or ``compiled``, per build."""

    def __init__(self) -> None:
        self.scopes: dict[str, str] = {}
        self.watched = False
        #: sglang's JIT cache (``SGLANG_JIT_CACHE_DIR``) and the builds in it at install (restored ones among them).
        self.root: Path | None = None
        self.present: int | None = None
        self._lock = threading.Lock()
        self._undo: list[Any] = []

    def install(self) -> LoaderCalls:
        """Watch the loader when this process runs sglang (nothing is imported for it otherwise)."""
        import importlib

        if "sglang" not in sys.modules:
            return self
        try:
            loader = importlib.import_module(LOADER)
        except Exception:  # noqa: BLE001 - a loader that does not import here runs no load_jit either
            return self
        find, lock = getattr(loader, "_find_prebuilt", None), getattr(loader, "_build_lock", None)
        if find is None or lock is None:
            return self

        def find_prebuilt(*args: Any, **kwargs: Any) -> Any:
            found = find(*args, **kwargs)
            scope = str(kwargs.get("scope", args[-1] if args else ""))
            with self._lock:
                if found is not None:  # first look or behind the lock (another rank built it): served
                    self.scopes[scope] = "served"
                elif self.scopes.get(scope) == "building":  # not found behind the lock: load_jit compiles
                    self.scopes[scope] = "compiled"
            return found

        def build_lock(scope: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.scopes[str(scope)] = "building"
            return lock(scope, *args, **kwargs)

        cache = getattr(loader, "cache", None)  # compile/cache.py, as the loader imports it
        if cache is not None and hasattr(cache, "cache_root"):
            self.root = Path(cache.cache_root())
            self.present = len(builds(self.root))
        loader._find_prebuilt, loader._build_lock = find_prebuilt, build_lock
        self._undo.append(lambda: (setattr(loader, "_find_prebuilt", find), setattr(loader, "_build_lock", lock)))
        self.watched = True
        return self

    def remove(self) -> None:
        """Put the loader's own functions back."""
        while self._undo:
            self._undo.pop()()

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
