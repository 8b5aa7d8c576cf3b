"""Build workers: fresh interpreters (``python -m jitwarm.precompile.builders``) that get or build one spec at a time.

One artifact per line in, one JSON answer per line out (:mod:`jitwarm.kernels.channel`). A fresh interpreter never
re-imports the caller's ``__main__`` (``sglang.launch_server``); a worker that dies is known by the task it held;
workers run in their own session, so a terminal's Ctrl-C reaches only the parent, which stops them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jitwarm.cache import BuildError, CacheError, Entry, FileRecord, KernelCache, LockTimeout, RemoteUnavailable
from jitwarm.kernels import CompileError, KernelSpec, LoadError, SpecError, TargetError, ToolchainError, channel
from jitwarm.kernels.artifacts import Artifact
from jitwarm.kernels.backend import set_build_only

#: Seconds the workers get to stop on their own (SIGTERM) before they are killed.
STOP_GRACE_S = 3.0

#: Error kinds: what a failure means to the caller (exit code, one message for all), whatever its type.
KINDS = ("compile", "load", "timeout", "remote_unavailable", "toolchain", "spec", "cache", "crash", "internal")


@dataclass
class Failure:
    """Why a spec failed: ``kind`` (one of :data:`KINDS`), the exception type, its first line, its whole text."""

    kind: str
    type: str
    message: str
    detail: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        """Classify an exception raised while getting or building a spec."""
        cause = exc.__cause__ if isinstance(exc, BuildError) and exc.__cause__ is not None else exc
        kinds = (("timeout", LockTimeout), ("remote_unavailable", RemoteUnavailable), ("compile", CompileError),
                 ("load", LoadError), ("toolchain", ToolchainError), ("spec", (SpecError, TargetError)),
                 ("cache", CacheError))
        kind = next((name for name, types in kinds if isinstance(cause, types)), "internal")
        text = str(cause) or type(cause).__name__
        summary = cause.summary if isinstance(cause, CompileError) else text.splitlines()[0]
        detail = cause.output if isinstance(cause, CompileError) else text
        return cls(kind, type(cause).__name__, summary, detail)


@dataclass
class SpecResult:
    """What warming one spec did: hit, built, waited, downloaded or failed; ``entry``: the verified entry, handed on."""

    spec: KernelSpec
    outcome: str  # "hit" | "built" | "waited" | "downloaded" | "failed"
    seconds: float = 0.0
    key: str | None = None
    error: str | None = None
    error_kind: str | None = None
    error_type: str | None = None
    detail: str | None = None
    remote_error: str | None = None
    entry: Any = field(default=None, repr=False, compare=False)

    @property
    def timed_out(self) -> bool:
        """True when this spec failed only because another holder kept its lock past the deadline."""
        return self.outcome == "failed" and self.error_kind == "timeout"

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-able dict (failure fields and ``remote_error`` only when set)."""
        data = {"spec": self.spec.id, "outcome": self.outcome, "seconds": round(self.seconds, 3), "key": self.key}
        if self.outcome == "failed":
            data.update(error=self.error, error_kind=self.error_kind, error_type=self.error_type, detail=self.detail)
        if self.remote_error is not None:
            data["remote_error"] = self.remote_error
        return data

    @classmethod
    def failed(cls, spec: KernelSpec, failure: Failure, seconds: float = 0.0,
               remote_error: str | None = None) -> SpecResult:
        """A failed result."""
        return cls(spec, "failed", seconds, error=failure.message, error_kind=failure.kind, error_type=failure.type,
                   detail=failure.detail, remote_error=remote_error)


@dataclass
class _Worker:
    proc: subprocess.Popen
    task: Artifact | None = None
    started: float = 0.0
    answers: channel.LineReader = field(default_factory=channel.LineReader)
    errors: channel.LineReader = field(default_factory=channel.LineReader)


class BuildPool:
    """Up to ``jobs`` workers sharing one cache (``cache_args``: ``KernelCache`` keyword arguments)."""

    def __init__(self, jobs: int, cache_args: dict[str, Any], timeout_s: float) -> None:
        self.jobs = max(1, jobs)
        self.config = {"cache": cache_args, "timeout_s": timeout_s}
        self._workers: list[_Worker] = []
        self._said: set[bytes] = set()  # what workers wrote on stderr: each line once, not once per worker

    def run(self, tasks: Sequence[Artifact]) -> Iterator[SpecResult]:
        """Yield one result per artifact as it finishes (a dead worker's task retried once); an exception stops all."""
        pending = list(tasks)
        retried: set[KernelSpec] = set()
        selector = selectors.DefaultSelector()
        try:
            while pending or any(w.task for w in self._workers):
                while pending and sum(1 for w in self._workers if w.task) < self.jobs:
                    worker = next((w for w in self._workers if w.task is None), None) or self._spawn(selector)
                    worker.task, worker.started = pending.pop(0), time.perf_counter()
                    channel.send(worker.proc.stdin, worker.task.to_json())
                for key, _ in selector.select(timeout=1.0):
                    worker, stream = key.data
                    chunk = os.read(key.fd, 1 << 16)
                    if stream == "stderr":
                        self._relay(worker, chunk, key, selector)
                    elif chunk:
                        yield from self._answers(worker, chunk)
                    else:  # EOF: the worker died (a compiler or loader crash?)
                        selector.unregister(key.fd)
                        self._workers.remove(worker)
                        task = worker.task
                        if task is None:
                            continue
                        code = worker.proc.wait()
                        if task.spec not in retried:  # once more, on a fresh worker: an OOM kill is not a bug
                            retried.add(task.spec)
                            pending.insert(0, task)
                            continue
                        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                        died = f"the build process died ({how}): a compiler or loader crash"
                        yield SpecResult.failed(task.spec, Failure("crash", "WorkerDied", died),
                                                time.perf_counter() - worker.started)
        finally:
            selector.close()
            self.close()

    def close(self) -> None:
        """Stop every worker: close its input, SIGTERM its session, SIGKILL what is left; a second Ctrl-C waits."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for worker in self._workers:
                with contextlib.suppress(OSError):
                    worker.proc.stdin.close()
                if worker.task is not None:  # a build in flight: stop it and its compiler now
                    _signal_session(worker.proc, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for worker in self._workers:
                try:
                    worker.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_session(worker.proc, signal.SIGKILL)
                    worker.proc.wait()
                for stream in (worker.proc.stdout, worker.proc.stderr):
                    with contextlib.suppress(OSError):
                        stream.close()
            self._workers.clear()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)

    def _spawn(self, selector: selectors.BaseSelector) -> _Worker:
        """Start a worker on the caller's import path (the same jitwarm, and for a replay the same modules)."""
        path = [str(Path(p).absolute()) if p else str(Path.cwd()) for p in sys.path if not p or Path(p).is_dir()]
        proc = subprocess.Popen([sys.executable, "-m", "jitwarm.precompile.builders", json.dumps(self.config)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(path)}, start_new_session=True)
        worker = _Worker(proc)
        selector.register(proc.stdout, selectors.EVENT_READ, (worker, "stdout"))
        selector.register(proc.stderr, selectors.EVENT_READ, (worker, "stderr"))
        self._workers.append(worker)
        return worker

    def _relay(self, worker: _Worker, chunk: bytes, key: Any, selector: selectors.BaseSelector) -> None:
        """Pass a worker's log lines on to our stderr."""
        if not chunk:
            selector.unregister(key.fd)
            chunk = b"\n" if worker.errors.pending else b""
        worker.errors.feed(chunk)
        for line in worker.errors.lines():
            self._say(line)

    def _say(self, line: bytes) -> None:
        """Write a worker's line on our stderr, each distinct line once (eight workers, one warning)."""
        if line.strip() and line not in self._said:
            self._said.add(line)
            sys.stderr.write(line.decode("utf-8", "replace") + "\n")
            sys.stderr.flush()

    def _answers(self, worker: _Worker, chunk: bytes) -> Iterator[SpecResult]:
        """The results of the answers that ``chunk`` completes."""
        worker.answers.feed(chunk)
        for line in worker.answers.lines():
            try:
                data = channel.decode(line)
            except ValueError:  # not an answer (a worker's stdout is its answers alone): pass it on as a log line
                self._say(line)
                continue
            spec, worker.task = worker.task.spec, None
            if data.get("failure"):
                yield SpecResult.failed(spec, Failure(**data["failure"]), data["seconds"], data["remote_error"])
            else:
                entry = data["entry"]  # as the worker hashed it
                entry = Entry(**{**entry, "path": Path(entry["path"]), "files": tuple(entry["files"]),
                                 "records": tuple(FileRecord(**r) for r in entry["records"]),
                                 "signature": tuple(tuple(item) for item in entry["signature"])})
                yield SpecResult(spec, data["outcome"], data["seconds"], data["key"], remote_error=data["remote_error"],
                                 entry=entry)


def _signal_session(proc: subprocess.Popen, sig: int) -> None:
    """Signal the worker and its compiler (``start_new_session`` made it the group leader)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# -- the worker side --------------------------------------------------------------------------------------------


class LogLines(logging.Formatter):
    """``jitwarm: <message>``, the prefix once (many messages carry it already, for a server's own log)."""

    def format(self, record: logging.LogRecord) -> str:
        """``jitwarm: <message>`` (no traceback: one line)."""
        return "jitwarm: " + record.getMessage().removeprefix("jitwarm: ")


@contextlib.contextmanager
def log_lines() -> Iterator[None]:
    """While the block runs (a build worker, or the CLI), jitwarm's warnings and errors go to stderr as one line each.

    Without it Python's last-resort handler printed them bare (a quarantine during ``warm`` had no prefix).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(LogLines())
    logger = logging.getLogger("jitwarm")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point: ``python -m jitwarm.precompile.builders CONFIG_JSON`` (one artifact a line on stdin)."""
    config = json.loads((sys.argv[1:] if argv is None else argv)[0])
    # SIGTERM from the parent (Ctrl-C there): unwind, so the cache removes the staging dir of a build in flight.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle
    # A module a replay imports that prints must not put a line that is not an answer into the protocol.
    answers = channel.answers()
    set_build_only()  # this worker hands no library a tensor: backends may import their runtimes leaner
    cache = KernelCache(**config["cache"])
    try:
        with log_lines():
            for line in sys.stdin:
                start = time.perf_counter()
                try:  # the parent looked the key up just before handing it over: go straight to the lock
                    got = Artifact.from_json(channel.decode(line)).get_or_build(cache, config["timeout_s"], missed=True)
                    entry = {**asdict(got.entry), "path": str(got.entry.path)}  # the path as a string
                    answer = {"outcome": got.outcome, "key": got.entry.key, "entry": entry}
                except Exception as exc:  # reported per spec: one bad spec must not fail the others
                    answer = {"failure": asdict(Failure.of(exc))}
                channel.send(answers, {**answer, "seconds": time.perf_counter() - start,
                                       "remote_error": cache.remote_error})
    except BrokenPipeError:  # the parent is gone
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
