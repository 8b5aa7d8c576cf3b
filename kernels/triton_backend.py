"""The Triton backend: description, ahead-of-time build to a cubin (no GPU needed), load and launch of one spec.

Target ``cpu`` runs the same kernels under Triton's interpreter (correctness checks only): ``TRITON_INTERPRET``
is read when ``@triton.jit`` decorates, so that copy is a second import of ``triton_kernels.py``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from jitwarm.kernels.backend import CompileError, LoadError, version_lines
from jitwarm.kernels.families import checked, family
from jitwarm.kernels.libraries.triton import driver
from jitwarm.kernels.spec import KernelSpec
from jitwarm.kernels.triton_launch import KernelSignature, bind, kernel_signature

name = "triton"
#: Layout of this backend's artifacts; part of every description, so a change orphans old entries.
FORMAT = "jitwarm-triton/1"
LAUNCH_JSON = "launch.json"

_KERNELS_PY = Path(__file__).with_name("triton_kernels.py")
_INTERPRETED = "jitwarm.kernels._triton_kernels_interpreted"
_interpreted_lock = threading.Lock()


def _checked(spec: KernelSpec) -> tuple[KernelSignature, int | None]:
    """The spec's kernel signature and CUDA arch (None for cpu); SpecError for a spec this backend cannot build."""
    target, _ = checked(spec, name)
    return kernel_signature(spec), target.arch


def description(spec: KernelSpec, facts: Any = None) -> dict[str, Any]:
    """Return the JSON-able cache description of ``spec``; SpecError for an unsupported target, family or dtype."""
    sig, arch = _checked(spec)
    toolchain: dict[str, Any] = dict(_triton_identity())
    if arch is None:
        toolchain["mode"] = "interpreter"
    else:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        toolchain.update(_ptxas(arch))
        toolchain["cubin_arch"] = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # Triton's own choice
        toolchain["warp_size"] = driver.WARP_SIZE
        toolchain["env"] = dict(sorted(get_cache_invalidating_env_vars().items()))
    return {"format": FORMAT, "family": spec.family, "backend": spec.backend, "target": spec.target,
            "params": spec.params_dict, "source": {_KERNELS_PY.name: _source_digest()},
            "kernel": sig.to_json(), "toolchain": toolchain}


def build(spec: KernelSpec, staging_dir: Path, described: dict[str, Any] | None = None) -> None:
    """Compile ``spec`` ahead of time into ``staging_dir`` (``launch.json`` only for cpu); CompileError if it fails."""
    sig, arch = _checked(spec)
    staging_dir = Path(staging_dir)
    # triton_version, not triton_key(): that costs 0.3 s per worker
    launch: dict[str, Any] = {"format": FORMAT, "spec": spec.to_json(), **sig.to_json(),
                              "triton_version": importlib.metadata.version("triton")}
    if arch is None:
        launch["mode"] = "interpreter"
        _write_json(staging_dir / LAUNCH_JSON, launch)
        return
    import triton
    from triton import knobs

    # The private cache is removed before the entry is sealed: Triton's group files hold absolute paths.
    with tempfile.TemporaryDirectory(prefix=".triton-", dir=staging_dir) as tmp, driver.private_cache(tmp):
        # No line info: it embeds this checkout's absolute path in the cubin, so identical builds on two
        # boxes would differ byte for byte (the cost: profilers show no source lines).
        knobs.compilation.disable_line_info = True
        src = _ast_source(spec)
        try:
            compiled = triton.compile(src, target=driver.gpu_target(arch), options=sig.options())
        except Exception as exc:  # Triton's CompilationError, ptxas's RuntimeError: the message is the diagnostic
            raise CompileError(f"{spec.id}: triton compile failed: {type(exc).__name__}",
                               str(exc)) from exc
        name = compiled.metadata.name
        metadata = json.loads(Path(compiled.metadata_group[f"{name}.json"]).read_text())
        cubin = compiled.asm["cubin"]
    (staging_dir / f"{name}.cubin").write_bytes(cubin)
    _write_json(staging_dir / f"{name}.json", _without_dirs(metadata))
    launch.update(name=name, cubin=f"{name}.cubin", metadata=f"{name}.json", hash=metadata["hash"],
                  num_warps=metadata["num_warps"], num_ctas=metadata.get("num_ctas", 1),
                  shared=metadata["shared"], target={"backend": "cuda", "arch": arch, "warp_size": driver.WARP_SIZE})
    _write_json(staging_dir / LAUNCH_JSON, launch)


def check(spec: KernelSpec, staging_dir: Path) -> None:
    """Read what :func:`build` wrote as :func:`load` would, and check the cubin is an ELF image; LoadError if not."""
    root = Path(staging_dir)
    launch = _read_launch(spec, root)
    if spec.target != "cpu":
        cubin = root / str(launch.get("cubin"))
        try:
            with cubin.open("rb") as f:
                magic = f.read(4)
            json.loads((root / str(launch.get("metadata"))).read_text())
        except (OSError, ValueError) as exc:
            raise LoadError(f"{spec.id}: build output in {root} is unreadable: {exc}") from exc
        if magic != b"\x7fELF":  # a cubin is an ELF image; a device is needed to load it any further
            raise LoadError(f"{spec.id}: {cubin.name} is not a cubin (no ELF header)")


def load(spec: KernelSpec, entry: Any) -> CudaKernel | InterpretedKernel:
    """Return the kernel of ``entry``, touching no device; LoadError for a ``launch.json`` missing or not its."""
    root = Path(entry.path)
    if getattr(entry, "files", None) and LAUNCH_JSON not in entry.files:
        raise LoadError(f"{spec.id}: cache entry {root} has no {LAUNCH_JSON}; it is not a triton build")
    launch = _read_launch(spec, root)
    return InterpretedKernel(spec) if spec.target == "cpu" else CudaKernel(spec, root, launch)


def _read_launch(spec: KernelSpec, root: Path) -> dict[str, Any]:
    try:
        launch = json.loads((root / LAUNCH_JSON).read_text())
        built_for = KernelSpec.from_json(launch["spec"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"{spec.id}: {root / LAUNCH_JSON} is unreadable: {exc}") from exc
    if launch.get("format") != FORMAT:
        raise LoadError(f"{spec.id}: entry {root} has format {launch.get('format')!r}, want {FORMAT!r}")
    if built_for != spec:
        raise LoadError(f"{spec.id}: entry {root} was built for {built_for.id}")
    return launch


class CudaKernel:
    """A cubin built by :func:`build`, launched through Triton's ``CompiledKernel``; one module per device."""

    def __init__(self, spec: KernelSpec, root: Path, launch: dict[str, Any]) -> None:
        self.spec = spec
        self._root = root
        self._launch = launch
        self._arch = int(launch["target"]["arch"])
        self._by_device: dict[int, Any] = {}

    def preload(self) -> int:
        """Load the cubin on the current CUDA device; RuntimeError without one or on another arch."""
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"{self.spec.id}: preload needs a CUDA device (this build is for "
                               f"sm_{self._arch}; use target 'cpu' to run under the interpreter)")
        self._load(torch.cuda.current_device())
        return 1

    def _load(self, device: int) -> Any:
        import torch
        from triton.compiler import CompiledKernel

        if device in self._by_device:
            return self._by_device[device]
        major, minor = torch.cuda.get_device_capability(device)
        if major * 10 + minor != self._arch:
            raise RuntimeError(f"{self.spec.id}: built for sm_{self._arch}, but cuda:{device} is "
                               f"sm_{major}{minor}; warm a plan for target sm_{major}{minor}")
        group = {name: str(self._root / name) for name in (self._launch["metadata"], self._launch["cubin"])}
        kernel = CompiledKernel(_ast_source(self.spec), group, self._launch["hash"])
        with torch.cuda.device(device):
            driver.load_module(kernel)  # cuModuleLoadData + cuModuleGetFunction now, not at the first launch
        self._by_device[device] = kernel
        return kernel

    def run(self, *args: Any) -> None:
        """Launch on ``torch.cuda.current_stream()`` of the tensors' device."""
        import torch

        grid, kernel_args = bind(self.spec, args)
        device = args[0].device
        if device.type != "cuda":
            raise ValueError(f"{self.spec.id}: tensors are on {device}, this kernel runs on CUDA")
        if grid[0] == 0:
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = self._by_device.get(index)
        if kernel is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.spec.id} is not preloaded on cuda:{index}; loading it inside "
                                   f"CUDA graph capture would break the capture: preload() it first")
            kernel = self._load(index)
        stream = torch.cuda.current_stream(index).cuda_stream
        # The module was loaded in that device's context: launch from it.
        with contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index):
            kernel[grid](*kernel_args, stream=stream)

    def __repr__(self) -> str:
        return f"CudaKernel({self.spec.id})"


class InterpretedKernel:
    """The spec's kernel run by Triton's interpreter on CPU tensors (target ``cpu``; a ``LoadedKernel``)."""

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self._fn: Any = None

    def preload(self) -> int:
        """Import the interpreter copy of the kernels (once per process); no device is involved."""
        if self._fn is None:
            self._fn = _kernel_fn(self.spec, interpreted_kernels())
        return 0

    def run(self, *args: Any) -> None:
        """Run on CPU tensors; results land in the output tensors as on a GPU."""
        grid, kernel_args = bind(self.spec, args)
        if args[0].device.type != "cpu":
            raise ValueError(f"{self.spec.id}: target cpu runs on CPU tensors, got {args[0].device}")
        self.preload()
        if grid[0]:
            self._fn[grid](*kernel_args)

    def __repr__(self) -> str:
        return f"InterpretedKernel({self.spec.id})"


def interpreted_kernels() -> ModuleType:
    """Return ``triton_kernels`` imported a second time, decorated in interpreter mode (the flag scoped by knobs)."""
    with _interpreted_lock:
        module = sys.modules.get(_INTERPRETED)
        if module is None:
            from triton import knobs

            spec = importlib.util.spec_from_file_location(_INTERPRETED, _KERNELS_PY)
            module = importlib.util.module_from_spec(spec)
            with knobs.runtime.scope():
                knobs.runtime.interpret = True
                spec.loader.exec_module(module)
            sys.modules[_INTERPRETED] = module
        return module


def _kernel_fn(spec: KernelSpec, module: ModuleType) -> Any:
    fn = getattr(module, family(spec).triton_kernel)
    names = tuple(getattr(fn, "arg_names", ()))
    want = kernel_signature(spec).arg_names
    if names != want:  # triton_kernels.py and triton_launch.py disagree: a bug here, not a user error
        raise RuntimeError(f"{fn.__name__} takes {names}, triton_launch expects {want}")
    return fn


def _ast_source(spec: KernelSpec) -> Any:
    """Triton's ``ASTSource`` of ``spec``'s kernel: its explicit signature, constexprs and attrs."""
    from triton.compiler import ASTSource

    from jitwarm.kernels import triton_kernels

    sig = kernel_signature(spec)
    return ASTSource(_kernel_fn(spec, triton_kernels), dict(sig.types), dict(sig.constexprs), sig.attrs())


def _source_digest() -> str:
    """sha256 of ``triton_kernels.py`` (content, not path; Triton also keys on line numbers)."""
    return hashlib.sha256(_KERNELS_PY.read_bytes()).hexdigest()


@functools.cache
def _triton_identity() -> dict[str, str]:  # triton_key(): its compiler, backends and libtriton
    import triton
    from triton.runtime.cache import triton_key

    return {"triton": triton.__version__, "triton_key": hashlib.sha256(triton_key().encode()).hexdigest()}


@functools.cache
def _ptxas(arch: int) -> dict[str, str]:  # ptxas-blackwell for arch >= 90 in Triton 3.9
    tool = driver.ptxas(arch)
    return {"ptxas": tool.name, "ptxas_version": "\n".join(version_lines(str(tool), "ptxas"))}


def _without_dirs(value: Any) -> Any:  # absolute paths (extern_libs' libdevice) to file names: relocatable
    if isinstance(value, dict):
        return {k: _without_dirs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_dirs(v) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        return Path(value).name
    return value


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
