"""Dispatch: the per-process table of loaded kernel modules, and the miss path through the cache.

Backend contract. A backend is a module named in :data:`BACKENDS` with three functions:

- ``description(spec) -> dict``: the cache description (JSON-able; family, backend, target, params,
  source digest, toolchain fingerprint). Cheap; no paths, hosts, times or device presence.
- ``build(spec, staging_dir: Path) -> None``: write the artifact files into ``staging_dir``. Runs under
  the cache's key lock; raises on failure and leaves no partial entry behind (the cache discards staging).
- ``load(spec, entry) -> LoadedKernel``: load a built :class:`jitwarm.cache.Entry` into this process.

A ``LoadedKernel`` has ``.spec``, ``.preload() -> int`` (force every kernel of the module onto the current
CUDA device, ``cudaFuncGetAttributes`` per kernel under lazy loading; returns how many, 0 and no device
call for a cpu spec) and ``.run(*args)``, which launches on the current stream with these positional
arguments (tensors are contiguous; ``N`` tokens, ``R`` requests, ``D`` head dim):

- plan: ``run(verify_lens, prefix_lens, cu_lens, token_req, token_pos, token_out_row, num_out,
  uniform)``; inputs ``int32[R]``; outputs ``int32[R+1]``, ``int32[N]`` x3, ``int32[1]`` x2.
- compressor: ``run(kv, score, cu_lens, token_out_row, state, out)``; ``kv, score [N, D]``,
  ``state float32[R, 3, D]`` (updated), ``out [rows, D]`` (rows named by ``token_out_row`` written).
- norm_rope: ``run(q, k, positions, q_weight, k_weight, eps, theta)``; ``q [N, Hq, D]`` and
  ``k [N, Hk, D]`` updated in place, ``positions int32[N]``, weights ``[D]``, ``eps``/``theta`` floats.

The math each one computes is :mod:`jitwarm.kernels.reference`; :mod:`jitwarm.kernels.ops` validates
arguments before calling ``run``.

Miss path. :func:`ensure_loaded` returns at once on a table hit. A miss while the current CUDA stream is
capturing raises :class:`~jitwarm.kernels.capture.CompileDuringCaptureError` before anything is built or
loaded. Otherwise it first calls every hook
registered with :func:`add_miss_hook` as ``hook(spec, shape)``; a hook may raise to forbid the compile or
load (the capture guard of :mod:`jitwarm.precompile` does), and the exception propagates unchanged.
Then it builds through ``KernelCache.get_or_build`` (:func:`ensure_built`), loads, and records the module.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from jitwarm.kernels import capture
from jitwarm.kernels.spec import KernelSpec

#: Backend name -> module implementing description/build/load, imported on first use.
BACKENDS: dict[str, str] = {
    "tvm_ffi": "jitwarm.kernels.tvm_backend",
    "triton": "jitwarm.kernels.triton_backend",
}

MissHook = Callable[[KernelSpec, Any], None]

_lock = threading.RLock()
_loaded: dict[KernelSpec, Any] = {}
_miss_hooks: list[MissHook] = []
_cache: Any = None
_counts = {"builds": 0, "loads": 0, "misses": 0}


def backend_module(name: str) -> ModuleType:
    """Import and return the backend module called ``name``.

    Raises
    ------
    ValueError
        ``name`` is not in :data:`BACKENDS`.

    """
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; known: {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


def get_cache() -> Any:
    """Return the process's default :class:`jitwarm.cache.KernelCache`, created on first need."""
    global _cache
    with _lock:
        if _cache is None:
            from jitwarm.cache import KernelCache

            _cache = KernelCache()
        return _cache


def set_cache(cache: Any) -> Any:
    """Make ``cache`` the default for later misses (None: back to lazy default); return the previous one.

    Modules already loaded stay loaded: a spec names its artifact whatever cache it came from.
    """
    global _cache
    with _lock:
        previous, _cache = _cache, cache
        return previous


def add_miss_hook(hook: MissHook) -> None:
    """Register ``hook(spec, shape)``, called before every compile or load that a miss would do."""
    with _lock:
        if hook not in _miss_hooks:
            _miss_hooks.append(hook)


def remove_miss_hook(hook: MissHook) -> None:
    """Unregister a hook added with :func:`add_miss_hook` (no error if absent)."""
    with _lock:
        if hook in _miss_hooks:
            _miss_hooks.remove(hook)


def ensure_built(spec: KernelSpec, cache: Any = None) -> Any:
    """Return the cache entry of ``spec``, building it (exactly once per cache) if it is missing.

    Raises
    ------
    Exception
        Whatever the backend's ``build`` or the cache's ``get_or_build`` raises (build failure, lock
        timeout, read-only cache).

    """
    backend = backend_module(spec.backend)
    cache = cache if cache is not None else get_cache()

    def build(staging: Any) -> None:
        backend.build(spec, staging)
        with _lock:
            _counts["builds"] += 1

    return cache.get_or_build(backend.description(spec), build)


def ensure_loaded(spec: KernelSpec, cache: Any = None, shape: Any = None, entry: Any = None) -> Any:
    """Return the loaded module of ``spec``, loading it (and building it if needed) on first use.

    Parameters
    ----------
    spec
        The spec to dispatch.
    cache
        Cache to build or find it in (default :func:`get_cache`); unused on a table hit.
    shape
        What asked for the spec (a ``VerifyLayout`` from ``ops``), passed to miss hooks for their message.
    entry
        The spec's verified cache entry when the caller already holds it (the capture hook does): it is
        loaded as is, without a second lookup.

    Raises
    ------
    CompileDuringCaptureError
        A miss while the current CUDA stream is capturing (always), or while a miss hook forbids it.
    Exception
        A miss hook's own exception, or a build/load failure.

    """
    kernel = _loaded.get(spec)  # lock-free hit: dict reads are atomic under the GIL
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _loaded.get(spec)
        if kernel is not None:
            return kernel
        _counts["misses"] += 1
        if capture.stream_is_capturing():  # never compile or load into a capturing stream, guard or not
            raise capture.CompileDuringCaptureError(capture.describe_miss(spec, shape),
                                                    " (the current stream is capturing)")
        for hook in list(_miss_hooks):
            hook(spec, shape)
        if entry is None:
            entry = ensure_built(spec, cache)
        kernel = backend_module(spec.backend).load(spec, entry)
        _loaded[spec] = kernel
        _counts["loads"] += 1
        return kernel


def is_loaded(spec: KernelSpec) -> bool:
    """Return True when ``spec``'s module is already in this process's table."""
    return spec in _loaded


def loaded_specs() -> tuple[KernelSpec, ...]:
    """Specs loaded into this process, in load order."""
    with _lock:
        return tuple(_loaded)


def counters() -> dict[str, int]:
    """Return this process's dispatch counts: ``misses``, ``builds`` (compiles run), ``loads``."""
    with _lock:
        return dict(_counts)


def target_of(device: Any) -> str:
    """Return the kernel target of a torch device: ``cpu``, or ``sm_XY`` from its compute capability.

    Raises
    ------
    ValueError
        The device is neither cpu nor cuda.

    """
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    raise ValueError(f"no kernel target for device {device} (cpu or cuda)")
