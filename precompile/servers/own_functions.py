"""A server's own functions as a ladder source: choosing them, running them in a child process, and its entry point.

Each room's ``native`` module resolves capture with the installed server's own code. What is the same for every
room lives here, parametrised by :class:`OwnFunctions`: the choice between the built-in rules and the server's
functions (``--ladder-source``; ``auto`` keeps the server's answer in :mod:`.resolution_memo`), running them here
when the server is loaded (a server process) or else in a child process (importing the server imports torch into
the planning process), the error each failure raises, and the child's ``{"inputs": ...}`` stdin protocol.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jitwarm.precompile.servers import resolution_memo

#: What a room's ``native.resolve`` is: the raw inputs in, the resolution out; ValueError for refused settings.
Resolve = Callable[[Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class OwnFunctions:
    """One server's own ladder functions, as its room's ``native`` module runs them."""

    server: str  #: its distribution and top-level module (``sglang``, ``vllm``), and its memo key's server
    title: str  #: how messages name the server (``sglang``, ``vLLM``)
    functions: str  #: how messages name the functions run (``sglang's own ladder functions``)
    module: str  #: the room's native module, run with ``python -m`` in the child
    version: str  #: the release the room's rules mirror
    sources: tuple[str, ...]  #: the ``--ladder-source`` values the room takes
    error: type[Exception]  #: the room's ResolutionError (one argument ``reason``, keyword ``hint``)
    timeout_s: float  #: seconds the child process may take

    def installed_version(self) -> str | None:
        """Return the installed server's version from its metadata, or None when it is not installed."""
        try:
            return importlib.metadata.version(self.server)
        except importlib.metadata.PackageNotFoundError:
            return None

    def resolve_from(self, inputs: Mapping[str, Any], source: str, *, defaults: Mapping[str, Any],
                     builtin: Callable[[], dict[str, Any]], resolve: Resolve) -> dict[str, Any]:
        """Return the resolution of ``inputs`` from ``source``: ``builtin()``, or the server's own ``resolve``.

        ``builtin``: the rules. ``<server>``: the installed server's functions, every time. ``auto``: the rules
        when no server is installed or the installed one is :attr:`version`; for any other release its own
        functions, whose answer is kept in a memo keyed by that release and the inputs completed by
        ``defaults``, so only the first plan of a command line pays for importing the server.
        """
        if source not in self.sources:
            raise self.error(f"unknown --ladder-source {source!r}; choose from {', '.join(self.sources)}")
        installed = self.installed_version() if source != "builtin" else None
        if source == "builtin" or (source == "auto" and installed in (None, self.version)):
            return builtin()
        full = {**defaults, **inputs}
        if source == self.server or self.server in sys.modules:
            return self.run(full, resolve)
        key = resolution_memo.key(self.server, installed, full)
        found = resolution_memo.load(key)
        if found is not None:
            return found
        result = self.run(full, resolve)
        resolution_memo.store(key, result)
        return result

    def run(self, inputs: dict[str, Any], resolve: Resolve) -> dict[str, Any]:
        """Resolve with ``resolve`` here when the server is loaded (a server), else in a child process.

        Anywhere but inside a server, importing the server would import torch into the planning process.
        """
        if self.server in sys.modules:
            try:
                return resolve(inputs)
            except ValueError as exc:
                raise self.error(str(exc)) from None
        try:
            proc = subprocess.run([sys.executable, "-m", self.module], input=json.dumps({"inputs": inputs}),
                                  capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            raise self.error(f"cannot run {self.functions} ({exc})", hint="use --ladder-source builtin") from None
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        if proc.returncode == 2:
            raise self.error(last)
        if proc.returncode != 0:
            raise self.error(f"{self.functions} failed ({last})",
                             hint=f"use --ladder-source builtin for the rules mirroring {self.title} {self.version}")
        try:
            return json.loads(proc.stdout)
        except ValueError:
            raise self.error(f"{self.functions} printed something that is not their answer",
                             hint="use --ladder-source builtin") from None

    def child_main(self, resolve: Resolve, name: str) -> int:
        """The child's entry point: ``{"inputs": {...}}`` on stdin, the resolution as one JSON object on stdout.

        Returns 0; 2 with one line ``<name>: ...`` on stderr for a bad request or refused settings; 1 (also one
        line) when the server cannot be imported.
        """
        try:
            request = json.loads(sys.stdin.read())
            if not isinstance(request, dict) or set(request) != {"inputs"}:
                raise ValueError('expected one JSON object: {"inputs": {...}}')
            answer = resolve(request["inputs"])
        except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
            print(f"{name}: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        except ImportError as exc:
            print(f"{name}: cannot import {self.server}: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(answer))
        return 0


def checked_inputs(inputs: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """Return ``inputs`` as a dict after checking it holds exactly ``keys``; ValueError naming the difference."""
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs must be a JSON object, got {type(inputs).__name__}")
    missing = [k for k in keys if k not in inputs]
    unknown = sorted(set(inputs) - set(keys))
    if missing or unknown:
        raise ValueError(f"inputs: missing {missing}, unknown {unknown}")
    return dict(inputs)
