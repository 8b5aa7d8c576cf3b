"""The object-store tier against a real S3-protocol server (moto_server on loopback).

Each "node" has its own cache root; all share one bucket. The nodes of the fleet tests are real processes.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from precompile_fixtures import TINY_FAST, jitwarm, plan_of, start_jitwarm
from remote_fixtures import (
    Bucket,
    MotoServer,
    assert_built_locally,
    use_endpoint,
    warm_while_the_store_stops,
)
from s3_fixtures import faulty_store

from jitwarm.cache import KernelCache, RemoteUnavailable, reset_remote_health
from jitwarm.cache.remote import FleetLease, RemoteStore
from jitwarm.cache.remote.s3 import ObjectLease, ObjectStore
from jitwarm.cache.signing import UntrustedEntry
from jitwarm.kernels.artifacts import artifact

pytest.importorskip("boto3")
pytest.importorskip("moto")
pytest_plugins = ["s3_fixtures"]  # the moto_server endpoint and each test's bucket, shared with other modules

DESC = {"kind": "s3-test", "n": 1}
PAYLOAD = b"kernel bytes " * 400


def _build(staging):
    (staging / "kernel.bin").write_bytes(PAYLOAD)


def test_three_nodes_warm_one_plan_on_an_empty_bucket_each_spec_built_once(bucket, tmp_path):
    keys = [artifact(spec).key for spec in plan_of(TINY_FAST).specs]
    procs = [start_jitwarm("warm", *TINY_FAST, "--json", "--jobs", "1", "--cache-dir", str(tmp_path / f"node{i}"),
                           *bucket.flags()) for i in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _out, err in outs]
    totals = collections.Counter()
    for out, _err in outs:
        report = json.loads(out.strip().splitlines()[-1])
        assert report["ok"] and report["remote"]["available"]
        totals.update(report["totals"])
    assert totals["built"] == len(keys) == 3 and totals["downloaded"] == 2 * len(keys)
    assert len(bucket.keys("entries/")) == 3 and not bucket.keys("leases/")  # every lease released
    for i in range(3):
        assert sorted(KernelCache(root=tmp_path / f"node{i}", layers=()).verify(keys).ok) == sorted(keys)
    status = jitwarm("status", *TINY_FAST, "--json", "--cache-dir", str(tmp_path / "fresh"), *bucket.flags())
    assert status.returncode == 5 and json.loads(status.stdout)["remote"]["present"] == 3


# A publisher that stops between its blobs and its record: SIGKILL it there.
_PUBLISHER = """
import pathlib, sys, time
from jitwarm.cache import KernelCache
from jitwarm.cache.remote import FleetLease, RemoteStore, s3
put = s3.ObjectStore.put
def put_or_hang(self, name, body, what, **condition):
    if "/entries/" in name:
        pathlib.Path(sys.argv[3]).touch()
        time.sleep(600)
    return put(self, name, body, what, **condition)
s3.ObjectStore.put = put_or_hang
cache = KernelCache(root=sys.argv[1], layers=(), remote=sys.argv[2])
cache.get_or_build({"kind": "s3-test", "n": 1}, lambda d: (d / "kernel.bin").write_bytes(b"kernel bytes " * 400))
"""


def test_publisher_killed_between_files_and_record_leaves_nothing_a_reader_uses(bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("JITWARM_REMOTE_LEASE_S", "1")
    monkeypatch.setenv("JITWARM_REMOTE_PREFIX", bucket.prefix)
    marker = tmp_path / "blobs-up"
    proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(tmp_path / "a"), bucket.url, str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        assert bucket.keys("blobs/") and not bucket.keys("entries/") and bucket.keys("leases/")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    reader = bucket.cache(tmp_path / "b")
    start = time.monotonic()
    result = reader.get_or_build_ex(DESC, _build, timeout_s=30)
    assert result.outcome == "built" and reader.stats().lease_waits == 1  # waited out the dead holder's lease
    assert time.monotonic() - start < 10 and reader.stats().remote_rejected == 0
    late = bucket.cache(tmp_path / "c").get_or_build_ex(DESC, lambda d: pytest.fail("must download"))
    assert late.outcome == "downloaded" and late.entry.file("kernel.bin").read_bytes() == PAYLOAD


def _blob_and_record(bucket):
    [blob] = bucket.keys("blobs/")
    [record] = bucket.keys("entries/")
    return blob, record


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing", "record"])
def test_a_damaged_object_is_refused_reported_and_replaced_by_a_build(bucket, tmp_path, damage):
    key = bucket.cache(tmp_path / "a").get_or_build(DESC, _build).key
    blob, record = _blob_and_record(bucket)
    if damage == "flipped":
        body = bytearray(bucket.read(blob))
        body[7] ^= 1
        bucket.write(blob, bytes(body))
    elif damage == "truncated":
        bucket.write(blob, bucket.read(blob)[:-10])
    elif damage == "missing":
        bucket.client.delete_object(Bucket=bucket.name, Key=blob)
    else:
        bucket.write(record, b'{"manifest": 42}')
    reader = bucket.cache(tmp_path / "b")
    result = reader.get_or_build_ex(DESC, _build)
    assert result.outcome == "built" and reader.stats().remote_rejected == 1
    assert reader.verify([key]).ok == (key,)
    # The builder replaced what it rejected (If-Match on that record): the next node downloads a good entry.
    again = bucket.cache(tmp_path / "c").get_or_build_ex(DESC, lambda d: pytest.fail("must download"))
    assert again.outcome == "downloaded" and again.entry.file("kernel.bin").read_bytes() == PAYLOAD


def test_a_damaged_object_under_a_required_store_is_exit_1_naming_it(bucket, tmp_path):
    bucket.cache(tmp_path / "a").get_or_build(DESC, _build)
    blob, _record = _blob_and_record(bucket)
    bucket.write(blob, b"X" * len(PAYLOAD))
    with pytest.raises(RemoteUnavailable, match="sha256 does not match"):
        bucket.cache(tmp_path / "b", remote_required=True).get_or_build(DESC, _build)
    assert not (tmp_path / "b" / "v1" / "entries").exists() or not any((tmp_path / "b" / "v1" / "entries").iterdir())


def test_two_publishers_of_one_key_one_record_wins(bucket, tmp_path):
    published = bucket.cache(tmp_path / "a").get_or_build(DESC, _build)
    _blob, record = _blob_and_record(bucket)
    first = bucket.read(record)
    late = KernelCache(root=tmp_path / "b", layers=()).get_or_build(DESC, _build)  # built without the store
    assert ObjectStore(bucket.url, bucket.prefix).upload(late) is True  # 412: the first record stands
    assert bucket.read(record) == first and late.key == published.key


def test_lease_is_exclusive_renewed_and_taken_over_only_after_it_expires(bucket):
    store = ObjectStore(bucket.url, bucket.prefix)
    first = ObjectLease(store, "a" * 64, ttl_s=1.0)
    assert first.try_acquire() and not ObjectLease(store, "a" * 64, ttl_s=1.0).try_acquire()
    time.sleep(1.5)  # renewed every third of its life: still held
    assert not ObjectLease(store, "a" * 64, ttl_s=1.0).try_acquire() and not first.lost
    holder = ObjectLease(store, "a" * 64, ttl_s=1.0).holder()
    assert holder is not None and holder.pid == os.getpid()
    first._stop_renewing()  # the holder dies: no more renewals, no release
    second = ObjectLease(store, "a" * 64, ttl_s=30)
    assert not second.try_acquire()  # not at once: it expires a lifetime after its last renewal
    deadline = time.monotonic() + 10
    while not second.try_acquire():
        assert time.monotonic() < deadline, "the dead holder's lease never expired"
        time.sleep(0.2)
    first.release()  # no longer ours: the new holder's lease stays
    assert bucket.keys("leases/")
    second.release()
    assert not bucket.keys("leases/")


@pytest.mark.parametrize("store", ["redis", "s3"])
def test_a_lease_taken_over_under_its_holder_is_found_lost_by_the_renewal(request, store, caplog):
    """One renewal thread for both stores (cache/remote/base.py): it notices the lease is no longer ours."""
    key = "b" * 64
    if store == "redis":
        remote = request.getfixturevalue("remote")
        lease = FleetLease(RemoteStore(remote.url, remote.prefix), key, ttl_s=0.6)
        assert lease.try_acquire()
        remote.client().set(lease.name, b'{"host": "other", "pid": 1, "since": 0}', px=60_000)
    else:
        bucket = request.getfixturevalue("bucket")
        lease = ObjectLease(ObjectStore(bucket.url, bucket.prefix), key, ttl_s=0.6)
        assert lease.try_acquire()
        bucket.write(f"fleet/{bucket.prefix}/v1/leases/{key}.json", b'{"host": "other", "pid": 1, "since": 0}')
    deadline = time.monotonic() + 10
    while not lease.lost:
        assert time.monotonic() < deadline, "the renewal never noticed"
        time.sleep(0.05)
    assert f"fleet lease of cache key {key}" in caplog.text and "was lost" in caplog.text
    lease.release()  # not ours: the other holder's lease stays
    assert (remote.client().get(lease.name) if store == "redis" else bucket.keys("leases/"))


def test_store_stopped_in_the_middle_of_a_warm(tmp_path, monkeypatch):
    server = MotoServer(tmp_path / "moto")
    try:
        use_endpoint(monkeypatch, server.url)
        flags = Bucket(server.url).flags()
    except BaseException:
        server.stop()
        raise
    root = tmp_path / "node"
    assert_built_locally(root, *warm_while_the_store_stops(server, root, *flags))


def test_required_store_stopped_mid_run_fails_naming_the_fault(tmp_path, monkeypatch):
    server = MotoServer(tmp_path / "moto")
    try:
        use_endpoint(monkeypatch, server.url)
        reset_remote_health()
        bucket = Bucket(server.url)
        node = bucket.cache(tmp_path / "a", remote_required=True)
        assert node.get_or_build_ex(DESC, _build).outcome == "built" and bucket.keys("entries/")
        server.stop()
        with pytest.raises(RemoteUnavailable, match=r"s3://.* is unavailable \(download: .*connect"):
            node.get_or_build({"kind": "s3-test", "n": 2}, _build)
    finally:
        server.stop()
        reset_remote_health()


def test_s3_without_boto3_is_one_line_exit_2(tmp_path):
    hide = ("import sys; sys.modules['boto3'] = None; from jitwarm.precompile.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", hide, "warm", *TINY_FAST, "--cache-dir", str(tmp_path),
                           "--remote", "s3://some-bucket/fleet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "jitwarm: error: remote s3://some-bucket/fleet needs boto3, which is not installed: pip install "
        "'jitwarm[s3]'"]
    bad = jitwarm("status", *TINY_FAST, "--cache-dir", str(tmp_path), "--remote", "s3://A_B/x")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "bucket name" in bad.stderr


FAULTS = {403: "HTTP 403 AccessDenied", 412: "HTTP 412 PreconditionFailed", 500: "HTTP 500 InternalError",
          "slow": "Read timeout", "truncated": "body cut short"}
#: Requests each fault breaks: 500 and a timeout are retried (with backoff), the rest are not.
ATTEMPTS = {403: 1, 412: 1, 500: 2, "slow": 2, "truncated": 1}


@pytest.fixture
def faulty(bucket, tmp_path, monkeypatch):
    """The bucket with one entry published, and a proxy in front of the store that breaks blob requests."""
    bucket.cache(tmp_path / "origin").get_or_build(DESC, _build)
    yield from faulty_store(bucket, monkeypatch, "/blobs/")


@pytest.mark.parametrize("fault", list(FAULTS), ids=str)
def test_each_store_fault_falls_back_to_a_local_build(faulty, bucket, tmp_path, fault):
    faulty.fault, faulty.delay = fault, 2.0
    node = bucket.cache(tmp_path / "b")
    result = node.get_or_build_ex(DESC, _build)
    assert result.outcome == "built" and faulty.hits == ATTEMPTS[fault]
    assert node.stats().remote_errors == 1 and node.stats().remote_rejected == 0
    assert FAULTS[fault] in node.remote_error, node.remote_error  # reported; the store is skipped for a while
    assert node.verify([result.entry.key]).clean


@pytest.mark.parametrize("fault", [403, 500, "truncated"], ids=str)
def test_each_store_fault_under_a_required_store_names_it(faulty, bucket, tmp_path, fault):
    faulty.fault = fault
    with pytest.raises(RemoteUnavailable, match=FAULTS[fault]):
        bucket.cache(tmp_path / "b", remote_required=True).get_or_build(DESC, _build)
    faulty.fault = None  # the store answers again: the same node downloads
    again = bucket.cache(tmp_path / "c", remote_required=True).get_or_build_ex(DESC, _build)
    assert again.outcome == "downloaded"


def test_a_store_that_trickles_is_a_fault_its_lock_is_released_and_the_node_builds(faulty, bucket, tmp_path,
                                                                                   monkeypatch):
    """Each read of the trickle is quicker than the read timeout (0.5 s here), so only the overall deadline, 0.5 s
    plus the size at JITWARM_REMOTE_MIN_RATE, ends it: the whole body at the trickle's pace would take 10 s."""
    faulty.fault = "trickle"
    assert faulty.pace < 0.5 and len(PAYLOAD) / faulty.chunk * faulty.pace > 10
    monkeypatch.setenv("JITWARM_REMOTE_MIN_RATE", "5000")
    node = bucket.cache(tmp_path / "b")
    started = time.monotonic()
    result = node.get_or_build_ex(DESC, _build)
    assert time.monotonic() - started < 6  # the deadline is 0.5 + 5200 / 5000 s
    assert result.outcome == "built" and faulty.hits >= 1
    assert "slower than JITWARM_REMOTE_MIN_RATE=5000 bytes/s" in node.remote_error, node.remote_error
    assert node.verify([result.entry.key]).clean
    # the key's lock was released: another process takes it at once and finds the entry built
    again = subprocess.run([sys.executable, "-c", "import sys; from jitwarm.cache import KernelCache; "
                            f"print(KernelCache(root=sys.argv[1], remote='').get_or_build_ex({DESC!r}, None).outcome)",
                            str(tmp_path / "b")], capture_output=True, text=True, timeout=60)
    assert again.stdout.split() == ["hit"], again.stderr
    with pytest.raises(RemoteUnavailable, match="slower than JITWARM_REMOTE_MIN_RATE=5000 bytes/s"):
        bucket.cache(tmp_path / "c", remote_required=True).get_or_build(DESC, _build)


# -- the fleet key: signed on upload, checked on download ----------------------------------------------------

KEY, OTHER_KEY = "fleet-key-0123456789abcdef", "another-key-0123456789abcdef"


def test_signed_entries_download_and_unsigned_or_altered_ones_are_refused(bucket, tmp_path, monkeypatch):
    key = bucket.cache(tmp_path / "unsigned").get_or_build(DESC, _build).key  # published without a key
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    with pytest.raises(UntrustedEntry, match=f"remote entry {key} on s3://.* is not signed") as refused:
        bucket.cache(tmp_path / "a").get_or_build(DESC, lambda d: pytest.fail("must not build"))
    assert refused.value.exit_code == 4 and not list((tmp_path / "a").glob("v1/entries/*/*"))

    _blob, record = _blob_and_record(bucket)
    bucket.client.delete_object(Bucket=bucket.name, Key=record)
    assert bucket.cache(tmp_path / "b").get_or_build_ex(DESC, _build).outcome == "built"  # signed upload
    doc = json.loads(bucket.read(record))
    assert set(doc["signature"]) == {"key_id", "hmac", "version"}  # version 2 signs the private files too
    assert bucket.cache(tmp_path / "c").get_or_build_ex(DESC, _build).outcome == "downloaded"

    doc["manifest"] = doc["manifest"].replace("{", "{ ", 1)  # the same manifest to a parser, not to the key
    bucket.write(record, json.dumps(doc).encode())
    with pytest.raises(UntrustedEntry, match="signature does not verify"):
        bucket.cache(tmp_path / "d").get_or_build(DESC, _build)
    monkeypatch.setenv("JITWARM_TRUST_KEY", OTHER_KEY)
    with pytest.raises(UntrustedEntry, match="signed with another key"):
        bucket.cache(tmp_path / "e").get_or_build(DESC, _build)


def test_warm_under_a_fleet_key_refuses_an_unsigned_entry_with_exit_4(bucket, tmp_path):
    """The CLI's answer to an unsigned entry under a key is 4 (untrusted), not 1 (a build to retry)."""
    plain = jitwarm("warm", *TINY_FAST, "--json", "--cache-dir", str(tmp_path / "unsigned"), *bucket.flags())
    assert plain.returncode == 0, plain.stderr  # published without a key
    keyed = jitwarm("warm", *TINY_FAST, "--json", "--cache-dir", str(tmp_path / "keyed"), *bucket.flags(),
                    env={"JITWARM_TRUST_KEY": KEY})
    assert keyed.returncode == 4, keyed.stderr
    failed = [r for r in json.loads(keyed.stdout)["specs"] if r["outcome"] == "failed"]
    assert failed and {r["error_type"] for r in failed} == {"UntrustedEntry"}
    assert not list((tmp_path / "keyed").glob("v1/entries/*/*"))  # nothing of theirs was written here


def test_redis_tier_signs_and_checks_too(remote, tmp_path, monkeypatch):
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    key = remote.cache(tmp_path / "a").get_or_build(DESC, _build).key
    assert remote.cache(tmp_path / "b").get_or_build_ex(DESC, _build).outcome == "downloaded"
    meta = json.loads(remote.client().hget(remote.entry_name(key), "meta"))
    meta["executable"] = ["kernel.bin"]  # a changed mode: not what was signed
    remote.client().hset(remote.entry_name(key), "meta", json.dumps(meta))
    with pytest.raises(UntrustedEntry, match=f"remote entry {key} on redis://.*does not verify"):
        remote.cache(tmp_path / "c").get_or_build(DESC, _build)


def test_a_bad_key_setting_is_one_line_exit_2(tmp_path):
    short = jitwarm("status", *TINY_FAST, "--cache-dir", str(tmp_path), "--remote", "s3://some-bucket/x",
                    env={"JITWARM_TRUST_KEY": "short"})
    assert short.returncode == 2 and short.stderr.strip().splitlines() == [
        "jitwarm: error: JITWARM_TRUST_KEY: the key is shorter than 16 bytes"]
    (tmp_path / "key").write_text(KEY + "\n")
    both = jitwarm("status", *TINY_FAST, "--cache-dir", str(tmp_path), "--remote", "s3://some-bucket/x",
                   env={"JITWARM_TRUST_KEY": KEY, "JITWARM_TRUST_KEY_FILE": str(tmp_path / "key")})
    assert both.returncode == 2 and "both set" in both.stderr
