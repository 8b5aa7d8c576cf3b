"""A complete cache on a volume nobody can write works for everything that needs no write.

Lookups, ``verify`` (looking only), ``status``-style checks, facts, stamps and claims on a root that cannot
be written (a tmpfs remounted read-only, or 0555 directories for a non-root user) never raise a raw
PermissionError or OSError; what needs a write (a build on a miss) is one clear CacheWriteError.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from test_cache_write_errors import needs_mount, small_tmpfs
from workers.cache_harness import as_user, cache_for, desc, make_builder, other_user, shared_dir

from jitwarm.cache import CacheWriteError, KernelCache

needs_other_user = pytest.mark.skipif(other_user() is None, reason="needs root and the user jwtest")


def _fill(root, tmp):
    """A complete cache: three entries (one of them then damaged), stamps, a fact, a plan record."""
    cache = cache_for(root)
    entries = [cache.get_or_build(desc(n), make_builder(tmp / "c", n)) for n in range(3)]
    cache.write_fact("cc-version", "12.4")
    cache.write_plan_record("plan-a", {"complete": True})
    bad = entries[2].path / "kernel.bin"
    bad.chmod(0o644)
    bad.write_bytes(b"damaged")
    return entries


def _exercise(root, layer_root, keys):
    """Everything that needs no write, as a fresh process would do it; returns what it saw (raises on a leak)."""
    good, other, bad = keys
    out = {}
    for read_only in (False, True):
        cache = KernelCache(root=root, layers=(), read_only=read_only)
        assert cache.lookup(good) is not None and cache.lookup(bad) is None
        assert cache.get_or_build(desc(1), lambda d: None).key == other  # a hit needs no write
        report = cache.verify(None)
        assert report.ok == tuple(sorted((good, other))) and list(report.corrupt) == [bad], report
        assert cache.verify([good, bad], repair=True).quarantined == ()  # asked to repair: cannot, says so
        assert cache.read_fact("cc-version") == "12.4" and cache.read_plan_record("plan-a") == {"complete": True}
        cache.write_fact("other", "x")  # best effort: nothing kept, nothing raised
        with cache.claim(cache.lookup(good)) as claimed:
            assert claimed is not None
        out[read_only] = cache.stats().corrupt
    layered = KernelCache(root=layer_root, layers=[root])
    assert layered.lookup(good).read_only and layered.lookup(bad) is None
    try:
        KernelCache(root=root, layers=()).get_or_build(desc(5), lambda d: (d / "f").write_bytes(b"x"))
    except CacheWriteError as exc:
        out["miss"] = str(exc)
    return out


@needs_mount
def test_cache_on_a_read_only_mount(tmp_path):
    with small_tmpfs(tmp_path / "disk", size="16m") as disk:
        entries = _fill(disk / "cache", tmp_path)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        out = _exercise(disk / "cache", tmp_path / "writable", [e.key for e in entries])
        assert out[False] >= 1 and out[True] >= 1
        assert "Read-only file system" in out["miss"] and "\n" not in out["miss"]
        assert (entries[2].path / "kernel.bin").exists()  # nothing could move it, nothing tried to raise


@needs_other_user
def test_cache_in_0555_directories_as_another_user():
    user = other_user()
    base = shared_dir(owner=user)
    try:
        root = base / "cache"

        def fill_and_freeze():
            entries = _fill(root, base)
            for path in sorted(root.rglob("*"), reverse=True):
                if path.is_dir() and not path.is_symlink():
                    path.chmod(0o555)
            root.chmod(0o555)
            base.chmod(0o555)
            return [e.key for e in entries]

        keys = as_user(user, fill_and_freeze)
        writable = shared_dir(owner=user)
        try:
            out = as_user(user, _exercise, root, writable / "root", keys)
        finally:
            shutil.rmtree(writable, ignore_errors=True)
        assert "Permission denied" in out["miss"] and "\n" not in out["miss"]
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)


@needs_other_user
def test_unreadable_entries_and_shards_are_corrupt_not_a_permission_error():
    user = other_user()
    base = shared_dir(owner=user)
    try:
        def run():
            root = base / "cache"
            cache = cache_for(root)
            e0, e1 = (cache.get_or_build(desc(n), make_builder(base / "c", n)) for n in (0, 1))
            e0.path.chmod(0o000)  # the entry directory
            e1.file("kernel.bin").chmod(0o000)  # a file of it
            seen = {"verify": sorted(cache_for(root).verify(None).corrupt)}
            fresh = cache_for(root)
            seen["lookups"] = [fresh.lookup(e0.key), fresh.lookup(e1.key)]
            seen["corrupt"] = fresh.stats().corrupt
            seen["rebuilt"] = [fresh.get_or_build_ex(desc(n), make_builder(base / "c", n)).outcome for n in (0, 1)]
            shard = root / "v1" / "entries" / e0.key[:2]
            shard.chmod(0o000)  # a whole shard
            seen["shard_verify"] = list(cache_for(root).verify(None).corrupt)
            seen["shard_lookup"] = cache_for(root).lookup(e0.key)
            seen["shard_rebuilt"] = cache_for(root).get_or_build_ex(desc(0), make_builder(base / "c", 0)).outcome
            seen["clean"] = cache_for(root).verify(None, repair=True).clean
            return seen, [e0.key, e1.key], str(shard)

        seen, keys, shard = as_user(user, run)
        assert seen["verify"] == sorted(keys) and seen["lookups"] == [None, None] and seen["corrupt"] == 2
        assert seen["rebuilt"] == ["built", "built"]
        assert seen["shard_verify"] == [shard] and seen["shard_lookup"] is None
        assert seen["shard_rebuilt"] == "built" and seen["clean"]
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)
