"""The fleet key file is held as ssh holds a private key (issue #31, N3, N4): a regular file, read bounded and
without blocking, owned by this user or root, readable by no one else; anything else is exit 2 with one line.

The hostile cases are real: a FIFO nobody writes to (it used to block forever), a link to ``/dev/zero`` (it used to
eat memory), a file another real user owns (``useradd``), a 0644 file. A link the operator gave to a good file is
followed: a Kubernetes Secret's files are links.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from precompile_fixtures import SMALL, jitwarm

from jitwarm.cache import settings

KEY = b"k" * 32


def key_file(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "fleet.key"
    path.write_bytes(KEY + b"\n")
    path.chmod(mode)
    return path


def read_key(monkeypatch, path: Path) -> bytes | None:
    monkeypatch.setenv("JITWARM_TRUST_KEY_FILE", str(path))
    return settings.trust_key()


def test_a_private_regular_file_and_a_link_to_one_are_the_key(tmp_path, monkeypatch):
    path = key_file(tmp_path)
    assert read_key(monkeypatch, path) == KEY
    secret = tmp_path / "..data"  # a Secret volume: the name is a link into a timestamped directory
    secret.mkdir()
    path.replace(secret / "fleet.key")
    (tmp_path / "fleet.key").symlink_to(secret / "fleet.key")
    assert read_key(monkeypatch, tmp_path / "fleet.key") == KEY


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o606, 0o660])
def test_a_key_others_can_read_or_write_is_refused(tmp_path, monkeypatch, mode):
    with pytest.raises(settings.SettingError, match=rf"readable or writable by others \(mode {mode:04o}\)"):
        read_key(monkeypatch, key_file(tmp_path, mode))


def test_a_key_another_user_owns_is_refused(tmp_path, monkeypatch, other_user):
    path = key_file(tmp_path)
    os.chown(path, other_user, -1)
    with pytest.raises(settings.SettingError, match=f"owned by uid {other_user}"):
        read_key(monkeypatch, path)


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "too large", "directory"])
def test_what_is_no_key_file_is_refused_at_once(tmp_path, monkeypatch, kind):
    path = tmp_path / "fleet.key"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "too large":
        path.write_bytes(b"k" * (settings.MAX_KEY_BYTES + 1))
        path.chmod(0o600)
    else:
        path.mkdir(mode=0o700)
    start = time.monotonic()
    with pytest.raises(settings.SettingError, match="JITWARM_TRUST_KEY_FILE: cannot read"):
        read_key(monkeypatch, path)
    assert time.monotonic() - start < 2  # never blocks on a FIFO nor reads /dev/zero to the end


def test_the_command_line_says_it_in_one_line_with_exit_2(tmp_path, prestarted):
    root, _ = prestarted  # export signs the bundle with the fleet key: it reads the file
    proc = jitwarm("export", *SMALL, "--cache-dir", str(root), str(tmp_path / "b.tar"),
                   env={"JITWARM_TRUST_KEY_FILE": str(key_file(tmp_path, 0o644))})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "JITWARM_TRUST_KEY_FILE" in proc.stderr and "chmod 600" in proc.stderr
