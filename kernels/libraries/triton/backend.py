"""The server's own Triton kernels, replayed from a manifest: described by Triton's own cache key, built by Triton.

A spec of this backend is one recorded specialization (:mod:`jitwarm.precompile.manifest`): ``family`` is the
kernel as ``module:qualname``, ``params["specialization"]`` is the specialization data Triton handed its
``jit_cache_hook`` (signature, constexprs, attrs, options, target), ``target`` the arch it was recorded on.
It implements :class:`jitwarm.kernels.backend.Backend` (see there for the failure rules):

``description(spec) -> dict``
    ``{"format", "triton_key", "group"}``: the key Triton's ``compile`` makes its cache manager with for this
    specialization and the name of the metadata file it asks the manager for, found by running Triton's own
    ``preload`` up to its cache lookup (:func:`triton_cache_key`). It is exactly what
    :class:`jitwarm.kernels.libraries.triton.cache.CacheManager` computes when the server's Triton compiles the same
    specialization, so the entry a CPU build box replays is the entry the GPU server's JIT finds. Triton's
    key covers its version and backend, the kernel's source and everything it calls, the options and the
    cache-invalidating ``TRITON_*`` variables: run the replay in the server's image and environment.
``build(spec, staging)``
    Triton's own ``preload(specialization)`` into a private Triton cache, with a driver that only reports
    the recorded target when this box has no such device; the files Triton wrote (IRs, cubin, metadata)
    go to ``staging`` with the group file naming them relative to the entry. ``CompileError`` with
    Triton's message, or when Triton keyed the compile differently than the description said.
``check(spec, staging)`` / ``load(spec, entry)``
    The group and its files are there and the cubin is an ELF image. ``load`` returns a kernel whose
    ``preload()``, on a device, runs Triton's ``preload`` again through jitwarm's cache manager (a hit: no
    compile) and loads the module onto the device (``_init_handles``: ``cuModuleLoadData``, which Triton
    otherwise does at the first launch, inside capture if that is where the first launch is). The server
    launches these kernels itself: ``run()`` raises.

Triton's knobs and its active driver are process-global: descriptions and builds here take one lock, and the
target-only driver is only ever installed by the CLI or a build worker, for the length of one call.
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
from jitwarm.kernels.libraries.triton import driver
from jitwarm.kernels.spec import KernelSpec

name = "triton_jit"
#: Layout of the entries of Triton's compiles, replayed or served; part of every description.
FORMAT = "jitwarm-triton-cache/1"
#: The target of a spec captured from the server's Triton (its real target is in Triton's key).
SERVED = "served"
GROUP_PREFIX = "__grp__"  # Triton's own name for a group file (runtime/cache.py, FileCacheManager.put_group)

_lock = threading.RLock()


def description(spec: KernelSpec, facts: Any = None) -> dict[str, Any]:
    """Return ``{"format", "triton_key", "group"}`` for ``spec`` (see the module docstring).

    Raises
    ------
    SpecError
        The kernel cannot be imported by name, is not a Triton kernel, or its specialization data does not
        fit it (another kernel, another Triton).

    """
    served = _served(spec)
    if served is not None:
        kind, triton_key = served
        return (group_description if kind == "group" else file_description)(triton_key, spec.family)
    fn = resolve(spec.family)
    key, group = triton_cache_key(fn, _specialization(spec), _target(spec))
    return group_description(key, group)


def served_group(triton_key: str, group: str) -> KernelSpec:
    """The spec of the compile the server's Triton asks its cache manager for: keyed ``triton_key``, named ``group``.

    Its description is the one a recorded specialization of that compile has, so both name one entry; it is
    captured from the server's compile (:mod:`jitwarm.kernels.libraries.triton.cache`), never built here.
    """
    return KernelSpec(group, name, SERVED, {"served": "group", "triton_key": triton_key})


def served_file(triton_key: str, filename: str) -> KernelSpec:
    """The spec of one file the server's Triton keeps outside a group (a launcher module, autotune results)."""
    return KernelSpec(filename, name, SERVED, {"served": "file", "triton_key": triton_key})


def _served(spec: KernelSpec) -> tuple[str, str] | None:
    """``(kind, triton_key)`` of a served spec (:func:`served_group`, :func:`served_file`), None for a recorded one."""
    params = spec.params_dict
    if spec.target != SERVED:
        return None
    if params.get("served") not in ("group", "file") or not isinstance(params.get("triton_key"), str):
        raise SpecError(f"{spec.id}: a served Triton spec names its kind (group or file) and Triton's key")
    return str(params["served"]), str(params["triton_key"])


def group_description(triton_key: str, group: str) -> dict[str, Any]:
    """The description of Triton's compile keyed ``triton_key`` whose metadata file is ``group``."""
    return {"format": FORMAT, "triton_key": triton_key, "group": group}


def file_description(triton_key: str, filename: str) -> dict[str, Any]:
    """The description of one file Triton stores outside a group (a launcher or utils module, autotune results)."""
    return {"format": FORMAT, "triton_key": triton_key, "file": filename}


def build(spec: KernelSpec, staging: Path) -> None:
    """Compile ``spec`` with Triton's own ``preload`` into ``staging`` (see the module docstring)."""
    import tempfile

    from triton import knobs

    if _served(spec) is not None:
        raise CompileError(f"{spec.family}: captured from the server's Triton compile, never built by jitwarm")
    fn = resolve(spec.family)
    want = description(spec)
    with _lock, driver.reporting(_target(spec)), tempfile.TemporaryDirectory(prefix=".triton-", dir=staging) as tmp, \
            knobs.cache.scope(), knobs.runtime.scope(), knobs.compilation.scope():
        knobs.cache.dir = tmp
        knobs.cache.manager_class = None  # Triton's own file manager, into the private dir
        knobs.runtime.jit_cache_hook = None  # a recorder or a guard of this process must not see the replay
        knobs.compilation.override = False  # TRITON_KERNEL_OVERRIDE would swap in foreign IR
        knobs.compilation.dump_ir = False
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


def write_group(directory: Path, group: str, children: list[str]) -> Path:
    """Write Triton's group file for ``group`` into ``directory``, its children named relative to it."""
    path = directory / (GROUP_PREFIX + group)
    path.write_text(json.dumps({"child_paths": {c: c for c in sorted(children)}}, sort_keys=True))
    return path


def read_group(directory: Path, group: str) -> dict[str, Path]:
    """The children of ``group`` in ``directory`` as paths, or LoadError when the group or a child is missing."""
    try:
        children = json.loads((directory / (GROUP_PREFIX + group)).read_text())["child_paths"]
        paths = {str(c): directory / Path(str(c)).name for c in children}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LoadError(f"{directory}: no readable Triton group {group!r}: {exc}") from exc
    missing = [c for c, p in paths.items() if not p.is_file()]
    if missing or group not in paths:
        raise LoadError(f"{directory}: Triton group {group!r} lacks {missing or [group]}")
    return paths


def check(spec: KernelSpec, staging: Path) -> None:
    """The one group :func:`build` wrote and its files are in ``staging``, its cubin an ELF image; LoadError if not."""
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
    paths = read_group(root, group)
    for child, path in paths.items():
        if child.endswith(".cubin"):
            with path.open("rb") as f:
                if f.read(4) != b"\x7fELF":
                    raise LoadError(f"{spec.family}: {child} is not a cubin (no ELF header)")


class TritonJitKernel:
    """A recorded Triton specialization, present in the cache (a :class:`~jitwarm.kernels.backend.LoadedKernel`)."""

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self._compiled: dict[int, Any] = {}

    def preload(self) -> int:
        """On a CUDA device: Triton's ``preload`` through jitwarm's cache (a hit), then the module load; else 0.

        The kernel lands in the ``JITFunction``'s own kernel cache for the current device, so the server's
        first launch of this specialization neither compiles nor loads a module.
        """
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

    Raises
    ------
    SpecError
        The module cannot be imported, has no such attribute, or it is not a Triton kernel.

    """
    from triton.runtime.jit import JITFunction

    module_name, _, qualname = kernel.partition(":")
    if not module_name or not qualname or "<locals>" in qualname:
        raise SpecError(f"{kernel}: not importable by name (a kernel defined inside a function cannot be replayed)")
    try:
        # A manifest names the module, so importing it runs code we do not control: what it prints goes to
        # stderr (stdout may be a --json report), and its sys.exit() is this spec's failure, not the command's.
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
    """Raised by the key probe at Triton's cache lookup: the compile is described, nothing is compiled."""

    def __init__(self, key: str, group: str) -> None:
        super().__init__(key, group)
        self.key, self.group = key, group


_probing = threading.local()


def triton_cache_key(fn: Any, specialization: str, target: dict[str, Any]) -> tuple[str, str]:
    """Return the key Triton makes its cache manager with for this compile, and the group it asks for.

    Runs Triton's own ``preload`` with a cache manager that stops at ``get_group``: Triton's ``compile``
    computes the key from the source, backend, options and environment itself (compiler.py, ``compile``),
    so nothing of it is repeated here. Other threads' compiles meanwhile get the manager they had.
    """
    from triton import knobs
    from triton.runtime.cache import CacheManager, FileCacheManager

    previous = knobs.cache.manager_class or FileCacheManager

    class KeyProbe(CacheManager):
        def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
            self.key = key
            mine = getattr(_probing, "active", False) and not (override or dump)
            self._other = None if mine else previous(key, override=override, dump=dump)

        def get_group(self, filename: str) -> Any:
            if self._other is None:
                raise _Described(self.key, filename)
            return self._other.get_group(filename)

        def get_file(self, filename: str) -> Any:
            return self._other.get_file(filename) if self._other is not None else None

        def put(self, data: Any, filename: str, binary: bool = True) -> Any:
            return self._other.put(data, filename, binary) if self._other is not None else None

        def put_group(self, filename: str, group: dict[str, str]) -> Any:
            return self._other.put_group(filename, group) if self._other is not None else None

    with _lock, driver.reporting(target), knobs.cache.scope(), knobs.runtime.scope():
        knobs.cache.manager_class = KeyProbe
        knobs.runtime.jit_cache_hook = None
        _probing.active = True
        try:
            fn.preload(specialization)
        except _Described as described:
            return described.key, described.group
        except Exception as exc:  # noqa: BLE001 - the record does not fit the kernel Triton has here
            raise SpecError(f"{fn.module}:{fn.__qualname__}: Triton cannot take the recorded specialization: "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        finally:
            _probing.active = False
    raise SpecError(f"{fn.module}:{fn.__qualname__}: Triton's preload did not reach its cache lookup: it cannot "
                    "be keyed")


def _specialization(spec: KernelSpec) -> str:
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
