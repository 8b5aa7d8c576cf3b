"""A server's own functions as a ladder source: choosing them, running them in a child process, its entry point."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jitwarm.kernels.channel import scratch_env
from jitwarm.precompile.servers import resolution_memo

#: What a room's ``native.resolve`` is: the raw inputs in, the resolution out; ValueError for refused settings.
Resolve = Callable[[Mapping[str, Any]], dict[str, Any]]


class OwnFunctions:
    """One server's own ladder functions, as its room's ``native`` module runs them.

    ``server`` is the room, distribution and top-level module; ``title`` names it in messages; ``error`` is the
    room's ResolutionError (keyword ``hint``); ``resolve`` the room's ``native.resolve``.
    """

    #: What the child may take: importing the server costs 21 to 67 s in its image.
    timeout_s = 300.0

    def __init__(self, server: str, title: str, error: type[Exception], resolve: Resolve) -> None:
        self.server, self.title, self.error, self.resolve = server, title, error, resolve
        room = sys.modules[f"jitwarm.precompile.servers.{server}"]
        self.version, self.sources = room.VERSION, room.LADDER_SOURCES
        self.module = f"jitwarm.precompile.servers.{server}.native"
        self.functions = f"{title}'s own ladder functions"

    def installed_version(self) -> str | None:
        """Return the installed server's version from its metadata, or None when it is not installed."""
        try:
            return importlib.metadata.version(self.server)
        except importlib.metadata.PackageNotFoundError:
            return None

    def source(self) -> str:
        """The ``source`` of a resolution by the installed server."""
        return f"{self.title} {self.installed_version()} (installed)"

    def resolve_from(self, inputs: Mapping[str, Any], source: str, *, defaults: Mapping[str, Any],
                     builtin: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Return the resolution of ``inputs`` from ``source``: ``builtin()`` (the rules), or the server's own.

        ``auto``: the rules when no server or the room's ``VERSION`` is installed, else its own functions memoised
        by release and inputs (completed by ``defaults``). The room's ResolutionError when they refuse or fail.
        """
        if source not in self.sources:
            raise self.error(f"unknown --ladder-source {source!r}; choose from {', '.join(self.sources)}")
        installed = self.installed_version() if source != "builtin" else None
        if source == "builtin" or (source == "auto" and installed in (None, self.version)):
            return builtin()
        full = {**defaults, **inputs}
        if source == self.server or self.server in sys.modules:
            return self.run(full)
        key = resolution_memo.key(self.server, installed, full)
        found = resolution_memo.load(key)
        if found is not None:
            return found
        result = self.run(full)
        resolution_memo.store(key, result)
        return result

    def run(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Resolve here when the server is loaded (a server process), else in a child (torch stays out of here)."""
        if self.server in sys.modules:
            try:
                return self.resolve(inputs)
            except ValueError as exc:
                raise self.error(str(exc)) from None
        try:
            with tempfile.TemporaryDirectory(prefix="jitwarm-own-functions-") as scratch:  # it imports torch
                proc = subprocess.run([sys.executable, "-m", self.module], input=json.dumps({"inputs": inputs}),
                                      capture_output=True, text=True, timeout=self.timeout_s, check=False,
                                      env={**os.environ, **scratch_env(scratch)})
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

    def main(self) -> int:
        """The child's entry point: ``{"inputs": {...}}`` on stdin, the resolution as one JSON object on stdout.

        Returns 0; 2 (one line on stderr) for a bad request or refused settings; 1 when the server cannot be imported.
        """
        try:
            request = json.loads(sys.stdin.read())
            if not isinstance(request, dict) or set(request) != {"inputs"}:
                raise ValueError('expected one JSON object: {"inputs": {...}}')
            answer = self.resolve(request["inputs"])
        except (ValueError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
            print(f"{self.module}: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        except ImportError as exc:
            print(f"{self.module}: cannot import {self.server}: {exc}", file=sys.stderr)
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
