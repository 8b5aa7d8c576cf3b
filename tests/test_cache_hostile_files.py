"""Hostile or broken files in a root or a layer: each is a corrupt entry, never a traceback.

A corrupt entry is quarantined when it is in the writable root, skipped in a layer, rebuilt by the next
get_or_build, counted in ``stats().corrupt`` and reported by ``verify``; its parsers bound depth and size.
Each case was first reproduced against the old code (RecursionError, NotADirectoryError, a refused symlink).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from workers.cache_harness import artifact_bytes, build_counts, cache_for, desc, make_builder

from jitwarm.cache import CacheError, KernelCache, LockTimeout, key_of
from jitwarm.cache.layout import RootLayout
from jitwarm.cache.locks import KeyLock

DEEP = b"[" * 100_000
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown of a symlink to another uid needs root")


def _writable(path):
    path.chmod(0o644)
    return path


def _deep_preimage(depth: int) -> bytes:
    """A well-formed manifest whose description nests ``depth`` deep: json.loads takes it, key_of must not recurse."""
    nested: object = 1
    for _ in range(depth):
        nested = [nested]
    return json.dumps({"format": 1, "key": "x", "preimage": {"format": 1, "description": {"a": nested}},
                       "files": []}).encode()


MANIFESTS = {
    "100000 nested [": DEEP,
    "nested objects": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "deep preimage": _deep_preimage(70),
    "17 MiB": b" " * (17 << 20),
    "created is a list": None,  # filled in from the real manifest
}


@pytest.mark.parametrize("kind", list(MANIFESTS))
@pytest.mark.parametrize("where", ["root", "layer"])
def test_hostile_manifest_is_a_corrupt_entry(tmp_path, kind, where):
    root, layer, counter = tmp_path / "root", tmp_path / "layer", tmp_path / "builds.log"
    entry = cache_for(root if where == "root" else layer).get_or_build(desc(0), make_builder(counter, 0))
    manifest = _writable(entry.path / "entry.json")
    if kind == "created is a list":
        doc = json.loads(manifest.read_bytes())
        doc["created"] = [1]
        manifest.write_text(json.dumps(doc))
    else:
        manifest.write_bytes(MANIFESTS[kind])

    def fresh():
        return KernelCache(root=root, layers=[layer] if where == "layer" else ())

    looker = fresh()
    report = looker.verify([entry.key])  # looking only: reported, nothing moved
    assert list(report.corrupt) == [entry.key] and report.quarantined == () and entry.path.exists()
    assert looker.stats().corrupt == 1
    cache = fresh()
    assert cache.lookup(entry.key) is None and cache.stats().corrupt == 1
    assert entry.path.exists() == (where == "layer")  # quarantined in the root, left in a layer
    result = cache.get_or_build_ex(desc(0), make_builder(counter, 0))
    assert result.outcome == "built" and build_counts(counter) == {0: 2}
    assert result.entry.file("kernel.bin").read_bytes() == artifact_bytes(0)
    if where == "root":
        assert fresh().verify(None).clean


def test_hostile_manifest_in_a_bundle_and_a_hostile_bundle_json(tmp_path):
    import io
    import tarfile

    src = cache_for(tmp_path / "src")
    entry = src.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    good = src.export_bundle([entry.key], tmp_path / "good.tar")
    for target, expect in (("bundle.json", "bundle.json is malformed"), ("entry.json", "does not verify")):
        bad = tmp_path / f"bad-{target}.tar"
        with tarfile.open(good) as tin, tarfile.open(bad, "w") as tout:
            for info in tin.getmembers():
                data = tin.extractfile(info).read()
                if info.name.endswith(target):
                    data, info.size = DEEP, len(DEEP)
                tout.addfile(info, io.BytesIO(data))
        dest = cache_for(tmp_path / f"dest-{target}")
        with pytest.raises(CacheError, match=expect):
            dest.import_bundle(bad)
        assert dest.lookup(entry.key) is None and dest.verify(None).clean


def test_hostile_small_json_files_are_ignored(tmp_path):
    """Holder records, stamps, facts and plan records: a planted deep document is as good as none."""
    root = tmp_path / "root"
    cache = cache_for(root)
    entry = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    layout = RootLayout(root)
    for stamp in (root / "v1" / "verified").rglob("*.json"):
        stamp.write_bytes(DEEP)
    assert cache_for(root).lookup(entry.key) == entry  # no stamp to trust: hashed in full instead
    cache.write_fact("cc-version", "12.4")
    (layout.facts / "cc-version.json").write_bytes(DEEP)
    assert cache.read_fact("cc-version") is None
    cache.write_plan_record("plan-a", {"complete": True})
    layout.plan_path("plan-a").write_bytes(DEEP)
    assert cache.read_plan_record("plan-a") is None

    key = cache.key(desc(1))
    holder = KeyLock(cache.lock_dir, key)
    assert holder.try_acquire()
    try:
        (cache.lock_dir / f"{key}.holder").write_bytes(DEEP)
        seen = []
        with pytest.raises(LockTimeout, match="no holder recorded"):
            cache.get_or_build(desc(1), make_builder(tmp_path / "c", 1), timeout_s=0.5, on_wait=seen.append)
        assert seen == [None]
        planted = {"host": "evil\nsecond line", "pid": os.getpid(), "since": 1.0}
        (cache.lock_dir / f"{key}.holder").write_text(json.dumps(planted))
        with pytest.raises(LockTimeout, match="held by pid") as info:
            cache.get_or_build(desc(1), make_builder(tmp_path / "c", 1), timeout_s=0.3)
        assert "\n" not in str(info.value) and "evil_second_line" in str(info.value)
    finally:
        holder.release()
    assert cache.prune(older_than_s=10**9).removed == ()  # prune reads stamps too


def test_a_description_nested_too_deep_is_a_type_error():
    nested: object = 1
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(TypeError, match="nests deeper than"):
        key_of({"a": nested})


# -- shard directories and entry paths that are not what they should be -------------------------------------------

def _same_shard(key: str) -> int:
    """Return an n whose key shares ``key``'s shard (two hex digits), to show the whole shard works again."""
    return next(n for n in range(1, 10_000) if key_of(desc(n))[:2] == key[:2])


def _break(kind: str, entry, tmp_path) -> str:
    """Put something that is no entry directory (or no shard directory) where the entry's shard or entry is."""
    shard, elsewhere = entry.path.parent, tmp_path / f"elsewhere-{kind}"
    if kind.startswith("shard"):
        shutil.copytree(shard, elsewhere, symlinks=True)
        shutil.rmtree(shard)
        target = shard
    else:
        shutil.copytree(entry.path, elsewhere, symlinks=True)
        shutil.rmtree(entry.path)
        target = entry.path
    if kind.endswith("file"):
        target.write_bytes(b"not a directory")
    elif kind.endswith("symlink"):
        target.symlink_to(elsewhere)  # to a good copy: still refused, a link could point anywhere
    elif kind.endswith("fifo"):
        os.mkfifo(target)
    return str(target) if kind.startswith("shard") else entry.key


BREAKS = ["shard_file", "shard_symlink", "shard_fifo", "entry_file", "entry_symlink", "entry_fifo"]


@pytest.mark.parametrize("kind", BREAKS)
def test_broken_shard_or_entry_path_in_the_root_is_moved_aside(tmp_path, kind):
    root, counter = tmp_path / "root", tmp_path / "builds.log"
    entry = cache_for(root).get_or_build(desc(0), make_builder(counter, 0))
    sibling_n = _same_shard(entry.key)
    name = _break(kind, entry, tmp_path)

    report = cache_for(root).verify(None)  # verify --all sees it, and only looks
    assert list(report.corrupt) == [name] and report.quarantined == () and os.path.lexists(name if
                                                                                          kind.startswith("shard")
                                                                                          else entry.path)
    cache = cache_for(root)
    assert cache.lookup(entry.key) is None and cache.stats().corrupt == 1
    assert not os.path.lexists(entry.path.parent if kind.startswith("shard") else entry.path)
    assert any(p.name.startswith(("shard-", entry.key)) for p in (root / "v1" / "quarantine").iterdir())
    assert cache.get_or_build_ex(desc(0), make_builder(counter, 0)).outcome == "built"
    assert cache.get_or_build_ex(desc(sibling_n), make_builder(counter, sibling_n)).outcome == "built"
    assert cache_for(root).verify(None, repair=True).clean


@pytest.mark.parametrize("kind", ["shard_file", "shard_symlink", "entry_file", "entry_symlink"])
def test_broken_shard_or_entry_path_found_by_verify_repair(tmp_path, kind):
    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    name = _break(kind, entry, tmp_path)
    report = cache_for(root).verify(None, repair=True)
    assert list(report.corrupt) == [name] and report.quarantined == (name,)
    assert cache_for(root).verify(None).clean


@pytest.mark.parametrize("kind", BREAKS)
def test_broken_shard_or_entry_path_in_a_layer_is_skipped(tmp_path, kind):
    layer, root, counter = tmp_path / "layer", tmp_path / "root", tmp_path / "builds.log"
    entry = cache_for(layer).get_or_build(desc(0), make_builder(counter, 0))
    name = _break(kind, entry, tmp_path)
    before = sorted(str(p) for p in layer.rglob("*"))
    cache = KernelCache(root=root, layers=[layer])
    assert cache.lookup(entry.key) is None and cache.stats().corrupt == 1
    result = cache.get_or_build_ex(desc(0), make_builder(counter, 0))
    assert result.outcome == "built" and result.entry.path.is_relative_to(root)
    report = cache.verify(None, repair=True)
    assert name in report.corrupt and report.quarantined == () and report.ok == (entry.key,)
    assert sorted(str(p) for p in layer.rglob("*")) == before  # a layer is never written


# -- the root itself: judged by what it resolves to ----------------------------------------------------------------

def test_symlinked_root_to_own_directory_is_accepted(tmp_path):
    real, link, counter = tmp_path / "volume" / "jitwarm", tmp_path / "cache-link", tmp_path / "builds.log"
    real.mkdir(parents=True)
    real.chmod(0o755)
    link.symlink_to(real)
    built = cache_for(link).get_or_build_ex(desc(0), make_builder(counter, 0))
    assert built.outcome == "built" and (real / "v1" / "entries").is_dir()
    assert cache_for(link).lookup(built.entry.key) == built.entry
    assert KernelCache(root=tmp_path / "other", layers=[link]).lookup(built.entry.key) is not None


def test_symlinked_root_to_a_world_writable_directory_is_refused_naming_the_target(tmp_path):
    real, link = tmp_path / "open", tmp_path / "cache-link"
    real.mkdir()
    real.chmod(0o777)
    link.symlink_to(real)
    with pytest.raises(CacheError) as info:
        cache_for(link).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    assert f"a symlink to {real}" in str(info.value) and "writable by every user and has no sticky bit" in str(
        info.value)
    assert info.value.hint.startswith("pass KernelCache(allow_shared=True)")
    real.chmod(0o1777)
    assert cache_for(link).get_or_build_ex(desc(0), make_builder(tmp_path / "c", 0)).outcome == "built"


@needs_root
def test_symlinked_root_owned_by_another_user_is_refused(tmp_path):
    real, link = tmp_path / "mine", tmp_path / "cache-link"
    real.mkdir()
    link.symlink_to(real)
    os.lchown(link, 12345, 12345)
    with pytest.raises(CacheError, match="symlink owned by uid 12345"):
        cache_for(link).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    assert cache_for(link, allow_shared=True).get_or_build_ex(desc(0), make_builder(tmp_path / "c", 0)).outcome \
        == "built"
