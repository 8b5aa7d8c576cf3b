"""``jitwarm capture -- <server line>``: one real start of the server, recorded, stopped, checked.

The server runs in its own process group with jitwarm's plugin recording (``JITWARM_RECORD``); its start is over
when its health endpoint answers and the plugin wrote the start-up ledger (``JITWARM_LEDGER``). Then the group is
stopped and every recorded unit is checked stored and verified in the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from jitwarm.cache.errors import EXIT_OK, JitwarmError, UsageError
from jitwarm.precompile import servers
from jitwarm.precompile.commands import keys_of, open_cache, plan_coverage
from jitwarm.precompile.manifest import read_manifest, record_id, spec_of
from jitwarm.precompile.plan import WarmPlan
from jitwarm.precompile.servers.command_line import split_env
from jitwarm.precompile.shipping import check_export_target, export_keys

#: Seconds the plugin's ledger may lag the health endpoint.
LEDGER_GRACE_S = 30.0
#: Seconds the server's process group has after SIGINT, then after SIGTERM, before the next signal.
STOP_GRACE_S, TERM_GRACE_S = 60.0, 10.0
_POLL_S = 0.5
_TAIL_LINES = 30
#: A line that starts an error's report in a server's log (vLLM's and sglang's ``ERROR`` level, a traceback).
_ERROR = re.compile(r"\bERROR\b|^Traceback |Error: ")
_ANY_HOST = ("", "0.0.0.0", "::", "[::]")


class ServerFailed(JitwarmError):
    """The server exited, was not ready in time, or started without jitwarm's plugin reporting (exit 1)."""


@dataclass
class ServerProcess:
    """A server started in a process group of its own, its output going to ``log``; stopped as a whole group."""

    proc: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str], log: Path) -> ServerProcess:
        """Start ``argv`` (leading ``NAME=value`` words join ``env``), output into ``log``; OSError if it cannot."""
        words_env, words = split_env(argv)
        with open(log, "ab") as out:
            proc = subprocess.Popen(words, env={**env, **words_env}, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return cls(proc, log)

    def exited(self) -> int | None:
        """The server's exit status once its main process has exited, else None."""
        return self.proc.poll()

    def tail(self, lines: int = _TAIL_LINES) -> list[str]:
        """The last ``lines`` lines of its output (a bounded read: a server's log can be gigabytes)."""
        try:
            with open(self.log, "rb") as f:
                return [line.decode(errors="replace").rstrip() for line in deque(f, maxlen=lines)]
        except OSError:
            return []

    def first_error(self) -> list[str]:
        """The lines from its first error on (a worker's, logged before the front's traceback), if before the tail."""
        text = _lines(self.log)
        first = next((i for i, line in enumerate(text) if _ERROR.search(line)), None)
        return [] if first is None or first >= len(text) - _TAIL_LINES else text[first:first + _TAIL_LINES]

    def group_alive(self) -> bool:
        """Whether any process of its group is left, reaping those that are our children (orphans, as a subreaper)."""
        self.proc.poll()
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-self.proc.pid, os.WNOHANG)[0]:
                pass
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a member changed its uid: still there
            pass
        return True

    def stop(self) -> int | None:
        """SIGINT the group (a server's Ctrl-C), then SIGTERM, then SIGKILL; the main exit status, None if unreaped.

        A Ctrl-C while waiting kills the group at once and is raised again (no terminal's Ctrl-C reaches it).
        """
        try:  # the graces are read now (a test sets them)
            for sig, wait_s in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
                if not self.group_alive():
                    break
                os.killpg(self.proc.pid, sig)
                deadline = time.monotonic() + wait_s
                while self.group_alive() and time.monotonic() < deadline:
                    time.sleep(0.1)
        except ProcessLookupError:
            pass
        except KeyboardInterrupt:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None


def health_url(room: Any, argv: Sequence[str]) -> str:
    """The server's readiness URL from its ``--host`` and ``--port`` (the room's defaults; any-host is loopback)."""
    given = {}
    words = split_env(argv)[1]
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag in ("--host", "--port") and (eq or i + 1 < len(words)):
            given[flag] = value if eq else words[i + 1]
    host, port = given.get("--host"), given.get("--port", str(room.DEFAULT_PORT))
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"the server's --port {port!r} is not a port number")
    host = "127.0.0.1" if host in _ANY_HOST or host is None else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{room.HEALTH}"


#: The server's own URL is asked directly: an ``http_proxy`` the environment names would never reach loopback.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        with _DIRECT.open(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def server_env(room: Any, base: Mapping[str, str], manifest: Path, ledger: Path, cache_dir: str | None
               ) -> dict[str, str]:
    """``base`` with jitwarm's plugin named, recording into ``manifest``, writing ``ledger``."""
    env = dict(base)
    plugins = env.get(room.PLUGINS_ENV)
    if plugins is not None and "jitwarm" not in [p.strip() for p in plugins.split(",")]:
        env[room.PLUGINS_ENV] = ",".join(p for p in (plugins, "jitwarm") if p.strip())
    env["JITWARM_RECORD"] = str(manifest)
    env.setdefault("JITWARM_LEDGER", str(ledger))
    if cache_dir:
        env["JITWARM_CACHE_DIR"] = str(cache_dir)
    return env


def wait_ready(server: ServerProcess, url: str, ledger: Path, timeout_s: float, room: Any,
               stale: tuple[int, int] | None = None) -> float:
    """Wait until ``url`` answers and the plugin wrote a new ``ledger``; the seconds to ready; else ServerFailed."""
    deadline = server.started + timeout_s
    while not answers(url):
        _check_running(server, "before it was ready")
        if time.monotonic() > deadline:
            raise ServerFailed(f"the server was not ready within {timeout_s:g} s ({url} did not answer)")
        time.sleep(_POLL_S)
    ready = time.monotonic() - server.started
    grace = min(time.monotonic() + LEDGER_GRACE_S, max(deadline, time.monotonic() + _POLL_S))
    while _identity(ledger) in (None, stale):
        _check_running(server, "after it answered, before jitwarm's plugin reported")
        if time.monotonic() > grace:
            raise ServerFailed(f"the server is ready but jitwarm's plugin never reported at its ready point (no "
                               f"ledger at {ledger}): is jitwarm installed where the server runs, and does "
                               f"{room.PLUGINS_ENV}, if set, name it?")
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
    """What one capture stored: this start's ``units`` per library, the ``keys`` of all the manifest names."""

    units: Counter[str]
    keys: list[str]
    ready_s: float
    warnings: list[str]
    ledger: dict[str, Any] | None


def capture(argv: Sequence[str], manifest: Path, *, cache: Any, cache_dir: str | None, timeout_s: float,
            log: IO[str] = sys.stderr) -> Captured:
    """Run the server line ``argv`` once, recording into ``manifest``; stop it; check every unit stored."""
    room = servers.adapter_for(argv)
    if not room.recognises(argv):
        raise UsageError(f"capture runs a server: the line after -- must start with its launcher "
                         f"({'; or '.join(servers.adapter(n).LAUNCHERS for n in servers.ROOMS)})")
    words_env, words = split_env(argv)
    with tempfile.TemporaryDirectory(prefix="jitwarm-capture-") as scratch:
        # capture's settings go on top of the line's own NAME=value words (`VLLM_PLUGINS=other vllm serve`)
        env = server_env(room, {**os.environ, **words_env}, manifest, Path(scratch) / "ledger.json", cache_dir)
        ledger = Path(env["JITWARM_LEDGER"])
        stale = _identity(ledger)
        before = {record_id(r) for r in read_manifest(manifest)} if manifest.exists() else set()
        for why in room.start_warnings(env):  # the room's known reasons a restored start compiles again
            print(f"jitwarm: warning: {why}", file=log)
        server_log = Path(scratch) / "server.log"
        url = health_url(room, argv)
        try:
            server = ServerProcess.start(words, env, server_log)
        except OSError as exc:
            raise ServerFailed(f"cannot start the server: {exc.strerror or exc}: {words[0]}") from None
        print(f"jitwarm: capture: {room.NAME} started (pid {server.proc.pid}), recording into {manifest}; waiting for "
              f"{url} and the plugin's ledger", file=log)
        try:
            ready_s = wait_ready(server, url, ledger, timeout_s, room, stale)
        except (ServerFailed, KeyboardInterrupt) as exc:
            server.stop()
            if isinstance(exc, ServerFailed):
                first = server.first_error()
                if first:
                    print("jitwarm: capture: the server's first error:", file=log)
                    for line in first:
                        print(f"  | {line}", file=log)
                print(f"jitwarm: capture: the server's last lines ({server_log.name}):", file=log)
                for line in server.tail():
                    print(f"  | {line}", file=log)
            raise
        server.stop()
        try:  # as text: a progress bar's \r ends a line, and a warning keeps its bytes
            said = server_log.read_text(errors="replace").splitlines()
        except OSError:
            said = []
        warnings = sorted({line[line.index("jitwarm:"):] for line in said
                           if "jitwarm:" in line and ("WARNING" in line or "ERROR" in line)})
        try:
            report = json.loads(ledger.read_text())
        except (OSError, ValueError):
            report = None
    # every unit the manifest names must be stored and verify; ``units`` counts this start's
    plan = WarmPlan.empty().with_manifests([manifest]) if manifest.is_file() else WarmPlan.empty()
    keys = keys_of(plan, cache)
    coverage = plan_coverage(plan, cache, keys=keys)
    if coverage["missing"] or coverage["corrupt"]:
        raise ServerFailed(f"{len(coverage['missing'])} recorded units are not in {cache.root} and "
                           f"{len(coverage['corrupt'])} do not verify: {', '.join(coverage['missing'][:3])}")
    new = [spec_of(r) for r in (read_manifest(manifest) if manifest.is_file() else []) if record_id(r) not in before]
    units = Counter(spec.backend.removesuffix("_cache") for spec in new)
    return Captured(units, sorted(keys.values()), ready_s, warnings, report)


def _lines(path: Path) -> list[str]:
    try:
        with open(path, "rb") as f:
            return [line.decode(errors="replace").rstrip() for line in f]
    except OSError:
        return []


def cmd_capture(args: argparse.Namespace, server_argv: list[str] | None) -> int:
    """Run ``capture``; print what it stored (``--json``: one object); ``--export`` the bundle."""
    if not server_argv:
        raise UsageError("capture needs the server's command line after -- (jitwarm capture -- vllm serve MODEL ...)")
    manifest = Path(args.manifest or "server.jsonl").absolute()
    if args.export:
        check_export_target(args.export)
    cache = open_cache(args, writes=True)  # an unwritable root is said now, not after the server's start
    done = capture(server_argv, manifest, cache=cache, cache_dir=args.cache_dir, timeout_s=args.timeout)
    for line in done.warnings:
        print(f"jitwarm: warning: the server said: {line}", file=sys.stderr)
    digest = None
    if args.export and done.keys:
        digest = export_keys(cache, done.keys, args.export)
    compiled = None if done.ledger is None else done.ledger.get("compiled")
    if args.json:
        print(json.dumps({"ready_s": round(done.ready_s, 1), "manifest": str(manifest), "units": dict(done.units),
                          "entries": len(done.keys), "compiled": compiled, "export": args.export,
                          "sha256": digest, "warnings": done.warnings}))
    else:
        what = ", ".join(f"{lib} {n}" for lib, n in sorted(done.units.items())) or "none: the start compiled nothing"
        print(f"jitwarm: captured {sum(done.units.values())} JIT cache units ({what}) from a start ready in "
              f"{done.ready_s:.1f}s; the {len(done.keys)} units {manifest} names are stored and verified in "
              f"{cache.root}")
        if args.export and digest:
            print(f"jitwarm: exported {len(done.keys)} entries to {args.export} (sha256 {digest})")
    return EXIT_OK
