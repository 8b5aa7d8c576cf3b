"""The remote tier across processes: exactly once per fleet, a killed lease holder, tampering, Redis going away.

Each "node" is a process with its own cache root; all share one real redis-server.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import pytest
from precompile_fixtures import TINY_FAST, jitwarm, plan_of, start_jitwarm
from remote_fixtures import RedisServer, Remote, assert_built_locally, redis_server_binary, warm_while_the_store_stops
from workers.cache_harness import artifact_bytes, build_counts, desc, wait_for_file

from jitwarm.cache import KernelCache
from jitwarm.kernels.artifacts import artifact

LEASE_ENV = {"JITWARM_REMOTE_LEASE_S": "2"}


def _results(procs, timeout: float = 60.0) -> list[dict]:
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"node failed ({proc.returncode}):\n{stdout}\n{stderr}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _start_together(procs, ready: Path, go: Path) -> None:
    deadline = time.monotonic() + 30
    while len(list(ready.iterdir())) < len(procs):
        assert time.monotonic() < deadline, "nodes did not get ready"
        time.sleep(0.01)
    go.touch()


def test_one_build_per_fleet_with_host_locks_and_fleet_lease(remote, tmp_path):
    """Three nodes with two processes each: one builds, one per other node downloads, the rest wait locally."""
    counter, ready, go = tmp_path / "builds.log", tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    procs = [remote.spawn(tmp_path / f"node{i // 2}", 0, counter=counter, sleep=1.0, go=go, ready_dir=ready,
                          in_build=tmp_path / "in-build") for i in range(6)]
    _start_together(procs, ready, go)
    results = _results(procs)
    assert build_counts(counter) == {0: 1}
    assert sorted(r["outcome"] for r in results) == ["built", "downloaded", "downloaded", "waited", "waited",
                                                     "waited"]
    builder = next(r for r in results if r["outcome"] == "built")
    for r in results:
        if r["outcome"] == "downloaded":  # waited on the lease, and was told who held it
            assert r["stats"]["lease_waits"] == 1 and r["holder"]["pid"] == builder["pid"]
    for node in range(3):
        entry = KernelCache(root=tmp_path / f"node{node}", layers=()).lookup(builder["key"])
        assert entry is not None and entry.file("kernel.bin").read_bytes() == artifact_bytes(0)


def test_killed_lease_holder_is_taken_over_after_the_lease_expires(remote, tmp_path):
    counter, in_build = tmp_path / "builds.log", tmp_path / "in-build"
    holder = remote.spawn(tmp_path / "node0", 1, counter=counter, hang=True, in_build=in_build, env=LEASE_ENV)
    try:
        wait_for_file(in_build)
        key = remote.cache(tmp_path / "probe").key(desc(1))
        assert remote.client().exists(remote.lease_name(key)) and not remote.client().exists(remote.entry_name(key))
        waiter = remote.spawn(tmp_path / "node1", 1, counter=counter, on_wait=tmp_path / "waiting",
                              timeout=30, env=LEASE_ENV)
        wait_for_file(tmp_path / "waiting")
        time.sleep(2.5)  # the heartbeat keeps a live holder's 2 s lease: the waiter must still be waiting
        assert waiter.poll() is None and build_counts(counter) == {1: 1}
        killed_at = time.monotonic()
        holder.kill()
        holder.communicate()
        [result] = _results([waiter], timeout=30)
        assert time.monotonic() - killed_at < 10  # lease expiry (2 s) plus polling, not the 30 s deadline
    finally:
        for proc in (holder,):
            if proc.poll() is None:
                proc.kill()
    assert result["outcome"] == "built" and result["holder"]["pid"] == holder.pid
    assert build_counts(counter) == {1: 2}  # the dead holder's partial build, then the takeover
    late = remote.cache(tmp_path / "node2").get_or_build_ex(desc(1), lambda d: pytest.fail("must download"))
    assert late.outcome == "downloaded" and late.entry.file("kernel.bin").read_bytes() == artifact_bytes(1)


def test_altered_blob_is_rejected_by_every_reader_and_rebuilt_once(remote, tmp_path):
    counter, ready, go = tmp_path / "builds.log", tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    key = remote.cache(tmp_path / "origin").get_or_build(desc(2), lambda d: (d / "kernel.bin").write_bytes(
        artifact_bytes(2))).key
    client = remote.client()
    blob = bytearray(client.hget(remote.entry_name(key), "file:kernel.bin"))
    blob[0] ^= 0x01
    client.hset(remote.entry_name(key), "file:kernel.bin", bytes(blob))
    procs = [remote.spawn(tmp_path / f"node{i}", 2, counter=counter, sleep=1.0, go=go, ready_dir=ready)
             for i in range(3)]
    _start_together(procs, ready, go)
    results = _results(procs)
    assert build_counts(counter) == {2: 1}
    assert sorted(r["outcome"] for r in results) == ["built", "downloaded", "downloaded"]
    assert [r["stats"]["remote_rejected"] for r in results] == [1, 1, 1]
    for i in range(3):
        assert KernelCache(root=tmp_path / f"node{i}", layers=()).verify([key]).ok == (key,)


def test_six_nodes_warm_one_plan_each_spec_built_once(remote, tmp_path):
    """Acceptance: six `jitwarm warm` processes, six roots, one Redis: 3 specs, 3 builds in total."""
    plan = plan_of(TINY_FAST)
    keys = [artifact(spec).key for spec in plan.specs]
    procs = [start_jitwarm("warm", *TINY_FAST, "--json", "--jobs", "3", "--cache-dir", str(tmp_path / f"node{i}"),
                           *remote.flags()) for i in range(6)]
    reports = [json.loads(line) for line in (p.communicate(timeout=240)[0].strip().splitlines()[-1] for p in procs)]
    assert all(p.returncode == 0 for p in procs), reports
    totals = collections.Counter()
    for report in reports:
        totals.update(report["totals"])
        assert report["ok"] and report["remote"]["available"]
        assert report["totals"]["built"] + report["totals"]["downloaded"] == len(keys)
    assert totals["built"] == len(keys) == 3 and totals["downloaded"] == 5 * len(keys)
    for i in range(6):
        verified = KernelCache(root=tmp_path / f"node{i}", layers=()).verify(keys)
        assert verified.clean and sorted(verified.ok) == sorted(keys)

    fresh = tmp_path / "node6"
    status = jitwarm("status", *TINY_FAST, "--json", "--cache-dir", str(fresh), *remote.flags())
    data = json.loads(status.stdout)
    assert status.returncode == 5 and data["missing"] == 3 and data["remote"]["present"] == 3  # not ready locally
    start = time.perf_counter()
    seventh = jitwarm("warm", *TINY_FAST, "--cache-dir", str(fresh), *remote.flags())
    assert seventh.returncode == 0, seventh.stderr
    assert "0 built, 3 downloaded" in seventh.stdout, seventh.stdout
    assert time.perf_counter() - start < 30


@pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server on PATH (a server this test can stop)")
@pytest.mark.parametrize("required", [False, True], ids=["lenient", "required"])
def test_redis_stopped_in_the_middle_of_a_warm(tmp_path, required):
    server = RedisServer(tmp_path / "redis")
    remote = Remote(server.url())
    root = tmp_path / "node"
    code, stdout, stderr = warm_while_the_store_stops(server, root, *remote.flags(),
                                                      *(["--remote-required"] if required else []))
    if not required:
        assert_built_locally(root, code, stdout, stderr)
    else:
        assert code == 1
        report = json.loads(stdout)
        assert report["totals"]["failed"] >= 1
        assert all(s["error_kind"] == "remote_unavailable" and s["error_type"] == "RemoteUnavailable"
                   for s in report["specs"] if s["outcome"] == "failed")
        text = jitwarm("warm", *TINY_FAST, "--cache-dir", str(tmp_path / "other"), *remote.flags(), "--remote-required")
        assert text.returncode == 1
        assert text.stderr.strip().splitlines() == [line for line in text.stderr.strip().splitlines()
                                                   if line.startswith("jitwarm: error: ")]
        assert "unavailable" in text.stderr and "required" in text.stderr
