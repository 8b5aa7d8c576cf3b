"""Dispatch: the process's table of loaded kernels, the hooks that may forbid a miss, and the miss path.

A hit is a dict read. A miss never compiles or loads into a capturing stream (sglang #33356, #33795), and any
miss hook (the guard) may forbid it. The module functions act on :data:`default`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from jitwarm.cache.errors import JitwarmError
from jitwarm.kernels.artifacts import artifact
from jitwarm.kernels.spec import KernelSpec
from jitwarm.kernels.target import Target


class CompileDuringCaptureError(JitwarmError, RuntimeError):
    """A kernel was about to be compiled or loaded while the guard was armed or a stream was capturing (exit 1).

    A ``RuntimeError`` too: a server's capture loop that catches ``RuntimeError`` around a graph stops on it.
    """

    PLAN_HINT = ("Add it to the warm plan (capture flags that produce this shape, or --cuda-graph-bs with this "
                 "batch size), run `jitwarm warm` with those flags, and call CaptureHook(plan)() before capture.")
    THIRD_PARTY_HINT = ("Record the server's kernels (JITWARM_RECORD=manifest.jsonl with the jitwarm sglang plugin), "
                        "replay them (`jitwarm warm --manifest manifest.jsonl`) and give the capture hook the "
                        "manifest, or run this kernel once for this shape before capture, so its compile and module "
                        "load happen outside the graph.")

    def __init__(self, what: str, detail: str = "", hint: str = PLAN_HINT) -> None:
        super().__init__(f"{what} would be compiled or loaded during CUDA-graph capture{detail}", hint)


def stream_is_capturing() -> bool:
    """True when torch is loaded, CUDA is initialized here and the current stream is capturing.

    ``is_initialized`` is a flag (``is_available`` asks the driver); asking an uninitialized process for its
    stream would initialize CUDA, which fails in a forked child.
    """
    torch = sys.modules.get("torch")  # never import torch just to learn that nothing is captured
    if torch is None or not torch.cuda.is_initialized():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def describe_miss(spec: KernelSpec, shape: Any) -> str:
    """Name the kernel and the shape that asked for it, for the error message."""
    params = ", ".join(f"{k}={v}" for k, v in spec.params)
    where = f" for shape {shape!r}" if shape is not None else ""
    return f"kernel {spec.family} [{spec.backend}, {spec.target}] ({params}){where}"


MissHook = Callable[[KernelSpec, Any], None]


class Dispatcher:
    """Loaded kernels of one process, the miss hooks, and the cache misses are built in (thread-safe)."""

    def __init__(self, cache: Any = None) -> None:
        self._lock = threading.RLock()
        self._loaded: dict[KernelSpec, Any] = {}
        self._miss_hooks: list[MissHook] = []
        self._cache = cache
        self._counts = {"builds": 0, "loads": 0, "misses": 0}

    def _cache_or(self, cache: Any) -> Any:
        """``cache``, else the one given, else ``KernelCache()`` from the environment, made on first need."""
        if cache is not None:
            return cache
        with self._lock:
            if self._cache is None:
                from jitwarm.cache import KernelCache

                self._cache = KernelCache()
            return self._cache

    def set_cache(self, cache: Any) -> Any:
        """Make ``cache`` the one later misses use (None: the lazy default); return the previous one."""
        with self._lock:
            previous, self._cache = self._cache, cache
            return previous

    def add_miss_hook(self, hook: MissHook) -> None:
        """Register ``hook(spec, shape)``, called before every compile or load a miss would do."""
        with self._lock:
            if hook not in self._miss_hooks:
                self._miss_hooks.append(hook)

    def remove_miss_hook(self, hook: MissHook) -> None:
        """Unregister a hook added with :meth:`add_miss_hook` (no error if absent)."""
        with self._lock:
            if hook in self._miss_hooks:
                self._miss_hooks.remove(hook)

    def ensure_built(self, spec: KernelSpec, cache: Any = None) -> Any:
        """Return the cache entry of ``spec``, building it (once per cache) if missing, as ``Artifact.get_or_build``."""
        cache = self._cache_or(cache)
        result = artifact(spec, cache).get_or_build(cache)
        if result.outcome == "built":
            with self._lock:
                self._counts["builds"] += 1
        return result.entry

    def ensure_loaded(self, spec: KernelSpec, cache: Any = None, shape: Any = None, entry: Any = None, *,
                      build: bool = True) -> Any:
        """Return the loaded kernel of ``spec``, loading it (and building it if needed) on first use.

        ``shape`` (what asked for it) is for the miss message; ``entry`` a verified entry the caller holds;
        ``build=False`` (strict) never builds.

        Raises
        ------
        CompileDuringCaptureError
            A miss while the current CUDA stream is capturing.
        Exception
            A miss hook's own exception, or a build or load failure (``KernelLoadError``).

        """
        kernel = self._loaded.get(spec)  # lock-free hit: dict reads are atomic under the GIL
        if kernel is not None:
            return kernel
        with self._lock:
            kernel = self._loaded.get(spec)
            if kernel is not None:
                return kernel
            self._counts["misses"] += 1
            if stream_is_capturing():  # never compile or load into a capturing stream, guard or not
                raise CompileDuringCaptureError(describe_miss(spec, shape), " (the current stream is capturing)")
            for hook in list(self._miss_hooks):
                hook(spec, shape)
            cache = self._cache_or(cache)
            if entry is None and build:
                entry = self.ensure_built(spec, cache)
            kernel = self._loaded[spec] = artifact(spec, cache).load(cache, entry, build=build)
            self._counts["loads"] += 1
            return kernel

    def is_loaded(self, spec: KernelSpec) -> bool:
        """True when ``spec``'s kernel is in this table."""
        return spec in self._loaded

    def loaded_specs(self) -> tuple[KernelSpec, ...]:
        """Specs loaded, in load order."""
        with self._lock:
            return tuple(self._loaded)

    def counters(self) -> dict[str, int]:
        """The counts of this table: ``misses``, ``builds`` (compiles run), ``loads``."""
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        """Forget every loaded kernel, hook, count and the cache (tests)."""
        with self._lock:
            self._loaded.clear()
            self._miss_hooks.clear()
            self._cache = None
            self._counts = dict.fromkeys(self._counts, 0)


#: The process's dispatcher: ``jitwarm.kernels.ops`` dispatches through it.
default = Dispatcher()
ensure_loaded, ensure_built, is_loaded, loaded_specs = (default.ensure_loaded, default.ensure_built,
                                                       default.is_loaded, default.loaded_specs)
add_miss_hook, remove_miss_hook = default.add_miss_hook, default.remove_miss_hook
counters, set_cache, reset = default.counters, default.set_cache, default.reset


def target_of(device: Any) -> str:
    """The target name of a torch device (:meth:`Target.of_device`): ``cpu`` or ``sm_XY``."""
    return Target.of_device(device).name
