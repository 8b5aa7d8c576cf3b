"""One tap per library hook point: patched once, shared by every subscriber (the recorder, the ledger, the seal).

Were each to patch for itself, the order of their undos would decide which patch survives. A :class:`Tap`
patches for its first subscriber and unpatches after the last, unless someone patched over it meanwhile. A
subscriber's method named after the event is called; what it raises reaches the library's caller. A library
not imported yet is tapped when it is (:meth:`Tap.attach_when_imported`, through :func:`when_imported`).
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

#: ``patch(tap)`` installs the wrappers and returns their undo (True once every original is back), or None when
#: the library is not in this process.
Patch = Callable[["Tap"], "Callable[[], bool] | None"]


class Tap:
    """The subscribers of one library's hook points, and the patch that feeds them."""

    def __init__(self, patch: Patch) -> None:
        self._patch = patch
        self._subscribers: list[Any] = []
        self._unpatch: Callable[[], bool] | None = None
        self._lock = threading.Lock()

    @property
    def live(self) -> bool:
        """True while the library's functions are patched (the library is in this process)."""
        return self._unpatch is not None

    def subscribe(self, subscriber: Any) -> bool:
        """Add ``subscriber``; patch the library first if it is the first. True when the tap is live."""
        with self._lock:
            if self._unpatch is None:
                self._unpatch = self._patch(self)
            if self._unpatch is not None and subscriber not in self._subscribers:
                self._subscribers.append(subscriber)
            return self._unpatch is not None

    def attach(self, subscriber: Any) -> Callable[[], None] | None:
        """:meth:`subscribe`, returning how to :meth:`unsubscribe` it again; None when the library is not here."""
        return (lambda: self.unsubscribe(subscriber)) if self.subscribe(subscriber) else None

    def attach_when_imported(self, subscriber: Any, module: str) -> Callable[[], None]:
        """:meth:`attach` now, or as soon as ``module`` (the library module the patch needs) is imported; the undo.

        The undo removes the import hook if it has not fired, else unsubscribes. A recording started before the
        library is imported would otherwise see none of its calls.
        """
        undo = self.attach(subscriber)
        if undo is not None:
            return undo
        attached: list[Callable[[], None]] = []
        unhook = when_imported(module, lambda _: attached.extend(filter(None, [self.attach(subscriber)])))

        def detach() -> None:
            unhook()
            while attached:
                attached.pop()()
        return detach

    def unsubscribe(self, subscriber: Any) -> None:
        """Remove ``subscriber``; the last one out unpatches, unless someone patched over it (then it stays live)."""
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)
            if not self._subscribers and self._unpatch is not None and self._unpatch():
                self._unpatch = None

    def emit(self, event: str, *args: Any, **kwargs: Any) -> None:
        """Call ``event(*args, **kwargs)`` on each subscriber that has it, in the order they subscribed."""
        for subscriber in tuple(self._subscribers):
            method = getattr(subscriber, event, None)
            if method is not None:
                method(*args, **kwargs)


def replace(owner: Any, name: str, ours: Any) -> Callable[[], bool]:
    """``setattr(owner, name, ours)``; its undo puts the original back (True) unless ``ours`` was replaced since."""
    original = getattr(owner, name)
    setattr(owner, name, ours)

    def undo() -> bool:
        current = getattr(owner, name, None)
        if current is ours:
            setattr(owner, name, original)
        return current is ours or current is original
    return undo


def undo_all(undos: list[Callable[[], bool]]) -> Callable[[], bool]:
    """One undo for several :func:`replace` calls: True only when every original is back."""
    def undo() -> bool:
        return all([u() for u in reversed(undos)])
    return undo


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder that hands module ``name``'s own loader a wrapper: ``then(module)`` once it has executed."""

    def __init__(self, name: str, then: Callable[[types.ModuleType], None]) -> None:
        self.name, self.then = name, then
        self._finding = threading.local()
        self._loader: Any = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name or getattr(self._finding, "busy", False):
            return None
        self._finding.busy = True  # the other finders may call importlib.util.find_spec themselves
        try:
            spec = next((found for finder in sys.meta_path if finder is not self and hasattr(finder, "find_spec")
                         and (found := finder.find_spec(fullname, path, target)) is not None), None)
        finally:
            self._finding.busy = False
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec  # nothing to wrap: the import goes on as it would have
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        loader = self._loader
        module.__loader__ = loader  # the module keeps its own loader (source reading, resources)
        if module.__spec__ is not None:
            module.__spec__.loader = loader
        loader.exec_module(module)
        self.then(module)


def when_imported(name: str, then: Callable[[types.ModuleType], None]) -> Callable[[], None]:
    """Call ``then(module)`` right after module ``name`` is next imported (executed); return the undo.

    The hook is a meta-path finder, first on ``sys.meta_path`` until the module has executed or the undo runs.
    A module imported already is not imported again: ``then`` is not called for it.
    """
    finder: _AfterImport

    def fired(module: types.ModuleType) -> None:
        remove()
        then(module)

    def remove() -> None:
        with _hooks_lock:
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)

    finder = _AfterImport(name, fired)
    with _hooks_lock:
        sys.meta_path.insert(0, finder)
    return remove


_hooks_lock = threading.Lock()
