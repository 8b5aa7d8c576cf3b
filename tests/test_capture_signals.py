"""``jitwarm capture`` interrupted: SIGINT, SIGTERM, SIGHUP and SIGKILL all leave no server and no manifest.

Capture runs as a shell's job would (a session of its own), against the stand-in server
(tests/workers/capture_stand_in.py) serving but never reporting, so capture is waiting when the signal comes. Every
wait is on an event (a file, a pid, an exit); a bound that proves "capture did not wait the grace" sets the grace to
60 s and allows 30 s, far above a quiet box's second.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from workers.capture_harness import RUN_TIMEOUT_S, StandIn, gone, stop_capture, wait_for


def private_root(stand_in: StandIn) -> Path:
    """The private folder the capture gave the server (its TMPDIR's parent)."""
    return Path(stand_in.noted("env")["TMPDIR"]).parent


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_stopping_signal_stops_the_server_and_leaves_no_manifest(stand_in, tmp_path, sig, code):
    bundle = tmp_path / "kernels.tar"
    proc = stand_in.start_capture({"STAND_IN_MODE": "no_ledger"})
    try:
        wait_for("the stand-in serves", stand_in.serving)
        proc.send_signal(sig)  # capture only: the server is in a session of its own
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)

        assert proc.returncode == code, stderr
        assert "interrupted" in stderr
        stand_in.assert_stopped()
        assert stand_in.signals() == ["SIGINT"]  # the server is stopped as its operator stops it
        assert not stand_in.manifest.exists() and not bundle.exists() and stand_in.leftovers() == []
        assert not private_root(stand_in).exists()
    finally:
        stop_capture(proc)


def test_ctrl_c_reaches_a_capture_started_with_sigint_ignored(stand_in):
    # A background job of a non-interactive shell inherits SIGINT ignored; Python then never raises on it.
    proc = stand_in.start_capture({"STAND_IN_MODE": "no_ledger"},
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_for("the stand-in serves", stand_in.serving)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)

        assert proc.returncode == 130, stderr
        stand_in.assert_stopped()
    finally:
        stop_capture(proc)


def test_a_killed_capture_takes_the_server_group_with_it(stand_in):
    proc = stand_in.start_capture({"STAND_IN_MODE": "no_ledger"})
    try:
        wait_for("the stand-in serves", stand_in.serving)
        root = private_root(stand_in)
        proc.kill()  # SIGKILL: capture runs no code of its own; its watchdog sees the pipe close
        proc.communicate(timeout=RUN_TIMEOUT_S)

        stand_in.wait_stopped()
        wait_for("the private caches removed", lambda: not root.exists())
        wait_for("the record file removed", lambda: stand_in.leftovers() == [])
        assert not stand_in.manifest.exists()
    finally:
        stop_capture(proc)


def test_a_server_that_ignores_sigint_is_terminated_after_the_grace(stand_in):
    grace_s = 1.0
    started = time.monotonic()
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "ignore_sigint",
                                                       "CAPTURE_STOP_GRACE_S": str(grace_s)}, short_waits=True)

    assert done.returncode == 0, done.stderr
    assert stand_in.signals() == ["SIGINT", "SIGTERM"]
    assert time.monotonic() - started >= grace_s
    stand_in.assert_stopped()  # the worker ignored SIGINT too: SIGTERM reached the whole group


def test_ctrl_c_while_stopping_kills_the_server_at_once(stand_in):
    proc = stand_in.start_capture({"STAND_IN_MODE": "ignore_sigint", "CAPTURE_STOP_GRACE_S": "60"},
                                  short_waits=True)
    try:
        wait_for("capture's SIGINT", lambda: "SIGINT" in stand_in.signals())  # ready, capture in stop()'s grace
        asked = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=RUN_TIMEOUT_S)

        stand_in.wait_stopped()
        assert time.monotonic() - asked < 30  # not the 60 s grace
        assert proc.returncode == 130
    finally:
        stop_capture(proc)


def test_a_worker_that_outlives_its_server_does_not_hold_capture(stand_in):
    grace_s = 60.0
    done = stand_in.capture(stand_in.vllm_line(), env={"STAND_IN_MODE": "orphan_worker", "CAPTURE_SUBREAPER": "1",
                                                       "CAPTURE_STOP_GRACE_S": str(grace_s),
                                                       "CAPTURE_TERM_GRACE_S": "0.5"}, short_waits=True)
    ended = time.time()

    assert done.returncode == 0, done.stderr
    # The worker exits half a second after SIGINT: capture's stop is over well within the SIGINT grace.
    assert ended - (stand_in.out / "signals").stat().st_mtime < grace_s / 2
    assert gone(stand_in.noted("pids")["worker"])
