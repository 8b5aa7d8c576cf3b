"""sglang's own ``load_jit``, run in child processes for the sglang_jit backend: both sides of that boundary.

sglang's JIT state is process-global (the arch, utils/arch.py:162-185; the target tag and fingerprint,
``cache_once``), so each child has one arch for its life: :func:`describe` keeps one per arch and environment
(``describe ARCH``: a JSON call a line on stdin, an answer a line), :func:`build` runs one per build
(``build ARCH RESULT``). ``ARCH`` is ``[major, minor, suffix or null]``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from jitwarm.kernels import channel
from jitwarm.kernels.backend import CompileError, SpecError, ToolchainError, version_lines

Arch = tuple[int, int, str | None]
_CHILD = "jitwarm.kernels.libraries.sglang_jit.child"
#: What sglang's key reads from the environment (toolchain.py:42-56,132-139; loader.py:90): a change starts
#: a new describer, since the old one's fingerprint and target were computed under the old values.
_ENV_READ = ("CUDA_HOME", "CUDA_PATH", "CXX", "PATH", "SGLANG_JIT_LOG_RESOURCE_USAGE")
_START_TIMEOUT_S = 600.0  # importing sglang (torch, transformers) takes about 5 s on 2 cores
_ASK_TIMEOUT_S = 300.0
_BUILD_TIMEOUT_S = 1800 + 300  # sglang's own ninja timeout (compile/ninja.py:36), plus the import


def env_signature() -> tuple[Any, ...]:
    """What a description depends on besides the spec: the variables sglang reads, and the import path."""
    return (*(os.environ.get(k) for k in _ENV_READ), tuple(sys.path))


def describe(arch: Arch, call: dict[str, Any], signature: tuple[Any, ...]) -> dict[str, Any]:
    """The parts of sglang's build key of ``load_jit(call)`` (:func:`sglang_key`), by the child of ``arch``.

    Raises
    ------
    SpecError
        sglang does not import here, or its ``load_jit`` rejects the call.
    ToolchainError
        nvcc, the CUDA runtime or the host compiler is not where sglang looks, or the child died or hung.

    """
    with _describers_lock:
        found = _describers.get((arch, signature))
        if found is None or found.proc.poll() is not None:
            found = _describers[arch, signature] = _Describer(arch)
    return found.ask(call)


def build(module: str, arch: Arch, call: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    """Run ``load_jit(call)`` for ``arch`` into ``cache_dir``; return ``{"leaf", "key", "driver"}`` (leaf: relative).

    sglang's crash, force-recompile and keep switches are off. CompileError when ``load_jit`` failed, timed out or
    published nothing (``output``: sglang's, ninja's, nvcc's text).
    """
    result_file = cache_dir.parent / f".{cache_dir.name}-result.json"
    cmd = [sys.executable, "-m", _CHILD, "build", json.dumps(arch), str(result_file)]
    try:
        with tempfile.TemporaryDirectory(prefix="jitwarm-sglang-jit-") as scratch:
            env = _child_env(scratch, SGLANG_JIT_CACHE_DIR=str(cache_dir), SGLANG_CRASH_ON_JIT_COMPILE="0",
                             SGLANG_JIT_FORCE_RECOMPILE="0")
            env.pop("SGLANG_JIT_CACHE_KEEP", None)
            proc = subprocess.run(cmd, input=json.dumps(call), capture_output=True, text=True, env=env,
                                  timeout=_BUILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise CompileError(f"{module}: sglang's load_jit did not finish within {exc.timeout} s") from exc
    try:
        result = json.loads(result_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        result = {"error": "crash", "message": f"python -m {_CHILD} build exited {proc.returncode}"}
    if "error" in result:
        output = "\n".join(t for t in (result.get("output", ""), proc.stderr, proc.stdout) if t.strip())
        raise CompileError(f"{module}: sglang's load_jit failed: {result['message']}", output[-60000:])
    return result


def _child_env(scratch: str, **overrides: str) -> dict[str, str]:
    """Our environment and import path, in ``scratch`` (the child imports torch: ``channel.scratch_env``)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **channel.scratch_env(scratch),
            **overrides}


class _Describer:
    """The parent's handle on one describe child (one JSON line per call, answers in order)."""

    def __init__(self, arch: Arch) -> None:
        self._lock = threading.Lock()
        self._log = tempfile.TemporaryFile()  # its stderr: sglang's warnings, and why it died if it does
        self._lines = channel.LineReader()
        self._scratch = tempfile.TemporaryDirectory(prefix="jitwarm-sglang-describe-")  # see _child_env
        self.proc = subprocess.Popen([sys.executable, "-m", _CHILD, "describe", json.dumps(arch)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=_child_env(self._scratch.name))
        self._reply(_START_TIMEOUT_S)  # {"ready": true}, or sglang's import error

    def ask(self, call: dict[str, Any]) -> dict[str, Any]:
        """The key of ``call``, or the child's error raised as SpecError or ToolchainError."""
        with self._lock:
            with contextlib.suppress(OSError):  # a dead child: the read below says why
                channel.send(self.proc.stdin, call)
            return self._reply(_ASK_TIMEOUT_S)["key"]

    def _reply(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (line := self._lines.next_line()) is None:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else None
            if not chunk:
                self.close()
                why = f"did not answer within {timeout:.0f} s" if chunk is None else "exited"
                raise ToolchainError(f"sglang's JIT loader (python -m {_CHILD} describe) {why}: {self._tail()}")
            self._lines.feed(chunk)
        reply = channel.decode(line)
        if "error" in reply:
            raise (ToolchainError if reply["error"] == "toolchain" else SpecError)(reply["message"])
        return reply

    def _tail(self) -> str:
        self._log.seek(0)
        lines = [ln for ln in self._log.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:500] if lines else "no output"

    def close(self) -> None:
        """End the child: it exits at the end of its input."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._scratch.cleanup()


_describers: dict[tuple[Any, ...], _Describer] = {}
_describers_lock = threading.Lock()


@atexit.register
def _close_describers() -> None:
    with _describers_lock:
        while _describers:
            _describers.popitem()[1].close()


# The child side: everything below runs inside the child, with sglang imported.

_process_arch = contextlib.ExitStack()  # entered once, left only when the child exits


def call_arguments(call: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """``load_jit``'s positional and keyword arguments of a recorded call (wrapper pairs are tuples again)."""
    kwargs = {k: v for k, v in call.items() if k != "args"}
    for key in ("cpp_wrappers", "cuda_wrappers"):
        if kwargs.get(key) is not None:
            kwargs[key] = [tuple(pair) for pair in kwargs[key]]
    return list(call["args"]), kwargs


def observe(call: dict[str, Any], *, build: bool) -> tuple[Any, Path]:
    """Run sglang's ``load_jit`` on ``call``; return the BuildSpec it resolved and the directory it keyed.

    Without ``build``, ``SGLANG_CRASH_ON_JIT_COMPILE`` stops it at its cache decision (loader.py:148-156); both
    are seen where load_jit hands them to ``cache.compute_build_key`` and ``cache.build_key_dir``.
    """
    from sglang.kernels.jit.utils.compile import cache, loader

    seen: dict[str, Any] = {}
    compute_build_key, build_key_dir = cache.compute_build_key, cache.build_key_dir

    def observed_key(spec: Any, *, build_file: str) -> str:
        seen["spec"] = spec
        return compute_build_key(spec, build_file=build_file)

    def observed_dir(*, module_name: str, build_key: str) -> Path:
        seen["scope"] = build_key_dir(module_name=module_name, build_key=build_key)
        return seen["scope"]

    os.environ["SGLANG_CRASH_ON_JIT_COMPILE"] = "0" if build else "1"
    cache.compute_build_key, cache.build_key_dir = observed_key, observed_dir
    try:
        args, kwargs = call_arguments(call)
        loader.load_jit(*args, **kwargs)
    except RuntimeError:
        if build or "scope" not in seen:
            raise
    finally:
        cache.compute_build_key, cache.build_key_dir = compute_build_key, build_key_dir
    return seen["spec"], seen["scope"]


def sglang_key(spec: Any, scope: Path) -> dict[str, Any]:
    """What sglang's build key of ``spec`` hashes (cache.py:275-304), each part as sglang computes it; no paths."""
    from sglang.kernels.jit.utils import get_jit_cuda_arch
    from sglang.kernels.jit.utils.compile import cache

    sources = []
    for source in sorted(spec.sources):  # cache.py:285-291: anchor-relative name and content digest
        path = Path(source).resolve()
        sources.append([*cache._normalize_path(path), cache._file_digest(path)])
    flags = {k: [cache._normalize_text(f) for f in getattr(spec, k)] for k in ("cflags", "cuda_cflags", "ldflags")}
    return {"module": spec.module_name, "arch": get_jit_cuda_arch().target_name,
            "target_tag": scope.parent.parent.name, "build_key": scope.name.removeprefix("build-"),
            "sources": sources, "flags": flags, "wrappers": [list(w) for w in spec.wrappers],
            "header_only": spec.header_only, "environment": cache._environment_fingerprint(),
            "packages": _packages(), "compilers": _compilers()}


@functools.cache
def _packages() -> dict[str, str]:
    """The package versions in sglang's environment fingerprint, "absent" as it says (cache.py:205-211,265-270)."""
    from sglang.kernels.jit.utils.compile import cache

    found = {}
    for name in cache._VERSIONED_PACKAGES:
        try:
            found[name] = version(name)
        except (PackageNotFoundError, ValueError):
            found[name] = "absent"
    return found


@functools.cache
def _compilers() -> dict[str, str]:
    """The ``--version`` of the two compilers sglang fingerprints (cache.py:257-263), one line each, by role."""
    from sglang.kernels.jit.utils.compile import toolchain

    found = {}
    for role, path in zip(("host", "device"), toolchain.compilers(), strict=True):
        try:
            lines = version_lines(path)
        except ToolchainError:
            lines = ["unknown"]  # what sglang hashes then too; toolchain_problem says what is missing
        # For people: the name line and nvcc's release and build; the fingerprint hashes the whole text
        found[role] = "; ".join(lines[:1] + [ln for ln in lines[1:] if ln.startswith(("Cuda compilation", "Build "))])
    return found


def toolchain_problem(spec: Any) -> str | None:
    """Why sglang could not build ``spec`` with this toolchain (one line), or None."""
    from sglang.kernels.jit.utils.compile import toolchain

    host, device = toolchain.compilers()
    if shutil.which(host) is None:
        return f"host compiler {host!r} not found: sglang's JIT runs $CXX, default c++ (toolchain.py:132-139)"
    if not any(unit.is_cuda for unit in spec.translation_units()):
        return None
    if not Path(device).is_file():
        return (f"nvcc not found at {device}: sglang's JIT runs $CUDA_HOME/bin/nvcc (toolchain.py:42-88); set "
                "CUDA_HOME to the CUDA toolkit root")
    home = toolchain.cuda_home()
    if not any((Path(home) / "lib64").glob("libcudart.so*")):
        # nvcc found on PATH through a wrapper (/usr/local/bin/nvcc) makes CUDA_HOME /usr/local (toolchain.py:53-55)
        return (f"no libcudart.so in {home}/lib64: sglang links -L$CUDA_HOME/lib64 -lcudart (toolchain.py:244); "
                f"set CUDA_HOME to the CUDA toolkit root (it is {os.environ.get('CUDA_HOME') or 'unset'})")
    return None


def driver() -> str:
    """Make ``-lcuda`` modules loadable (load_jit dlopens its build): "present" (a driver), "stub" or "absent"."""
    from sglang.kernels.jit.utils.compile import toolchain

    with contextlib.suppress(OSError):
        ctypes.CDLL("libcuda.so.1")
        return "present"
    stub = Path(toolchain.cuda_stubs_dir()) / "libcuda.so"
    if not stub.is_file():
        return "absent"
    ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
    return "stub"


def _enter_arch(arch: list[Any]) -> None:
    from sglang.kernels.jit.utils import override_jit_cuda_arch

    _process_arch.enter_context(override_jit_cuda_arch(*arch))


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def _serve_descriptions(arch: list[Any]) -> int:
    answers = channel.answers()  # whatever sglang or torch prints goes to the log, never into the answers
    with tempfile.TemporaryDirectory(prefix="jitwarm-sglang-describe-") as tmp:
        os.environ["SGLANG_JIT_CACHE_DIR"] = str(Path(tmp) / "never-written")  # the crash comes before any write
        try:
            _enter_arch(arch)
        except Exception as exc:  # ImportError, or whatever sglang's own imports raise
            channel.send(answers, {"error": "spec", "message": f"cannot import sglang's JIT loader: {_one_line(exc)}"})
            return 1
        channel.send(answers, {"ready": True})
        for line in sys.stdin:
            call = channel.decode(line)
            try:
                spec, scope = observe(call, build=False)
                problem = toolchain_problem(spec)
                reply = {"error": "toolchain", "message": problem} if problem else {"key": sglang_key(spec, scope)}
            except Exception as exc:  # load_jit's ValueError (unknown dependency), TypeError (a bad keyword)
                reply = {"error": "spec", "message": f"load_jit{tuple(call.get('args', ()))}: {_one_line(exc)}"}
            channel.send(answers, reply)
    return 0


def _build_one(arch: list[Any], result: Path) -> int:
    call = json.loads(sys.stdin.read())
    try:
        _enter_arch(arch)
        from sglang.kernels.jit.utils.compile import cache

        loaded_driver = driver()
        spec, scope = observe(call, build=True)
        library = cache.find_prebuilt(scope=scope, module_name=spec.module_name)
        if library is None:
            raise RuntimeError(f"load_jit built {spec.module_name} but published no leaf under {scope} "
                               "(cache.commit_build found no usable dependency information)")
        out = {"leaf": library.parent.relative_to(cache.cache_root()).as_posix(), "key": sglang_key(spec, scope),
               "driver": loaded_driver}
    except Exception as exc:  # sglang's RuntimeError carries ninja's and nvcc's output in its message
        out = {"error": "compile", "message": _one_line(exc), "output": traceback.format_exc()}
    result.write_text(json.dumps(out), encoding="utf-8")
    return 1 if "error" in out else 0


if __name__ == "__main__":
    _mode, _arch, *_rest = sys.argv[1:]
    sys.exit(_serve_descriptions(json.loads(_arch)) if _mode == "describe" else
             _build_one(json.loads(_arch), Path(_rest[0])))
