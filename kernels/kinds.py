"""The kinds jitwarm knows, one :class:`Kind` each, registered once in :data:`KINDS`.

A kind is a kernel family's backend (jitwarm's ``tvm_ffi`` and ``triton``), a server's kernels that jitwarm
replays (``triton_jit``, ``sglang_jit``), or a JIT library's cache that a run fills and jitwarm captures and
restores (``inductor_cache``, ``deep_gemm_cache``, ...). Everything jitwarm does with one goes through its kind:
describe and key, build, replay or capture, check, load or restore, resolve its cache in an environment,
fingerprint, turn a manifest record into a spec and back, count for the ledger, seal inside capture. Every list
of kinds or families elsewhere (the backends a plan may name, the JIT cache families, the ledger's lines, the
seals, the variables a capture makes private, the compiler spawners) is derived from :data:`KINDS`.

Adding a library is its module plus one line in :data:`KINDS`. The declaration is data only: registering
imports nothing, so ``jitwarm plan`` stays light; each method imports the kind's module on first use.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

_LIBRARIES = "jitwarm.kernels.libraries"


@dataclass(frozen=True)
class Kind:
    """One kind: its declared facts and the contract of its methods (as vLLM's ``CompilerInterface``).

    The declared facts: ``name`` (a spec's ``backend``), ``family`` (its ledger line and a ``jit_cache``
    record's ``library``), ``abilities`` (``build`` a spec from its params, ``replay`` a record, ``capture``
    from a run), ``module`` (the backend: ``description``, ``build``, ``check``, ``load``, and a JIT cache's
    ``LIBRARY``), ``record`` (the manifest record kind that names it, ``records`` the module that converts one),
    ``variable`` (the library's own variable for its cache's place), ``spawners`` (the packages whose frames
    start its compilers), ``seals`` (the module whose ``seal(refuse)`` seals it, and ``sealed``, what it says),
    ``tap`` (its records module taps the library to record a run's compiles).

    Failure semantics: :meth:`description` raises ``SpecError`` or ``ToolchainError``; :meth:`build` raises
    ``CompileError``; :meth:`check` and :meth:`load` raise ``LoadError`` (``load`` never returns None). Every
    other method returns None where the kind has no such thing (no cache, no record, no signal, no seal, not in
    this process) and never raises for that; :meth:`spec_of` expects a record :meth:`record_problem` passed.
    ``build`` runs under the key's lock; ``load`` under the entry's claim.
    """

    name: str
    module: str
    abilities: frozenset[str]
    family: str = ""
    record: str | None = None
    records: str | None = None
    variable: str | None = None
    spawners: tuple[str, ...] = ()
    seals: str | None = None
    sealed: str | None = None
    is_cache: bool = False
    #: Counted in the ledger (a JIT cache's new units, or a server room's watcher of the family).
    counted: bool = False
    #: Its :attr:`records` module holds the ``TAP`` and ``recording(add)`` that record the kind's compiles in a run.
    tap: bool = False

    # -- the backend: describe, key, build, check, load -------------------------------------------------------

    def backend(self) -> Any:
        """The kind's backend module (:class:`~jitwarm.kernels.backend.Backend`), imported on first use."""
        return _module(self.module)

    def description(self, spec: Any, facts: Any = None) -> dict[str, Any]:
        """The cache description of ``spec`` (its key is the description's hash); SpecError, ToolchainError."""
        return self.backend().description(spec, facts)

    def build(self, spec: Any, staging: Path, described: dict[str, Any] | None = None) -> None:
        """Write ``spec``'s files into ``staging`` under the key's lock; CompileError (a kind that cannot build)."""
        self.backend().build(spec, staging, described)

    def check(self, spec: Any, staging: Path) -> None:
        """Load what was built or captured, without a device; LoadError."""
        self.backend().check(spec, staging)

    def load(self, spec: Any, entry: Any) -> Any:
        """Load a published entry into this process, or restore a unit where its library looks; LoadError."""
        return self.backend().load(spec, entry)

    # -- a JIT library's cache: resolve, fingerprint, count ---------------------------------------------------

    def library(self) -> Any:
        """The JIT cache's ``Library`` (``jit_caches/units.py``), or None for a kind that keeps no cache."""
        return self.backend().LIBRARY if self.is_cache else None

    def resolve(self, environ: Mapping[str, str] | None = None, dirs: Mapping[str, Path | None] | None = None
                ) -> Path | None:
        """Where the cache is in ``environ`` (a server's ``dirs`` first); None: no cache, or turned off there."""
        library = self.library()
        return None if library is None else library.root(environ, dirs)

    def mismatch(self, spec: Any, target: str | None = None) -> tuple[str, str, str] | None:
        """The first fingerprint item of a captured unit that differs on this node, or None (none, or no unit)."""
        if not self.is_cache:
            return None
        return _module(self.records).mismatch(self.library(), spec, target)

    def signal(self) -> Any:
        """The library's own hit signal for the ledger (a ``Signal``), or None: its new units count."""
        library = self.library()
        return None if library is None or library.signal is None else library.signal()

    # -- records: a run's compile as a manifest line, and back --------------------------------------------------

    def record_problem(self, record: Mapping[str, Any]) -> str | None:
        """Why ``record`` (of :attr:`record`'s kind) is not one of this kind's, or None when it is."""
        return _module(self.records).record_problem(self, record) if self.records else "no record names it"

    def spec_of(self, record: Mapping[str, Any]) -> Any:
        """The KernelSpec that replays or restores a record :meth:`record_problem` passed."""
        return _module(self.records).spec_of(self, record)

    def record_of(self, spec: Any) -> dict[str, Any] | None:
        """The manifest record body of ``spec`` (no ``v``), or None for a kind no record names."""
        return _module(self.records).record_of(self, spec) if self.records else None

    # -- the capture seal ----------------------------------------------------------------------------------------

    def seal(self, refuse: Callable[..., None]) -> tuple[str, Callable[[], None]] | None:
        """Hand each compile or load of the kind to ``refuse(what, key)``: ``(name, undo)``, or None when unsealable."""
        return _module(self.seals).seal(refuse) if self.seals else None


def _module(name: str) -> ModuleType:
    # sys.modules first (import_module costs microseconds per spec on the hook's path), but not a module another
    # thread is still importing: a build pool's threads got one without its functions.
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        module = importlib.import_module(name)
    return module


def cache(family: str, *, kind: str = "", module: str = "", where: str = "", variable: str | None = None,
          spawners: tuple[str, ...] = (), seals: bool = False, sealed: str | None = None) -> Kind:
    """A JIT library's cache kind: captured from a run, restored where the library looks, counted in the ledger.

    ``kind`` defaults to ``<family>_cache``; its module is ``jit_caches/<module or family>.py``, or ``where`` (a
    module's full name) for a library room kept elsewhere.
    """
    where = where or f"{_LIBRARIES}.jit_caches.{module or family}"
    return Kind(kind or f"{family}_cache", where, frozenset({"capture"}), family=family, record="jit_cache",
                records=f"{_LIBRARIES}.jit_caches.backend", variable=variable, spawners=spawners,
                seals=where if seals else None, sealed=sealed, is_cache=True, counted=True)


#: Every kind, registered once; the order is the order of ``--backend`` choices, captures and ledger lines.
KINDS: tuple[Kind, ...] = (
    Kind("tvm_ffi", "jitwarm.kernels.tvm_backend", frozenset({"build"}), family="tvm_ffi",
         seals="jitwarm.kernels.tvm_backend", sealed="tvm-ffi build and load"),
    Kind("triton", "jitwarm.kernels.triton_backend", frozenset({"build"}), family="triton"),
    Kind("triton_jit", f"{_LIBRARIES}.triton.backend", frozenset({"replay", "capture"}), family="triton_jit",
         record="triton", records=f"{_LIBRARIES}.triton.tap", tap=True, seals=f"{_LIBRARIES}.triton.tap",
         sealed="Triton compile"),
    cache("inductor", variable="TORCHINDUCTOR_CACHE_DIR", spawners=("torch._inductor.",), seals=True,
          sealed="Inductor compile"),
    cache("triton", module="triton_dir", variable="TRITON_CACHE_DIR", spawners=("triton.",)),
    Kind("sglang_jit", f"{_LIBRARIES}.sglang_jit.backend", frozenset({"replay"}), family="load_jit",
         record="sglang_jit", records=f"{_LIBRARIES}.sglang_jit.records", counted=True,
         spawners=("sglang.kernels.jit.", "tvm_ffi.", "sglang.jit_kernel.")),
    cache("vllm_compile", spawners=("vllm.compilation.",)),
    cache("vllm_modelinfo"),
    cache("tilelang", variable="TILELANG_CACHE_DIR", spawners=("tilelang.",)),
    cache("deep_gemm", variable="DG_JIT_CACHE_DIR", spawners=("deep_gemm.",)),
    cache("cute_dsl", spawners=("cutlass.",)),
    cache("flashinfer", variable="FLASHINFER_WORKSPACE_BASE", spawners=("flashinfer.",)),
    cache("ptx", kind="cuda_ptx_cache", variable="CUDA_CACHE_PATH"),
)


def kind(name: str) -> Kind:
    """The kind called ``name`` (a spec's backend), else the JIT cache kind of the family ``name``; KeyError.

    A name is looked up first: ``triton`` is jitwarm's Triton backend, its cache family's kind is ``triton_cache``.
    """
    for k in KINDS:
        if k.name == name:
            return k
    for k in KINDS:
        if k.is_cache and k.family == name:
            return k
    raise KeyError(f"no kind {name!r}; known: {', '.join(k.name for k in KINDS)}")


def named(family: str) -> tuple[str, str]:
    """``(family, kind name)`` of the JIT cache family ``family``: how its ``Library`` is named."""
    found = next((k for k in KINDS if k.is_cache and k.family == family), None)
    if found is None:
        raise KeyError(f"no JIT cache family {family!r}")
    return found.family, found.name


def names() -> tuple[str, ...]:
    """Every kind's name (a spec's backend), in registry order."""
    return tuple(k.name for k in KINDS)


def caches() -> tuple[Kind, ...]:
    """The JIT cache kinds, in registry order."""
    return tuple(k for k in KINDS if k.is_cache)


def record_kinds() -> tuple[str, ...]:
    """Every manifest record kind a kind is named by, in registry order."""
    return tuple(dict.fromkeys(k.record for k in KINDS if k.record))


def recorded_as(record_kind: str) -> tuple[Kind, ...]:
    """The kinds a manifest record of ``record_kind`` (``triton``, ``sglang_jit``, ``jit_cache``) may name."""
    return tuple(k for k in KINDS if k.record == record_kind)


def ledger_families() -> tuple[str, ...]:
    """The families a ledger reports, one line each, in registry order."""
    return tuple(k.family for k in KINDS if k.counted)


def seals() -> tuple[Kind, ...]:
    """The kinds that seal their library inside capture."""
    return tuple(k for k in KINDS if k.seals)


def spawners() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(family, packages)`` for each kind whose frames start compilers (the ledger's compiler witness)."""
    return tuple((k.family, k.spawners) for k in KINDS if k.spawners)


def cache_variables() -> dict[str, str]:
    """JIT cache family -> the library's own variable for its cache's place (the ones that have one)."""
    return {k.family: k.variable for k in KINDS if k.is_cache and k.variable}
