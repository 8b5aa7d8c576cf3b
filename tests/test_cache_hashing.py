"""Hashing once: each description once per process (``key=``), each file once on every publish path.

sha256 calls are counted by replacing the ``hashlib`` that ``jitwarm.cache.entry`` (every file hash, the
``file_hashes`` fixture of conftest.py) and ``jitwarm.cache.keys`` (every key) see with a counting wrapper.
"""

from __future__ import annotations

import collections
import types

import pytest
from workers.cache_harness import (
    FILES_PER_ENTRY,
    Sha256Counter,
    artifact_bytes,
    build_counts,
    cache_for,
    desc,
    make_builder,
)

from jitwarm.cache import KernelCache
from jitwarm.cache import keys as keys_module
from jitwarm.cache.errors import UntrustedPath


@pytest.fixture
def key_hashes(monkeypatch):
    counter = Sha256Counter()
    monkeypatch.setattr(keys_module, "hashlib", types.SimpleNamespace(sha256=counter.sha256))
    return counter


def test_a_build_hashes_each_file_once(tmp_path, file_hashes):
    cache = cache_for(tmp_path / "root")
    entry = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    assert len(entry.files) == FILES_PER_ENTRY and file_hashes.calls == FILES_PER_ENTRY
    assert cache.lookup(entry.key) == entry and cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0)) == entry
    assert file_hashes.calls == FILES_PER_ENTRY  # later lookups compare stat signatures only


def test_a_new_process_trusts_this_hosts_stamp_until_a_file_changes(tmp_path, file_hashes):
    entry = cache_for(tmp_path / "root").get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    assert file_hashes.calls == FILES_PER_ENTRY
    # a new instance (a new process) finds the stamp the publish wrote: same inodes, sizes and times, no hash
    assert cache_for(tmp_path / "root").lookup(entry.key) == entry and file_hashes.calls == FILES_PER_ENTRY
    victim = entry.path / entry.files[0]
    victim.chmod(0o644)
    victim.write_bytes(victim.read_bytes())  # the same bytes, but a write: the ctime moves on
    victim.chmod(0o444)
    assert cache_for(tmp_path / "root").lookup(entry.key) == entry  # hashed again, still valid
    assert file_hashes.calls == 2 * FILES_PER_ENTRY
    victim.chmod(0o644)
    victim.write_bytes(b"tampered")
    assert cache_for(tmp_path / "root").lookup(entry.key) is None  # and a change is caught: corrupt, quarantined
    # `verify` hashes whatever the stamps say (it is the check for what stat cannot see, such as bit rot)
    again = cache_for(tmp_path / "root").get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    before = file_hashes.calls
    assert cache_for(tmp_path / "root").verify([again.key]).ok == (again.key,)
    assert file_hashes.calls == before + FILES_PER_ENTRY


def test_a_read_only_root_keeps_no_stamps(tmp_path, file_hashes):
    entry = cache_for(tmp_path / "root").get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    for stamp in (tmp_path / "root" / "v1" / "verified").rglob("*.json"):
        stamp.unlink()
    reader = KernelCache(root=tmp_path / "root", layers=(), read_only=True)
    assert reader.lookup(entry.key) == entry and file_hashes.calls == 2 * FILES_PER_ENTRY
    assert not list((tmp_path / "root" / "v1" / "verified").rglob("*.json"))


def test_a_bundle_import_hashes_each_file_once(tmp_path, file_hashes):
    src = cache_for(tmp_path / "src")
    entries = [src.get_or_build(desc(n), make_builder(tmp_path / "c", n)) for n in range(3)]
    bundle = src.export_bundle([e.key for e in entries], tmp_path / "b.tar.gz")
    before = file_hashes.calls
    dest = cache_for(tmp_path / "dest")
    assert len(dest.import_bundle(bundle).imported) == 3
    assert file_hashes.calls - before == 3 * FILES_PER_ENTRY
    assert all(dest.lookup(e.key).records == e.records for e in entries)
    assert file_hashes.calls - before == 3 * FILES_PER_ENTRY


def test_a_download_and_its_upload_hash_each_file_once(remote, tmp_path, file_hashes):
    counter = tmp_path / "builds.log"
    built = remote.cache(tmp_path / "a").get_or_build_ex(desc(1), make_builder(counter, 1))
    assert built.outcome == "built" and file_hashes.calls == FILES_PER_ENTRY  # sealed once, uploaded unhashed
    reader = remote.cache(tmp_path / "b")
    got = reader.get_or_build_ex(desc(1), make_builder(counter, 1))
    assert got.outcome == "downloaded" and file_hashes.calls == 2 * FILES_PER_ENTRY
    assert reader.lookup(got.entry.key) == got.entry and file_hashes.calls == 2 * FILES_PER_ENTRY
    assert got.entry.file("kernel.bin").read_bytes() == artifact_bytes(1) and build_counts(counter) == {1: 1}


def test_a_precomputed_key_is_not_hashed_again(tmp_path, key_hashes):
    cache, counter = cache_for(tmp_path / "root"), tmp_path / "c"
    key = cache.key(desc(2))
    assert key_hashes.calls == 1
    built = cache.get_or_build_ex(desc(2), make_builder(counter, 2), key=key)
    assert built.outcome == "built" and built.entry.key == key
    assert key_hashes.calls == 2  # a build checks the key against its description once, under the lock
    for _ in range(3):
        assert cache.get_or_build_ex(desc(2), make_builder(counter, 2), key=key).outcome == "hit"
        assert cache.get_or_build(desc(2), make_builder(counter, 2), key=key) == built.entry
    assert key_hashes.calls == 2
    assert cache.get_or_build_ex(desc(2), make_builder(counter, 2)).outcome == "hit"
    assert key_hashes.calls == 3  # without key=, each call hashes the description
    assert build_counts(counter) == {2: 1}


def test_a_wrong_precomputed_key_builds_nothing(tmp_path):
    cache, counter = cache_for(tmp_path / "root"), tmp_path / "c"
    with pytest.raises(ValueError, match="not a cache key"):
        cache.get_or_build(desc(3), make_builder(counter, 3), key="../../etc")
    other = cache.key(desc(4))
    with pytest.raises(ValueError, match=f"key {other} is not the key of this description"):
        cache.get_or_build(desc(3), make_builder(counter, 3), key=other)
    assert build_counts(counter) == collections.Counter() and cache.lookup(other) is None
    assert not (tmp_path / "root" / "v1" / "staging").exists()
    assert cache.get_or_build_ex(desc(3), make_builder(counter, 3), key=cache.key(desc(3)), timeout_s=0.5).outcome \
        == "built"  # the lock was released


def test_a_stamp_stands_only_for_the_folders_it_was_taken_over(tmp_path, file_hashes):
    entry = cache_for(tmp_path / "root").get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    assert cache_for(tmp_path / "root").lookup(entry.key) == entry and file_hashes.calls == FILES_PER_ENTRY
    # an added folder, even an empty one, is not what was stamped: hashed again (and still valid)
    (entry.path / "meta" / "added").mkdir()
    assert cache_for(tmp_path / "root").lookup(entry.key) == entry
    assert file_hashes.calls == 2 * FILES_PER_ENTRY
    (entry.path / "meta" / "added").rmdir()
    # a folder of the entry that other users can write is refused on the stamp's path as on a first look
    (entry.path / "meta").chmod(0o777)
    with pytest.raises(UntrustedPath, match="cache entry directory"):
        cache_for(tmp_path / "root").lookup(entry.key)
