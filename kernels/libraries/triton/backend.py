"""The server's own Triton kernels (kind ``triton_jit``): described by Triton's own cache key, built by Triton.

A recorded spec is one specialization (``module:qualname``, the data Triton handed its ``jit_cache_hook``); a
served spec (target ``served``) is a compile the server's Triton asked :mod:`.cache` for, captured, never built
here. Both are keyed as Triton keys its cache (docs/triton.md), under ``driver.LOCK``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import threading
from pathlib import Path
from typing import Any

from jitwarm.kernels.backend import CompileError, LoadError, SpecError
from jitwarm.kernels.libraries.triton import SERVED, driver
from jitwarm.kernels.libraries.triton.driver import GROUP_PREFIX, read_group, write_group
from jitwarm.kernels.spec import KernelSpec

#: Layout of the entries of Triton's compiles, replayed or served; part of every description.
FORMAT = "jitwarm-triton-cache/1"


def description(spec: KernelSpec, facts: Any = None) -> dict[str, Any]:
    """Return ``{"format", "triton_key", "group"}`` for ``spec`` (``"file"`` for a served single file).

    SpecError when the kernel cannot be imported by name, is no Triton kernel, or the specialization does not fit.
    """
    served = _served(spec)
    if served is not None:
        kind, triton_key = served
        return {"format": FORMAT, "triton_key": triton_key, kind: spec.family}
    key, group = triton_cache_key(resolve(spec.family), _specialization(spec), _target(spec))
    return {"format": FORMAT, "triton_key": key, "group": group}


def _served(spec: KernelSpec) -> tuple[str, str] | None:
    """``(kind, triton_key)`` of a served spec, None for a recorded one."""
    if spec.target != SERVED:
        return None
    params = spec.params_dict
    if params.get("served") not in ("group", "file") or not isinstance(params.get("triton_key"), str):
        raise SpecError(f"{spec.id}: a served Triton spec names its kind (group or file) and Triton's key")
    return str(params["served"]), str(params["triton_key"])


def build(spec: KernelSpec, staging: Path, described: dict[str, Any] | None = None) -> None:
    """Compile ``spec`` with Triton's own ``preload`` into ``staging``; CompileError with Triton's message."""
    import tempfile

    if _served(spec) is not None:
        raise CompileError(f"{spec.family}: captured from the server's Triton compile, never built by jitwarm")
    fn = resolve(spec.family)
    want = described or description(spec)
    with driver.LOCK, driver.reporting(_target(spec)), \
            tempfile.TemporaryDirectory(prefix=".triton-", dir=staging) as tmp, driver.private_cache(tmp):
        try:
            fn.preload(_specialization(spec))
        except Exception as exc:  # Triton's CompilationError, ptxas's RuntimeError: the message is the diagnostic
            raise CompileError(f"{spec.family}: triton compile failed: {type(exc).__name__}", str(exc)) from exc
        made = Path(tmp) / want["triton_key"]
        group = made / (GROUP_PREFIX + want["group"])
        if not group.is_file():
            found = sorted(p.name for p in Path(tmp).iterdir())
            raise CompileError(f"{spec.family}: Triton keyed the compile {found} but the description says "
                               f"{want['triton_key']}: the environment changed between describing and building")
        children = json.loads(group.read_text())["child_paths"]
        for child in children:
            (staging / child).write_bytes((made / child).read_bytes())
    write_group(staging, want["group"], list(children))


def check(spec: KernelSpec, staging: Path) -> None:
    """The one group :func:`build` wrote and its files are in ``staging``, its cubins ELF; LoadError if not."""
    served = _served(spec)
    if served is not None and served[0] == "file":
        if not (Path(staging) / spec.family).is_file():
            raise LoadError(f"{spec.family}: Triton's file is not among the captured files")
        return
    groups = [p.name[len(GROUP_PREFIX):] for p in Path(staging).glob(GROUP_PREFIX + "*")]
    if served is not None and groups != [spec.family]:
        raise LoadError(f"{spec.family}: the captured files hold the Triton groups {groups}, not this one")
    if len(groups) != 1:
        raise LoadError(f"{spec.family}: the build wrote {len(groups)} Triton groups, not one")
    _check_group(spec, Path(staging), groups[0])


def load(spec: KernelSpec, entry: Any) -> TritonJitKernel:
    """Return the kernel of ``entry`` (a cache ``Entry``, its description naming the group), checked as at build."""
    described = entry.description if isinstance(entry.description, dict) else {}
    group = described.get("group")
    if described.get("format") != FORMAT or not isinstance(group, str):
        raise LoadError(f"{spec.family}: cache entry {entry.path} is not a Triton compile ({FORMAT})")
    _check_group(spec, Path(entry.path), group)
    return TritonJitKernel(spec)


def _check_group(spec: KernelSpec, root: Path, group: str) -> None:
    for child, path in read_group(root, group).items():
        if child.endswith(".cubin"):
            with path.open("rb") as f:
                if f.read(4) != b"\x7fELF":
                    raise LoadError(f"{spec.family}: {child} is not a cubin (no ELF header)")


class TritonJitKernel:
    """A recorded Triton specialization, present in the cache (a ``LoadedKernel``)."""

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self._compiled: dict[int, Any] = {}

    def preload(self) -> int:
        """On a CUDA device: Triton's ``preload`` through jitwarm's cache (a hit), then the module load; else 0."""
        import torch

        if not torch.cuda.is_available():
            return 0
        device = torch.cuda.current_device()
        if device not in self._compiled:
            from jitwarm.kernels.libraries.triton import cache as triton_cache

            fn = resolve(self.spec.family)
            with triton_cache.serving():
                kernel = fn.preload(_specialization(self.spec))
            if kernel is None:
                raise RuntimeError(f"{self.spec.family}: Triton skipped the preload (a jit_cache_hook said so)")
            driver.load_module(kernel)  # cuModuleLoadData now, not at the first launch
            self._compiled[device] = kernel
        return 1

    def run(self, *args: Any) -> None:
        """The server launches its own kernels; jitwarm only makes them present and loaded."""
        raise TypeError(f"{self.spec.family}: a recorded server kernel is launched by the server, not by jitwarm")

    def __repr__(self) -> str:
        return f"TritonJitKernel({self.spec.family}@{self.spec.target})"


def resolve(kernel: str) -> Any:
    """Return the ``JITFunction`` named ``module:qualname`` (through an autotuner's or heuristics' ``.fn``).

    SpecError when the module cannot be imported (``sys.exit()`` included), lacks the name, or it is no kernel.
    """
    from triton.runtime.jit import JITFunction

    module_name, _, qualname = kernel.partition(":")
    if not module_name or not qualname or "<locals>" in qualname:
        raise SpecError(f"{kernel}: not importable by name (a kernel defined inside a function cannot be replayed)")
    try:
        # Its sys.exit() is this spec's failure; its prints go to stderr (stdout may be a --json report).
        with contextlib.redirect_stdout(sys.stderr):
            obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any import failure of the server's module
        raise SpecError(f"{kernel}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise SpecError(f"{kernel}: {module_name} has no {qualname}")
    for _ in range(8):  # @triton.autotune / @triton.heuristics wrap the JITFunction as .fn
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
    raise SpecError(f"{kernel}: not a Triton kernel (@triton.jit)")


class _Described(Exception):
    """Raised by the key probe at Triton's cache lookup with ``(key, group)``: nothing is compiled."""


_probing = threading.local()


def triton_cache_key(fn: Any, specialization: str, target: dict[str, Any]) -> tuple[str, str]:
    """Return the key Triton makes its cache manager with for this compile, and the group it asks for.

    Triton's own ``preload`` runs with a manager that stops at ``get_group``: the key is Triton's, not repeated here.
    """
    from triton import knobs
    from triton.runtime.cache import CacheManager, FileCacheManager

    previous = knobs.cache.manager_class or FileCacheManager

    class KeyProbe(CacheManager):
        def __new__(cls, key: str, override: bool = False, dump: bool = False) -> Any:
            if getattr(_probing, "active", False) and not (override or dump):
                return super().__new__(cls)
            return previous(key, override=override, dump=dump)  # another thread's compile: the manager it had

        def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
            self.key = key

        def get_group(self, filename: str) -> Any:
            raise _Described(self.key, filename)

        def _unreached(self, *args: Any, **kwargs: Any) -> None:  # get_group comes first and stops the compile
            return None

        get_file = put = put_group = _unreached

    with driver.LOCK, driver.reporting(target), knobs.cache.scope(), knobs.runtime.scope():
        knobs.cache.manager_class = KeyProbe
        knobs.runtime.jit_cache_hook = None
        _probing.active = True
        try:
            fn.preload(specialization)
        except _Described as described:
            return described.args
        except Exception as exc:  # noqa: BLE001 - the record does not fit the kernel Triton has here
            raise SpecError(f"{fn.module}:{fn.__qualname__}: Triton cannot take the recorded specialization: "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        finally:
            _probing.active = False
    raise SpecError(f"{fn.module}:{fn.__qualname__}: Triton's preload did not reach its cache lookup: it cannot "
                    "be keyed")


def _specialization(spec: KernelSpec) -> str:
    """Triton's specialization data of a recorded spec; SpecError if it has none."""
    value = spec.params_dict.get("specialization")
    if not isinstance(value, str):
        raise SpecError(f"{spec.id}: a triton_jit spec carries Triton's specialization data as a string")
    return value


def _target(spec: KernelSpec) -> dict[str, Any]:
    """The target the specialization was recorded on, as Triton serialized it (``{"backend", "arch", ...}``)."""
    try:
        target = json.loads(_specialization(spec))["target"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SpecError(f"{spec.family}: the specialization data has no target: {exc}") from None
    if not isinstance(target, dict) or target.get("backend") != "cuda":
        raise SpecError(f"{spec.family}: recorded for {target!r}; only CUDA targets are replayed")
    return target
