"""``jitwarm capture`` on a clean node: private caches, a manifest written whole, its own port, and what it says.

Against the stand-in server (tests/workers/capture_stand_in.py), which writes one Inductor unit into the
``TORCHINDUCTOR_CACHE_DIR`` it is given and records it through jitwarm's real recorder.
"""

from __future__ import annotations

import json
import os
import re
import tracemalloc
from pathlib import Path

import pytest
from workers.capture_harness import another_server, error_lines, wait_for
from workers.capture_stand_in import DEFAULT_UNIT, FIRST_ERROR, WARNED

from jitwarm.precompile import capture_node, server_process, servers
from jitwarm.precompile.manifest import read_manifest
from jitwarm.precompile.server_process import ServerProcess


def recorded_units(manifest: Path) -> list[str]:
    return [r["unit"] for r in read_manifest(manifest) if r["kind"] == "jit_cache"]


# -- a clean node ---------------------------------------------------------------------------------------------


def test_a_unit_already_in_the_callers_cache_is_captured_and_a_rerun_captures_it_again(stand_in):
    # The caller's own Inductor cache holds the unit the start writes: a capture into it stored nothing new.
    mine = stand_in.inductor / DEFAULT_UNIT
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"a pickled FX graph, as Inductor writes it")
    for run in range(2):
        done = stand_in.capture(stand_in.vllm_line(), "--json")

        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["units"] == {"inductor": 1}, run
        assert recorded_units(stand_in.manifest) == [DEFAULT_UNIT]
    noted = stand_in.noted("env")
    private = Path(noted["TMPDIR"]).parent
    # The caller set TORCHINDUCTOR_CACHE_DIR (so does the pod): it is set, to a private folder, removed afterwards.
    assert Path(noted["TORCHINDUCTOR_CACHE_DIR"]).parent == private != stand_in.inductor.parent
    assert not private.exists() and mine.is_file()
    # HOME and XDG_CACHE_HOME are the caller's: a model named by its hub id is cached under them.
    assert (noted["HOME"], noted["XDG_CACHE_HOME"]) == (os.environ.get("HOME"), os.environ.get("XDG_CACHE_HOME"))
    # The private folder reaches no record: a unit is named relative to its library's root.
    assert str(private) not in stand_in.manifest.read_text()


@pytest.mark.parametrize("room", servers.ROOMS)
def test_every_library_cache_of_the_server_is_private(tmp_path, room):
    adapter = servers.adapter(room)
    caller = {"HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"), "TRITON_CACHE_DIR": "/srv/triton",
              "SGLANG_CUTE_AOT_CACHE_DIR": ""}  # set empty: sglang's CuTe cache is off, and stays off
    root = tmp_path / "private"
    root.mkdir()
    env, outside = capture_node.private_env(adapter, caller, root)

    assert outside == {}
    where = capture_node.roots(adapter, env)
    assert all(path is None or path.is_relative_to(root) for path in where.values()), where
    assert where["triton"] is not None and where["inductor"] is not None  # the two every server has
    assert env["HOME"] == caller["HOME"]
    if room == "sglang":
        assert where["cute_dsl"] is None


# -- the manifest, written whole or not at all --------------------------------------------------------------


def test_a_failed_capture_leaves_the_previous_manifest_as_it_was(stand_in):
    assert stand_in.capture(stand_in.vllm_line()).returncode == 0
    before = stand_in.manifest.read_bytes()

    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "die"})

    assert done.returncode == 1, done.stderr
    assert stand_in.manifest.read_bytes() == before and stand_in.leftovers() == []


def test_a_manifest_given_as_a_link_is_replaced_and_its_target_not_written(stand_in, tmp_path):
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("")
    stand_in.manifest.symlink_to(target)
    done = stand_in.capture(stand_in.vllm_line())

    assert done.returncode == 0, done.stderr
    assert not stand_in.manifest.is_symlink() and recorded_units(stand_in.manifest) == [DEFAULT_UNIT]
    assert target.read_text() == ""


def test_a_manifest_that_is_a_directory_is_exit_2_before_the_start(stand_in):
    stand_in.manifest.mkdir()
    done = stand_in.capture(stand_in.vllm_line())

    assert done.returncode == 2, done.stderr
    assert "is a directory" in error_lines(done)[0] and not stand_in.started()


def test_a_manifest_that_cannot_be_written_is_exit_1_before_the_start(stand_in, tmp_path):
    done = stand_in.run("capture", "--manifest", str(tmp_path / "no-such-dir" / "server.jsonl"), "--",
                        *stand_in.vllm_line())

    assert done.returncode == 1, done.stderr
    assert "cannot write the manifest" in error_lines(done)[0] and not stand_in.started()


def test_a_plugin_that_cannot_record_is_exit_1_and_nothing_is_written(stand_in, tmp_path):
    bundle = tmp_path / "kernels.tar"
    done = stand_in.capture(stand_in.vllm_line(), "--export", str(bundle), env={"STAND_IN_MODE": "unrecordable"})

    assert done.returncode == 1, done.stderr
    error = error_lines(done)[0]
    assert "could not record the start: cannot record inductor unit " in error, error
    assert "compiled nothing" not in done.stderr + done.stdout
    assert not stand_in.manifest.exists() and not bundle.exists() and stand_in.leftovers() == []
    stand_in.assert_stopped()


# -- the port -----------------------------------------------------------------------------------------------


def test_a_port_another_process_answers_is_exit_2_before_the_start(stand_in):
    with another_server(stand_in.port):
        done = stand_in.capture(stand_in.vllm_line())

    assert done.returncode == 2, done.stderr
    assert f":{stand_in.port}" in error_lines(done)[0] and not stand_in.started()


def test_health_from_another_process_is_not_the_servers(stand_in):
    # The stand-in never serves; another process takes the port once the server has started.
    proc = stand_in.start_capture({"STAND_IN_MODE": "never_ready"})
    try:
        wait_for("the stand-in started", stand_in.started)
        with another_server(stand_in.port):
            _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    assert proc.returncode == 1, stderr
    assert "no process of the server's group listens" in stderr
    stand_in.assert_stopped()


# -- what capture says ----------------------------------------------------------------------------------------


def test_capture_says_its_progress_keeps_the_log_and_ends_with_the_next_step(stand_in, tmp_path):
    bundle = tmp_path / "kernels.tar"
    done = stand_in.capture(stand_in.vllm_line(), "--export", str(bundle),
                            env={"STAND_IN_DELAY": "3", "CAPTURE_PROGRESS_S": "0.5"}, short_waits=True)

    assert done.returncode == 0, done.stderr
    progress = [line for line in done.stderr.splitlines() if re.match(r"jitwarm: capture: \d+s, waiting for ", line)]
    assert progress, done.stderr
    # The server's phase from its log, and the unit it stored before /health: seen in its private cache.
    assert "1 JIT cache units so far; the server: stand-in: stored 1 unit(s)" in progress[-1]
    assert "stand-in: serving /health" in stand_in.log.read_text()
    out = done.stdout.splitlines()
    assert f"jitwarm: the server's log: {stand_in.log}" in out
    assert out[-1] == f"  jitwarm prestart --manifest {stand_in.manifest} --bundle {bundle} --sha256 " + \
        re.search(r"sha256 ([0-9a-f]{64})", done.stdout).group(1) + " --offline"
    assert "VLLM_PLUGINS=jitwarm" in out[-2]


def test_the_first_error_is_an_error_line_never_a_warning(stand_in):
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "error_after_warning"})

    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    first = lines.index("jitwarm: capture: the server's first error:")
    assert lines[first + 1] == f"  | {FIRST_ERROR}"
    assert f"  | {WARNED}" not in lines[first:]


def test_the_log_is_read_in_bounded_pieces(tmp_path):
    # A 64 MiB log: a progress bar's one long line, then a warning, the first error, and the rest.
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        f.write(b"Loading: " + b"#\r" * (24 << 20) + b"\n")
        f.write(f"{WARNED}\n{FIRST_ERROR}\n".encode())
        f.write(b"".join(b"INFO filler line %d\n" % i for i in range(2_000_000)))
    server = ServerProcess(proc=None, log=log)  # the log alone: no process is asked
    tracemalloc.start()
    try:
        first, last = server.first_error(), server.tail()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert first[0] == FIRST_ERROR and len(first) == 30
    assert last[-1] == "INFO filler line 1999999" and len(last) == 30
    assert peak < 4 << 20, peak  # the file is 64 MiB: never held whole


@pytest.mark.parametrize(("line", "error"), [
    (FIRST_ERROR, True),
    ("(EngineCore pid=7) ERROR 12-05 02:00:00 [core.py:1] boom", True),
    ("ERROR:root:boom", True),
    ("Traceback (most recent call last):", True),
    (WARNED, False),  # holds "OSError:", and is a warning
    ("INFO 12-05 02:00:00 [x.py:1] retrying after ERROR 503", False),
    ("RuntimeError: boom", False),  # a traceback's last line: its first line was the error
])
def test_an_error_line_is_one_whose_level_is_error(line, error):
    assert server_process.is_error(line) is error
