"""The start-up ledger: what a served start still compiled, per family, and what its caches served.

A restored cache proves nothing until the server is seen not compiling (modelexpress #560; dynamo #10119).
Each family is counted by its library's own signal where it has one, else by its new units, and by two witnesses
that do not ask the library: the units written into its caches (its precompiled headers too) and the compiler
processes it started (:mod:`~jitwarm.kernels.libraries.jit_caches.compilers`). "compiled 0" means none of them saw
a compile. The ledger is written at the ready point and again when the process exits (docs/deployment.md, Ledger).
"""

from __future__ import annotations

import argparse
import atexit
import errno
import json
import logging
import os
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jitwarm.cache import settings
from jitwarm.cache.errors import EXIT_BUILD_FAILED, EXIT_OK, EXIT_USAGE
from jitwarm.cache.files import write_atomic
from jitwarm.kernels import kinds
from jitwarm.kernels.libraries.jit_caches import compilers
from jitwarm.kernels.libraries.jit_caches.census import added, beside, snapshot
from jitwarm.kernels.libraries.jit_caches.units import NO_SIGNAL, FamilyCount, shown
from jitwarm.precompile import servers

log = logging.getLogger("jitwarm.ledger")

VERSION = 1


@dataclass(frozen=True)
class LedgerReport:
    """Every family's count, in the registry's order (:func:`jitwarm.kernels.kinds.ledger_families`)."""

    families: tuple[FamilyCount, ...]
    #: Families the restore placed where this server does not find them (``receipt.Elsewhere``), and their lines.
    elsewhere: tuple[Any, ...] = ()
    elsewhere_lines: tuple[str, ...] = ()
    #: Compiler processes no family's frames started: ``(compiles, probes, outputs)``; the compiles count.
    unattributed: tuple[int, int, tuple[str, ...]] = (0, 0, ())

    @property
    def compiled(self) -> int:
        """How many compiles the start still made, all families together (unattributed compiler runs too)."""
        return sum(f.compiled for f in self.families) + self.unattributed[0]

    def family(self, name: str) -> FamilyCount:
        """The count of family ``name`` (KeyError when the report has no line of it)."""
        return {f.family: f for f in self.families}[name]

    def lines(self) -> list[str]:
        """One line per family, then :meth:`warnings`."""
        return [f.line() for f in self.families] + self.warnings()

    def warnings(self) -> list[str]:
        """One line per family that compiled although units of it were present at start; one for stray compilers.

        A stray compiler run is one no JIT family's frames started (it counts in :attr:`compiled`).
        """
        runs, probes, outputs = self.unattributed
        stray = [f"jitwarm: ledger: {runs} compiler run(s) no JIT family started ({probes} probe(s) not counted)"
                 + (f": {shown(outputs)}" if outputs else "")] if runs else []
        return [w for f in self.families if (w := f.after_restore())] + stray + list(self.elsewhere_lines)

    def as_json(self) -> dict[str, Any]:
        """``{"v", "pid", "compiled", "families": {name: ...}, "compiled_after_restore": [...]}``."""
        runs, probes, outputs = self.unattributed
        return {"v": VERSION, "pid": os.getpid(), "compiled": self.compiled,
                "uncached": sum(f.uncached for f in self.families),
                "families": {f.family: f.as_json() for f in self.families},
                "unattributed": {"compiler_runs": runs, "compiler_probes": probes, "compiler_outputs": list(outputs)},
                "compiled_after_restore": [{"family": f.family, "keys": list(f.keys), "present_at_start": f.present}
                                           for f in self.families if f.after_restore()],
                "restored_elsewhere": [gone.as_json() for gone in self.elsewhere]}

    def write(self, path: str | Path, **extra: Any) -> None:
        """Write :meth:`as_json` (and ``extra``) whole.

        OSError if it cannot, or if what is there is no regular file (a link is never written through).
        """
        target = Path(path)
        try:
            mode = target.lstat().st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            what = "a link" if stat.S_ISLNK(mode) else "not a regular file"
            raise OSError(errno.EEXIST, f"{what}: left as it is", str(target))
        text = json.dumps({**self.as_json(), **extra}, indent=1, sort_keys=True) + "\n"
        write_atomic(target, text.encode(), durable=False)


class Ledger:
    """The start snapshot of one process; :meth:`report` counts since (``watchers``: a room's, by family)."""

    def __init__(self, watchers: Mapping[str, Any] | None = None) -> None:
        self._dirs = servers.cache_dirs(servers.running())  # where the server this runs in keeps each cache
        self._tap = compilers.watching()
        self._runs = self._tap.counts()
        self._before = self._census()
        self._signals = {name: taken.library.signal() for name, taken in self._before.items() if taken.library.signal}
        self.watchers: dict[str, Any] = dict(watchers or {})
        self.elsewhere: tuple[tuple[Any, ...], tuple[str, ...]] = ((), ())

    def note_elsewhere(self, found: Any, lines: Any) -> None:
        """Report the restore receipt's check (``receipt.Elsewhere`` and their lines) with the counts."""
        self.elsewhere = (tuple(found), tuple(lines))

    def _census(self) -> dict[str, Any]:
        """Each library's units now, with those it keeps outside its root (Inductor's precompiled headers)."""
        taken = snapshot(dirs=self._dirs)
        for name, out in beside(dirs=self._dirs).items():
            if name in taken:
                now = taken[name]
                taken[name] = now._replace(units={**out.units, **now.units}, sizes={**out.sizes, **now.sizes})
        return taken

    def watch(self, watchers: Mapping[str, Any]) -> None:
        """Count the families of ``watchers`` by them (a server's room hands over the signal it installed)."""
        for name, watcher in watchers.items():
            self.watchers.setdefault(name, watcher)

    def report(self) -> LedgerReport:
        """Each family's count since the snapshot (its signal, a watcher, or its new units); never raises OSError.

        Each count is then witnessed by the units written and the compiler runs (:meth:`FamilyCount.witnessed`).
        """
        after = self._census()
        new = added(self._before, after)
        compiles, probes, outputs = self._since()
        written: dict[str, list[str]] = {}  # by the library whose rules a unit follows: vLLM's tree holds Inductor's
        rewritten: Counter[str] = Counter()  # those of them a start writes without compiling (Library.rewrites)
        for name, units in new.items():
            for unit, files in units.items():
                part = after[name].library.part(unit)
                written.setdefault(part.name, []).append(unit)
                rewritten[part.name] += part.rewrites(files)
        counts = []
        for name in kinds.ledger_families():
            signal = self._signals.get(name)
            count = signal.count(self._before, after, new) if signal is not None else None
            if count is None and name in self.watchers:
                count = self.watchers[name].count()
            if count is None and name in after:
                units, root = new.get(name, {}), after[name].root
                present = (len(self._before[name].units), str(root)) if root else (None, None)
                count = FamilyCount(name, NO_SIGNAL, None, len(units), tuple(sorted(units)), *present)
            count = count or FamilyCount(name, "no signal: not watched in this process", None, 0)
            mine = written.get(name, []) if name in after and after[name].root is not None else None
            counts.append(count.witnessed(mine, compiles[name], probes[name], outputs.get(name, ()), rewritten[name]))
        stray = compilers.UNATTRIBUTED
        found, lines = self.elsewhere
        return LedgerReport(tuple(counts), found, lines, (compiles[stray], probes[stray],
                                                          tuple(outputs.get(stray, ()))))

    def _since(self) -> tuple[Counter[str], Counter[str], dict[str, list[str]]]:
        """The compiler runs since the snapshot, by family."""
        (c0, p0, o0), (c1, p1, o1) = self._runs, self._tap.counts()
        return c1 - c0, p1 - p0, {k: v[len(o0.get(k, ())):] for k, v in o1.items()}

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
    """Log the ledger's lines and write ``JITWARM_LEDGER`` when set (else a warning): after the last capture.

    The process then writes the ledger again when it exits (:func:`stop_path`): what compiled after ready.
    """
    ledger = ledger or begin()
    report = ledger.report()
    for count in report.families:
        log.info("%s", count.line())
    for line in report.warnings():
        log.warning("%s", line)
    _write(report, settings_path(), "ready")
    _at_exit(ledger, report)
    return report


def settings_path() -> str | None:
    """``JITWARM_LEDGER``, None when unset or unusable (a warning)."""
    try:
        path = settings.ledger()
    except settings.SettingError as exc:
        log.warning("jitwarm: %s", exc)
        return None
    return None if path is None else str(path)


def stop_path(path: str | Path) -> Path:
    """Where the ledger written at exit goes: ``ledger.json`` -> ``ledger.stop.json`` beside it."""
    p = Path(path)
    return p.with_name(f"{p.stem}.stop{p.suffix}" if p.suffix else f"{p.name}.stop")


def _write(report: LedgerReport, path: str | Path | None, phase: str, **extra: Any) -> None:
    """Write ``report`` to ``path`` (nothing when None); a failure is one warning."""
    if path is None:
        return
    try:
        report.write(path, phase=phase, **extra)
    except OSError as exc:
        log.warning("jitwarm: ledger not written to %s=%s: %s", settings.ENV_VARS["ledger"], path,
                    exc.strerror or exc)


_exit_hook: list[Any] = []
_stop_writer: list[Any] = []


def _at_exit(ledger: Ledger, ready: LedgerReport) -> None:
    """Once per process: at exit, the ledger since start and what compiled after ``ready``, to :func:`stop_path`.

    A multiprocessing finalizer, not only ``atexit``: vLLM's engine core is a forked ``multiprocessing`` child,
    which leaves by ``os._exit`` after running its finalizers (multiprocessing/popen_fork.py) and never atexit's.
    """
    if _exit_hook:
        _exit_hook[0] = (ledger, ready, Ledger())  # a later ready point (a second capture) is the one that counts
        return
    import multiprocessing.util

    _exit_hook.append((ledger, ready, Ledger()))
    done = threading.Event()

    def write_at_exit() -> None:
        if done.is_set():
            return
        done.set()
        try:
            first, at_ready, since_ready = _exit_hook[0]
            path = settings_path()
            if path is None:
                return
            now, after = first.report(), since_ready.report()
            then = {f.family: f.compiled for f in at_ready.families}
            families = {f.family: max(f.compiled - then.get(f.family, 0), after.family(f.family).compiled)
                        for f in now.families}
            _write(now, stop_path(path), "stop", after_ready={"compiled": sum(families.values()) + max(
                0, now.unattributed[0] - at_ready.unattributed[0]), "families": families})
        except Exception as exc:  # noqa: BLE001 - the server is leaving: one line, never a traceback
            log.warning("jitwarm: ledger at exit not written: %s: %s", type(exc).__name__, exc)

    multiprocessing.util.Finalize(None, write_at_exit, exitpriority=100)
    atexit.register(write_at_exit)
    _stop_writer.append(write_at_exit)


def stop_request_path(path: str | Path) -> Path:
    """The file ``jitwarm capture`` makes to ask for the ledger at stop: ``ledger.json`` -> ``ledger.stop-request``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.stop-request")


def answer_stop_request(store: Callable[[], Any], poll_s: float = 0.5) -> None:
    """When :func:`stop_request_path` appears beside ``JITWARM_LEDGER``: ``store()``, then :func:`write_stop`.

    ``jitwarm capture`` asks after its first requests and waits for the ledger at stop before it stops the server;
    an operator may ask the same of a running server (``touch ledger.stop-request``). A daemon thread polls for
    the file; nothing else happens unless it appears.
    """
    path = settings_path()
    if path is None:
        return
    request = stop_request_path(path)

    def wait() -> None:
        while not request.exists():
            time.sleep(poll_s)
        try:
            store()
        except Exception as exc:  # noqa: BLE001 - a side job: the ledger is still written
            log.warning("jitwarm: units at stop not stored: %s: %s", type(exc).__name__, exc)
        write_stop()

    threading.Thread(target=wait, name="jitwarm-stop-request", daemon=True).start()


def write_stop() -> None:
    """Write the ledger at stop now, once (nothing before the ready point).

    Asked for before a stop, where the process may never exit in order (vLLM's worker is killed at once).
    """
    for write in _stop_writer:
        write()


def cmd_ledger(args: argparse.Namespace, plan: object = None) -> int:
    """``jitwarm ledger FILE [--require-zero] [--json]``: the ledger a start wrote, one line per family.

    Exit 0, 1 when it compiled anything and ``--require-zero`` is given, 2 for a file that is missing or no ledger.
    """
    del plan
    try:
        data = json.loads(Path(args.path).read_text(encoding="utf-8"))
        families = data["families"]
        if not isinstance(families, dict) or not isinstance(data["compiled"], int):
            raise TypeError("families is no object")
        counts = [FamilyCount(name, str(f.get("signal", "")), f.get("served"), int(f["compiled"]),
                              tuple(f.get("keys") or ()), f.get("present_at_start"), f.get("root"), f.get("written"),
                              int(f.get("compiler_runs") or 0), int(f.get("compiler_probes") or 0),
                              tuple(f.get("compiler_outputs") or ()), int(f.get("uncached") or 0),
                              int(f.get("rewritten") or 0)) for name, f in families.items()]
        stray = data.get("unattributed") or {}
        elsewhere = [f"jitwarm: restore: {g['family']}: placed in {g['placed_in']}, this server looks in "
                     f"{g['looks_in']} and found {g['found']} of {g['restored']}"
                     for g in data.get("restored_elsewhere") or ()]
        report = LedgerReport(tuple(counts), elsewhere_lines=tuple(elsewhere),
                              unattributed=(int(stray.get("compiler_runs") or 0),
                                            int(stray.get("compiler_probes") or 0),
                                            tuple(stray.get("compiler_outputs") or ())))
    except OSError as exc:
        print(f"jitwarm: error: cannot read the ledger {args.path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"jitwarm: error: {args.path} is not a jitwarm ledger ({type(exc).__name__}: {exc})"[:400],
              file=sys.stderr)
        return EXIT_USAGE
    compiled = max(report.compiled, data["compiled"])
    if args.json:
        print(json.dumps({"path": str(args.path), "compiled": compiled, "phase": data.get("phase"),
                          "families": {f.family: f.compiled for f in report.families},
                          "after_ready": data.get("after_ready"), "warnings": report.warnings()}))
    else:
        for line in report.lines():
            print(line)
        after = data.get("after_ready")
        if isinstance(after, dict):
            firsts = ", ".join(f"{name} {n}" for name, n in (after.get("families") or {}).items() if n)
            print(f"jitwarm: ledger: compiled after ready: {after.get('compiled')}"
                  + (f" ({firsts})" if firsts else ""))
        uncached = sum(f.uncached for f in report.families)
        print(f"jitwarm: ledger: {args.path}: compiled {compiled} in all"
              + (f" ({data['phase']})" if data.get("phase") else "")
              + (f"; {uncached} not cacheable, done again at every start" if uncached else ""))
    return EXIT_BUILD_FAILED if args.require_zero and compiled else EXIT_OK
