"""The compiler processes this process starts, by JIT family: the ledger's witness beside the caches' files.

A library's own counter says what it looked up, not what it ran: a restored start whose Inductor precompiled header
and one ``.so`` were gone hit its FX graph cache, ran g++ to build both again, and counted no miss. The tap wraps
process creation (``subprocess.Popen._execute_child``, ``os.posix_spawn``, ``os.posix_spawnp``) and counts each
compiler started, by the family whose frames started it (the innermost one on the stack), else unattributed.

A compiler run is a *compile* unless it only answers a question or preprocesses: Inductor runs ``g++ --version``,
``g++ -v`` and ``g++ -E`` on its precompiled header's include at every start, warm or not (torch/_inductor
cpp_builder.py ``get_compiler_version_info``, codecache.py ``_precompile_header``): those are *probes*, counted
apart and never a compile. The tap counts after the spawn succeeded, never raises into the process that spawns,
and a spawn of anything that is not a compiler costs one name match (under a microsecond, against a spawn's
milliseconds). Compilers that a library's own worker processes start are not seen here: their files are.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from jitwarm.kernels import kinds

#: Program names of compilers and build drivers (a version or target prefix is allowed: ``x86_64-linux-gnu-g++-12``).
_COMPILER = re.compile(r"^(?:[\w.]+-)*(g\+\+|gcc|c\+\+|cc|clang\+\+|clang|nvcc|ptxas|ninja|ld|ld\.\w+)(?:-[\d.]+)?$")
#: Arguments that make a run a question, not a compile.
_QUESTIONS = frozenset({"--version", "-dumpversion", "-dumpfullversion", "-dumpmachine", "-###", "--help"})
#: Arguments that make a run a preprocessing only (no object written).
_PREPROCESS = frozenset({"-E", "-M", "-MM"})
#: A family with no frame of its own on the stack.
UNATTRIBUTED = ""
#: How many compile outputs (``-o``) are kept per family.
KEPT = 16
#: Set while ``Popen`` spawns in this thread.
_within = threading.local()


def classify(argv: list[str]) -> tuple[str, bool, str | None] | None:
    """``(program, is a compile, its -o output)`` when ``argv`` starts a compiler, else None."""
    if not argv:
        return None
    program = os.fsdecode(argv[0]).rpartition("/")[2]
    if not _COMPILER.match(program):
        return None
    args = [str(a) for a in argv[1:]]
    output = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "-o"), None)
    question = bool(_QUESTIONS.intersection(args)) or any(a.startswith(("-print-", "--print-")) for a in args) or (
        args == ["-v"]) or (program.startswith("ninja") and bool({"-t", "-n"}.intersection(args)))
    return program, not (question or _PREPROCESS.intersection(args)), output


def family_of(frame: Any) -> str:
    """The family whose package's frame is innermost on the stack from ``frame`` (``""``: none).

    The packages are each kind's ``spawners`` (:func:`jitwarm.kernels.kinds.spawners`).
    """
    spawners = kinds.spawners()
    while frame is not None:
        module = frame.f_globals.get("__name__", "") + "."
        for family, packages in spawners:
            if module.startswith(packages):
                return family
        frame = frame.f_back
    return UNATTRIBUTED


class CompilerTap:
    """The compiler runs of this process since the tap was installed; ``counts()`` copies, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.compiles: Counter[str] = Counter()
        self.probes: Counter[str] = Counter()
        self.outputs: dict[str, list[str]] = {}
        self._undo: list[Callable[[], None]] = []

    def note(self, command: Callable[[], Any], frame: Any) -> None:
        """Count ``command()`` (a command line) if it starts a compiler; never raises."""
        try:
            argv = command()
            if isinstance(argv, (str, bytes)):
                argv = shlex.split(os.fsdecode(argv))
            found = classify(list(argv))
            if found is None:
                return
            program, compiles, output = found
            family = family_of(frame)
            with self._lock:
                (self.compiles if compiles else self.probes)[family] += 1
                if compiles and output:
                    kept = self.outputs.setdefault(family, [])
                    if len(kept) < KEPT:
                        kept.append(output)
        except Exception:  # noqa: BLE001, S110 - a witness must never break the spawn it watches
            pass

    def counts(self) -> tuple[Counter[str], Counter[str], dict[str, list[str]]]:
        """``(compiles, probes, outputs)`` by family, copied."""
        with self._lock:
            return Counter(self.compiles), Counter(self.probes), {k: list(v) for k, v in self.outputs.items()}

    def install(self) -> None:
        """Wrap process creation (once)."""
        if self._undo:
            return
        tap = self
        original = subprocess.Popen._execute_child  # type: ignore[attr-defined]

        def _execute_child(self: Any, args: Any, executable: Any, *rest: Any, **kwargs: Any) -> Any:
            _within.popen = True  # subprocess may spawn through os.posix_spawn: counted here, once
            try:
                out = original(self, args, executable, *rest, **kwargs)
            finally:
                _within.popen = False
            tap.note(lambda: _argv(args, executable, rest[7] if len(rest) > 7 else kwargs.get("shell", False)),
                     sys._getframe(1))  # rest[7]: ``shell``, after preexec_fn ... creationflags
            return out

        _execute_child.__wrapped__ = original  # type: ignore[attr-defined]
        subprocess.Popen._execute_child = _execute_child  # type: ignore[attr-defined]
        self._undo.append(lambda: setattr(subprocess.Popen, "_execute_child", original))
        for name in ("posix_spawn", "posix_spawnp"):
            spawn = getattr(os, name, None)
            if spawn is None:
                continue

            def wrapped(path: Any, argv: Any, *args: Any, _spawn: Any = spawn, **kwargs: Any) -> Any:
                pid = _spawn(path, argv, *args, **kwargs)
                if not getattr(_within, "popen", False):
                    tap.note(lambda: [path, *list(argv)[1:]], sys._getframe(1))
                return pid

            wrapped.__wrapped__ = spawn  # type: ignore[attr-defined]
            setattr(os, name, wrapped)
            self._undo.append(lambda n=name, s=spawn: setattr(os, n, s))

    def remove(self) -> None:
        """Put process creation back as it was."""
        while self._undo:
            self._undo.pop()()


def _argv(args: Any, executable: Any, shell: bool) -> Any:
    """The command line ``Popen`` runs: a shell's command string as its words, else ``executable`` first."""
    if isinstance(args, (str, bytes, os.PathLike)):
        return args if shell else [args]
    args = list(args)
    if shell:
        return " ".join(os.fsdecode(a) for a in args)
    return [executable if executable is not None else args[0], *args[1:]] if args else args


_tap: CompilerTap | None = None
_tap_lock = threading.Lock()


def watching() -> CompilerTap:
    """The process's tap, installed on first call."""
    global _tap
    with _tap_lock:
        if _tap is None:
            _tap = CompilerTap()
            _tap.install()
        return _tap
