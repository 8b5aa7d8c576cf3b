"""``jitwarm capture -- <server line>``: how it starts a server, sees it ready, stops it, and fails.

The server is a stand-in (tests/workers/capture_stand_in.py), because what is tested here is capture's side of a
start, in seconds: sglang cannot start on this box (no GPU), and a real vLLM start takes minutes on the CPU
(tests/test_real_server.py runs it once, with the real plugin). The stand-in does what capture sees of a start, as
jitwarm's plugin would inside the server: it records (``JITWARM_RECORD``) one complete Inductor unit it writes into
``TORCHINDUCTOR_CACHE_DIR``, stores it in jitwarm's cache, writes the ledger (``JITWARM_LEDGER``), serves
``/health`` on loopback at the line's ``--port``, and notes its pids, environment and signals for the test to read.
It runs as ``vllm serve MODEL`` (a ``vllm`` script first on PATH) and as ``python -m sglang.launch_server`` (a
``sglang`` package first on PYTHONPATH); ``STAND_IN_MODE`` makes it die, never answer, never report, ignore
SIGINT, or leave its worker orphaned. tests/workers/capture_harness.py runs capture and reads what it left.

The signals capture takes are tests/test_capture_signals.py; the clean node, the manifest written whole, the port
and what capture says while it waits are tests/test_capture_node.py. The last tests here are bugs this file found
in capture (a stale ledger, an ``http_proxy``, the line's own ``NAME=value`` words), fixed.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from workers.capture_harness import error_lines, free_port
from workers.capture_stand_in import DEFAULT_UNIT, DYING

from jitwarm.precompile.manifest import capture_of, read_manifest


def units(manifest: Path) -> list[tuple[str, str, str]]:
    return [(r["kind"], r["library"], r["unit"]) for r in read_manifest(manifest) if r["kind"] != "capture"]


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
    assert units(stand_in.manifest) == [("jit_cache", "inductor", DEFAULT_UNIT)]
    # The plugin variable and Inductor's headers off, as capture set them (as the documented pod sets them).
    pod = {"VLLM_PLUGINS": "jitwarm", "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}
    assert capture_of(read_manifest(stand_in.manifest))["environment"] == pod
    assert out["environment"] == pod and out["unrecorded"] == []
    assert out["next"] == (f"jitwarm prestart --manifest {stand_in.manifest} --bundle {bundle} --sha256 "
                           f"{out['sha256']} --offline")
    # Stored and verified where the capture said, and whole in the bundle: a fresh cache imports it. Neither box
    # has restored it where Inductor looks (capture's caches were private), and status says that is all it lacks.
    fresh = tmp_path / "fresh-cache"
    imported = stand_in.run("import", str(bundle), "--cache-dir", str(fresh))
    assert imported.returncode == 0, imported.stderr
    for cache in (stand_in.cache, fresh):
        status = stand_in.run("status", "--json", "--manifest", str(stand_in.manifest), "--cache-dir", str(cache))
        specs = json.loads(status.stdout)["specs"]
        assert status.returncode == 5 and specs["corrupt"] == [], status.stdout + status.stderr
        assert specs["missing"] == list(specs["not_where_looked"]) and len(specs["missing"]) == 1, specs


@pytest.mark.parametrize(("room", "given", "seen"), [
    ("vllm", None, "jitwarm"),  # unset: named, as the documented pod names it (vLLM hashes the variable)
    ("vllm", "other", "other,jitwarm"),
    ("vllm", "jitwarm", "jitwarm"),
    ("vllm", "other, jitwarm", "other, jitwarm"),
    ("sglang", None, "jitwarm"),
    ("sglang", "", "jitwarm"),  # empty: no plugin at all
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
    # The plugin records beside the manifest (the same directory: renamed into place whole at the end).
    recorded = Path(noted["JITWARM_RECORD"])
    assert recorded.is_absolute() and recorded.parent.samefile(stand_in.manifest.parent)
    assert units(stand_in.manifest) == [("jit_cache", "inductor", DEFAULT_UNIT)] and not recorded.exists()


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
    assert units(stand_in.manifest) == [("jit_cache", "inductor", DEFAULT_UNIT)]
    assert capture_of(read_manifest(stand_in.manifest))["environment"] == {"SGLANG_PLUGINS": "jitwarm"}
    stand_in.assert_stopped()


def test_a_server_that_exits_is_exit_1_with_its_status_and_last_lines(stand_in):
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "die"})

    assert done.returncode == 1, done.stderr
    assert "status 3" in error_lines(done)[0]
    assert f"  | {DYING}" in done.stderr.splitlines()
    # A failed capture leaves no manifest (prestart --offline accepted a failed one's records) and no bundle.
    assert not stand_in.manifest.exists() and stand_in.leftovers() == []


def test_a_server_never_ready_is_stopped_at_the_timeout_and_not_blamed_for_capture_s_sigint(stand_in, tmp_path):
    started = time.monotonic()
    bundle = tmp_path / "kernels.tar"
    # On SIGINT it logs a traceback and 40 lines more, as a server's Ctrl-C does: capture's signal, not its error.
    done = stand_in.capture(stand_in.vllm_line(), "--timeout", "3", "--export", str(bundle),
                            env={"STAND_IN_MODE": "never_ready", "STAND_IN_NOISY_STOP": "1"})

    assert done.returncode == 1, done.stderr
    assert "not ready within 3 s" in error_lines(done)[0]
    assert time.monotonic() - started >= 3
    stand_in.assert_stopped()
    assert stand_in.signals() == ["SIGINT"]
    assert "first error" not in done.stderr and "Traceback" in stand_in.log.read_text()
    assert not stand_in.manifest.exists() and not bundle.exists()


def test_a_server_whose_plugin_never_reports_is_exit_1_naming_the_plugin(stand_in):
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "no_ledger", "CAPTURE_LEDGER_GRACE_S": "1"},
                            short_waits=True)

    assert done.returncode == 1, done.stderr
    error = error_lines(done)[0]
    assert "plugin never reported" in error and "VLLM_PLUGINS" in error
    stand_in.assert_stopped()


def test_a_stale_ledger_is_not_the_plugins_report(stand_in, tmp_path):
    stale = tmp_path / "start-ledger.json"
    stale.write_text(json.dumps({"v": 1, "compiled": 0, "families": {}}))
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "no_ledger", "JITWARM_LEDGER": str(stale),
                                                       "CAPTURE_LEDGER_GRACE_S": "1"}, short_waits=True)

    assert done.returncode == 1, done.stderr


def test_a_proxy_in_the_environment_does_not_hide_the_server(stand_in):
    done = stand_in.capture(stand_in.vllm_line(), env={"http_proxy": f"http://127.0.0.1:{free_port()}"})

    assert done.returncode == 0, done.stderr


def test_the_lines_own_plugins_variable_names_jitwarm_too(stand_in):
    done = stand_in.capture(["VLLM_PLUGINS=other", *stand_in.vllm_line()])

    assert done.returncode == 0, done.stderr
    assert stand_in.noted("env")["VLLM_PLUGINS"] == "other,jitwarm"


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
