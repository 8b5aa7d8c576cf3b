"""KernelCache.claim_all and set stamps: a whole plan's entries looked up and claimed with one stamp read.

The capture hook of a fresh process over a warm cache spent most of its time reading one stamp per key and
then claiming each key. ``claim_all`` reads one set stamp for the plan's keys, claims each entry it names and
checks its stat signature; every answer must still be the one ``lookup`` + ``claim`` would give.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from workers.cache_harness import (
    FILES_PER_ENTRY,
    artifact_bytes,
    as_user,
    build_counts,
    cache_for,
    desc,
    make_builder,
    other_user,
    pruning,
    shared_dir,
)

from jitwarm.cache import KernelCache, LockTimeout, files, stamps
from jitwarm.cache.layout import RootLayout
from jitwarm.cache.locks import KeyLock


@pytest.fixture
def warm(tmp_path):
    """Three published entries in a root, and their keys."""
    root = tmp_path / "root"
    cache = cache_for(root)
    entries = [cache.get_or_build(desc(n), make_builder(tmp_path / "c", n)) for n in range(3)]
    return root, entries, [e.key for e in entries]


def set_stamps(root: Path) -> list[Path]:
    return sorted((root / "v1" / "verified" / "sets").glob("*.json"))


def set_stamp_path(root: Path, keys: list[str]) -> Path:
    return RootLayout(root).set_stamp_path(keys)


def entry_stamps(root: Path) -> list[Path]:
    return [p for p in (root / "v1" / "verified").rglob("*.json") if p.parent.name != "sets"]


def test_claim_all_answers_as_lookup_and_claim_do_and_keeps_prune_off(warm):
    root, entries, keys = warm
    missing = cache_for(root).key(desc(9))
    cache = cache_for(root)
    with cache.claim_all([*keys, missing, keys[0]]) as found:
        assert list(found) == [*keys, missing]  # in order, once each
        assert [found[k] for k in keys] == entries and found[missing] is None
        report = cache_for(root).prune(max_bytes=0)
        assert report.removed == () and sorted(report.skipped_locked) == sorted(keys)
        for entry in entries:
            assert entry.file("kernel.bin").read_bytes() == artifact_bytes(keys.index(entry.key))
    assert sorted(cache_for(root).prune(max_bytes=0).removed) == sorted(keys)  # released with the block


def test_a_fresh_process_reads_one_set_stamp_and_no_manifest(warm, monkeypatch, file_hashes):
    root, entries, keys = warm
    with cache_for(root).claim_all(keys):
        pass
    assert len(set_stamps(root)) == 1
    for stamp in entry_stamps(root):  # the set stamp alone must answer
        stamp.unlink()
    opened = []
    real = files.read_file_stat

    def counting(path, max_bytes):
        opened.append(os.fspath(path))
        return real(path, max_bytes)

    monkeypatch.setattr(files, "read_file_stat", counting)  # read_file (entry.json) goes through it too
    monkeypatch.setattr(stamps, "read_file_stat", counting)
    before = file_hashes.calls
    with cache_for(root).claim_all(keys) as found:
        assert [found[k] for k in keys] == entries
    assert file_hashes.calls == before  # no file hashed
    assert opened == [os.fspath(set_stamps(root)[0])]  # one stamp read: no entry.json, no stamp per key
    assert len(set_stamps(root)) == 1 and not entry_stamps(root)  # it answered every key: nothing rewritten


@pytest.mark.parametrize("how", ["flip_byte", "unlisted_file", "unlisted_file_in_subdir", "replaced_manifest"])
def test_a_change_after_the_set_stamp_is_caught_and_the_stamp_renewed(warm, how):
    root, entries, keys = warm
    with cache_for(root).claim_all(keys):
        pass
    victim = entries[1]
    if how == "flip_byte":
        lib = victim.path / "kernel.bin"
        data = bytearray(lib.read_bytes())
        data[3] ^= 1
        lib.chmod(0o644)
        lib.write_bytes(bytes(data))
    elif how == "unlisted_file":
        (victim.path / "extra.so").write_bytes(b"planted")
    elif how == "unlisted_file_in_subdir":
        (victim.path / "meta").chmod(0o755)
        (victim.path / "meta" / "extra.json").write_text("{}")
    else:
        manifest = victim.path / "entry.json"
        text = manifest.read_text()
        manifest.unlink()
        manifest.write_text(text)  # the same bytes, another inode
    cache = cache_for(root)
    with cache.claim_all(keys) as found:
        assert found[keys[0]] == entries[0] and found[keys[2]] == entries[2]
        if how == "replaced_manifest":  # the bytes are still right: hashed in full and accepted
            assert found[keys[1]] == victim
        else:
            assert found[keys[1]] is None and cache.stats().corrupt == 1
    fresh = cache_for(root)
    with fresh.claim_all(keys) as again:  # the set stamp was written again with what was found
        assert [again[k] for k in keys] == [found[k] for k in keys]
    assert fresh.stats().corrupt == 0


def test_claim_all_keeps_lookups_search_order(tmp_path):
    root, layer = tmp_path / "root", tmp_path / "layer"
    baked = cache_for(layer).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    reader = cache_for(root, layers=[layer])
    with reader.claim_all([baked.key]) as found:
        assert found[baked.key].path == baked.path and found[baked.key].read_only
    own = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))  # now the root has a copy too
    fresh = cache_for(root, layers=[layer])
    with fresh.claim_all([baked.key]) as found:
        assert found[baked.key].path == own.path == fresh.lookup(baked.key).path  # the root's, as lookup says
        assert not found[baked.key].read_only


def test_a_discarded_entry_is_not_claimed_again(warm):
    root, entries, keys = warm
    cache = cache_for(root)
    with cache.claim_all(keys):
        pass
    reader = KernelCache(root=root, layers=(), read_only=True)  # discard can only skip it there
    reader.discard(entries[0], "OSError: invalid ELF header", timeout_s=5)
    with reader.claim_all(keys) as found:
        assert found[keys[0]] is None and found[keys[1]] == entries[1]


def test_a_nested_claim_takes_no_lock_and_a_later_one_does(warm, monkeypatch):
    root, entries, keys = warm
    cache = cache_for(root)
    from jitwarm.cache import locks as claims

    acquired = []
    real = claims.SharedClaim.acquire
    monkeypatch.setattr(claims.SharedClaim, "acquire", lambda self, t: acquired.append(self.key) or real(self, t))
    with cache.claim_all(keys) as found:
        assert sorted(acquired) == sorted(keys)
        with cache.claim(found[keys[0]]) as claimed:
            assert claimed == entries[0]
        assert len(acquired) == 3
    with cache.claim(entries[0]) as claimed:
        assert claimed == entries[0] and acquired[-1] == keys[0] and len(acquired) == 4


def test_claim_all_waits_for_an_exclusive_holder_until_its_deadline(warm):
    root, _entries, keys = warm
    with cache_for(root).claim_all(keys):
        pass
    holder = KeyLock(root / "v1" / "locks", keys[1])
    assert holder.try_acquire()
    try:
        start = time.monotonic()
        with pytest.raises(LockTimeout), cache_for(root).claim_all(keys, timeout_s=0.4):
            pass
        assert 0.3 < time.monotonic() - start < 2
    finally:
        holder.release()
    assert sorted(cache_for(root).prune(max_bytes=0).removed) == sorted(keys)  # the failed call holds no claim


def test_a_read_only_cache_claims_all_and_writes_no_set_stamp(warm):
    root, entries, keys = warm
    reader = KernelCache(root=root, layers=(), read_only=True)
    with reader.claim_all(keys) as found:
        assert [found[k] for k in keys] == entries
    assert set_stamps(root) == []


def plant(path: Path, body: bytes) -> None:
    """Write a stamp file as the cache does, its body's sha256 first: what a planted stamp must look like to be read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


def stamp_doc(entry) -> dict:
    return {"path": str(entry.path), "signature": [x for item in entry.signature for x in item],
            "files": [x for r in entry.records for x in (r.path, r.size, r.sha256)], "created": entry.created,
            "preimage": entry.preimage}


@pytest.mark.parametrize("planted", ["deep", "garbage", "wrong_shapes", "no_digest", "fifo", "symlink"])
def test_a_planted_or_malformed_set_stamp_is_ignored(warm, planted):
    root, entries, keys = warm
    path = set_stamp_path(root, keys)
    if planted == "deep":  # with a right digest: the depth bound still refuses it
        plant(path, b"[" * 100_000 + b"]" * 100_000)
    elif planted == "garbage":
        plant(path, b"\x00\xff{not json")
    elif planted == "wrong_shapes":
        doc = {"entries": {keys[0]: {"path": str(entries[0].path), "signature": [[1, 2]], "files": "x",
                                      "created": "soon", "preimage": []},
                           keys[1]: {"path": str(entries[1].path), "signature": ["entry.json", [], 0, 0, 0],
                                     "files": [], "created": 0, "preimage": {"description": {}}},
                           keys[2]: [1, 2, 3]}}
        plant(path, json.dumps(doc).encode())
    elif planted == "no_digest":  # a right document, as an older layout (or a careless hand) wrote it
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"entries": {e.key: stamp_doc(e) for e in entries}}))
    elif planted == "fifo":
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
    else:
        plant(path.with_name("x"), json.dumps({"entries": {e.key: stamp_doc(e) for e in entries}}).encode())
        path.symlink_to(path.with_name("x"))
    start = time.monotonic()
    with cache_for(root).claim_all(keys) as found:  # answered by lookups (per-entry stamps) instead
        assert [found[k] for k in keys] == entries
    assert time.monotonic() - start < 5  # a FIFO never blocks


def test_a_damaged_stamp_is_never_read_as_a_wrong_description(warm, file_hashes):
    """A stamp holds the description a loader reads: a flipped byte in it must cost a hash, not mislead."""
    root, entries, keys = warm
    with cache_for(root).claim_all(keys):
        pass
    damaged = []
    for stamp in [*entry_stamps(root), *set_stamps(root)]:
        data = stamp.read_bytes()
        if b'"n":1' in data:  # entry 1's stamp and the set stamp
            stamp.write_bytes(data.replace(b'"n":1', b'"n":7'))  # still JSON, another description
            damaged.append(stamp)
    assert len(damaged) == 2
    before = file_hashes.calls
    fresh = cache_for(root)
    with fresh.claim_all(keys) as found:
        assert [found[k] for k in keys] == entries and found[keys[1]].description == desc(1)
    assert fresh.lookup(keys[1]).description == desc(1)
    assert file_hashes.calls == before + FILES_PER_ENTRY  # the damaged entry's stamps ignored: hashed in full


def test_another_users_set_stamp_is_ignored(tmp_path, file_hashes):
    user = other_user()
    if user is None:
        pytest.skip("needs root and the jwtest account")
    base = shared_dir()
    root = base / "root"
    entries = [cache_for(root).get_or_build(desc(n), make_builder(tmp_path / "c", n)) for n in range(2)]
    keys = [e.key for e in entries]
    path = set_stamp_path(root, keys)
    path.parent.mkdir(parents=True, exist_ok=True)
    (root / "v1" / "verified" / "sets").chmod(0o1777)  # a sticky dir another user can add to
    body = json.dumps({"entries": {e.key: stamp_doc(e) for e in entries}}).encode()
    as_user(user, path.write_bytes, hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    assert path.stat().st_uid == user.pw_uid
    for stamp in entry_stamps(root):
        stamp.unlink()
    before = file_hashes.calls
    with cache_for(root).claim_all(keys) as found:
        assert [found[k] for k in keys] == entries
    assert file_hashes.calls == before + 2 * FILES_PER_ENTRY  # not trusted: each entry hashed in full


def test_prune_removes_the_set_stamps_of_removed_entries(warm):
    root, entries, keys = warm
    with cache_for(root).claim_all(keys[:2]):
        pass
    with cache_for(root).claim_all(keys[2:]):
        pass
    assert len(set_stamps(root)) == 2
    cache = cache_for(root)
    with cache.claim(entries[2]):  # kept: its set stamp stays
        cache_for(root).prune(max_bytes=0)
    remaining = set_stamps(root)
    assert len(remaining) == 1 and keys[2] in remaining[0].read_text()


def test_prune_deletes_damaged_stamps_and_keeps_good_ones(warm):
    root, _entries, keys = warm
    with cache_for(root).claim_all(keys):
        pass
    (damaged,) = set_stamps(root)
    damaged.write_bytes(damaged.read_bytes()[:-2] + b"]}")
    good = entry_stamps(root)
    assert len(good) == 3
    assert cache_for(root).prune(older_than_s=10**9).removed == ()
    assert set_stamps(root) == [] and sorted(entry_stamps(root)) == sorted(good)


def test_prune_loop_against_claim_all_and_load_loop(tmp_path):
    """A process prunes to nothing in a loop; this one claims all three keys and loads them: no load fails."""
    root, counter = tmp_path / "root", tmp_path / "c"
    cache = cache_for(root)
    keys = [cache.get_or_build(desc(n), make_builder(counter, n)).key for n in range(3)]
    rounds = 0
    with pruning(root, tmp_path) as report:
        deadline = time.monotonic() + 60
        while rounds < 100 and time.monotonic() < deadline:
            with cache.claim_all(keys, timeout_s=30) as found:
                for n, key in enumerate(keys):
                    if found[key] is None:  # pruned before the claim: built again, as the hook's build policy does
                        cache.get_or_build(desc(n), make_builder(counter, n), timeout_s=30)
                        continue
                    time.sleep(0.001)  # loading takes a while: prune runs meanwhile, and must keep it
                    assert found[key].file("kernel.bin").read_bytes() == artifact_bytes(n)
            rounds += 1
    assert rounds == 100 and report["removed"] > 0 and report["skipped_locked"], report
    assert sum(build_counts(counter).values()) > 3  # prune did remove entries between the rounds
