"""KernelCache.claim: a reader's shared lock that prune, quarantine and discard respect, and its deadlock-free order.

``prune`` running while a process starts loading made the load fail (``Failed to load dynamic shared library``
in 20 of 20 trials): an entry a lookup returned could be deleted before it was loaded. A claim takes a SHARED
flock on the key's lock file, which the exclusive try-lock of prune and quarantine cannot get.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from workers.cache_harness import artifact_bytes, cache_for, desc, make_builder, pruning

from jitwarm.cache import CacheError, KernelCache, LockTimeout
from jitwarm.cache.locks import KeyLock


def _load(entry) -> None:
    """What a loader does with an entry: read every file (dlopen maps them), and check the bytes."""
    assert entry.file("kernel.bin").read_bytes() == artifact_bytes(json.loads(
        entry.file("meta/info.json").read_text())["n"])


def test_prune_keeps_a_claimed_entry_and_lists_it_as_kept(tmp_path):
    cache = cache_for(tmp_path / "root")
    entries = [cache.get_or_build(desc(n), make_builder(tmp_path / "c", n)) for n in range(3)]
    with cache.claim(entries[1]) as claimed:
        assert claimed == entries[1]
        report = cache_for(tmp_path / "root").prune(max_bytes=0)
        assert report.skipped_locked == (entries[1].key,) and sorted(report.removed) == sorted(
            e.key for e in (entries[0], entries[2]))
        _load(claimed)
    assert cache.prune(max_bytes=0).removed == (entries[1].key,)  # released: prunable again


def test_a_claim_of_an_entry_that_vanished_yields_none_and_holds_nothing(tmp_path):
    cache, counter = cache_for(tmp_path / "root"), tmp_path / "c"
    entry = cache.get_or_build(desc(0), make_builder(counter, 0))
    assert cache_for(tmp_path / "root").prune(max_bytes=0).removed == (entry.key,)
    with cache.claim(entry) as claimed:
        assert claimed is None
        again = cache.get_or_build_ex(desc(0), make_builder(counter, 0), timeout_s=2)  # no claim is held
        assert again.outcome == "built"
        with cache.claim(again.entry) as fresh:
            assert fresh == again.entry


def test_a_builder_or_discard_of_the_key_elsewhere_waits_for_the_claim(tmp_path):
    root = tmp_path / "root"
    cache = cache_for(root)
    entry = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    other = cache_for(root)
    done = threading.Event()

    def discard():
        other.discard(other.lookup(entry.key), "OSError: invalid ELF header", timeout_s=10)
        done.set()

    with cache.claim(entry) as claimed:
        thread = threading.Thread(target=discard)
        thread.start()
        time.sleep(0.5)
        assert not done.is_set() and claimed.path.exists()  # waiting for the reader
        _load(claimed)
    thread.join(10)
    assert done.is_set() and not entry.path.exists()  # quarantined once the claim was released


def test_the_claimers_own_discard_and_rebuild_in_the_block_do_not_deadlock(tmp_path):
    root, counter = tmp_path / "root", tmp_path / "c"
    cache = cache_for(root)
    entry = cache.get_or_build(desc(0), make_builder(counter, 0))
    start = time.monotonic()
    with cache.claim(entry) as claimed:
        cache.discard(claimed, "OSError: invalid ELF header", timeout_s=5)  # releases this thread's claim first
        rebuilt = cache.get_or_build_ex(desc(0), make_builder(counter, 0), timeout_s=5)
    assert time.monotonic() - start < 3 and rebuilt.outcome == "built"
    assert len([p for p in (root / "v1" / "quarantine").iterdir() if p.is_dir()]) == 1


def test_building_a_key_this_thread_claims_is_an_error_not_a_hang(tmp_path):
    root = tmp_path / "root"
    cache = cache_for(root)
    entry = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    with cache.claim(entry) as claimed:
        (claimed.path / "kernel.bin").chmod(0o644)
        (claimed.path / "kernel.bin").write_bytes(b"changed under the reader")
        start = time.monotonic()
        with pytest.raises(CacheError, match="this thread holds a claim on it") as info:
            cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0), timeout_s=30)
        assert time.monotonic() - start < 2 and "leave the claim" in info.value.hint
    assert cache.get_or_build_ex(desc(0), make_builder(tmp_path / "c", 0)).outcome == "built"


def test_a_claim_waits_for_an_exclusive_holder_until_its_deadline(tmp_path):
    cache = cache_for(tmp_path / "root")
    entry = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    holder = KeyLock(cache.lock_dir, entry.key)
    assert holder.try_acquire()
    try:
        start = time.monotonic()
        with pytest.raises(LockTimeout), cache.claim(entry, timeout_s=0.4):
            pass
        assert 0.3 < time.monotonic() - start < 2
    finally:
        holder.release()


def test_claims_in_read_only_caches_and_layers(tmp_path):
    root, layer = tmp_path / "root", tmp_path / "layer"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    baked = cache_for(layer).get_or_build(desc(1), make_builder(tmp_path / "c", 1))
    reader = KernelCache(root=root, layers=[layer], read_only=True)
    with reader.claim(reader.lookup(entry.key)) as claimed:  # the lock file exists: opened read-only, locked shared
        assert claimed == entry and cache_for(root).prune(max_bytes=0).skipped_locked == (entry.key,)
    with reader.claim(reader.lookup(baked.key)) as claimed:
        assert claimed.read_only and claimed.path == baked.path
    fresh = KernelCache(root=tmp_path / "nothing", layers=[layer], read_only=True)
    with fresh.claim(fresh.lookup(baked.key)) as claimed:
        assert claimed is not None and not (tmp_path / "nothing").exists()  # nothing written to claim it


def test_prune_loop_against_claim_and_load_loop(tmp_path):
    """A process prunes to nothing in a loop; this one gets, claims and loads in a loop: no load ever fails."""
    root, counter = tmp_path / "root", tmp_path / "c"
    cache = cache_for(root)
    for n in range(3):
        cache.get_or_build(desc(n), make_builder(counter, n))
    loads, vanished, claimed_keys = 0, 0, set()
    with pruning(root, tmp_path) as report:
        deadline = time.monotonic() + 60
        while loads < 300 and time.monotonic() < deadline:
            n = loads % 3
            entry = cache.get_or_build(desc(n), make_builder(counter, n), timeout_s=30)
            with cache.claim(entry, timeout_s=30) as claimed:
                if claimed is None:  # pruned between get_or_build and claim: get it again
                    vanished += 1
                    continue
                _load(claimed)
                time.sleep(0.002)  # a load takes a while: prune runs meanwhile, and must keep it
                _load(claimed)
                claimed_keys.add(claimed.key)
            loads += 1
    assert loads == 300
    assert report["removed"] > 0, report  # prune did remove entries between the loads ...
    assert set(report["skipped_locked"]) & claimed_keys, report  # ... and kept the claimed ones
