"""KernelCache.claim: a reader's shared lock that prune, quarantine and discard respect.

``prune`` running while a process starts loading made the load fail (``Failed to load dynamic shared library``
in 20 of 20 trials): an entry a lookup returned could be deleted before it was loaded. A claim takes a SHARED
flock on the key's lock file, which the exclusive try-lock of prune and quarantine cannot get.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from workers.cache_harness import artifact_bytes, cache_for, desc, make_builder

from jitwarm.cache import KernelCache, LockTimeout
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


def test_inside_its_own_claim_a_discard_or_rebuild_times_out_and_after_it_works(tmp_path):
    """The documented order: leave the claim, then discard or rebuild (``Artifact.load`` does so)."""
    root, counter = tmp_path / "root", tmp_path / "c"
    cache = cache_for(root)
    entry = cache.get_or_build(desc(0), make_builder(counter, 0))
    with cache.claim(entry) as claimed:
        start = time.monotonic()
        with pytest.raises(LockTimeout):  # flock SH and EX conflict within one process too: bounded, not a hang
            cache.discard(claimed, "OSError: invalid ELF header", timeout_s=0.3)
        assert time.monotonic() - start < 2 and claimed.path.exists()
    cache.discard(entry, "OSError: invalid ELF header", timeout_s=5)
    assert cache.get_or_build_ex(desc(0), make_builder(counter, 0), timeout_s=5).outcome == "built"
    assert len([p for p in (root / "v1" / "quarantine").iterdir() if p.is_dir()]) == 1


def test_a_claim_waits_for_an_exclusive_holder_until_its_deadline(tmp_path):
    cache = cache_for(tmp_path / "root")
    entry = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    holder = KeyLock(cache.lock_dir, entry.key)
    assert holder.try_acquire()
    try:
        start = time.monotonic()
        with pytest.raises(LockTimeout), cache.claim(entry, timeout_s=0.4):
            pass
        assert 0.3 < time.monotonic() - start < 20
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
