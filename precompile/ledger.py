"""The start-up ledger: what a served start still compiled, per family, and what its caches served.

A restored cache proves nothing until the server is seen not compiling: a unit copied "successfully" is never
used when one flag or version differs (modelexpress #560; dynamo #10119, #10695). :func:`begin` takes the
start snapshot (the plugin calls it when sglang loads it, before the model); :func:`report_after_capture`,
called once the last graph is captured, logs one line per family and writes them as JSON to
``JITWARM_LEDGER`` when it is set. Each family is counted by its library's own signal where it has one:

==============  ======================================================================================
family          signal
==============  ======================================================================================
``inductor``    ``torch._dynamo.utils.counters["inductor"]``: ``fxgraph_cache_hit`` / ``fxgraph_cache_miss``;
                the keys compiled are the FX graph directories new in its cache
``triton``      jitwarm's Triton cache manager (:func:`jitwarm.kernels.libraries.triton.cache.served`) while
                it serves Triton; otherwise the key directories new in Triton's own cache
``load_jit``    sglang's loader, watched by the sglang room (:mod:`jitwarm.precompile.servers.sglang.
                loader_calls`, a :class:`Watcher` the plugin hands to :func:`begin`): found (served) or
                compiled, per build directory
``vllm_compile`` vLLM's ``compilation_counter`` (AOT artifacts and compiled graphs loaded: served); the units
                new in its compile tree (compiled), each with the cache key factor that differs from the units
                there at start (:func:`~jitwarm.kernels.libraries.jit_caches.vllm_compile.why_missed`)
the others      TileLang, DeepGEMM, CuTe DSL, FlashInfer, the driver's PTX cache: no hit signal; what
                compiled is the units new in the family's cache directory (:mod:`~jitwarm.kernels.libraries.
                jit_caches.census`), served is unknown, and the units present at start are counted
==============  ======================================================================================

A family that compiled although units of it were present at start (restored, usually) gets a warning naming
each compiled key: the restored units were keyed differently (docs/deployment.md, "The fingerprint rule").
This module imports no library: it reads the signals of those already imported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("jitwarm.ledger")

VERSION = 1
#: The families a ledger reports, in order (the JIT cache families with ``load_jit`` after Triton).
FAMILIES = ("inductor", "triton", "load_jit", "vllm_compile", "tilelang", "deep_gemm", "cute_dsl", "flashinfer",
            "ptx")
_TRITON_MANAGER = "jitwarm.kernels.libraries.triton.cache"
_VLLM_COUNTER = "vllm.compilation.counter"
_VLLM_LOADS = ("num_aot_artifacts_loaded", "num_compiled_artifacts_loaded")
_NO_SIGNAL = "new units in its cache directory"
_SHOWN_KEYS = 3


@dataclass(frozen=True)
class FamilyCount:
    """One family's line: ``served`` from its cache (None: the library gives no hit signal), ``compiled`` now.

    ``keys`` are the library's keys of what compiled; ``present`` the complete units in its cache directory
    ``root`` at start (None where the family has no such directory here).
    """

    family: str
    signal: str
    served: int | None
    compiled: int
    keys: tuple[str, ...] = ()
    present: int | None = None
    root: str | None = None

    def line(self) -> str:
        """``jitwarm: ledger: <family>: served from cache N, compiled now M (<how it was counted>)[: <keys>]``."""
        if self.served is None:
            counts = f"compiled now {self.compiled}, served from cache unknown"
            how = (f"no hit signal: counted from the new units in {self.root}" if self.root
                   else "no hit signal, and no cache directory here")
        else:
            counts = f"served from cache {self.served}, compiled now {self.compiled}"
            how = self.signal + (f"; cache {self.root}" if self.root else "")
        if self.present is not None:
            how += f", {self.present} unit(s) there at start"
        return f"jitwarm: ledger: {self.family}: {counts} ({how})" + (f": {_shown(self.keys)}" if self.keys else "")

    def after_restore(self) -> str | None:
        """The warning for a compile although units of the family were present at start, else None."""
        if not self.compiled or not self.present:
            return None
        keys = _shown(self.keys) if self.keys else "(keys not known: no new unit was written)"
        return (f"jitwarm: ledger: {self.family} compiled {self.compiled} although {self.present} unit(s) of "
                f"{self.family} were present at start in {self.root}: {keys}; none of them has that key (a flag, "
                "a version or a shape differs: record in the server's image, docs/deployment.md)")

    def as_json(self) -> dict[str, Any]:
        """The family's JSON object."""
        return {"signal": self.signal, "served": self.served, "compiled": self.compiled, "keys": list(self.keys),
                "present_at_start": self.present, "root": self.root}


@dataclass(frozen=True)
class LedgerReport:
    """Every family's count, in :data:`FAMILIES` order."""

    families: tuple[FamilyCount, ...]

    @property
    def compiled(self) -> int:
        """How many compiles the start still made, all families together."""
        return sum(f.compiled for f in self.families)

    def family(self, name: str) -> FamilyCount:
        """The count of family ``name`` (KeyError when it is not one of :data:`FAMILIES`)."""
        for count in self.families:
            if count.family == name:
                return count
        raise KeyError(name)

    def lines(self) -> list[str]:
        """One line per family, then :meth:`warnings`."""
        return [f.line() for f in self.families] + self.warnings()

    def warnings(self) -> list[str]:
        """One line per family that compiled although units of it were present at start, naming the keys."""
        return [w for f in self.families if (w := f.after_restore())]

    def as_json(self) -> dict[str, Any]:
        """``{"v", "pid", "compiled", "families": {name: ...}, "compiled_after_restore": [...]}``."""
        return {"v": VERSION, "pid": os.getpid(), "compiled": self.compiled,
                "families": {f.family: f.as_json() for f in self.families},
                "compiled_after_restore": [{"family": f.family, "keys": list(f.keys), "present_at_start": f.present}
                                           for f in self.families if f.after_restore()]}

    def write(self, path: str | Path) -> None:
        """Write :meth:`as_json` to ``path`` whole (a temporary file beside it, renamed); OSError if it cannot."""
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(21, "is a directory", str(path))
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(self.as_json(), out, indent=1, sort_keys=True)
                out.write("\n")
            tmp.replace(path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise


class Watcher(Protocol):
    """A family's signal installed by a server's room (sglang's loader: ``servers/sglang/loader_calls.py``)."""

    def count(self) -> FamilyCount:
        """The family's count since the watcher was installed."""

    def remove(self) -> None:
        """Undo what installing it did."""


class Ledger:
    """The start snapshot of one process; :meth:`report` counts what happened since.

    Taking it lists every JIT cache family's complete units and notes the Inductor counters and the Triton
    manager's compiles so far; ``watchers`` (a server room's, :class:`Watcher`) count their own families.
    """

    def __init__(self, watchers: Mapping[str, Watcher] | None = None) -> None:
        from jitwarm.kernels.libraries.jit_caches.census import snapshot

        self._before = snapshot()
        self._inductor = _inductor_counters()
        self._triton = len(_triton_served())
        self._vllm_loads = _vllm_loads()
        self.watchers: dict[str, Watcher] = dict(watchers or {})

    def watch(self, watchers: Mapping[str, Watcher]) -> None:
        """Count the families of ``watchers`` by them (a server's room hands over the signal it installed)."""
        for name, watcher in watchers.items():
            self.watchers.setdefault(name, watcher)

    def report(self) -> LedgerReport:
        """Each family's count since the snapshot (never raises OSError: a vanished directory counts empty)."""
        from jitwarm.kernels.libraries.jit_caches.census import added, snapshot

        after = snapshot(self._before)
        new = added(self._before, after)
        counts = []
        for name in FAMILIES:
            if name == "inductor":
                counts.append(self._inductor_count(after, new.get(name, {})))
            elif name == "triton" and _triton_served_by_jitwarm():
                counts.append(self._triton_count())
            elif name == "vllm_compile":
                counts.append(self._vllm_count(after[name].root, new.get(name, {})))
            elif name in self.watchers:
                counts.append(self.watchers[name].count())
            elif name == "load_jit":
                counts.append(FamilyCount(name, "sglang's loader: not watched in this process", None, 0))
            else:
                counts.append(_dir_count(name, after[name].root, self._before[name].units, new.get(name, {})))
        return LedgerReport(tuple(counts))

    def close(self) -> None:
        """Remove what the watchers installed."""
        for watcher in self.watchers.values():
            watcher.remove()

    def _inductor_count(self, after: Mapping[str, Any], new: Mapping[str, Any]) -> FamilyCount:
        now = _inductor_counters()
        hits = now.get("fxgraph_cache_hit", 0) - self._inductor.get("fxgraph_cache_hit", 0)
        misses = now.get("fxgraph_cache_miss", 0) - self._inductor.get("fxgraph_cache_miss", 0)
        from jitwarm.kernels.libraries.jit_caches.inductor import graph_keys

        keys = graph_keys(new)
        root = after["inductor"].root
        return FamilyCount("inductor", "Inductor's fxgraph_cache_hit/miss counters", hits, misses,
                           tuple(f"fxgraph {k}" for k in keys), len(self._before["inductor"].units),
                           str(root) if root else None)

    def _vllm_count(self, root: Path | None, new: Mapping[str, Any]) -> FamilyCount:
        from jitwarm.kernels.libraries.jit_caches.vllm_compile import why_missed

        present = self._before["vllm_compile"].units
        keys = []
        for unit in sorted(new):
            why = why_missed(root, unit, present) if root is not None and present else None
            keys.append(f"{unit} ({why})" if why else unit)
        loads = _vllm_loads()
        served = None if loads is None else loads - (self._vllm_loads or 0)
        signal = ("vLLM's compilation_counter (artifacts loaded); compiled: new units in its tree" if loads is not None
                  else _NO_SIGNAL)
        return FamilyCount("vllm_compile", signal, served, len(new), tuple(keys), len(present) if root else None,
                           str(root) if root else None)

    def _triton_count(self) -> FamilyCount:
        done = _triton_served()[self._triton:]
        compiled = sorted(kernel for kernel, outcome in done if outcome == "compiled")
        return FamilyCount("triton", "jitwarm's Triton cache manager", sum(o == "served" for _, o in done),
                           len(compiled), tuple(compiled))


def _dir_count(name: str, root: Path | None, before: Mapping[str, Any], new: Mapping[str, Any]) -> FamilyCount:
    return FamilyCount(name, _NO_SIGNAL, None, len(new), tuple(sorted(new)), len(before) if root else None,
                       str(root) if root else None)


def _shown(keys: tuple[str, ...]) -> str:
    return ", ".join(keys[:_SHOWN_KEYS]) + (f" and {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else "")


def _inductor_counters() -> dict[str, int]:
    """``counters["inductor"]`` when torch._dynamo is imported here (else nothing has compiled through it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return dict(counters["inductor"]) if counters is not None else {}


def _triton_served() -> list[tuple[str, str]]:
    manager = sys.modules.get(_TRITON_MANAGER)
    return manager.served() if manager is not None else []


def _triton_served_by_jitwarm() -> bool:
    """Whether Triton's compiles go through jitwarm's manager here (then its directory holds none of them)."""
    from jitwarm.kernels.libraries.jit_caches.triton_dir import served_by_jitwarm

    return served_by_jitwarm() or bool(_triton_served())


def _vllm_loads() -> int | None:
    """The AOT artifacts and compiled graphs vLLM loaded from its cache so far (None: vLLM's counter not imported)."""
    counter = getattr(sys.modules.get(_VLLM_COUNTER), "compilation_counter", None)
    return None if counter is None else sum(int(getattr(counter, name, 0)) for name in _VLLM_LOADS)


_process: Ledger | None = None
_process_lock = threading.Lock()


def begin(watchers: Mapping[str, Watcher] | None = None) -> Ledger:
    """The process's ledger, its snapshot taken now if not yet (once: later calls return it, adding ``watchers``)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = Ledger(watchers)
        elif watchers:
            _process.watch(watchers)
        return _process


def report_after_capture(ledger: Ledger | None = None) -> LedgerReport:
    """Log the ledger's lines and write them to ``JITWARM_LEDGER`` when set: the one call after the last capture.

    ``ledger`` defaults to this process's (:func:`begin`). A path that is a directory or cannot be written is
    one warning line: the server goes on. Returns the report.
    """
    from jitwarm.cache import settings

    report = (ledger or begin()).report()
    for count in report.families:
        log.info("%s", count.line())
    for line in report.warnings():
        log.warning("%s", line)
    path = settings.ledger()
    if path is not None:
        try:
            report.write(path)
        except OSError as exc:
            log.warning("jitwarm: ledger not written to %s=%s: %s", settings.ENV_VARS["ledger"], path,
                        exc.strerror or exc)
    return report
