"""Manifests as an attacker and a full disk meet them: another user's file, a torn last line, special files.

A manifest is code (replay imports the modules its records name), so it is trusted only from this user or root.
A full disk mid-append must cost at most the record being written; readers ignore a torn last line and the next
append cuts it off. The other user is a uid with no account (``chown`` needs root); the full disk is a 64 KiB
tmpfs (mounting needs root). Both skip with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading

import pytest
from precompile_fixtures import jitwarm

from jitwarm.precompile.manifest import ManifestError, append_records, read_manifest
from jitwarm.precompile.recorder import Recorder

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid and mounting a tmpfs need root")
OTHER_UID = 12345  # no account needed: ownership is a number


def record(n: int, pad: int = 0) -> dict:
    """A well-formed Triton record (planning never imports its module)."""
    return {"v": 1, "kind": "triton", "kernel": f"server_kernels:k{n}", "target": "cpu", "name": "k" + "x" * pad,
            "specialization": json.dumps({"n": n})}


def one_line_exit_2(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("jitwarm: error: ") and proc.stderr.count("\n") == 1, proc.stderr


@needs_root
def test_a_manifest_owned_by_another_user_is_refused_unless_allowed(tmp_path, monkeypatch):
    path = tmp_path / "server.jsonl"
    append_records(path, [record(1)])
    os.chown(path, OTHER_UID, OTHER_UID)
    monkeypatch.delenv("JITWARM_ALLOW_SHARED", raising=False)
    with pytest.raises(ManifestError, match=f"refusing manifest {path}: it is owned by uid {OTHER_UID}"):
        read_manifest(path)
    with pytest.raises(ManifestError, match="refusing manifest"):  # root does not append to it either
        append_records(path, [record(2)])
    assert len(path.read_text().splitlines()) == 1
    proc = jitwarm("plan", "--manifest", str(path), env={"JITWARM_ALLOW_SHARED": ""})
    one_line_exit_2(proc)
    assert "JITWARM_ALLOW_SHARED=1" in proc.stderr
    allowed = jitwarm("plan", "--manifest", str(path), "--json", env={"JITWARM_ALLOW_SHARED": "1"})
    assert allowed.returncode == 0 and json.loads(allowed.stdout)["totals"]["specs"] == 1


def test_a_manifest_every_user_can_write_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "server.jsonl"
    append_records(path, [record(1)])
    path.chmod(0o666)
    monkeypatch.delenv("JITWARM_ALLOW_SHARED", raising=False)
    with pytest.raises(ManifestError, match="writable by every user"):
        read_manifest(path)
    one_line_exit_2(jitwarm("warm", "--manifest", str(path), "--cache-dir", str(tmp_path / "c"),
                            env={"JITWARM_ALLOW_SHARED": ""}))


def test_a_torn_last_line_is_ignored_once_and_the_next_append_repairs_it(tmp_path, caplog):
    path = tmp_path / "server.jsonl"
    append_records(path, [record(1), record(2)])
    whole = path.read_bytes()
    path.write_bytes(whole + json.dumps(record(3)).encode()[:40])  # an append cut short: no newline
    with caplog.at_level(logging.WARNING, logger="jitwarm.manifest"):
        assert read_manifest(path) == [record(1), record(2)]
        assert read_manifest(path) == [record(1), record(2)]
    assert sum("torn" in r.getMessage() for r in caplog.records) == 1  # said once
    planned = jitwarm("plan", "--manifest", str(path), "--json")
    assert planned.returncode == 0 and json.loads(planned.stdout)["totals"]["specs"] == 2
    assert append_records(path, [record(3)]) == 1
    assert path.read_bytes() == whole + (json.dumps(record(3), sort_keys=True) + "\n").encode()
    assert read_manifest(path) == [record(1), record(2), record(3)]


def test_a_last_record_without_its_newline_is_kept_and_appended_after(tmp_path):
    path = tmp_path / "server.jsonl"
    path.write_text(json.dumps(record(1)))  # written by hand, no final newline: a whole record, not a torn one
    assert read_manifest(path) == [record(1)]
    assert append_records(path, [record(2)]) == 1
    assert read_manifest(path) == [record(1), record(2)]


@contextlib.contextmanager
def tiny_tmpfs(where, size="64k"):
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@needs_root
def test_a_full_disk_while_recording_loses_only_what_did_not_fit(tmp_path, caplog):
    with tiny_tmpfs(tmp_path / "disk") as disk:
        filler = disk / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:  # fill the disk, then free 6 KiB
            f.write(b"x" * (1 << 20))
        os.truncate(filler, max(0, filler.stat().st_size - 6 * 1024))
        manifest = disk / "server.jsonl"
        recorder = Recorder(manifest)
        records = [record(n, pad=200) for n in range(200)]
        with caplog.at_level(logging.WARNING, logger="jitwarm.record"):
            for r in records:
                recorder.add(r)
        assert any("No space left" in m.getMessage() for m in caplog.records)
        kept = read_manifest(manifest)  # no torn line: every record is whole
        assert manifest.read_bytes().endswith(b"\n")
        assert 0 < recorder.recorded == len(kept) < len(records)
        assert kept == records[:len(kept)]
        filler.unlink()  # space again: the records that failed were not marked seen, so they are recorded now
        for r in records:
            recorder.add(r)
        assert read_manifest(manifest) == records and recorder.recorded == len(records)
        planned = jitwarm("plan", "--manifest", str(manifest), "--json")
        assert planned.returncode == 0 and json.loads(planned.stdout)["totals"]["specs"] == len(records)


@pytest.mark.parametrize("make", ["directory", "proc_mem", "fifo", "dev_zero", "missing"])
def test_special_files_as_a_manifest_are_one_line_and_exit_2(tmp_path, make):
    path = tmp_path / "m.jsonl"
    if make == "directory":
        path.mkdir()
    elif make == "proc_mem":
        path = "/proc/self/mem"
    elif make == "fifo":
        os.mkfifo(path)
    elif make == "dev_zero":
        path = "/dev/zero"
    for command in (["plan"], ["warm", "--cache-dir", str(tmp_path / "c")]):
        one_line_exit_2(jitwarm(*command, "--manifest", str(path), timeout=60))


@pytest.mark.parametrize("version", [True, 1.0, "1", 2, None])
def test_a_version_that_is_not_the_integer_1_is_refused(tmp_path, version):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({**record(1), "v": version}) + "\n")
    with pytest.raises(ManifestError, match="not a jitwarm manifest record"):
        read_manifest(path)
    one_line_exit_2(jitwarm("plan", "--manifest", str(path)))


def test_an_append_waits_for_another_process_holding_the_manifest_and_adds_only_what_it_lacks(tmp_path):
    """The manifest is its own lock file (filelock's flock on it): no sidecar file, the file never removed."""
    path = tmp_path / "server.jsonl"
    append_records(path, [record(1)])
    holder = subprocess.Popen(  # another rank: holds the manifest's lock, appends record 2, then lets go
        [sys.executable, "-c", "import fcntl, json, os, sys\n"
         f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_APPEND)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.readline()\n"
         f"os.write(fd, (json.dumps({record(2)!r}, sort_keys=True) + '\\n').encode())\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        added: list[int] = []
        appender = threading.Thread(target=lambda: added.append(append_records(path, [record(2), record(3)])))
        appender.start()
        appender.join(0.5)
        assert appender.is_alive() and not added  # blocked on the other process's lock, nothing written
        holder.stdin.write("\n")
        holder.stdin.flush()
        appender.join(30)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
    assert added == [1]  # record 2 was there by the time the lock was ours: only record 3 added
    assert read_manifest(path) == [record(1), record(2), record(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.jsonl"]


@pytest.mark.parametrize("content", [b'{"v": 1, "kind": ["triton"], "target": "sm_90"}\n',  # unhashable kind
                                     b'{"v": 1, "kind": {"a": 1}}\n'])
def test_a_kind_that_is_not_a_string_is_refused(tmp_path, content):
    path = tmp_path / "m.jsonl"
    path.write_bytes(content)
    one_line_exit_2(jitwarm("plan", "--manifest", str(path)))


@pytest.mark.parametrize("content", [b'{"v": 1, "kind": "tri', b"\x00" * 64, b"x" * 70_000],
                         ids=["killed-first-append", "nul", "long"])
def test_a_manifest_whose_only_line_is_torn_is_one_error(tmp_path, content):
    """No complete record to warn past: one line, exit 2 (not a torn-line warning, then "the plan is empty")."""
    path = tmp_path / "m.jsonl"
    path.write_bytes(content)
    proc = jitwarm("plan", "--manifest", str(path))
    one_line_exit_2(proc)
    assert "holds no complete record" in proc.stderr
    assert append_records(path, []) == 0 and path.read_bytes() == b""  # the next append still repairs it
