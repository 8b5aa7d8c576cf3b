"""The backend contract: how one spec is described, built, checked and loaded; and the registry of kinds.

A backend is a module implementing :class:`Backend` (``tvm_backend``, ``triton_backend``, and the server's kinds
in :mod:`jitwarm.kernels.libraries`); each is one :class:`~jitwarm.kernels.kinds.Kind` of the registry
:data:`jitwarm.kernels.kinds.KINDS`, which says what it can do (:func:`abilities`). The failure rules:

- ``description(spec, facts)``: cheap, JSON-able, no paths, hosts, times or device presence. Raises
  :class:`SpecError` for a spec it cannot build, :class:`ToolchainError` when its compiler is missing.
- ``build(spec, staging, described)``: writes the files into the empty ``staging``, under the key's lock
  (``described``: the description the key came from). Raises :class:`CompileError` with the compiler's output.
- ``check(spec, staging)``: loads what ``build`` wrote, without a device, so nothing unloadable is published.
  Raises :class:`LoadError`.
- ``load(spec, entry)``: returns a :class:`LoadedKernel`, never None. Raises :class:`LoadError` when the
  artifact cannot be loaded or holds another spec.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Protocol

from jitwarm.cache.errors import JitwarmError
from jitwarm.kernels import kinds
from jitwarm.kernels.spec import KernelSpec

#: Every backend name, from the registry (:data:`jitwarm.kernels.kinds.KINDS`) as this process started.
BACKEND_NAMES: tuple[str, ...] = kinds.names()
#: The backends a plan's ``--backend`` may name: those that build a spec from nothing but its params.
BUILDABLE: tuple[str, ...] = tuple(k.name for k in kinds.KINDS if "build" in k.abilities)

_process = {"build_only": False}


def set_build_only() -> None:
    """Say that this process only builds and checks (a build worker): backends may import their runtimes leaner."""
    _process["build_only"] = True


def build_only() -> bool:
    """Whether :func:`set_build_only` was called in this process."""
    return _process["build_only"]


def abilities(name: str) -> frozenset[str]:
    """What the backend ``name`` can do (``build``, ``replay``, ``capture``); empty for an unknown name."""
    try:
        return kinds.kind(name).abilities
    except KeyError:
        return frozenset()


def refusal(name: str, ability: str, flag: str = "kernel backend") -> str | None:
    """Why the backend ``name`` cannot ``ability`` (one line for a usage error, naming ``flag``), or None.

    Examples
    --------
    >>> refusal("sglang_jit", "build", "--backend").split(":")[0]
    "--backend 'sglang_jit' cannot build"

    """
    able = ", ".join(n for n in kinds.names() if ability in abilities(n))
    if name not in kinds.names():
        return f"unknown {flag} {name!r}; choose from {able}"
    if ability in abilities(name):
        return None
    can = " and ".join(sorted(abilities(name)))
    how = " (jitwarm warm --manifest replays its records)" if "replay" in abilities(name) else ""
    return f"{flag} {name!r} cannot {ability}: it can only {can}{how}; choose from {able}"


# Each derives from jitwarm's one error root (exit 1: the spec failed) and from the builtin it always was.
class SpecError(JitwarmError, ValueError):
    """The backend cannot build this spec (unknown family, wrong params, unsupported target or dtype)."""


class ToolchainError(JitwarmError, RuntimeError):
    """A compiler the spec needs is missing or broken; the message says which and where it was looked for."""


class CompileError(JitwarmError, RuntimeError):
    """The compiler failed. ``str()`` starts with a one-line summary; ``output`` is the compiler's whole text."""

    def __init__(self, summary: str, output: str = "") -> None:
        self.summary = summary
        self.output = output
        super().__init__(f"{summary}\n{output}" if output else summary)


class LoadError(JitwarmError, RuntimeError):
    """A built artifact cannot be loaded into this process, or holds another spec than the one asked for."""


def version_lines(exe: str, name: str | None = None, timeout_s: float = 60.0) -> list[str]:
    """The non-empty lines ``exe --version`` prints, stripped; ToolchainError if it fails or prints nothing."""
    try:
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"{name or exe} --version cannot run: {exc}") from None
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise ToolchainError(f"{name or exe} --version failed: {proc.stderr.strip()[:500]}")
    return lines


class Facts(Protocol):
    """Where a backend keeps toolchain facts between processes (a KernelCache), each named by what it came from."""

    def read_fact(self, name: str) -> str | None:
        """The fact ``name``, or None."""

    def write_fact(self, name: str, value: str) -> None:
        """Keep ``value`` as the fact ``name`` (best effort)."""


class LoadedKernel(Protocol):
    """One spec's kernel loaded into this process."""

    spec: KernelSpec

    def preload(self) -> int:
        """Put the module on the current CUDA device (never inside capture); return its kernels, 0 for cpu."""

    def run(self, *args: Any) -> None:
        """Launch with the family's ``run_args`` on the tensors' device and current stream."""


class Backend(Protocol):
    """What a backend module provides (see the module docstring for the failure rules)."""

    name: str

    def description(self, spec: KernelSpec, facts: Facts | None = None) -> dict[str, Any]:
        """The cache description of ``spec`` (``facts`` may spare it re-running a toolchain probe)."""

    def build(self, spec: KernelSpec, staging: Path, described: dict[str, Any] | None = None) -> None:
        """Write ``spec``'s artifact files into ``staging``."""

    def check(self, spec: KernelSpec, staging: Path) -> None:
        """Load what :meth:`build` wrote, without a device."""

    def load(self, spec: KernelSpec, entry: Any) -> LoadedKernel:
        """Load a published entry of ``spec``."""


def backend(name: str) -> Backend:
    """Return the backend called ``name``; SpecError when it is no kind of :data:`jitwarm.kernels.kinds.KINDS`."""
    for k in kinds.KINDS:
        if k.name == name:
            return k.backend()
    raise SpecError(f"unknown kernel backend {name!r}; known: {', '.join(kinds.names())}")
