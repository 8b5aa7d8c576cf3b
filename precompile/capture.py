"""``jitwarm capture -- <server line>``: one real start of the server on a clean node, recorded, stopped, checked.

The server runs with jitwarm's plugin named as the documented pod names it (``VLLM_PLUGINS=jitwarm``), recording
(``JITWARM_RECORD``) into a file beside the manifest, with private, empty cache directories for every JIT library
its room knows: every unit of the start is this start's, whatever the caller's disk holds. The start is over when
the server's own process answers its health endpoint and the plugin wrote the start-up ledger (``JITWARM_LEDGER``).
Then capture sends the first requests (:mod:`~jitwarm.precompile.warm_requests`: what the server compiles on first
use), stops the group (the plugin stores what they compiled and writes the ledger again, ``ledger.stop.json``),
checks every recorded unit stored and verified in the cache, and only then writes the bundle and the manifest (the
manifest by one rename): a capture cut short leaves neither.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from jitwarm.cache.errors import EXIT_OK, JitwarmError, UsageError
from jitwarm.precompile import servers, warm_requests
from jitwarm.precompile.capture_node import census, private_env, store_beside, unrecorded
from jitwarm.precompile.coverage import keys_of, open_cache, plan_coverage
from jitwarm.precompile.ledger import stop_path, stop_request_path
from jitwarm.precompile.manifest import append_records, capture_record, read_manifest, spec_of
from jitwarm.precompile.plan import WarmPlan
from jitwarm.precompile.server_process import (
    ServerProcess,
    Watchdog,
    answers,
    check_port_free,
    health_url,
    log_lines,
    owns_port,
)
from jitwarm.precompile.servers.command_line import split_env
from jitwarm.precompile.shipping import check_export_target, export_keys

__all__ = ["LEDGER_GRACE_S", "PROGRESS_S", "Captured", "Interrupted", "ServerFailed", "ServerProcess", "answers",
           "capture", "cmd_capture", "health_url"]

#: Seconds the plugin's ledger may lag the health endpoint; the most seconds between two progress lines.
LEDGER_GRACE_S, PROGRESS_S = 30.0, 10.0
_POLL_S = 0.5
#: What jitwarm's plugin logs when a record or a unit could not be written (recorder.Recorder).
_NOT_RECORDED = ("jitwarm: cannot record ", "jitwarm: cannot capture ")


class ServerFailed(JitwarmError):
    """The server exited, was not ready in time, or started without jitwarm's plugin recording (exit 1)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP reached capture: the server's group is stopped, and the exit is 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stopping_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` inside the block, SIGINT even where it was ignored.

    A background job of a non-interactive shell inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt: a Ctrl-C sent to such a capture left the server running.
    """
    def interrupted(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {sig: signal.signal(sig, interrupted) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def server_env(room: Any, base: Mapping[str, str], record: Path, ledger: Path, cache_root: Path) -> dict[str, str]:
    """``base`` with jitwarm's plugin named (as the pod names it), recording into ``record``, writing ``ledger``."""
    env = dict(base)
    names = [p.strip() for p in env.get(room.PLUGINS_ENV, "").split(",") if p.strip()]
    if "jitwarm" not in names:  # unset is "jitwarm", as the documented pod sets it (vLLM hashes it: envs.py)
        env[room.PLUGINS_ENV] = ",".join([*names, "jitwarm"])
    env["JITWARM_RECORD"] = str(record)
    env.setdefault("JITWARM_LEDGER", str(ledger))
    env["JITWARM_CACHE_DIR"] = str(cache_root)  # the store capture checks, whatever the environment's default
    for name, value in room.CAPTURE_ENV.items():  # the room's settings for a restorable start,
        env.setdefault(name, value)  # recorded (:func:`recorded_env`); a value the caller set is kept
    return env


def recorded_env(room: Any, env: Mapping[str, str]) -> dict[str, str]:
    """What the capture record keeps of the server's environment: the plugin variable and the room's settings.

    The restored server must run with the same (``next_step`` says so; the room's ``unloadable`` warns).
    """
    return {name: env[name] for name in (room.PLUGINS_ENV, *room.CAPTURE_ENV) if name in env}


class Progress:
    """While capture waits, a line every :data:`PROGRESS_S` seconds: time, the server's phase, units so far.

    The phase is the server's last log line; the units are those its libraries' private caches hold.
    """

    def __init__(self, server: ServerProcess, room: Any, env: Mapping[str, str], log: IO[str]) -> None:
        self.server, self.room, self.env, self.log = server, room, env, log
        self.last = time.monotonic()

    def tick(self, waiting_for: str) -> None:
        """Print the line when it is due."""
        if time.monotonic() - self.last < PROGRESS_S:
            return
        self.last = time.monotonic()
        phase = next((line.strip() for line in reversed(self.server.tail(5)) if line.strip()), "(no output yet)")
        units = sum(census(self.room, self.env).values())
        print(f"jitwarm: capture: {self.last - self.server.started:.0f}s, waiting for {waiting_for}; "
              f"{units} JIT cache units so far; the server: {phase[:160]}", file=self.log, flush=True)


def wait_ready(server: ServerProcess, url: str, ledger: Path, timeout_s: float, room: Any,
               stale: tuple[int, int] | None = None, progress: Progress | None = None) -> float:
    """Wait until the server answers ``url`` and the plugin wrote a new ``ledger``; the seconds to ready.

    ServerFailed when the server exits, is not ready in ``timeout_s``, or another process answers ``url``.
    """
    deadline = server.started + timeout_s
    port = urllib.parse.urlsplit(url).port or 80
    while not answers(url):
        _check_running(server, "before it was ready")
        if time.monotonic() > deadline:
            raise ServerFailed(f"the server was not ready within {timeout_s:g} s ({url} did not answer)")
        if progress is not None:
            progress.tick(url)
        time.sleep(_POLL_S)
    ready = time.monotonic() - server.started
    if not owns_port(server.proc.pid, port):
        raise ServerFailed(f"{url} answers, but no process of the server's group listens on port {port}: another "
                           "process took the port")
    grace = min(time.monotonic() + LEDGER_GRACE_S, max(deadline, time.monotonic() + _POLL_S))
    while _identity(ledger) in (None, stale):
        _check_running(server, "after it answered, before jitwarm's plugin reported")
        if time.monotonic() > grace:
            raise ServerFailed(f"the server is ready but jitwarm's plugin never reported at its ready point (no "
                               f"ledger at {ledger}): is jitwarm installed where the server runs, and does "
                               f"{room.PLUGINS_ENV} name it?")
        if progress is not None:
            progress.tick("jitwarm's ledger")
        time.sleep(_POLL_S)
    return ready


def _check_running(server: ServerProcess, when: str) -> None:
    code = server.exited()
    if code is not None:
        raise ServerFailed(f"the server exited with status {code} {when}")


def _identity(path: Path) -> tuple[int, int] | None:
    """A file's ``(inode, mtime_ns)``, None when there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


@dataclass
class Captured:
    """What one capture stored: its ``units`` per library, the ``keys`` of all the manifest names, its files."""

    units: Counter[str]
    keys: list[str]
    ready_s: float
    warnings: list[str]
    ledger: dict[str, Any] | None
    log: Path
    environment: dict[str, str]
    #: ``library unit`` of each unit the start wrote that the plugin did not record (said as a warning).
    unrecorded: list[str]
    digest: str | None = None
    #: The ledger the plugin wrote when the server stopped (``after_ready``: what the first requests compiled).
    stop_ledger: dict[str, Any] | None = None
    #: How many first requests were sent (:mod:`~jitwarm.precompile.warm_requests`), and where their answers are.
    warm_requests: int = 0
    answers: Path | None = None


def server_log_path(manifest: Path) -> Path:
    """Where the server's log is kept: beside the manifest, ``server.jsonl`` -> ``server.log``."""
    name = manifest.stem if manifest.suffix != ".log" else manifest.name
    return manifest.with_name(f"{name}.log")


def answers_path(manifest: Path) -> Path:
    """Where the first requests' answers are kept: beside the manifest, ``server.jsonl`` -> ``server.answers.jsonl``.

    What the cold start answered, for a restored node's answers to be compared with (``warm_requests.comparable``).
    """
    return manifest.with_name(f"{manifest.stem}.answers.jsonl")


def _claim_record_file(manifest: Path) -> Path:
    """A new, empty file beside ``manifest`` for the plugin to record into; ServerFailed where none can be made."""
    if manifest.is_dir():
        raise UsageError(f"--manifest {manifest} is a directory; give the manifest's file name (server.jsonl)")
    record = manifest.with_name(f".{manifest.name}.capture-{os.getpid()}")
    try:
        os.close(os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
    except OSError as exc:
        raise ServerFailed(f"cannot write the manifest {manifest}: {exc.strerror or exc} (making {record.name} "
                           "beside it)") from None
    return record


def capture(argv: Sequence[str], manifest: Path, *, cache: Any, timeout_s: float, export: str | None = None,
            log: IO[str] = sys.stderr,
            requests: Sequence[warm_requests.WarmRequest] = warm_requests.DEFAULT) -> Captured:
    """Run ``argv`` once on a clean node, recording; send ``requests``; stop it; check; write the bundle, manifest.

    Every recorded unit must be stored and verified before the bundle ``export`` (if any) and then ``manifest`` are
    written. Raises ServerFailed, UsageError, or Interrupted (the server's group stopped first).
    """
    room = servers.adapter_for(argv)
    if not room.recognises(argv):
        raise UsageError(f"capture runs a server: the line after -- must start with its launcher "
                         f"({'; or '.join(servers.adapter(n).LAUNCHERS for n in servers.ROOMS)})")
    words_env, words = split_env(argv)
    url = health_url(room, argv)
    check_port_free(url)
    record = _claim_record_file(manifest)
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-capture-"))
    server: ServerProcess | None = None
    watchdog = None
    try:
        watchdog = Watchdog([scratch, record])
        base, outside = private_env(room, {**os.environ, **words_env}, scratch)
        env = server_env(room, base, record, scratch / "ledger.json", Path(cache.root))
        ledger = Path(env["JITWARM_LEDGER"])
        stale = _identity(ledger)
        for why in room.start_warnings(env):  # the room's known reasons a restored start compiles again
            print(f"jitwarm: warning: {why}", file=log)
        for name, root in outside.items():
            print(f"jitwarm: warning: {name}'s cache stays at {root} (no variable of its moves it): units already "
                  "there are not captured", file=log)
        server_log = server_log_path(manifest)
        server_log.unlink(missing_ok=True)
        try:
            server = ServerProcess.start(words, env, server_log, watchdog=watchdog)
        except OSError as exc:
            raise ServerFailed(f"cannot start the server: {exc.strerror or exc}: {words[0]}") from None
        print(f"jitwarm: capture: {room.NAME} started (pid {server.proc.pid}) with {room.PLUGINS_ENV}="
              f"{env[room.PLUGINS_ENV]} and empty JIT caches under {scratch}; its log: {server_log}; waiting for "
              f"{url} and the plugin's ledger", file=log, flush=True)
        try:
            ready_s = wait_ready(server, url, ledger, timeout_s, room, stale, Progress(server, room, env, log))
        except ServerFailed:
            server.stop()
            _say_failure(server, log)
            raise
        answered = _send_first_requests(server, url, requests, log)
        request_warnings = [a.failure for a in answered if a.failure]
        request_warnings += _ask_for_stop_ledger(server, room, ledger)
        server.stop()
        stop_request_path(ledger).unlink(missing_ok=True)
        warnings, failures = _plugin_lines(server_log)
        if failures:
            raise ServerFailed(f"jitwarm's plugin could not record the start: {failures[0].removeprefix('jitwarm: ')}"
                               f" ({len(failures)} such lines in {server_log})")
        report = _read_json(ledger)
        append_records(record, store_beside(room, env, cache))  # Inductor's header outside an sglang's root
        done = _check_stored(room, env, record, cache, ready_s, [*request_warnings, *warnings], report, server_log)
        done.stop_ledger, done.warm_requests = _read_json(stop_path(ledger)), len(requests)
        if answered:
            try:
                warm_requests.write_answers(answers_path(manifest), answered)
                done.answers = answers_path(manifest)
            except OSError as exc:
                print(f"jitwarm: warning: the first requests' answers were not kept: {exc.strerror or exc}: "
                      f"{answers_path(manifest)}", file=log)
        append_records(record, [capture_record(room.NAME, done.environment)])
        if export:
            done.digest = export_keys(cache, done.keys, export, manifest=record)  # the bundle carries it
        record.replace(manifest)  # the manifest appears whole, or not at all
        return done
    except BaseException:
        if server is not None and server.group_alive():
            server.stop()  # a signal while waiting: the group goes down before capture exits
        raise
    finally:
        record.unlink(missing_ok=True)
        _remove_tree(scratch)
        if watchdog is not None:
            watchdog.done()


def _send_first_requests(server: ServerProcess, url: str, requests: Sequence[warm_requests.WarmRequest],
                         log: IO[str]) -> list[warm_requests.Answered]:
    """Send the first requests to the ready server; what it answered (those not 2xx are warnings).

    ServerFailed (the group stopped, its last lines said) when it stops answering or exits.
    """
    if not requests:
        return []
    print(f"jitwarm: capture: ready; sending {len(requests)} first requests (what the server compiles on first "
          "use)", file=log, flush=True)
    try:
        answered = warm_requests.send(url, requests)
    except OSError as exc:
        server.stop()
        _say_failure(server, log)
        raise ServerFailed(f"the server stopped answering the first requests: {exc}") from None
    _check_running(server, "while it answered the first requests")
    return answered


def _ask_for_stop_ledger(server: ServerProcess, room: Any, ledger: Path) -> list[str]:
    """Ask the plugin for what the first requests compiled and the ledger at stop; wait for it (a warning if none).

    Only where the room's plugin answers (``ANSWERS_STOP_REQUEST``); elsewhere the plugin writes it at exit.
    """
    if not room.ANSWERS_STOP_REQUEST:
        return []
    done, stale = stop_path(ledger), _identity(stop_path(ledger))
    stop_request_path(ledger).touch()
    deadline = time.monotonic() + LEDGER_GRACE_S
    while _identity(done) in (None, stale):
        _check_running(server, "before jitwarm's plugin wrote the ledger at stop")
        if time.monotonic() > deadline:
            return [f"jitwarm's plugin did not write the ledger at stop ({done}) within {LEDGER_GRACE_S:g} s: what "
                    "the first requests compiled may be missing from the capture"]
        time.sleep(_POLL_S / 5)
    return []


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, None when there is none."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _say_failure(server: ServerProcess, log: IO[str]) -> None:
    """The server's first error (before capture stopped it) and its last lines, each line as ``  | text``."""
    first = server.first_error()
    if first:
        print("jitwarm: capture: the server's first error:", file=log)
        for line in first:
            print(f"  | {line}", file=log)
    print(f"jitwarm: capture: the server's last lines ({server.log}):", file=log)
    for line in server.tail():
        print(f"  | {line}", file=log)


def _plugin_lines(server_log: Path) -> tuple[list[str], list[str]]:
    r"""The plugin's warnings and errors in the server's log, and those saying a record or unit was not written.

    Each from ``jitwarm:`` on; the log streamed, a progress bar's ``\r`` ending a line.
    """
    warnings, failures = set(), []
    for _, line in log_lines(server_log):
        for piece in (p for p in line.split("\r") if "jitwarm:" in p):
            said = piece[piece.index("jitwarm:"):]  # after the server's own prefix, whatever its format
            if said.startswith(_NOT_RECORDED):
                failures.append(said)
            if said.startswith(_NOT_RECORDED) or "WARNING" in piece or "ERROR" in piece:
                warnings.add(said)
    return sorted(warnings), failures


def _check_stored(room: Any, env: Mapping[str, str], record: Path, cache: Any, ready_s: float, warnings: list[str],
                  report: dict[str, Any] | None, server_log: Path) -> Captured:
    """Every unit the record file names stored and verified, every unit the census saw recorded; ServerFailed."""
    records = read_manifest(record) if record.stat().st_size else []
    plan = WarmPlan.empty().with_manifests([record]) if records else WarmPlan.empty()
    keys = keys_of(plan, cache)
    coverage = plan_coverage(plan, cache, keys=keys)
    if coverage["missing"] or coverage["corrupt"]:
        raise ServerFailed(f"{len(coverage['missing'])} recorded units are not in {cache.root} and "
                           f"{len(coverage['corrupt'])} do not verify: {', '.join(coverage['missing'][:3])}")
    missed = unrecorded(room, env, records)
    said = (f"the start wrote {len(missed)} JIT cache units that jitwarm's plugin did not record "
            f"({', '.join(missed[:3])}{', ...' if len(missed) > 3 else ''}); the server's log: {server_log}")
    if missed and not any(r["kind"] == "jit_cache" for r in records):
        raise ServerFailed(said)  # never "the start compiled nothing"
    if missed:
        warnings = [*warnings, said]
    units = Counter(spec_of(r).backend.removesuffix("_cache") for r in records)
    return Captured(units, sorted(keys.values()), ready_s, warnings, report, server_log, recorded_env(room, env),
                    missed)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def next_step(manifest: Path, export: str | None, digest: str | None, environment: Mapping[str, str]) -> list[str]:
    """The lines that end a capture's output: what to ship, and the ``prestart`` line each node runs."""
    env = " ".join(f"{k}={v}" for k, v in environment.items())
    bundle = export or "kernels.tar"
    lines = [] if export else [f"  jitwarm export --manifest {manifest} {bundle}    # the bundle (not written: no "
                                "--export)"]
    pin = f" --sha256 {digest}" if digest else ""
    return [f"jitwarm: next: ship {manifest} and {bundle} with the server's image; on each node, in the server's "
            f"environment ({env}, as the server runs), before the server starts:", *lines,
            f"  jitwarm prestart --manifest {manifest} --bundle {bundle}{pin} --offline"]


def cmd_capture(args: argparse.Namespace, server_argv: list[str] | None) -> int:
    """Run ``capture``; print what it stored and the next step (``--json``: one object); ``--export`` the bundle."""
    if not server_argv:
        raise UsageError("capture needs the server's command line after -- (jitwarm capture -- vllm serve MODEL ...)")
    manifest = Path(args.manifest or "server.jsonl").absolute()
    if args.export:
        check_export_target(args.export)
    requests = warm_requests.read(args.warm_requests) if args.warm_requests else warm_requests.DEFAULT
    cache = open_cache(args, writes=True)  # an unwritable root is said now, not after the server's start
    with stopping_signals():
        done = capture(server_argv, manifest, cache=cache, timeout_s=args.timeout, export=args.export,
                       requests=requests)
    for line in done.warnings:
        print(f"jitwarm: warning: the server said: {line}", file=sys.stderr)
    compiled = None if done.ledger is None else done.ledger.get("compiled")
    after = None if done.stop_ledger is None else done.stop_ledger.get("after_ready")
    nxt = next_step(manifest, args.export, done.digest, done.environment)
    if args.json:
        print(json.dumps({"ready_s": round(done.ready_s, 1), "manifest": str(manifest), "units": dict(done.units),
                          "entries": len(done.keys), "compiled": compiled, "export": args.export,
                          "sha256": done.digest, "warnings": done.warnings, "log": str(done.log),
                          "environment": done.environment, "unrecorded": done.unrecorded,
                          "warm_requests": done.warm_requests, "compiled_after_ready": after,
                          "answers": None if done.answers is None else str(done.answers),
                          "next": nxt[-1].strip()}))
        return EXIT_OK
    what = ", ".join(f"{lib} {n}" for lib, n in sorted(done.units.items())) or "none: the start compiled nothing"
    print(f"jitwarm: captured {sum(done.units.values())} JIT cache units ({what}) from a start ready in "
          f"{done.ready_s:.1f}s; the {len(done.keys)} units {manifest} names are stored and verified in {cache.root}")
    if isinstance(after, dict):
        firsts = ", ".join(f"{name} {n}" for name, n in sorted((after.get("families") or {}).items()) if n)
        print(f"jitwarm: the {done.warm_requests} first requests compiled {after.get('compiled')} more"
              + (f" ({firsts}), captured too" if firsts else ""))
    print(f"jitwarm: the server's log: {done.log}")
    if args.export:
        print(f"jitwarm: exported {len(done.keys)} entries to {args.export} (sha256 {done.digest})")
    print("\n".join(nxt))
    return EXIT_OK
