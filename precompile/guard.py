"""The capture guard: a compile or module load inside CUDA-graph capture becomes a clear error (sglang #33356)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from jitwarm.kernels import KernelSpec, dispatch, kinds
from jitwarm.kernels.dispatch import CompileDuringCaptureError, describe_miss, stream_is_capturing
from jitwarm.precompile import servers

_log = logging.getLogger(__name__)

_lock = threading.Lock()
_armed = 0


def is_armed() -> bool:
    """True while a CaptureHook has armed the guard or a ``capture_guard`` block is active."""
    return _armed > 0


def check_dispatch_miss(spec: KernelSpec, shape: Any = None) -> None:
    """Raise :class:`CompileDuringCaptureError` if a dispatch miss happens while armed or capturing."""
    if guarded():
        state = " (the guard is armed)" if is_armed() else " (the current stream is capturing)"
        raise CompileDuringCaptureError(describe_miss(spec, shape), state)


def install() -> None:
    """Register :func:`check_dispatch_miss` with the default kernel dispatcher (idempotent)."""
    dispatch.add_miss_hook(check_dispatch_miss)  # a no-op when it is registered already


def reset() -> None:
    """Disarm completely, whatever the nesting (tests; a process that starts over)."""
    global _armed
    with _lock:
        _armed = 0


def arm() -> None:
    """Arm the guard until a matching :func:`disarm`; nesting counts."""
    global _armed
    install()
    with _lock:
        _armed += 1


def disarm() -> None:
    """Undo one :func:`arm`."""
    global _armed
    with _lock:
        _armed = max(0, _armed - 1)


@contextlib.contextmanager
def capture_guard(*, seal_third_party: bool = False) -> Iterator[None]:
    """Arm the guard for the block (``seal_third_party``: and :class:`ThirdPartySeal`); a miss inside raises."""
    arm()
    seal = ThirdPartySeal() if seal_third_party else None
    if seal:
        seal.install()
    try:
        yield
    finally:
        if seal:
            seal.remove()
        disarm()


class ThirdPartySeal:
    """Refuse (``mode="error"``) or log once (``"warn"``) each JIT library compile or load made while ``when()``.

    Each library and server room seals its own (``seal(refuse)``); off until :meth:`install` (it patches hooks).
    """

    def __init__(self, *, mode: str = "error", when: Callable[[], bool] | None = None,
                 log: logging.Logger | None = None) -> None:
        if mode not in ("error", "warn"):
            raise ValueError(f"mode must be error or warn, got {mode!r}")
        self.mode, self.when, self.log = mode, when or guarded, log or _log
        #: What :meth:`install` sealed (``Triton compile``, ``sglang load_jit`` ...).
        self.armed: list[str] = []
        self._said: set[tuple[str, Any]] = set()
        self._undo: list[Callable[[], Any]] = []
        self._lock = threading.Lock()

    def install(self) -> list[str]:
        """Seal every library of this process that can be sealed; return their names (also :attr:`armed`)."""
        # every kind that seals its library (kinds.seals(): Triton, Inductor, tvm-ffi), then each server's own JIT
        for seal in [k.seal for k in kinds.seals()] + [servers.adapter(name).seal for name in servers.ROOMS]:
            if (sealed := seal(self.refuse)) is not None:
                self.armed.append(sealed[0])
                self._undo.append(sealed[1])
        return self.armed

    def remove(self) -> None:
        """Restore every patched hook and function."""
        while self._undo:
            self._undo.pop()()
        self.armed = []

    def refuse(self, what: str, key: Any = None) -> None:
        """Raise or log ``what`` (about to compile or load) when ``when()``; ``warn`` logs each ``(what, key)`` once."""
        if not self.when():
            return
        if self.mode == "error":
            raise CompileDuringCaptureError(what, hint=CompileDuringCaptureError.THIRD_PARTY_HINT)
        with self._lock:
            if (what, key) in self._said:
                return
            self._said.add((what, key))
        self.log.warning("jitwarm: %s is compiled or loaded during CUDA-graph capture: a driver call inside the "
                         "capture can kill the server (sglang #33356); JITWARM_STRICT=1 refuses it. %s", what,
                         CompileDuringCaptureError.THIRD_PARTY_HINT)


def guarded() -> bool:
    """True while the guard is armed or the current stream captures."""
    return is_armed() or stream_is_capturing()
