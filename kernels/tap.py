"""One tap per library hook point: patched once, shared by every subscriber (the recorder, the ledger, the seal).

Were each to patch for itself, the order of their undos would decide which patch survives. A :class:`Tap`
patches for its first subscriber and unpatches after the last, unless someone patched over it meanwhile. A
subscriber's method named after the event is called; what it raises reaches the library's caller.
"""

from __future__ import annotations

import threading
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
