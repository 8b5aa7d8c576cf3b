"""``jitwarm capture -- <server line>``: how it starts a server, sees it ready, stops it, and fails.

The server is a stand-in (tests/workers/capture_stand_in.py), because what is tested here is capture's side of a
start, in seconds: sglang cannot start on this box (no GPU), and a real vLLM start takes minutes on the CPU
(tests/test_real_server.py runs it once, with the real plugin). The stand-in does what capture sees of a start, as
jitwarm's plugin would inside the server: it records (``JITWARM_RECORD``) one complete Inductor unit it writes into
``TORCHINDUCTOR_CACHE_DIR``, stores it in jitwarm's cache, writes the ledger (``JITWARM_LEDGER``), serves
``/health`` on loopback at the line's ``--port``, and notes its pids, environment and signals for the test to read.
It runs as ``vllm serve MODEL`` (a ``vllm`` script first on PATH) and as ``python -m sglang.launch_server`` (a
``sglang`` package first on PYTHONPATH); ``STAND_IN_MODE`` makes it die, never answer, never report, ignore
SIGINT, or leave its worker orphaned.

Every capture runs as a subprocess, the real command line, except where a test needs capture's 30 s ledger grace
or 60 s SIGINT grace shorter (or capture as a container's PID 1 would be, a subreaper): it runs
tests/workers/capture_cli.py, the same command line with those constants replaced (capture reads neither from the
environment). The last five tests are bugs this file found in capture (a Ctrl-C while stopping, a stale ledger, an
``http_proxy``, the line's own ``NAME=value`` words, a container's PID 1 holding zombies), fixed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workers.capture_stand_in import DEFAULT_UNIT, DYING

from jitwarm.precompile.manifest import read_manifest

WORKERS = Path(__file__).resolve().parent / "workers"
STAND_IN, SHORT_WAITS = WORKERS / "capture_stand_in.py", WORKERS / "capture_cli.py"
#: The longest one capture here may take: a hang fails the test instead of the run.
RUN_TIMEOUT_S = 60.0
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
    """Whether no process ``pid`` is left."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class StandIn:
    """One test's stand-in server: its lines, the environment capture runs in, and what the stand-in noted."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.port = tmp, free_port()
        self.out, self.cache, self.inductor = tmp / "stand-in", tmp / "cache", tmp / "inductor"
        self.manifest = tmp / "server.jsonl"
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

    def noted(self, name: str) -> dict:
        return json.loads((self.out / f"{name}.json").read_text())

    def signals(self) -> list[str]:
        path = self.out / "signals"
        return path.read_text().split() if path.exists() else []

    def started(self) -> bool:
        return (self.out / "pids.json").exists()

    def assert_stopped(self) -> None:
        """The stand-in's whole process group is gone: the server, its worker, anything else in it."""
        pids = self.noted("pids")
        with pytest.raises(ProcessLookupError):
            os.killpg(pids["server"], 0)
        assert gone(pids["server"]) and gone(pids["worker"]), pids

    def kill(self) -> None:
        """Kill what is left of the stand-in's group (a test that failed half-way leaves it serving)."""
        if self.started():
            try:
                os.killpg(self.noted("pids")["server"], signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def stand_in(tmp_path):
    server = StandIn(tmp_path)
    try:
        yield server
    finally:
        server.kill()


def wait_for(what: str, predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.05)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("jitwarm: error:")]


def test_capture_stores_the_starts_unit_stops_the_group_and_bundles_it(stand_in, tmp_path):
    bundle = tmp_path / "captured.tar"
    done = stand_in.capture(stand_in.vllm_line(), "--json", "--export", str(bundle))

    assert done.returncode == 0, done.stderr
    stand_in.assert_stopped()
    # Ctrl-C's signal first, as a server's operator stops it; the stand-in stopped on it.
    assert stand_in.signals() == ["SIGINT"]
    out = json.loads(done.stdout)
    assert (out["units"], out["entries"], out["manifest"]) == ({"inductor": 1}, 1, str(stand_in.manifest))
    assert out["sha256"] == hashlib.sha256(bundle.read_bytes()).hexdigest()
    assert [(r["kind"], r["library"], r["unit"]) for r in read_manifest(stand_in.manifest)] == [
        ("jit_cache", "inductor", DEFAULT_UNIT)]
    # Stored and verified where the capture said, and whole in the bundle: a fresh cache imports it.
    status = stand_in.run("status", "--manifest", str(stand_in.manifest), "--cache-dir", str(stand_in.cache))
    assert status.returncode == 0, status.stdout + status.stderr
    fresh = tmp_path / "fresh-cache"
    imported = stand_in.run("import", str(bundle), "--cache-dir", str(fresh))
    assert imported.returncode == 0, imported.stderr
    status = stand_in.run("status", "--manifest", str(stand_in.manifest), "--cache-dir", str(fresh))
    assert status.returncode == 0, status.stdout + status.stderr


@pytest.mark.parametrize(("room", "given", "seen"), [
    ("vllm", None, None),  # unset: the server loads every installed plugin, jitwarm's among them
    ("vllm", "other", "other,jitwarm"),
    ("vllm", "jitwarm", "jitwarm"),
    ("vllm", "other, jitwarm", "other, jitwarm"),
    ("sglang", None, None),
    ("sglang", "other", "other,jitwarm"),
])
def test_the_server_loads_jitwarms_plugin_and_records_into_the_manifest(stand_in, room, given, seen):
    variable = {"vllm": "VLLM_PLUGINS", "sglang": "SGLANG_PLUGINS"}[room]
    line = stand_in.vllm_line() if room == "vllm" else stand_in.sglang_line()
    # A relative --manifest: the server runs wherever its line says, so the path it is given must be absolute.
    done = stand_in.run("capture", "--manifest", stand_in.manifest.name, "--", *line,
                        env={variable: given} if given is not None else None)

    assert done.returncode == 0, done.stderr
    noted = stand_in.noted("env")
    assert noted[variable] == seen
    assert Path(noted["JITWARM_RECORD"]).is_absolute()
    assert Path(noted["JITWARM_RECORD"]).samefile(stand_in.manifest)


def test_the_operators_ledger_path_is_where_the_plugin_writes(stand_in, tmp_path):
    mine = tmp_path / "start-ledger.json"
    done = stand_in.capture(stand_in.vllm_line(), "--json", env={"JITWARM_LEDGER": str(mine)})

    assert done.returncode == 0, done.stderr
    assert stand_in.noted("env")["JITWARM_LEDGER"] == str(mine)
    ledger = json.loads(mine.read_text())
    assert ledger["pid"] == stand_in.noted("pids")["server"]  # this start's, written there
    assert json.loads(done.stdout)["compiled"] == ledger["compiled"]  # and what capture read


def test_an_sglang_line_is_captured_at_its_own_port(stand_in):
    done = stand_in.capture(stand_in.sglang_line(), "--json")

    assert done.returncode == 0, done.stderr
    # Not sglang's default port (30000): the stand-in only answers at the line's.
    assert f"waiting for http://127.0.0.1:{stand_in.port}/health" in done.stderr
    assert json.loads(done.stdout)["units"] == {"inductor": 1}
    assert [r["unit"] for r in read_manifest(stand_in.manifest)] == [DEFAULT_UNIT]
    stand_in.assert_stopped()


def test_a_server_that_exits_is_exit_1_with_its_status_and_last_lines(stand_in):
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "die"})

    assert done.returncode == 1, done.stderr
    assert "status 3" in error_lines(done)[0]
    assert f"  | {DYING}" in done.stderr.splitlines()
    assert not stand_in.manifest.exists()


def test_a_server_never_ready_is_stopped_at_the_timeout(stand_in):
    started = time.monotonic()
    done = stand_in.capture(stand_in.vllm_line(), "--timeout", "3", env={"STAND_IN_MODE": "never_ready"})

    assert done.returncode == 1, done.stderr
    assert "not ready within 3 s" in error_lines(done)[0]
    assert time.monotonic() - started >= 3
    stand_in.assert_stopped()
    assert stand_in.signals() == ["SIGINT"]


def test_a_server_whose_plugin_never_reports_is_exit_1_naming_the_plugin(stand_in):
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "no_ledger", "CAPTURE_LEDGER_GRACE_S": "1"},
                            short_waits=True)

    assert done.returncode == 1, done.stderr
    error = error_lines(done)[0]
    assert "plugin never reported" in error and "VLLM_PLUGINS" in error
    stand_in.assert_stopped()


def test_a_server_that_ignores_sigint_is_terminated_after_the_grace(stand_in):
    grace_s = 1.0
    started = time.monotonic()
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "ignore_sigint",
                                                       "CAPTURE_STOP_GRACE_S": str(grace_s)}, short_waits=True)

    assert done.returncode == 0, done.stderr
    assert stand_in.signals() == ["SIGINT", "SIGTERM"]
    assert time.monotonic() - started >= grace_s
    stand_in.assert_stopped()  # the worker ignored SIGINT too: SIGTERM reached the whole group


def start_capture(stand_in: StandIn, env: dict[str, str], short_waits: bool = False) -> subprocess.Popen:
    """Start a capture of the vLLM line without waiting; in a session of its own, as a shell's job would be."""
    return subprocess.Popen(stand_in.argv("capture", "--manifest", str(stand_in.manifest), "--",
                                          *stand_in.vllm_line(), short_waits=short_waits),
                            cwd=stand_in.tmp, env={**stand_in.env, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def stop_capture(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def test_ctrl_c_stops_the_server_and_exits_130(stand_in):
    # Serving but never reporting: capture is waiting for the ledger when Ctrl-C comes.
    proc = start_capture(stand_in, {"STAND_IN_MODE": "no_ledger"})
    try:
        wait_for("the stand-in serves", lambda: (stand_in.out / "serving").exists())
        proc.send_signal(signal.SIGINT)  # capture only: the server is in a session of its own
        _, stderr = proc.communicate(timeout=10)

        assert proc.returncode == 130, stderr
        assert "interrupted" in stderr
        stand_in.assert_stopped()
        assert stand_in.signals() == ["SIGINT"]
    finally:
        stop_capture(proc)


def test_ctrl_c_while_stopping_still_stops_the_server(stand_in):
    proc = start_capture(stand_in, {"STAND_IN_MODE": "ignore_sigint", "CAPTURE_STOP_GRACE_S": "20"},
                         short_waits=True)
    try:
        wait_for("capture's SIGINT", lambda: "SIGINT" in stand_in.signals())  # ready, capture in stop()'s grace
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)

        wait_for("the server gone", lambda: gone(stand_in.noted("pids")["server"]), timeout_s=3)
    finally:
        stop_capture(proc)


def test_a_stale_ledger_is_not_the_plugins_report(stand_in, tmp_path):
    stale = tmp_path / "start-ledger.json"
    stale.write_text(json.dumps({"v": 1, "compiled": 0, "families": {}}))
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "no_ledger", "JITWARM_LEDGER": str(stale),
                                                       "CAPTURE_LEDGER_GRACE_S": "1"}, short_waits=True)

    assert done.returncode == 1, done.stderr


def test_a_proxy_in_the_environment_does_not_hide_the_server(stand_in):
    done = stand_in.capture(stand_in.vllm_line(), "--timeout", "3",
                            env={"http_proxy": f"http://127.0.0.1:{free_port()}"})

    assert done.returncode == 0, done.stderr


def test_the_lines_own_plugins_variable_names_jitwarm_too(stand_in):
    done = stand_in.capture(["VLLM_PLUGINS=other", *stand_in.vllm_line()])

    assert done.returncode == 0, done.stderr
    assert stand_in.noted("env")["VLLM_PLUGINS"] == "other,jitwarm"


def test_a_worker_that_outlives_its_server_does_not_hold_capture(stand_in):
    grace_s = 3.0
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "orphan_worker", "CAPTURE_SUBREAPER": "1",
                                                       "CAPTURE_STOP_GRACE_S": str(grace_s),
                                                       "CAPTURE_TERM_GRACE_S": "0.5"}, short_waits=True)
    ended = time.time()

    assert done.returncode == 0, done.stderr
    # The worker exits half a second after SIGINT: capture's stop is over well within the SIGINT grace.
    assert ended - (stand_in.out / "signals").stat().st_mtime < grace_s


@pytest.mark.parametrize("args", [
    [],  # no --
    ["--"],  # nothing after it
    ["--", "ls", "-l"],  # no room's launcher
    ["--", "--model-path", "m"],  # bare flags: capture must know which server to start
])
def test_a_capture_without_a_server_line_is_exit_2_in_one_line(stand_in, args):
    done = stand_in.run("capture", "--manifest", str(stand_in.manifest), *args)

    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and error_lines(done), done.stderr
    assert not stand_in.started()


@pytest.mark.parametrize("port", ["abc", "70000"])
def test_a_server_line_whose_port_is_not_one_is_exit_2_before_it_starts(stand_in, port):
    done = stand_in.capture(["vllm", "serve", "stand-in/model", "--port", port])

    assert done.returncode == 2, done.stderr
    assert port in error_lines(done)[0]
    assert not stand_in.started()
