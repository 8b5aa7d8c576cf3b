"""A server that ``jitwarm capture`` starts: its process group, its log, the port it answers on, its stop, its watchdog.

The server runs in a session of its own (a terminal's Ctrl-C reaches capture, never the server), so capture stops it
as a group. A watchdog child holds the read end of a pipe that only capture can write: when capture ends in any
way without saying ``done`` (a SIGKILL included), the pipe closes and the watchdog kills the group and removes the
files capture made for the start. The log is only ever read in bounded pieces: a server's log can be gigabytes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import UsageError
from jitwarm.precompile.servers.command_line import split_env

#: Seconds the server's process group has after SIGINT, then after SIGTERM, before the next signal.
STOP_GRACE_S, TERM_GRACE_S = 60.0, 10.0
TAIL_LINES = 30
#: The most of the log's end a tail reads, and the most of one line kept (a progress bar can be one long line).
_TAIL_BYTES, _LINE_BYTES = 256 << 10, 4096
#: The first level word of a log line (vLLM's ``ERROR 12-05 ...``, logging's ``ERROR:name:``), and a traceback.
_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b")
_TRACEBACK = re.compile(r"\bTraceback \(most recent call last\):")
_ANY_HOST = ("", "0.0.0.0", "::", "[::]")

#: The watchdog (stdlib only, run with -S -I): argv is the pipe's read end, then files to remove after the group.
#: It reads the server's group id, then waits; EOF without ``done`` is capture gone: SIGKILL the group, wait until
#: no member is left but zombies (a container's PID 1 may never reap them), remove the files.
_WATCHDOG = r"""
import os, shutil, signal, sys, time
for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
data = b""
while chunk := os.read(int(sys.argv[1]), 64):
    data += chunk
words = data.split()
if b"done" in words:
    sys.exit(0)
groups = [int(w) for w in words if w.isdigit()]
def alive(pgid):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            return True
    return False
deadline = time.monotonic() + 30
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    while alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
for path in sys.argv[2:]:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
"""


class Watchdog:
    """Kills a process group, and removes ``paths``, when the process that started it ends without :meth:`done`."""

    def __init__(self, paths: Iterable[Path]) -> None:
        read, self._write = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-S", "-I", "-c", _WATCHDOG, str(read), *map(str, paths)],
                                         pass_fds=(read,), stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)  # the write end is not inheritable (os.pipe): its EOF is this process's end

    def guard(self, pgid: int) -> None:
        """Kill group ``pgid`` if this process ends before :meth:`done`."""
        os.write(self._write, f"{pgid}\n".encode())

    def done(self) -> None:
        """Capture ended in order (the group is stopped, its files dealt with): the watchdog exits, killing nothing."""
        with contextlib.suppress(OSError):
            os.write(self._write, b"done\n")
            os.close(self._write)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)


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


def check_port_free(url: str) -> None:
    """UsageError when a process listens on ``url``'s port already: the server could not bind it."""
    where = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((where.hostname, where.port), timeout=2):
            pass
    except OSError:
        return
    raise UsageError(f"another process listens on {where.hostname}:{where.port} (the server line's port): stop it, "
                     "or give the server line another --port")


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group ``pgid``, read from /proc."""
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):  # noqa: PTH208 - names, not paths
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            members.append(int(pid))
    return members


def cpu_seconds(pgid: int) -> float:
    """CPU seconds (user and system) of group ``pgid``'s live members and of the children they reaped.

    Steadier than wall time on a shared machine: a start's compiles and imports cost the same CPU however busy the
    other cores are. A member's unreaped or orphaned children are not in it until reaped.
    """
    total = 0
    for pid in group_members(pgid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime (proc(5) fields 14-17)
    return total / os.sysconf("SC_CLK_TCK")


def listening_inodes(port: int) -> set[str] | None:
    """The socket inodes listening on TCP ``port`` (IPv4 and IPv6), or None where /proc/net cannot tell."""
    found, read = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(fields[9])
    return found if read else None


def owns_port(pgid: int, port: int) -> bool:
    """Whether a process of group ``pgid`` holds the socket that listens on ``port`` (True where /proc cannot tell)."""
    inodes = listening_inodes(port)
    if inodes is None:
        return True
    for pid in group_members(pgid):
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = str(fd.readlink())
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        return True
    return False


def is_error(line: str) -> bool:
    """Whether ``line`` starts an error's report: its first level word is ERROR (or worse), or a traceback starts."""
    if _TRACEBACK.search(line):
        return True
    level = _LEVEL.search(line)
    return level is not None and level.group(1) in ("ERROR", "CRITICAL", "FATAL")


def log_lines(path: Path, end: int | None = None) -> Iterator[tuple[int, str]]:
    """Each line of ``path`` up to byte ``end`` with its offset, streamed; a line is cut at 4 KiB, never held whole."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a generator's with-block is the same
    except OSError:
        return
    with f:
        offset = 0
        while end is None or offset < end:
            raw = f.readline(_LINE_BYTES)
            if not raw:
                return
            start, offset = offset, offset + len(raw)
            rest = raw
            while not rest.endswith(b"\n"):  # the rest of a long line, skipped
                rest = f.readline(_LINE_BYTES)
                if not rest:
                    break
                offset += len(rest)
            yield start, raw.decode(errors="replace").rstrip("\r\n")


def tail(path: Path, lines: int = TAIL_LINES) -> tuple[int, list[str]]:
    """The last ``lines`` lines of ``path`` and the offset of the first of them (a bounded read of its end)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - _TAIL_BYTES)
            f.seek(start)
            data = f.read(_TAIL_BYTES)
    except OSError:
        return 0, []
    if start:  # the first line read is a piece of one
        cut = data.find(b"\n") + 1
        start, data = start + cut, data[cut:]
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    kept = parts[-lines:]
    offset = start + sum(len(p) + 1 for p in parts[:len(parts) - len(kept)])
    return offset, [p[:_LINE_BYTES].decode(errors="replace").rstrip("\r") for p in kept]


@dataclass
class ServerProcess:
    """A server started in a process group of its own, its output going to ``log``; stopped as a whole group."""

    proc: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)
    #: The log's size when the first stopping signal was sent: what follows is the server's answer to it.
    stopped_at: int | None = None
    watchdog: Watchdog | None = None

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str], log: Path, *,
              watchdog: Watchdog | None = None) -> ServerProcess:
        """Start ``argv`` (leading ``NAME=value`` words join ``env``), output into ``log``; OSError if it cannot.

        ``watchdog``: told the group at once, so a capture killed from here on takes the server with it.
        """
        words_env, words = split_env(argv)
        with open(log, "ab") as out:
            proc = subprocess.Popen(words, env={**env, **words_env}, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        if watchdog is not None:
            watchdog.guard(proc.pid)
        return cls(proc, log, watchdog=watchdog)

    def exited(self) -> int | None:
        """The server's exit status once its main process has exited, else None."""
        return self.proc.poll()

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        """The last ``lines`` lines of its output (a bounded read: a server's log can be gigabytes)."""
        return tail(self.log, lines)[1]

    def first_error(self) -> list[str]:
        """The lines from its first error on, when that error is before the tail and before capture's stop.

        A worker's error is logged before the front's traceback; what the server logs after capture's own SIGINT
        (its KeyboardInterrupt) is not its error.
        """
        tail_at = tail(self.log)[0]
        end = tail_at if self.stopped_at is None else min(tail_at, self.stopped_at)
        lines = log_lines(self.log, end)
        for _, line in lines:
            if is_error(line):
                return [line, *(text for _, (_, text) in zip(range(TAIL_LINES - 1), lines, strict=False))]
        return []

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
            return True
        return bool(group_members(self.proc.pid)) or self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGINT the group (a server's Ctrl-C), then SIGTERM, then SIGKILL; the main exit status, None if unreaped.

        A signal that interrupts capture while it waits (Ctrl-C again) kills the group at once and is raised again.
        """
        if self.stopped_at is None:
            with contextlib.suppress(OSError):
                self.stopped_at = self.log.stat().st_size
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
