"""The test side of ``jitwarm capture`` against the stand-in server (tests/test_capture*.py): lines, runs, reads.

Every capture runs as a subprocess, the real command line, except where a test needs capture's 30 s ledger grace,
60 s SIGINT grace or 10 s progress interval shorter (or capture as a container's PID 1 would be, a subreaper): it
runs tests/workers/capture_cli.py, the same command line with those constants replaced.

No wall-clock bound here races a loaded box: a test waits on a file, a pid or an exit, and any bound is at least
ten times what a quiet box needs (a capture of the stand-in takes about 2 s there).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

WORKERS = Path(__file__).resolve().parent
STAND_IN, SHORT_WAITS = WORKERS / "capture_stand_in.py", WORKERS / "capture_cli.py"
#: The longest one capture here may take: a hang fails the test instead of the run (60x a quiet box's).
RUN_TIMEOUT_S = 120.0
#: How long a test waits for an event that takes a second on a quiet box.
EVENT_TIMEOUT_S = 60.0
#: Variables of the developer's shell that would change what the server sees or how capture reaches it.
#: (conftest's _isolated_env already drops JITWARM_*; a proxy: see test_a_proxy_in_the_environment_...)
DROPPED = ("VLLM_PLUGINS", "SGLANG_PLUGINS", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
           "NO_PROXY")


def free_port() -> int:
    """A loopback port nothing listens on now (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended: none left, or a zombie (an orphan's: this box's PID 1 may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float = EVENT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.05)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("jitwarm: error:")]


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server's name for it
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # http.server's signature
        """Quiet."""


@contextmanager
def another_server(port: int) -> Iterator[None]:
    """Another process's /health on ``port`` (this test's own thread: not the server capture starts)."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


class StandIn:
    """One test's stand-in server: its lines, the environment capture runs in, and what the stand-in noted."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.port = tmp, free_port()
        self.out, self.cache, self.inductor = tmp / "stand-in", tmp / "cache", tmp / "inductor"
        self.manifest = tmp / "server.jsonl"
        self.log = tmp / "server.log"
        bin_dir, packages = tmp / "bin", tmp / "packages"
        for d in (self.out, bin_dir, packages / "sglang"):
            d.mkdir(parents=True)
        run_stand_in = f"import runpy\nrunpy.run_path({str(STAND_IN)!r}, run_name='__main__')\n"
        vllm = bin_dir / "vllm"
        vllm.write_text(f"#!{sys.executable}\n{run_stand_in}")
        vllm.chmod(0o755)
        (packages / "sglang" / "__init__.py").write_text("")
        (packages / "sglang" / "launch_server.py").write_text(run_stand_in)
        env = {k: v for k, v in os.environ.items() if k not in DROPPED}
        pythonpath = [str(packages), *filter(None, [env.get("PYTHONPATH")])]
        # Inductor's family only: the other families' default directories (~/.triton/cache, /tmp/torchinductor_*)
        # are shared with whatever else runs on the box, and conftest's JITWARM_RECORD_CACHES=none records nothing.
        self.env = {**env, "JITWARM_RECORD_CACHES": "inductor", "JITWARM_CACHE_DIR": str(self.cache),
                    "TORCHINDUCTOR_CACHE_DIR": str(self.inductor), "STAND_IN_DIR": str(self.out),
                    "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": os.pathsep.join(pythonpath)}

    def vllm_line(self) -> list[str]:
        return ["vllm", "serve", "stand-in/model", "--port", str(self.port)]

    def sglang_line(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", "stand-in/model", "--host",
                "127.0.0.1", f"--port={self.port}"]

    def argv(self, *args: str, short_waits: bool = False) -> list[str]:
        """``jitwarm ARGS``, or with ``short_waits`` the same through tests/workers/capture_cli.py."""
        return [sys.executable, *([str(SHORT_WAITS)] if short_waits else ["-m", "jitwarm"]), *args]

    def run(self, *args: str, env: dict[str, str] | None = None, short_waits: bool = False
            ) -> subprocess.CompletedProcess:
        """Run ``jitwarm ARGS`` to its end, in the test's directory (``server.jsonl`` lands there)."""
        return subprocess.run(self.argv(*args, short_waits=short_waits), cwd=self.tmp, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)

    def capture(self, line: list[str], *flags: str, env: dict[str, str] | None = None, short_waits: bool = False
                ) -> subprocess.CompletedProcess:
        return self.run("capture", "--manifest", str(self.manifest), *flags, "--", *line, env=env,
                        short_waits=short_waits)

    def start_capture(self, env: dict[str, str], short_waits: bool = False, **popen: object) -> subprocess.Popen:
        """Start a capture of the vLLM line without waiting; in a session of its own, as a shell's job would be."""
        return subprocess.Popen(self.argv("capture", "--manifest", str(self.manifest), "--", *self.vllm_line(),
                                          short_waits=short_waits),
                                cwd=self.tmp, env={**self.env, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, **popen)

    def noted(self, name: str) -> dict:
        return json.loads((self.out / f"{name}.json").read_text())

    def signals(self) -> list[str]:
        path = self.out / "signals"
        return path.read_text().split() if path.exists() else []

    def started(self) -> bool:
        return (self.out / "pids.json").exists()

    def serving(self) -> bool:
        return (self.out / "serving").exists()

    def leftovers(self) -> list[str]:
        """What a capture left beside the manifest besides the manifest and the log: nothing, ever."""
        return sorted(p.name for p in self.tmp.iterdir() if p.name.startswith(f".{self.manifest.name}"))

    def assert_stopped(self) -> None:
        """The stand-in's whole process group is gone: the server, its worker, anything else in it."""
        pids = self.noted("pids")
        assert gone(pids["server"]) and gone(pids["worker"]), pids

    def wait_stopped(self) -> None:
        """Wait until the server and its worker have ended (a watchdog's kill is not synchronous with the test)."""
        pids = self.noted("pids")
        wait_for("the stand-in's group gone", lambda: gone(pids["server"]) and gone(pids["worker"]))

    def kill(self) -> None:
        """Kill what is left of the stand-in's group (a test that failed half-way leaves it serving)."""
        if self.started():
            try:
                os.killpg(self.noted("pids")["server"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def stop_capture(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
