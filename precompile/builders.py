"""Build workers: fresh Python processes that get or build one spec at a time and report the outcome as data.

Each worker is ``python -m jitwarm.precompile.builders``, reading one task per line (the spec's artifact) and
answering one JSON line (:mod:`jitwarm.kernels.channel`; what it prints goes to stderr). A fresh interpreter,
not a ``multiprocessing`` child: it never re-imports the caller's ``__main__`` (``sglang.launch_server``), and a
worker that dies is known by the task it held. Workers run in their own session, so a terminal's Ctrl-C reaches
only the parent, which stops them and their compilers; a build cut short leaves only a staging directory.
Errors and entries cross as data (the exception's type and kind with its full text; the entry as the worker
verified it, stat signature included, so the parent uses it without a second lookup).
"""

from __future__ import annotations

import contextlib
import json
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
from typing import IO, Any

from jitwarm.cache import Entry, FileRecord
from jitwarm.kernels import channel

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

    def to_json(self) -> dict[str, str]:
        """JSON-able form (as it travels from a worker)."""
        return {"kind": self.kind, "type": self.type, "message": self.message, "detail": self.detail}

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        """Classify an exception raised while getting or building a spec."""
        from jitwarm.cache import BuildError, CacheError, LockTimeout, RemoteUnavailable
        from jitwarm.kernels import CompileError, LoadError, SpecError, TargetError, ToolchainError

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
class Task:
    """One spec to get or build: its artifact (spec, description, key) as JSON, and its index."""

    index: int
    artifact: dict[str, Any]


@dataclass
class Outcome:
    """What a worker did with a task: hit, built, waited, downloaded (with its ``entry``), or failed (``failure``)."""

    index: int
    outcome: str
    seconds: float
    key: str | None = None
    failure: Failure | None = None
    remote_error: str | None = None
    entry: Entry | None = None


@dataclass
class _Worker:
    proc: subprocess.Popen
    task: Task | None = None
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

    def run(self, tasks: Sequence[Task]) -> Iterator[Outcome]:
        """Yield one outcome per task as it finishes; a worker that dies fails its task (retried once alone).

        On ``KeyboardInterrupt`` (or any exception in the caller) every worker is stopped before it
        propagates.
        """
        pending = list(tasks)
        retried: set[int] = set()
        selector = selectors.DefaultSelector()
        try:
            while pending or any(w.task for w in self._workers):
                while pending and len([w for w in self._workers if w.task]) < self.jobs:
                    worker = next((w for w in self._workers if w.task is None), None) or self._spawn(selector)
                    self._send(worker, pending.pop(0))
                for key, _ in selector.select(timeout=1.0):
                    worker, stream = key.data
                    chunk = os.read(key.fd, 1 << 16)
                    if stream == "stderr":
                        self._relay(worker, chunk, key, selector)
                        continue
                    if chunk:
                        worker.answers.feed(chunk)
                        for line in worker.answers.lines():
                            if (outcome := self._received(worker, line)) is not None:
                                yield outcome
                        continue
                    selector.unregister(key.fd)  # EOF: the worker died (a compiler or loader crash?)
                    self._workers.remove(worker)
                    if worker.task is not None:
                        task, code = worker.task, worker.proc.wait()
                        if task.index not in retried:  # once more, on a fresh worker: an OOM kill is not a bug
                            retried.add(task.index)
                            pending.insert(0, task)
                        else:
                            yield Outcome(task.index, "failed", time.perf_counter() - worker.started,
                                          failure=Failure("crash", "WorkerDied", _death(code)))
        finally:
            selector.close()
            self.close()

    def close(self) -> None:
        """Stop every worker: close its input, SIGTERM its session, SIGKILL what is left after the grace period.

        A second Ctrl-C while this runs does not interrupt it: it cannot leave a worker or a compiler behind.
        """
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self._stop_all()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)

    def _stop_all(self) -> None:
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

    def _spawn(self, selector: selectors.BaseSelector) -> _Worker:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(_import_path())}
        proc = subprocess.Popen([sys.executable, "-m", "jitwarm.precompile.builders", json.dumps(self.config)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)
        worker = _Worker(proc)
        selector.register(proc.stdout, selectors.EVENT_READ, (worker, "stdout"))
        selector.register(proc.stderr, selectors.EVENT_READ, (worker, "stderr"))
        self._workers.append(worker)
        return worker

    def _relay(self, worker: _Worker, chunk: bytes, key: Any, selector: selectors.BaseSelector) -> None:
        """Pass a worker's log lines on to our stderr (see :meth:`_say`)."""
        if not chunk:
            selector.unregister(key.fd)
            chunk = b"\n" if worker.errors.pending else b""
        worker.errors.feed(chunk)
        for line in worker.errors.lines():
            self._say(line)

    def _say(self, line: bytes) -> None:
        """Write one of the workers' lines on our stderr, each distinct line once (eight workers, one warning)."""
        if line.strip() and line not in self._said:
            self._said.add(line)
            sys.stderr.write(line.decode("utf-8", "replace") + "\n")
            sys.stderr.flush()

    def _send(self, worker: _Worker, task: Task) -> None:
        worker.task, worker.started = task, time.perf_counter()
        assert worker.proc.stdin is not None
        worker.proc.stdin.write(channel.encode({"index": task.index, "artifact": task.artifact}))
        worker.proc.stdin.flush()

    def _received(self, worker: _Worker, line: bytes) -> Outcome | None:
        try:
            data = channel.decode(line)
        except ValueError:  # not an answer (a worker's stdout is its answers alone): pass it on as a log line
            self._say(line)
            return None
        worker.task = None
        failure = Failure(**data["failure"]) if data.get("failure") else None
        entry = entry_from_json(data["entry"]) if data.get("entry") else None
        return Outcome(data["index"], data["outcome"], data["seconds"], data.get("key"), failure,
                       data.get("remote_error"), entry)


def entry_to_json(entry: Entry) -> dict[str, Any]:
    """An entry as a worker sends it: every field, the path as a string."""
    return {**asdict(entry), "path": str(entry.path)}


def entry_from_json(data: dict[str, Any]) -> Entry:
    """The entry a worker sent (:func:`entry_to_json`), its records and signature as the worker hashed them."""
    return Entry(key=data["key"], path=Path(data["path"]), files=tuple(data["files"]),
                 description=data["description"], preimage=data["preimage"],
                 records=tuple(FileRecord(**r) for r in data["records"]), created=data["created"],
                 read_only=data["read_only"], signature=tuple(tuple(item) for item in data["signature"]))


def _import_path() -> list[str]:
    """The caller's import path, so a worker imports the same jitwarm (and, for a replay, the same modules)."""
    return [str(Path(p).absolute()) if p else str(Path.cwd()) for p in sys.path if not p or Path(p).is_dir()]


def _signal_session(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the worker and its compiler: start_new_session made it the group leader


def _death(code: int) -> str:
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"the build process died ({how}): a compiler or loader crash"


# -- the worker side --------------------------------------------------------------------------------------------


def _serve(config: dict[str, Any], tasks: IO[str], answers: IO[str]) -> None:
    """Answer every task line on ``tasks`` until it closes."""
    from jitwarm.cache import KernelCache
    from jitwarm.kernels.artifacts import Artifact

    cache = KernelCache(**config["cache"])
    for line in tasks:
        task = channel.decode(line)
        start = time.perf_counter()
        answer: dict[str, Any] = {"index": task["index"]}
        try:
            # The parent looked the key up just before handing it over: go straight to the lock.
            result = Artifact.from_json(task["artifact"]).get_or_build(cache, config["timeout_s"], missed=True)
            answer.update(outcome=result.outcome, key=result.entry.key, entry=entry_to_json(result.entry))
        except Exception as exc:  # reported per spec: one bad spec must not fail the others
            answer.update(outcome="failed", failure=Failure.of(exc).to_json())
        answer.update(seconds=time.perf_counter() - start, remote_error=cache.remote_error)
        channel.send(answers, answer)


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point: ``python -m jitwarm.precompile.builders CONFIG_JSON`` (tasks on stdin)."""
    args = sys.argv[1:] if argv is None else argv
    # SIGTERM from the parent (Ctrl-C there): unwind, so the cache removes the staging dir of a build in flight.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle
    # A module a replay imports that prints must not put a line that is not an answer into the protocol.
    answers = channel.answers()
    from jitwarm.kernels.backend import set_build_only
    from jitwarm.precompile.log_lines import log_lines  # the parent relays our stderr: the CLI's form of a line

    set_build_only()  # this worker hands no library a tensor: backends may import their runtimes leaner

    try:
        with log_lines():
            _serve(json.loads(args[0]), sys.stdin, answers)
    except BrokenPipeError:  # the parent is gone
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
