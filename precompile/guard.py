"""The capture guard: a kernel compile or module load inside CUDA-graph capture becomes a clear error.

Without it, a JIT compile that lands in capture issues driver calls (``cuModuleLoadData``) into the
capturing stream and the server dies later with ``CUDA_ERROR_ILLEGAL_ADDRESS`` (sglang #33356, #33795).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from jitwarm.kernels import KernelSpec
from jitwarm.kernels.capture import CompileDuringCaptureError, describe_miss, stream_is_capturing

_lock = threading.Lock()
_armed = 0


def is_armed() -> bool:
    """True while a CaptureHook has armed the guard or a ``capture_guard`` block is active."""
    return _armed > 0


def check_dispatch_miss(spec: KernelSpec, shape: Any = None) -> None:
    """Raise :class:`CompileDuringCaptureError` if a dispatch miss happens while armed or capturing."""
    if is_armed() or stream_is_capturing():
        state = " (the guard is armed)" if is_armed() else " (the current stream is capturing)"
        raise CompileDuringCaptureError(describe_miss(spec, shape), state)


def install() -> None:
    """Register :func:`check_dispatch_miss` with the default kernel dispatcher (idempotent)."""
    from jitwarm.kernels import dispatch

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
    """Make Triton's JIT compile, tvm-ffi's build and load and each server's own JIT raise while guarded.

    Off by default: it patches other libraries' process-wide hooks; outside capture those calls pass untouched.
    A server's own JIT (sglang's ``load_jit``) is sealed by its room (``ServerAdapter.seal``).
    """

    def __init__(self) -> None:
        self._undo: list[Any] = []

    def install(self) -> None:
        """Install the seals for whichever of triton and tvm_ffi can be imported, and every server room's."""
        from jitwarm.precompile import servers

        self._seal_triton()
        for name in servers.ROOMS:
            servers.adapter(name).seal(self._undo)
        self._seal_tvm_ffi()

    def remove(self) -> None:
        """Restore every patched hook and function."""
        while self._undo:
            self._undo.pop()()

    def _seal_triton(self) -> None:
        try:
            import triton
        except ImportError:
            return
        runtime = triton.knobs.runtime
        previous = runtime.jit_cache_hook

        def jit_cache_hook(*, key: str, repr: str, **kwargs: Any) -> Any:
            fn = kwargs.get("fn")
            _refuse(f"Triton kernel {fn.module}:{fn.name} {repr}" if fn is not None else f"Triton kernel {repr}")
            return previous(key=key, repr=repr, **kwargs) if previous else None

        runtime.jit_cache_hook = jit_cache_hook
        self._undo.append(lambda: setattr(runtime, "jit_cache_hook", previous))

    def _seal_tvm_ffi(self) -> None:
        try:
            import tvm_ffi
            import tvm_ffi.cpp
        except ImportError:
            return
        for owner, name in ((tvm_ffi.cpp, "load_inline"), (tvm_ffi.cpp, "build_inline"),
                            (tvm_ffi.cpp, "build"), (tvm_ffi.cpp, "load"), (tvm_ffi, "load_module")):
            original = getattr(owner, name, None)
            if original is None:
                continue
            self._undo.append(lambda o=owner, n=name, f=original: setattr(o, n, f))
            setattr(owner, name, _sealed(original, f"tvm_ffi.{'cpp.' if owner is not tvm_ffi else ''}{name}"))


def _refuse(what: str) -> None:
    """Raise :class:`CompileDuringCaptureError` for a third-party compile or load while armed or capturing."""
    if is_armed() or stream_is_capturing():
        raise CompileDuringCaptureError(what, hint=CompileDuringCaptureError.THIRD_PARTY_HINT)


def _sealed(fn: Any, label: str) -> Any:
    """``fn`` that refuses to run while armed or capturing."""

    def call(*args: Any, **kwargs: Any) -> Any:
        _refuse(f"{label}({kwargs.get('name') or (args[0] if args else '?')!r})")
        return fn(*args, **kwargs)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
