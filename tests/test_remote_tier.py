"""The remote tier in one process: download instead of build, checks, rejection, size cap, failures, settings."""

from __future__ import annotations

import json
import logging
import pickle
import socket
import subprocess
import sys
import time

import pytest
from remote_fixtures import RedisServer, TrickleProxy, free_port, redis_server_binary
from workers.cache_harness import artifact_bytes, build_counts, desc, make_builder

from jitwarm.cache import CacheError, KernelCache, LockTimeout, RemoteUnavailable, settings
from jitwarm.cache.remote import FleetLease, RemoteStore
from jitwarm.cache.settings import override

pytestmark = pytest.mark.floor  # CI's floor pass (-m floor) reruns these on redis's floor (the client, 5.0)


def test_second_node_downloads_instead_of_building(remote, tmp_path):
    counter = tmp_path / "builds.log"
    a, b = remote.cache(tmp_path / "a"), remote.cache(tmp_path / "b")
    built = a.get_or_build_ex(desc(0), make_builder(counter, 0))
    got = b.get_or_build_ex(desc(0), make_builder(counter, 0))
    assert (built.outcome, got.outcome) == ("built", "downloaded")
    assert build_counts(counter) == {0: 1}
    assert got.entry.path.is_relative_to(tmp_path / "b") and not got.entry.read_only
    assert got.entry.files == ("kernel.bin", "meta/info.json") and got.entry.records == built.entry.records
    assert got.entry.file("kernel.bin").read_bytes() == artifact_bytes(0)
    assert (a.stats().remote_uploads, a.stats().remote_misses, a.stats().builds) == (1, 1, 1)
    assert (b.stats().remote_hits, b.stats().builds, b.stats().remote_uploads) == (1, 0, 0)
    assert b.verify([got.entry.key]).ok == (got.entry.key,)  # published locally, fully verifiable
    assert b.get_or_build_ex(desc(0), make_builder(counter, 0)).outcome == "hit"  # local first from now on
    report = b.remote_report([got.entry.key, "0" * 64])
    assert report.available and report.present == (got.entry.key,) and report.missing == ("0" * 64,)


def test_prefix_separates_fleets_on_one_server(remote, tmp_path):
    counter = tmp_path / "builds.log"
    remote.cache(tmp_path / "a").get_or_build(desc(1), make_builder(counter, 1))
    other = KernelCache(root=tmp_path / "b", layers=(), remote=remote.url, remote_prefix=remote.prefix + "-other")
    assert other.get_or_build_ex(desc(1), make_builder(counter, 1)).outcome == "built"
    assert build_counts(counter) == {1: 2}


def _tamper(kind: str, client, name: str) -> None:
    """Damage the remote entry hash ``name`` in one way."""
    if kind == "blob altered":
        data = bytearray(client.hget(name, "file:kernel.bin"))
        data[10] ^= 0xFF
        client.hset(name, "file:kernel.bin", bytes(data))
    elif kind == "blob truncated":
        client.hset(name, "file:kernel.bin", client.hget(name, "file:kernel.bin")[:-1])
    elif kind == "file missing":
        client.hdel(name, "file:meta/info.json")
    elif kind == "file added":
        client.hset(name, "file:evil.so", b"\x7fELF")
    elif kind == "manifest for another key":
        doc = json.loads(client.hget(name, "manifest"))
        doc["preimage"]["description"]["n"] = 99
        client.hset(name, "manifest", json.dumps(doc))
    elif kind == "manifest garbage":
        client.hset(name, "manifest", b"{not json")
    elif kind == "manifest nested 100000 deep":
        client.hset(name, "manifest", b"[" * 100_000)
    elif kind == "manifest of 17 MiB":
        client.hset(name, "manifest", b" " * (17 << 20))
    elif kind == "200000 fields":
        pipe = client.pipeline(transaction=False)
        for i in range(0, 200_000, 10_000):
            pipe.hset(name, mapping={f"x{j}": b"" for j in range(i, i + 10_000)})
        pipe.execute()
    elif kind == "meta of 2 MiB":
        client.hset(name, "meta", b"x" * (2 << 20))


@pytest.mark.parametrize("kind", ["blob altered", "blob truncated", "file missing", "file added",
                                  "manifest for another key", "manifest garbage", "manifest nested 100000 deep",
                                  "manifest of 17 MiB", "200000 fields", "meta of 2 MiB"])
def test_damaged_remote_entry_is_rejected_reported_and_replaced(remote, tmp_path, caplog, kind):
    counter = tmp_path / "builds.log"
    key = remote.cache(tmp_path / "a").get_or_build(desc(2), make_builder(counter, 2)).key
    _tamper(kind, remote.client(), remote.entry_name(key))
    reader = remote.cache(tmp_path / "b")
    with caplog.at_level(logging.WARNING, logger="jitwarm.cache"):
        result = reader.get_or_build_ex(desc(2), make_builder(counter, 2))
    assert result.outcome == "built" and build_counts(counter) == {2: 2}  # never loaded: rebuilt
    assert result.entry.file("kernel.bin").read_bytes() == artifact_bytes(2)
    assert (reader.stats().remote_rejected, reader.stats().remote_uploads) == (1, 1)
    assert any(f"rejected remote entry {key}" in m for m in caplog.messages)
    again = remote.cache(tmp_path / "c").get_or_build_ex(desc(2), make_builder(counter, 2))
    assert again.outcome == "downloaded" and build_counts(counter) == {2: 2}  # the rebuild replaced it


def test_nested_meta_and_lease_token_are_harmless(remote, tmp_path):
    counter = tmp_path / "builds.log"
    key = remote.cache(tmp_path / "a").get_or_build(desc(2), make_builder(counter, 2)).key
    client = remote.client()
    client.hset(remote.entry_name(key), "meta", b"[" * 100_000)  # informational only: still downloaded
    assert remote.cache(tmp_path / "b").get_or_build_ex(desc(2), make_builder(counter, 2)).outcome == "downloaded"
    other = remote.cache(tmp_path / "c")
    client.set(remote.lease_name(other.key(desc(3))), b"[" * 100_000, px=5000)
    seen = []
    with pytest.raises(LockTimeout, match="no holder recorded"):
        other.get_or_build(desc(3), make_builder(counter, 3), timeout_s=0.5, on_wait=seen.append)
    assert seen == [None]


def test_an_entry_over_the_size_cap_is_not_downloaded(remote, tmp_path, monkeypatch, caplog):
    """Sized on the server first: the reader builds locally and receives almost nothing of the 4 MiB entry."""
    counter = tmp_path / "builds.log"
    big = make_builder(counter, 11, extra={"big.bin": bytes(4 << 20)})
    remote.cache(tmp_path / "a").get_or_build(desc(11), big)
    monkeypatch.setenv("JITWARM_REMOTE_MAX_BYTES", str(1 << 20))
    client = remote.client()
    sent_before = client.info("stats")["total_net_output_bytes"]
    reader = remote.cache(tmp_path / "b")
    with caplog.at_level(logging.INFO, logger="jitwarm.cache"):
        result = reader.get_or_build_ex(desc(11), big)
    sent = client.info("stats")["total_net_output_bytes"] - sent_before
    assert result.outcome == "built" and build_counts(counter) == {11: 2} and sent < 256 << 10, sent
    assert any("over the remote size cap" in m and "building it locally" in m for m in caplog.messages)
    assert reader.stats().remote_rejected == 0 and reader.stats().remote_uploads == 0


def test_a_store_that_trickles_is_a_fault_its_lock_is_released_and_the_node_builds(remote, tmp_path, monkeypatch):
    """The entry is sized on the server first, and its download gets the read timeout (0.5 s here) plus that size
    at JITWARM_REMOTE_MIN_RATE. Each read of the trickle is quicker than the read timeout; the whole entry at the
    trickle's pace would take over 20 s."""
    counter = tmp_path / "builds.log"
    big = make_builder(counter, 13, extra={"big.bin": bytes(range(256)) * 40})  # about 10 KB
    remote.cache(tmp_path / "a").get_or_build(desc(13), big)
    host_port = remote.url.split("//")[1].split("/")[0].rsplit("@", 1)[-1]
    proxy = TrickleProxy(int(host_port.rsplit(":", 1)[1]))
    slow_url = remote.url.replace(host_port, f"127.0.0.1:{proxy.port}") + "?socket_timeout=0.5"
    monkeypatch.setenv("JITWARM_REMOTE_MIN_RATE", "5000")
    try:
        proxy.trickle = True
        assert proxy.pace < 0.5 and 10_240 / proxy.chunk * proxy.pace > 20
        node = KernelCache(root=tmp_path / "b", layers=(), remote=slow_url, remote_prefix=remote.prefix)
        started = time.monotonic()
        result = node.get_or_build_ex(desc(13), big)
        assert time.monotonic() - started < 8  # the deadline: 0.5 s plus about 10.5 KB at 5000 bytes/s
        assert result.outcome == "built" and build_counts(counter) == {13: 2} and proxy.trickled >= 1
        assert "slower than JITWARM_REMOTE_MIN_RATE=5000 bytes/s" in node.remote_error, node.remote_error
        assert node.verify([result.entry.key]).clean
        # the key's lock was released: another process takes it at once and finds the entry built
        again = subprocess.run([sys.executable, "-c", "import sys; from jitwarm.cache import KernelCache; "
                                f"print(KernelCache(root=sys.argv[1], remote='').get_or_build_ex({desc(13)!r}, "
                                "None).outcome)", str(tmp_path / "b")], capture_output=True, text=True, timeout=60)
        assert again.stdout.split() == ["hit"], again.stderr
        from jitwarm.cache import reset_remote_health

        reset_remote_health()
        required = KernelCache(root=tmp_path / "c", layers=(), remote=slow_url, remote_prefix=remote.prefix,
                               remote_required=True)
        with pytest.raises(RemoteUnavailable, match="slower than JITWARM_REMOTE_MIN_RATE=5000 bytes/s"):
            required.get_or_build(desc(13), big)
        proxy.trickle = False  # the same store at full speed: downloaded
        reset_remote_health()
        fast = KernelCache(root=tmp_path / "d", layers=(), remote=slow_url, remote_prefix=remote.prefix)
        assert fast.get_or_build_ex(desc(13), big).outcome == "downloaded"
    finally:
        proxy.stop()


@pytest.mark.parametrize("required", [False, True], ids=["lenient", "required"])
def test_a_lease_without_expiry_builds_locally_at_once_and_says_so_once(remote, tmp_path, caplog, required):
    counter = tmp_path / "builds.log"
    client = remote.client()
    key = remote.cache(tmp_path / "probe").key(desc(12))
    token = json.dumps({"host": "old-node", "pid": 1, "since": time.time() - 3600, "nonce": "x"})
    client.set(remote.lease_name(key), token)  # no PX: never expires by itself
    node = remote.cache(tmp_path / "a", remote_required=required)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="jitwarm.cache"):
        result = node.get_or_build_ex(desc(12), make_builder(counter, 12), timeout_s=30)
        for n in range(2):  # more nodes: the first one's upload is there
            assert remote.cache(tmp_path / f"more{n}").get_or_build_ex(
                desc(12), make_builder(counter, 12), timeout_s=30).outcome == "downloaded"
    assert result.outcome == "built" and time.monotonic() - start < 10 and build_counts(counter) == {12: 1}
    warnings = [m for m in caplog.messages if "had no expiry" in m]
    assert len(warnings) == 1 and f"building cache key {key} locally" in warnings[0]
    assert 0 < client.pttl(remote.lease_name(key)) <= 30_000  # healed: it expires like a dead holder's
    assert node.stats().remote_uploads == 1 and node.stats().remote_errors == 0


def test_uploader_that_dies_before_commit_leaves_nothing(remote, tmp_path):
    # An upload is one MULTI/EXEC: a connection that drops before EXEC applies nothing.
    host, port = remote.url.split("//")[1].split("/")[0].rsplit("@", 1)[-1].split(":")
    key = remote.cache(tmp_path / "x").key(desc(3))
    with socket.create_connection((host, int(port))) as s:
        name = remote.entry_name(key).encode()
        cmds = [[b"MULTI"], [b"HSET", name, b"manifest", b"{}", b"file:kernel.bin", b"partial"]]
        s.sendall(b"".join(b"*%d\r\n" % len(c) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in c) for c in cmds))
        time.sleep(0.1)
    counter = tmp_path / "builds.log"
    assert remote.cache(tmp_path / "b").get_or_build_ex(desc(3), make_builder(counter, 3)).outcome == "built"


def test_entries_over_the_size_cap_are_not_uploaded(remote, tmp_path, monkeypatch):
    monkeypatch.setenv("JITWARM_REMOTE_MAX_BYTES", "100")
    counter = tmp_path / "builds.log"
    cache = remote.cache(tmp_path / "a")
    key = cache.get_or_build(desc(4), make_builder(counter, 4)).key
    assert cache.stats().remote_uploads == 0 and cache.remote_report([key]).missing == (key,)


def test_unreachable_remote_warns_once_and_builds_locally(remote, tmp_path, caplog):
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    counter = tmp_path / "builds.log"
    cache = KernelCache(root=tmp_path / "a", layers=(), remote=url)
    with caplog.at_level(logging.DEBUG, logger="jitwarm.cache"):
        outcomes = [cache.get_or_build_ex(desc(n), make_builder(counter, n)).outcome for n in (5, 6)]
        assert KernelCache(root=tmp_path / "b", layers=(), remote=url).get_or_build_ex(
            desc(5), make_builder(counter, 5)).outcome == "built"
    assert outcomes == ["built", "built"] and build_counts(counter) == {5: 2, 6: 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "continuing with the local cache only" in warnings[0]
    assert "hunter2" not in caplog.text and ":***@" in warnings[0]
    assert cache.stats().remote_errors == 1 and "ConnectionError" in cache.remote_error


def test_required_remote_fails_clearly(remote, tmp_path):
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    cache = KernelCache(root=tmp_path / "a", layers=(), remote=url, remote_required=True)
    with pytest.raises(RemoteUnavailable) as info:
        cache.get_or_build(desc(7), make_builder(tmp_path / "builds.log", 7))
    assert isinstance(info.value, CacheError) and "required" in str(info.value) and "hunter2" not in str(info.value)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
    with pytest.raises(RemoteUnavailable):
        cache.remote_report([cache.key(desc(7))])
    lenient = KernelCache(root=tmp_path / "b", layers=(), remote=url)
    report = lenient.remote_report([lenient.key(desc(7))])
    assert not report.available and "ConnectionError" in report.error and lenient.check_remote() is not None


@pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server on PATH")
def test_password_and_database_in_the_url(tmp_path):
    server = RedisServer(tmp_path / "redis", "--requirepass", "s3cret")
    try:
        counter = tmp_path / "builds.log"
        url = server.url(db=3)
        KernelCache(root=tmp_path / "a", layers=(), remote=url).get_or_build(desc(8), make_builder(counter, 8))
        got = KernelCache(root=tmp_path / "b", layers=(), remote=url).get_or_build_ex(desc(8), make_builder(counter, 8))
        assert got.outcome == "downloaded"
        db0 = KernelCache(root=tmp_path / "c", layers=(), remote=server.url(db=0))
        assert db0.remote_report([got.entry.key]).missing == (got.entry.key,)
        wrong = KernelCache(root=tmp_path / "d", layers=(), remote=url.replace("s3cret", "nope"))
        assert "s3cret" not in repr(wrong) and "nope" not in (wrong.check_remote() or "nope")
    finally:
        server.stop()


def test_lease_is_extended_while_held_and_released_only_by_its_owner(remote, tmp_path):
    store = RemoteStore(remote.url, remote.prefix)
    client = remote.client()
    first = FleetLease(store, "a" * 64, ttl_s=0.6)
    assert first.try_acquire() and not FleetLease(store, "a" * 64, ttl_s=0.6).try_acquire()
    time.sleep(1.5)  # more than twice the lifetime: only the heartbeat keeps it
    assert client.pttl(first.name) > 0 and not first.lost
    holder = FleetLease(store, "a" * 64, ttl_s=0.6).holder()
    assert holder.pid == __import__("os").getpid() and abs(holder.since - time.time()) < 5
    client.delete(first.name)  # as if it had expired: someone else takes it
    second = FleetLease(store, "a" * 64, ttl_s=5)
    assert second.try_acquire()
    first.release()  # must not delete the new holder's lease
    assert client.get(second.name) is not None
    second.release()
    assert client.get(second.name) is None


def test_waiting_on_a_live_lease_times_out_naming_the_holder(remote, tmp_path):
    cache = remote.cache(tmp_path / "a")
    lease = FleetLease(RemoteStore(remote.url, remote.prefix), cache.key(desc(9)), ttl_s=120)
    assert lease.try_acquire()
    seen = []
    try:
        start = time.monotonic()
        with pytest.raises(LockTimeout) as info:
            cache.get_or_build(desc(9), make_builder(tmp_path / "builds.log", 9), timeout_s=0.8, on_wait=seen.append)
        assert time.monotonic() - start < 60  # the wait's deadline, not the lease's 120 s
    finally:
        lease.release()
    assert info.value.holder is not None and info.value.holder.pid == __import__("os").getpid()
    assert seen and seen[0].pid == info.value.holder.pid
    assert cache.stats().lease_waits == 1 and cache.stats().builds == 0


REMOTE_KNOBS = {"remote": "JITWARM_REMOTE", "remote_prefix": "JITWARM_REMOTE_PREFIX",
                "remote_required": "JITWARM_REMOTE_REQUIRED", "remote_lease_s": "JITWARM_REMOTE_LEASE_S",
                "remote_max_bytes": "JITWARM_REMOTE_MAX_BYTES"}


def _remote_settings():
    return tuple(getattr(settings, name)() for name in REMOTE_KNOBS)


def test_remote_settings_parse_and_validate(monkeypatch):
    for var in REMOTE_KNOBS.values():
        monkeypatch.delenv(var, raising=False)
    assert _remote_settings() == (None, "jitwarm", False, 30.0, 256 << 20)
    with override(remote="rediss://:pw@cache:6380/2", remote_prefix="fleet-a", remote_required=True,
                  remote_lease_s=2.5, remote_max_bytes=1000):
        assert _remote_settings() == ("rediss://:pw@cache:6380/2", "fleet-a", True, 2.5, 1000)
        cache = KernelCache(layers=())
        assert (cache.remote, cache.remote_prefix, cache.remote_required) == ("rediss://:pw@cache:6380/2",
                                                                              "fleet-a", True)
        assert "pw" not in repr(cache) and KernelCache(layers=(), remote="").remote is None
    for var, value in [("JITWARM_REMOTE", "http://:pw@x"), ("JITWARM_REMOTE_PREFIX", "a b"),
                       ("JITWARM_REMOTE_LEASE_S", "0"), ("JITWARM_REMOTE_MAX_BYTES", "lots")]:
        monkeypatch.setenv(var, value)
        name = next(n for n, v in REMOTE_KNOBS.items() if v == var)
        with pytest.raises(ValueError, match=var) as info:
            getattr(settings, name)()
        assert "pw" not in str(info.value)
        monkeypatch.delenv(var)
    with pytest.raises(ValueError):
        KernelCache(layers=(), remote="localhost:6379")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:notaport/0", "redis://127.0.0.1:99999/0", "redis://:pw@:6379/0",
                                 "redis://127.0.0.1:0/0", "redis://127.0.0.1:6379/zero", "rediss://h:-1/0"])
def test_a_remote_url_redis_py_cannot_connect_with_is_a_usage_error(url, tmp_path, capsys):
    """A bad port was a ValueError from redis-py at the first call (exit 1): now one line, exit 2, no password."""
    from precompile_fixtures import TINY

    from jitwarm.cache.errors import UsageError
    from jitwarm.precompile.cli import main

    with pytest.raises(UsageError) as info:
        KernelCache(root=tmp_path / "root", layers=(), remote=url)
    assert "\n" not in str(info.value) and "pw" not in str(info.value)
    assert main(["warm", *TINY, "--cache-dir", str(tmp_path / "root"), "--remote", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jitwarm: error: ") and "pw" not in err


def test_good_remote_urls_still_pass():
    for url in ("redis://127.0.0.1:6390/0", "redis://cache", "rediss://:pw@cache:6380/2", "redis://[::1]:6379/1",
                "unix:///run/redis.sock?db=1", "redis://user:pw@cache-host/"):
        assert settings.check_remote_url(url) == url


@pytest.mark.parametrize(("var", "value"), [("JITWARM_REMOTE_LEASE_S", "bad"), ("JITWARM_REMOTE_MAX_BYTES", "lots"),
                                            ("JITWARM_REMOTE_PREFIX", "a b"), ("JITWARM_REMOTE_REQUIRED", "maybe")])
def test_remote_knobs_are_read_only_with_a_remote(monkeypatch, tmp_path, var, value):
    """A bad remote knob never fails a cache without a remote; with one, construction fails in one line."""
    monkeypatch.setenv(var, value)
    local = KernelCache(root=tmp_path / "root", layers=())
    assert local.remote is None and not local.remote_required
    assert local.get_or_build_ex(desc(10), make_builder(tmp_path / "c", 10)).outcome == "built"
    with pytest.raises(ValueError, match=f"^{var}=") as info:
        KernelCache(root=tmp_path / "root", layers=(), remote="redis://127.0.0.1:1/0")
    assert "\n" not in str(info.value)
    monkeypatch.setenv("JITWARM_REMOTE", "redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match=f"^{var}="):
        KernelCache(root=tmp_path / "root", layers=())


def test_no_remote_means_no_redis_import_and_no_change(tmp_path):
    code = ("import sys, pathlib; from jitwarm.cache import KernelCache; c = KernelCache(root=sys.argv[1], layers=());"
            "r = c.get_or_build_ex({'n': 1}, lambda d: (d / 'f').write_text('x'));"
            "s = c.stats(); print(r.outcome, c.remote, s.remote_misses + s.remote_errors, 'redis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "root")], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["built", "None", "0", "False"]


def test_cli_remote_flags(remote, tmp_path, capsys, monkeypatch):
    from precompile_fixtures import TINY

    from jitwarm.precompile.cli import main

    root = ["--cache-dir", str(tmp_path / "root")]
    assert main(["status", *TINY, *root, *remote.flags()]) == 5  # not ready here: nothing is local
    out = capsys.readouterr().out
    assert f"remote {remote.url} (prefix {remote.prefix}): 0/3 present on remote, 3 missing" in out
    assert out.count("  missing on remote: ") == 3
    assert main(["status", *TINY, *root, "--remote"]) == 2  # no URL and no JITWARM_REMOTE
    assert capsys.readouterr().err.strip() == ("jitwarm: error: --remote without a URL needs JITWARM_REMOTE "
                                               "(e.g. redis://cache-host:6379/0)")
    monkeypatch.setenv("JITWARM_REMOTE", remote.url)
    assert main(["status", *TINY, *root, "--remote", "--remote-prefix", remote.prefix, "--json"]) == 5
    assert json.loads(capsys.readouterr().out)["remote"]["missing"] == 3
    assert main(["warm", *TINY, *root, "--remote", "http://:pw@host/0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected a Redis URL" in err and "pw" not in err
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["status", *TINY, *root, "--remote", dead, "--remote-required"]) == 1
    assert "is unavailable" in capsys.readouterr().err


def test_a_download_cut_at_its_deadline_leaves_the_other_calls_on_the_store_alone(remote, tmp_path, monkeypatch):
    """Past its deadline a download's own connection is shut, not the client's pool: another thread's calls on the
    same store meanwhile (here, status reports; in a fleet, a lease's heartbeat) all answer."""
    import threading

    counter = tmp_path / "builds.log"
    big = make_builder(counter, 14, extra={"big.bin": bytes(range(256)) * 40})  # about 10 KB
    key = remote.cache(tmp_path / "a").get_or_build(desc(14), big).key
    host_port = remote.url.split("//")[1].split("/")[0].rsplit("@", 1)[-1]
    proxy = TrickleProxy(int(host_port.rsplit(":", 1)[1]))
    slow_url = remote.url.replace(host_port, f"127.0.0.1:{proxy.port}") + "?socket_timeout=2"
    monkeypatch.setenv("JITWARM_REMOTE_MIN_RATE", "5000")
    node = KernelCache(root=tmp_path / "b", layers=(), remote=slow_url, remote_prefix=remote.prefix)
    answers, stop = [], threading.Event()

    def ask() -> None:  # a status reply is a few bytes: quick through the trickle, unless its socket is shut
        while not stop.is_set():
            try:
                report = node.remote_report([key])
            except Exception as exc:  # noqa: BLE001 - what reached the caller is the finding
                answers.append(f"raised {exc!r}")
            else:
                answers.append(report.error or key in report.present)

    try:
        proxy.trickle = True
        asker = threading.Thread(target=ask)
        asker.start()
        try:
            result = node.get_or_build_ex(desc(14), big)
            time.sleep(0.5)  # and after the cut
        finally:
            stop.set()
            asker.join(timeout=30)
        assert result.outcome == "built" and "slower than" in (node.remote_error or "")
        assert len(answers) >= 5 and [a for a in answers if a is not True] == []
    finally:
        proxy.stop()
