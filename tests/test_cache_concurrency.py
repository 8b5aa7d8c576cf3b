"""Exactly-once builds across real processes, holder death, lock-wait reporting and wait_for."""

from __future__ import annotations

import logging
import threading

import pytest
from workers.cache_harness import Workers, build_counts, cache_for, desc, make_builder, wait_for_file

from jitwarm.cache import LockHolder, LockTimeout


@pytest.fixture
def workers(tmp_path):
    w = Workers(tmp_path, tmp_path / "root")
    yield w
    w.kill_all()


def test_sixteen_processes_one_key_build_once(workers):
    for _ in range(16):
        workers.spawn("get", 0, sleep=0.3, together=True)
    workers.start_together(16)
    results = workers.results()

    assert build_counts(workers.counter) == {0: 1}
    assert len({(r["key"], r["path"]) for r in results}) == 1
    assert sorted(r["outcome"] for r in results).count("built") == 1
    assert all(r["files"] == ["kernel.bin", "meta/info.json"] for r in results)
    cache = cache_for(workers.root)
    assert cache.lookup(results[0]["key"]) is not None
    assert cache.verify().clean


def test_sixteen_processes_ten_keys_build_each_once(workers):
    for i in range(16):
        workers.spawn("get", i % 10, sleep=0.2, together=True)
    workers.start_together(16)
    results = workers.results()

    assert build_counts(workers.counter) == {n: 1 for n in range(10)}
    cache = cache_for(workers.root)
    by_n = {}
    for i, r in enumerate(results):
        assert r["key"] == cache.key(desc(i % 10))
        by_n.setdefault(i % 10, set()).add(r["path"])
    assert all(len(paths) == 1 for paths in by_n.values())
    assert len(cache.verify().ok) == 10


def test_losing_the_rename_race_is_success(workers):
    """Two "hosts" share a root but not a lock dir (node-local JITWARM_LOCK_DIR): both build, one wins."""
    for host in ("a", "b"):
        lock_dir = workers.tmp / f"locks-{host}"
        workers.spawn("get", 0, sleep=0.1, together=True, rendezvous=2, lock_dir=lock_dir)
    workers.start_together(2)
    results = workers.results()
    assert build_counts(workers.counter) == {0: 2}
    assert [r["outcome"] for r in results] == ["built", "built"]
    assert len({r["path"] for r in results}) == 1
    assert not (workers.root / "v1" / "staging").exists()
    assert cache_for(workers.root).verify().ok == (results[0]["key"],)


def test_sigkilled_builder_is_taken_over_once(workers):
    cache = cache_for(workers.root)
    key = cache.key(desc(0))
    in_build = workers.tmp / "in_build"
    builder = workers.spawn("hang", 0, in_build=in_build)
    wait_for_file(in_build)

    # Mid-build: the partial artifact sits in staging only; lookup never sees it.
    staging = list((workers.root / "v1" / "staging").iterdir())
    assert [p.name.split("-")[-2] for p in staging] == [key]
    assert cache.lookup(key) is None
    assert not (workers.root / "v1" / "entries" / key[:2] / key).exists()

    waiters = [workers.spawn("get", 0, sleep=0.2, on_wait=workers.tmp / f"waiting{i}") for i in range(3)]
    for i in range(3):
        wait_for_file(workers.tmp / f"waiting{i}")
    assert cache.lookup(key) is None
    builder.kill()
    builder.wait()
    results = workers.results(waiters)

    counts = build_counts(workers.counter)
    assert counts == {0: 2}  # the killed builder, then exactly one waiter
    assert sorted(r["outcome"] for r in results) == ["built", "waited", "waited"]
    assert len({r["path"] for r in results}) == 1
    assert not any(p.exists() for p in staging), "the dead builder's staging dir must be removed"
    entry = cache_for(workers.root).lookup(key)
    assert entry is not None and entry.file("kernel.bin").stat().st_size > 100


def test_waiter_logs_holder_once_then_times_out(workers, caplog):
    in_build = workers.tmp / "in_build"
    holder_proc = workers.spawn("hang", 1, in_build=in_build)
    wait_for_file(in_build)
    cache = cache_for(workers.root)
    seen: list[LockHolder | None] = []

    with caplog.at_level(logging.INFO, logger="jitwarm.cache"), pytest.raises(LockTimeout) as info:
        cache.get_or_build(desc(1), make_builder(workers.counter, 1), timeout_s=3.4, on_wait=seen.append)

    key = cache.key(desc(1))
    exc = info.value
    assert exc.key == key and key in str(exc)
    assert exc.holder is not None and exc.holder.pid == holder_proc.pid
    assert f"pid {holder_proc.pid}" in str(exc)
    assert len(seen) == 1 and seen[0] is not None and seen[0].pid == holder_proc.pid
    waits = [r.getMessage() for r in caplog.records if "waiting for cache key" in r.getMessage()]
    assert len(waits) == 1 and key in waits[0] and f"pid {holder_proc.pid}" in waits[0]
    assert build_counts(workers.counter) == {1: 1}  # only the hanging holder ever built
    stats = cache.stats()
    assert stats.waits == 1 and stats.builds == 0 and stats.lock_wait_s >= 3.0

    # wait_for never builds either, and names the holder when it gives up.
    with pytest.raises(LockTimeout, match=f"pid {holder_proc.pid}"):
        cache.wait_for(key, timeout_s=0.3)
    holder_proc.kill()
    holder_proc.wait()
    assert build_counts(workers.counter) == {1: 1}


def test_wait_for_returns_what_another_process_publishes(workers):
    cache = cache_for(workers.root)
    builder = workers.spawn("get", 2, sleep=0.8)
    entry = cache.wait_for(cache.key(desc(2)), timeout_s=30)
    assert workers.results([builder])[0]["path"] == str(entry.path)
    assert build_counts(workers.counter) == {2: 1}
    assert cache.stats().builds == 0


def test_wait_for_times_out_without_holder(tmp_path):
    cache = cache_for(tmp_path / "root")
    with pytest.raises(LockTimeout, match="no holder recorded") as info:
        cache.wait_for(cache.key(desc(3)), timeout_s=0.2)
    assert info.value.key == cache.key(desc(3))
    assert not (tmp_path / "root").exists()


def test_threads_of_one_process_build_once(tmp_path):
    cache = cache_for(tmp_path / "root")
    counter = tmp_path / "builds.log"
    outcomes = []
    barrier = threading.Barrier(4)

    def run():
        barrier.wait()
        outcomes.append(cache.get_or_build_ex(desc(4), make_builder(counter, 4, sleep=0.3)).outcome)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert build_counts(counter) == {4: 1}
    assert sorted(outcomes) == ["built", "waited", "waited", "waited"]
    assert cache.stats().builds == 1 and cache.stats().waits == 3
