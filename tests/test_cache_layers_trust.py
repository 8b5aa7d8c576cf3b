"""Read-only layers, read-only caches, and the trust check on roots and entries."""

from __future__ import annotations

import os

import pytest
from workers.cache_harness import build_counts, cache_for, desc, make_builder

from jitwarm.cache import CacheError, KernelCache
from jitwarm.cache.settings import override

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def test_layer_serves_hits_and_builds_go_to_root(tmp_path):
    layer, root, counter = tmp_path / "image-layer", tmp_path / "root", tmp_path / "builds.log"
    baked = cache_for(layer).get_or_build(desc(0), make_builder(counter, 0))

    cache = KernelCache(root=root, layers=[layer])
    hit = cache.get_or_build_ex(desc(0), make_builder(counter, 0))
    assert hit.outcome == "hit" and hit.entry.path == baked.path and hit.entry.read_only
    built = cache.get_or_build_ex(desc(1), make_builder(counter, 1))
    assert built.outcome == "built" and built.entry.path.is_relative_to(root)
    assert build_counts(counter) == {0: 1, 1: 1}
    assert sorted(p.name for p in (layer / "v1" / "entries").rglob("*") if len(p.name) == 64) == [baked.key]


def test_layers_default_to_jitwarm_cache_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    entry = cache_for(b).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    with override(cache_dir=tmp_path / "root", cache_path=[a, b]):
        cache = KernelCache()
        assert cache.root == tmp_path / "root" and cache.layers == (a, b)
        assert cache.lookup(entry.key) == entry
        assert KernelCache(layers=()).layers == ()


def test_read_only_cache_miss_raises_and_writes_nothing(tmp_path):
    root = tmp_path / "root"
    cache = KernelCache(root=root, layers=(), read_only=True)
    with pytest.raises(CacheError, match="read-only") as info:
        cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    assert cache.key(desc(0)) in str(info.value)
    assert not root.exists() and not (tmp_path / "c").exists()
    for call in (lambda: cache.prune(max_bytes=0), lambda: cache.import_bundle(tmp_path / "b.tar")):
        with pytest.raises(CacheError, match="read-only"):
            call()


def test_read_only_cache_serves_hits_without_writing(tmp_path):
    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    before = sorted(str(p) for p in root.rglob("*"))
    mtime = entry.path.stat().st_mtime_ns
    ro = cache_for(root, read_only=True)
    assert ro.get_or_build(desc(0), make_builder(tmp_path / "c", 0)).read_only
    assert sorted(str(p) for p in root.rglob("*")) == before and entry.path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("target", ["root", "v1", "entries", "layer"])
def test_world_writable_directory_is_refused(tmp_path, target):
    root, layer = tmp_path / "root", tmp_path / "layer"
    where = layer if target == "layer" else root
    entry = cache_for(where).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    path = {"root": root, "v1": root / "v1", "entries": root / "v1" / "entries", "layer": layer}[target]
    path.chmod(0o777)
    cache = KernelCache(root=root, layers=[layer])
    with pytest.raises(CacheError) as info:
        cache.lookup(entry.key)
    msg = str(info.value)
    assert str(path) in msg and "writable by every user" in msg and "sticky" in msg
    assert "allow_shared=True" in msg and "JITWARM_ALLOW_SHARED=1" in msg

    path.chmod(0o1777)  # /tmp style: sticky bit makes it fine
    assert KernelCache(root=root, layers=[layer]).lookup(entry.key) == entry


def test_world_writable_root_refused_before_building(tmp_path):
    root, counter = tmp_path / "root", tmp_path / "builds.log"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(CacheError, match="JITWARM_ALLOW_SHARED"):
        cache_for(root).get_or_build(desc(0), make_builder(counter, 0))
    assert build_counts(counter) == {}
    allowed = cache_for(root, allow_shared=True)
    assert allowed.get_or_build_ex(desc(0), make_builder(counter, 0)).outcome == "built"


def test_world_writable_file_in_entry_is_refused(tmp_path):
    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    entry.file("kernel.bin").chmod(0o666)
    with pytest.raises(CacheError, match="kernel.bin: it is writable by every user"):
        cache_for(root).lookup(entry.key)


@needs_root
@pytest.mark.parametrize("target", ["entry", "file", "root"])
def test_owned_by_another_uid_is_refused_unless_allowed(tmp_path, target):
    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    path = {"entry": entry.path, "file": entry.file("kernel.bin"), "root": root}[target]
    os.chown(path, 12345, -1)
    with pytest.raises(CacheError, match="owned by uid 12345") as info:
        cache_for(root).lookup(entry.key)
    assert "allow_shared=True" in str(info.value) and "JITWARM_ALLOW_SHARED=1" in str(info.value)

    assert cache_for(root, allow_shared=True).lookup(entry.key) == entry
    with override(allow_shared=True):
        assert cache_for(root).lookup(entry.key) == entry


# -- lock files and the lock directory (issue #20: another user blocked root's builds) ------------------------

def _flock_read_only(path):
    """What the attack did: open another user's lock file read-only and take it exclusively."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    return "locked"


def test_lock_files_are_private_and_another_user_cannot_lock_them(tmp_path):
    from workers.cache_harness import as_user, other_user, shared_dir

    base = shared_dir()
    try:
        cache = cache_for(base / "root")
        entry = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
        lock = cache.lock_dir / f"{entry.key}.lock"
        assert (lock.stat().st_mode & 0o777) == 0o600
        with cache.claim(entry):  # a claim creates no looser file either
            pass
        assert (lock.stat().st_mode & 0o777) == 0o600
        user = other_user()
        if user is None:
            pytest.skip("needs root and the jwtest account for the attack itself")
        with pytest.raises(RuntimeError, match="PermissionError"):
            as_user(user, _flock_read_only, lock)
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_an_older_0644_lock_file_of_ours_is_made_private(tmp_path):
    cache = cache_for(tmp_path / "root")
    key = cache.key(desc(1))
    cache.lock_dir.mkdir(parents=True)
    lock = cache.lock_dir / f"{key}.lock"
    lock.touch(mode=0o644)
    lock.chmod(0o644)
    cache.get_or_build(desc(1), make_builder(tmp_path / "c", 1))
    assert (lock.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o773])
def test_a_lock_dir_every_user_can_write_without_sticky_bit_is_refused(tmp_path, mode):
    from jitwarm.cache.errors import UntrustedPath

    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    lock_dir.chmod(mode)
    cache = KernelCache(root=tmp_path / "root", layers=(), lock_dir=lock_dir)
    with pytest.raises(UntrustedPath, match=f"refusing lock directory {lock_dir}: .*no sticky bit"):
        cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    assert not list(lock_dir.iterdir())  # refused before any lock file was made
    lock_dir.chmod(mode | 0o1000)  # /tmp style: others add names but cannot replace ours
    assert KernelCache(root=tmp_path / "root2", layers=(), lock_dir=lock_dir).get_or_build_ex(
        desc(0), make_builder(tmp_path / "c", 0)).outcome == "built"
    shared = KernelCache(root=tmp_path / "root3", layers=(), lock_dir=tmp_path / "open", allow_shared=True)
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)
    assert shared.get_or_build_ex(desc(0), make_builder(tmp_path / "c", 0)).outcome == "built"


@needs_root
def test_a_lock_dir_owned_by_another_user_is_refused(tmp_path):
    from jitwarm.cache.errors import UntrustedPath

    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    os.chown(lock_dir, 4242, 4242)
    cache = KernelCache(root=tmp_path / "root", layers=(), lock_dir=lock_dir)
    with pytest.raises(UntrustedPath, match="refusing lock directory .* owned by uid 4242"):
        cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    with pytest.raises(UntrustedPath):
        cache.prune(max_bytes=0)
    with override(allow_shared=True):
        assert KernelCache(root=tmp_path / "root", layers=(), lock_dir=lock_dir).get_or_build_ex(
            desc(0), make_builder(tmp_path / "c", 0)).outcome == "built"
