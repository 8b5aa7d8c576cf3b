"""The start-up ledger: what a served start still compiled, per family, and what its caches served.

A restored cache proves nothing until the server is seen not compiling: a unit copied "successfully" is never
used when one flag or version differs (modelexpress #560; dynamo #10119, #10695). :func:`begin` takes the start
snapshot (a plugin calls it before the model loads); :func:`report_after_capture`, after the last graph is
captured, logs one line per family and writes them as JSON to ``JITWARM_LEDGER``. Each family is counted by its
library's own hit signal where it has one (Inductor's counters, jitwarm's Triton manager, the sglang room's
``load_jit`` watcher, vLLM's ``compilation_counter``), else by the units new in its cache directory
(docs/deployment.md, "Ledger", says which family has which). This module imports no library: it reads the
signals of those already imported.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("jitwarm.ledger")

VERSION = 1
#: The families a ledger reports, in order (the JIT cache families with ``load_jit`` after Triton).
FAMILIES = ("inductor", "triton", "load_jit", "vllm_compile", "vllm_modelinfo", "tilelang", "deep_gemm", "cute_dsl",
            "flashinfer", "ptx")
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
        return {f.family: f for f in self.families}[name]

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
        """Write :meth:`as_json` to ``path`` whole (a temporary file beside it, renamed); OSError if it cannot.

        Only a regular file is replaced: a device, a FIFO or a link there is refused (OSError) and left as it is
        (the rename would have replaced ``/dev/null`` itself, as root: issue #31, N6).
        """
        import errno
        import stat

        from jitwarm.cache.files import write_atomic

        target = Path(path)
        try:
            mode = target.lstat().st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            what = "a link" if stat.S_ISLNK(mode) else "not a regular file"
            raise OSError(errno.EEXIST, f"{what}: left as it is", str(target))
        text = json.dumps(self.as_json(), indent=1, sort_keys=True) + "\n"
        write_atomic(target, text.encode(), durable=False)


class Watcher(Protocol):
    """A family's signal installed by a server's room (sglang's loader: ``servers/sglang/loader_calls.py``)."""

    def count(self) -> FamilyCount:
        """The family's count since the watcher was installed."""

    def remove(self) -> None:
        """Undo what installing it did."""


class Ledger:
    """The start snapshot of one process; :meth:`report` counts what happened since.

    Taking it lists every JIT cache family's complete units and notes the Inductor counters, the Triton
    manager's compiles and vLLM's loads so far; ``watchers`` (a server room's) count their own families.
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
        from jitwarm.kernels.libraries.jit_caches.triton_dir import served_by_jitwarm

        after = snapshot(self._before)
        new = added(self._before, after)
        counts = []
        for name in FAMILIES:
            units = new.get(name, {})
            if name == "inductor":  # Inductor writes into vLLM's tree too (its units there are named in it)
                counts.append(self._inductor_count(after[name].root, {**units, **new.get("vllm_compile", {})}))
            elif name == "triton" and (served_by_jitwarm() or _triton_served()):
                counts.append(self._triton_count())
            elif name == "vllm_compile":
                counts.append(self._vllm_count(after[name].root, units))
            elif name in self.watchers:
                counts.append(self.watchers[name].count())
            elif name == "load_jit":
                counts.append(FamilyCount(name, "sglang's loader: not watched in this process", None, 0))
            else:
                counts.append(FamilyCount(name, _NO_SIGNAL, None, len(units), tuple(sorted(units)),
                                          *self._present(name, after[name].root)))
        return LedgerReport(tuple(counts))

    def close(self) -> None:
        """Remove what the watchers installed."""
        for watcher in self.watchers.values():
            watcher.remove()

    def _present(self, name: str, root: Path | None) -> tuple[int | None, str | None]:
        """The family's units at start and its cache directory (both None where it has none here)."""
        return (len(self._before[name].units), str(root)) if root else (None, None)

    def _inductor_count(self, root: Path | None, new: Mapping[str, Any]) -> FamilyCount:
        from jitwarm.kernels.libraries.jit_caches.inductor import graph_keys

        now = _inductor_counters()
        hits, misses = (now.get(k, 0) - self._inductor.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss"))
        return FamilyCount("inductor", "Inductor's fxgraph_cache_hit/miss counters", hits, misses,
                           tuple(f"fxgraph {k}" for k in graph_keys(new)), len(self._before["inductor"].units),
                           str(root) if root else None)

    def _vllm_count(self, root: Path | None, new: Mapping[str, Any]) -> FamilyCount:
        from jitwarm.kernels.libraries.jit_caches.vllm_compile import LIBRARY, why_missed

        # The tree's Inductor and Triton units are those libraries' compiles (Inductor's counters count them).
        new = {unit: files for unit, files in new.items() if LIBRARY.part(unit) is LIBRARY}
        present = [unit for unit in self._before["vllm_compile"].units if LIBRARY.part(unit) is LIBRARY]
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


def _shown(keys: tuple[str, ...]) -> str:
    """The first keys, and how many more."""
    return ", ".join(keys[:_SHOWN_KEYS]) + (f" and {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else "")


def _inductor_counters() -> dict[str, int]:
    """``counters["inductor"]`` when torch._dynamo is imported here (else nothing has compiled through it)."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    return dict(counters["inductor"]) if counters is not None else {}


def _triton_served() -> list[tuple[str, str]]:
    """What jitwarm's Triton cache manager did in this process, if it is imported."""
    manager = sys.modules.get("jitwarm.kernels.libraries.triton.cache")
    return manager.served() if manager is not None else []


def _vllm_loads() -> int | None:
    """The AOT artifacts and compiled graphs vLLM loaded from its cache so far (None: vLLM's counter not imported)."""
    counter = getattr(sys.modules.get("vllm.compilation.counter"), "compilation_counter", None)
    loads = ("num_aot_artifacts_loaded", "num_compiled_artifacts_loaded")
    return None if counter is None else sum(int(getattr(counter, name, 0)) for name in loads)


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
