"""Prune: LRU by size, by age, never a locked entry; abandoned staging dirs of dead processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from workers.cache_harness import build_counts, cache_for, desc, make_builder

from jitwarm.cache import maintenance as prune_module
from jitwarm.cache.locks import KeyLock, this_host
from jitwarm.cache.settings import override


@pytest.fixture
def three(tmp_path):
    """Three entries whose last use is 300, 200 and 100 s ago."""
    root = tmp_path / "root"
    cache = cache_for(root)
    entries = [cache.get_or_build(desc(n), make_builder(tmp_path / "c", n)) for n in range(3)]
    now = time.time()
    for age, entry in zip((300, 200, 100), entries, strict=True):
        os.utime(entry.path, (now - age, now - age))
    return root, entries


def test_prune_by_size_removes_least_recently_used_first(three):
    root, (e0, e1, e2) = three
    cache_for(root).lookup(e0.key)  # a use: e0 becomes the most recent
    total = cache_for(root).size_bytes()
    keep = sum(f.stat().st_size for f in e0.path.rglob("*") if f.is_file())

    report = cache_for(root).prune(max_bytes=keep + 10)
    assert report.removed == (e1.key, e2.key)
    assert report.remaining_bytes == keep == cache_for(root).size_bytes()
    assert report.freed_bytes == total - keep
    fresh = cache_for(root)
    assert fresh.lookup(e0.key) is not None and fresh.lookup(e1.key) is None and fresh.lookup(e2.key) is None
    assert not (root / "v1" / "staging").exists()
    # the verification stamps of removed entries go with them
    assert sorted(p.name.split("-")[0] for p in (root / "v1" / "verified").rglob("*.json")) == [e0.key]


def test_prune_never_removes_an_entry_whose_lock_is_held(three):
    root, (e0, e1, e2) = three
    cache = cache_for(root)
    holder = KeyLock(cache.lock_dir, e1.key)  # its own descriptor: a real flock conflict
    assert holder.try_acquire()
    try:
        report = cache.prune(max_bytes=0)
    finally:
        holder.release()
    assert report.removed == (e0.key, e2.key) and report.skipped_locked == (e1.key,)
    assert cache_for(root).lookup(e1.key) == e1


def test_an_entry_get_or_build_returned_is_kept_for_the_grace_period(tmp_path):
    """A plain get_or_build then a read lost the file to a concurrent prune (9 of 3,470): no claim needed now."""
    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    old = time.time() - 7200
    os.utime(entry.path, (old, old))  # unused for two hours
    with override(prune_grace_s=600):
        got = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))  # a hit: a use
        report = cache_for(root).prune(max_bytes=0)
        assert report.removed == () and report.skipped_recent == (entry.key,)
        assert got.file("kernel.bin").read_bytes()  # the caller's read, after the prune
        os.utime(entry.path, (old, old))
        assert cache_for(root).prune(max_bytes=0).removed == (entry.key,)  # unused again: pruned


def test_a_use_between_prunes_listing_and_its_removal_keeps_the_entry(tmp_path, monkeypatch):
    """The race made certain: the entry is looked up after prune listed it as unused, before it is removed."""
    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    old = time.time() - 7200
    os.utime(entry.path, (old, old))
    real, got = prune_module._remove_entry, []

    def use_then_remove(*args):
        got.append(cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0)))
        return real(*args)

    monkeypatch.setattr(prune_module, "_remove_entry", use_then_remove)
    with override(prune_grace_s=600):
        report = cache_for(root).prune(older_than_s=3600)
    assert report.removed == () and report.skipped_recent == (entry.key,) and got[0].file("kernel.bin").exists()


def test_prune_by_age(three):
    root, (e0, e1, e2) = three
    report = cache_for(root).prune(older_than_s=250)
    assert report.removed == (e0.key,)
    assert cache_for(root).prune().removed == ()


def _dead_pid():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(proc.stdout)


def test_prune_removes_staging_of_dead_processes_on_this_host_only(tmp_path):
    root = tmp_path / "root"
    cache = cache_for(root)
    cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    key, dead, host = cache.key(desc(1)), _dead_pid(), this_host()
    staging = root / "v1" / "staging"
    dirs = {
        "dead_build": staging / f"{host}-{dead}-{key}-0badc0de",
        "dead_import": staging / f"{host}-{dead}-bundle-0badc0de",
        "live_build": staging / f"{host}-{os.getpid()}-{key}-0badc0de",
        "other_host": staging / f"elsewhere.example-{dead}-{key}-0badc0de",
        "not_ours": staging / "something-else",
    }
    for d in dirs.values():
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "partial.o").write_bytes(b"x" * 10)

    report = cache.prune()
    assert sorted(report.staging_removed) == sorted([dirs["dead_build"].name, dirs["dead_import"].name])
    assert sorted(p.name for p in staging.iterdir()) == sorted(
        d.name for k, d in dirs.items() if k not in ("dead_build", "dead_import"))


def test_next_build_of_the_key_removes_its_dead_staging(tmp_path):
    root, counter = tmp_path / "root", tmp_path / "c"
    cache = cache_for(root)
    key = cache.key(desc(1))
    stale = root / "v1" / "staging" / f"{this_host()}-{_dead_pid()}-{key}-0badc0de"
    stale.mkdir(parents=True)
    (stale / "kernel.bin").write_bytes(b"partial")
    cache.get_or_build(desc(1), make_builder(counter, 1))
    assert not stale.exists() and build_counts(counter) == {1: 1}


def test_prune_removes_old_quarantine(three):
    root, (e0, _e1, _e2) = three
    (e0.path / "entry.json").chmod(0o644)
    (e0.path / "entry.json").write_text("garbage")
    assert cache_for(root).lookup(e0.key) is None
    assert len(list((root / "v1" / "quarantine").iterdir())) == 2  # the copy and its .reason note
    assert cache_for(root).prune(older_than_s=3600).quarantine_removed == ()
    old = time.time() - 7200
    for p in (root / "v1" / "quarantine").iterdir():
        os.utime(p, (old, old))
    assert len(cache_for(root).prune(older_than_s=3600).quarantine_removed) == 2
    assert list((root / "v1" / "quarantine").iterdir()) == []


def test_a_lookup_under_the_keys_own_lock_touches_without_waiting_for_itself(tmp_path):
    """A touch takes a shared claim; under the key's exclusive lock (look again, publish) that would wait."""
    import shutil

    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    shutil.rmtree(root / "v1" / "verified")  # no stamp: the fresh instance verifies in full, then touches
    old = time.time() - 7200
    os.utime(entry.path, (old, old))
    cache = cache_for(root)
    with KeyLock(cache.lock_dir, entry.key) as lock:
        assert lock.try_acquire()
        start = time.monotonic()
        assert cache.lookup(entry.key, locked=True) == entry
        assert time.monotonic() - start < 20
    assert time.time() - entry.path.stat().st_mtime < 60  # touched all the same


def test_prune_s_grace_flag_overrides_the_environment(three, monkeypatch):
    """``jitwarm prune --grace SECONDS`` beats ``JITWARM_PRUNE_GRACE_S`` both ways; a bad value is exit 2."""
    root, entries = three  # last used 300, 200 and 100 s ago

    def prune(*flags: str, grace_env: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "JITWARM_PRUNE_GRACE_S": grace_env}
        return subprocess.run([sys.executable, "-m", "jitwarm", "prune", "--max-bytes", "0", "--cache-dir", str(root),
                               "--json", *flags], capture_output=True, text=True, env=env, cwd="/", check=False)

    kept = json.loads(prune("--grace", "250", grace_env="0").stdout)  # 250 s: the two newer entries stay
    assert kept["removed"] == [entries[0].key] and sorted(kept["skipped_recent"]) == sorted(e.key for e in entries[1:])
    gone = json.loads(prune("--grace", "0", grace_env="3600").stdout)  # 0: off, whatever the environment says
    assert sorted(gone["removed"]) == sorted(e.key for e in entries[1:]) and not gone["skipped_recent"]
    for bad in ("-1", "nan", "soon"):
        proc = prune("--grace", bad, grace_env="0")
        assert proc.returncode == 2 and proc.stderr.startswith("jitwarm: error: ") and "grace" not in proc.stdout
        assert proc.stderr.count("\n") == 1 and "invalid duration" in proc.stderr, proc.stderr
