"""The driver's PTX cache index, captured while a real writer process rewrites it in place: never stored torn.

The CUDA driver rewrites ``ComputeCache/index`` while a process runs (no GPU here: the writer is a second
process that rewrites the file the way an in-place writer does, truncate then write in two parts with a pause
between, in bursts). Each version carries its own length and sha256, so a torn one is seen for what it is.
"""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
import time

from jitwarm.cache import KernelCache
from jitwarm.kernels.artifacts import artifact
from jitwarm.kernels.libraries.jit_caches import ptx
from jitwarm.kernels.libraries.jit_caches.backend import store

WRITER = r"""
import hashlib, struct, sys, time
from pathlib import Path
index, until, sample = Path(sys.argv[1]), time.monotonic() + float(sys.argv[2]), Path(sys.argv[3])
v = 0
while time.monotonic() < until:
    burst = time.monotonic() + 0.3
    while time.monotonic() < burst:  # a burst of rewrites, then a quiet moment (the driver between compiles)
        v += 1
        body = bytes([v % 251]) * (2000 + 37 * (v % 50))
        head = b"IDX1" + struct.pack("<QI", v, len(body))
        with open(index, "r+b") as f:
            f.truncate(0)
            f.write(head + body[: len(body) // 2])
            f.flush()
            if v == 1:  # what a plain read sees now, kept for the test
                sample.write_bytes(index.read_bytes())
            time.sleep(0.02)  # half written: a reader now sees a torn index
            f.write(body[len(body) // 2:] + hashlib.sha256(head + body).digest())
        entry = index.parent / "a" / f"{v:x}"
        entry.parent.mkdir(exist_ok=True)
        entry.write_bytes(body[:64])
        time.sleep(0.01)
    time.sleep(0.4)
"""


def version(v: int, body: bytes) -> bytes:
    """Version ``v`` of the index as the writer writes it: a header with its length, the body, their sha256."""
    head = b"IDX1" + struct.pack("<QI", v, len(body))
    return head + body + hashlib.sha256(head + body).digest()


def whole(data: bytes) -> bool:
    """Whether ``data`` is one whole version the writer wrote."""
    if len(data) < 16 + 32 or data[:4] != b"IDX1":
        return False
    _, n = struct.unpack("<QI", data[4:16])
    return len(data) == 16 + n + 32 and hashlib.sha256(data[:16 + n]).digest() == data[16 + n:]


def test_a_capture_never_stores_an_index_the_driver_is_rewriting(tmp_path):
    root = tmp_path / "nv"
    root.mkdir()
    # The index the writer finds is a whole version too: a capture taken before its first rewrite (its start can
    # take longer than QUIET_S on a loaded box) stores this one, as it should.
    (root / ptx.INDEX).write_bytes(version(0, b"\0" * 2000))
    cache = KernelCache(tmp_path / "cache")
    sample = tmp_path / "plain-read"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root / ptx.INDEX), "3.5", str(sample)])
    stored, refused = [], 0
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            files = ptx.LIBRARY.units(root)["."]
            try:
                stored.append(store(ptx.LIBRARY, root, ".", files, cache, target="sm_90"))
            except Exception:  # noqa: BLE001 - refused by the entry's check: the two reads saw two versions
                refused += 1
    finally:
        writer.wait(timeout=30)
    assert not whole(sample.read_bytes())  # a plain read in the middle of a rewrite would have stored a torn index
    assert stored, f"no capture succeeded ({refused} refused)"
    for spec in stored:
        entry = artifact(spec).lookup(cache)
        assert entry is not None
        assert whole((entry.path / ptx.INDEX).read_bytes()), spec.params_dict["files"]
    assert not cache.verify().corrupt


def test_a_settled_read_waits_for_a_quiet_file_and_gives_up_on_one_that_keeps_changing(tmp_path):
    path = tmp_path / "index"
    path.write_bytes(b"v1")
    t0 = time.monotonic()
    assert ptx.settled_bytes(path, quiet_s=0.2) == b"v1"
    assert time.monotonic() - t0 >= 0.15  # written just now: read only once it had been left alone
    writer = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "t = time.monotonic() + 2\nwhile time.monotonic() < t:\n"
                               "    Path(sys.argv[1]).write_bytes(str(time.time()).encode()); time.sleep(0.02)",
                               str(path)])
    try:
        deadline = time.monotonic() + 30
        while path.read_bytes() == b"v1" and time.monotonic() < deadline:  # the writer has started
            time.sleep(0.01)
        try:
            ptx.settled_bytes(path, quiet_s=0.2, timeout_s=0.8)
        except OSError as exc:
            assert "kept changing" in str(exc)
        else:
            raise AssertionError("a file rewritten every 20 ms was read as settled")
    finally:
        writer.wait(timeout=30)


def test_an_index_read_in_a_truncates_gap_is_read_again(tmp_path, monkeypatch):
    """ext4 shows a truncate's new size before its new mtime: for an instant the index is empty and looks quiet.

    The instant is made certain here, and as long as a loaded box can make it: the file is empty and quiet when
    read, and the writer's new version lands only after the reader has waited twice. An empty index is never a
    version; any other empty file is one.
    """
    index, entry = tmp_path / ptx.INDEX, tmp_path / "a" / "1"
    index.write_bytes(b"")
    entry.parent.mkdir()
    entry.write_bytes(b"")
    time.sleep(ptx.QUIET_S + 0.05)
    assert ptx.LIBRARY.stored_bytes(tmp_path, "a/1") == b""
    new = version(1, b"\1" * 100)
    sleeps, real_sleep = [], time.sleep

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:  # a writer preempted between its truncate and its mtime, longer than one look
            index.write_bytes(new)
        real_sleep(seconds)

    monkeypatch.setattr(ptx.time, "sleep", sleep)
    assert ptx.LIBRARY.stored_bytes(tmp_path, ptx.INDEX) == new  # not the empty file it read first
    assert len(sleeps) > 3  # then it waited for the new version to be quiet in its turn
