"""The start-up ledger: what a served start still compiled, per family, and what its caches served.

A restored cache proves nothing until the server is seen not compiling (modelexpress #560; dynamo #10119).
Each family is counted by its library's own signal where it has one, else by its new units (docs/deployment.md).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jitwarm.cache import settings
from jitwarm.cache.files import write_atomic
from jitwarm.kernels.libraries.jit_caches.census import added, snapshot
from jitwarm.kernels.libraries.jit_caches.units import NO_SIGNAL, FamilyCount
from jitwarm.precompile import servers

log = logging.getLogger("jitwarm.ledger")

VERSION = 1
#: The families a ledger reports, in order (the JIT cache families with ``load_jit`` after Triton).
FAMILIES = ("inductor", "triton", "load_jit", "vllm_compile", "vllm_modelinfo", "tilelang", "deep_gemm", "cute_dsl",
            "flashinfer", "ptx")


@dataclass(frozen=True)
class LedgerReport:
    """Every family's count, in :data:`FAMILIES` order."""

    families: tuple[FamilyCount, ...]
    #: Families the restore placed where this server does not find them (``receipt.Elsewhere``), and their lines.
    elsewhere: tuple[Any, ...] = ()
    elsewhere_lines: tuple[str, ...] = ()

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
        """One line per family that compiled although units of it were present at start."""
        return [w for f in self.families if (w := f.after_restore())] + list(self.elsewhere_lines)

    def as_json(self) -> dict[str, Any]:
        """``{"v", "pid", "compiled", "families": {name: ...}, "compiled_after_restore": [...]}``."""
        return {"v": VERSION, "pid": os.getpid(), "compiled": self.compiled,
                "families": {f.family: f.as_json() for f in self.families},
                "compiled_after_restore": [{"family": f.family, "keys": list(f.keys), "present_at_start": f.present}
                                           for f in self.families if f.after_restore()],
                "restored_elsewhere": [gone.as_json() for gone in self.elsewhere]}

    def write(self, path: str | Path) -> None:
        """Write :meth:`as_json` whole; OSError if it cannot, or if what is there is no regular file (issue #31, N6)."""
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


class Ledger:
    """The start snapshot of one process; :meth:`report` counts since (``watchers``: a room's, by family)."""

    def __init__(self, watchers: Mapping[str, Any] | None = None) -> None:
        self._dirs = servers.cache_dirs(servers.running())  # where the server this runs in keeps each cache
        self._before = snapshot(dirs=self._dirs)
        self._signals = {name: taken.library.signal() for name, taken in self._before.items() if taken.library.signal}
        self.watchers: dict[str, Any] = dict(watchers or {})
        self.elsewhere: tuple[tuple[Any, ...], tuple[str, ...]] = ((), ())

    def note_elsewhere(self, found: Any, lines: Any) -> None:
        """Report the restore receipt's check (``receipt.Elsewhere`` and their lines) with the counts."""
        self.elsewhere = (tuple(found), tuple(lines))

    def watch(self, watchers: Mapping[str, Any]) -> None:
        """Count the families of ``watchers`` by them (a server's room hands over the signal it installed)."""
        for name, watcher in watchers.items():
            self.watchers.setdefault(name, watcher)

    def report(self) -> LedgerReport:
        """Each family's count since the snapshot (its signal, a watcher, or its new units); never raises OSError."""
        after = snapshot(self._before, dirs=self._dirs)
        new = added(self._before, after)
        counts = []
        for name in FAMILIES:
            signal = self._signals.get(name)
            count = signal.count(self._before, after, new) if signal is not None else None
            if count is None and name in self.watchers:
                count = self.watchers[name].count()
            if count is None and name in after:
                units, root = new.get(name, {}), after[name].root
                present = (len(self._before[name].units), str(root)) if root else (None, None)
                count = FamilyCount(name, NO_SIGNAL, None, len(units), tuple(sorted(units)), *present)
            counts.append(count or FamilyCount(name, "no signal: not watched in this process", None, 0))
        return LedgerReport(tuple(counts), *self.elsewhere)

    def close(self) -> None:
        """Remove what the watchers installed."""
        for watcher in self.watchers.values():
            watcher.remove()


_process: Ledger | None = None
_process_lock = threading.Lock()


def begin(watchers: Mapping[str, Any] | None = None) -> Ledger:
    """The process's ledger, its snapshot taken now if not yet (later calls return it, adding ``watchers``)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = Ledger(watchers)
        elif watchers:
            _process.watch(watchers)
        return _process


def report_after_capture(ledger: Ledger | None = None) -> LedgerReport:
    """Log the ledger's lines and write ``JITWARM_LEDGER`` when set (else a warning): after the last capture."""
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
