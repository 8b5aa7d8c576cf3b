"""One tap per library hook point: patched once, shared by every subscriber (the recorder, the ledger, the seal).

Each of them once patched the same functions itself (sglang's loader in three modules, each with its own undo list,
and Triton's ``jit_cache_hook`` chained twice, issue #32): the order of their undos decided which patch survived.
A :class:`Tap` patches when its first subscriber comes and puts the library's own functions back when the last one
leaves, unless someone patched over it meanwhile; then it stays, passing calls through.

A subscriber is any object; the tap calls its method named after the event, where it has one. A subscriber may
raise (the seal refuses a compile that way): the exception reaches the library's caller, as a patch's would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: ``patch(tap)`` installs the tap's wrappers and returns how to take them out again (True once every original is
#: back), or None when the library is not in this process (nothing then is patched, and the tap stays off).
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
        """Remove ``subscriber``; the last one out puts the library's functions back where nobody patched over them.

        Where someone did, the tap stays live with no subscriber (its wrappers pass calls through): patching again
        at the next subscribe would chain it twice.
        """
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
