"""discard: an entry its caller cannot load is quarantined (root) or skipped (layer), then rebuilt exactly once.

The cache knows nothing of kernels: here a "library that fails to load" is a kernel.bin the caller refuses
because it starts with REJECTED, as a loader refuses a library dlopen rejects.
"""

from __future__ import annotations

import pytest
from workers.cache_harness import REJECTED, Workers, artifact_bytes, build_counts, cache_for, desc, make_builder

from jitwarm.cache import CacheError, KernelCache


def _rejected_build(staging):
    """A build whose library 'compiles' but does not load."""
    (staging / "kernel.bin").write_bytes(REJECTED + b" not an ELF file")


def _loads(entry) -> bool:
    return not entry.file("kernel.bin").read_bytes().startswith(REJECTED)


def _quarantined(root):
    q = root / "v1" / "quarantine"
    return sorted(p for p in q.iterdir() if p.is_dir()) if q.exists() else []


def test_discarded_root_entry_is_quarantined_with_its_reason_and_rebuilt_once(tmp_path):
    root, counter = tmp_path / "root", tmp_path / "builds.log"
    cache = cache_for(root)
    bad = cache.get_or_build(desc(0), _rejected_build)
    assert not _loads(bad)

    cache.discard(bad, "OSError: kernel.bin: invalid ELF header")
    assert not bad.path.exists() and cache.lookup(bad.key) is None
    [moved] = _quarantined(root)
    assert moved.name.startswith(bad.key)
    assert (moved.parent / (moved.name + ".reason")).read_text() == "OSError: kernel.bin: invalid ELF header"

    rebuilt = cache.get_or_build_ex(desc(0), make_builder(counter, 0))
    assert rebuilt.outcome == "built" and rebuilt.entry.path == bad.path and _loads(rebuilt.entry)
    assert cache.get_or_build_ex(desc(0), make_builder(counter, 0)).outcome == "hit"
    assert build_counts(counter) == {0: 1}
    assert cache_for(root).lookup(bad.key) == rebuilt.entry


def test_processes_that_all_fail_to_load_one_entry_rebuild_it_once(tmp_path):
    """Eight ranks load the same bad entry: one quarantines and rebuilds, the others wait for it."""
    workers = Workers(tmp_path, tmp_path / "root")
    bad = cache_for(workers.root).get_or_build(desc(1), _rejected_build)
    try:
        for _ in range(8):
            workers.spawn("load", 1, sleep=0.3, together=True)
        workers.start_together(8)
        results = workers.results()
    finally:
        workers.kill_all()
    assert build_counts(workers.counter) == {1: 1}
    assert sum(r["discarded"] for r in results) >= 1  # at least the first to load it; later ones may never see it
    assert [r["outcome"] for r in results].count("built") == 1
    assert len({r["path"] for r in results}) == 1 == len(_quarantined(workers.root))
    entry = cache_for(workers.root).lookup(bad.key)
    assert entry is not None and entry.file("kernel.bin").read_bytes() == artifact_bytes(1)


def test_discarded_layer_entry_is_skipped_and_rebuilt_into_the_root(tmp_path):
    layer, root, counter = tmp_path / "image-layer", tmp_path / "root", tmp_path / "builds.log"
    baked = cache_for(layer).get_or_build(desc(2), _rejected_build)
    cache = KernelCache(root=root, layers=[layer])
    hit = cache.get_or_build_ex(desc(2), make_builder(counter, 2))
    assert hit.outcome == "hit" and hit.entry.read_only and hit.entry.path == baked.path

    cache.discard(hit.entry, "OSError: invalid ELF header")
    assert baked.path.exists() and not (layer / "v1" / "quarantine").exists()  # a layer is never written
    assert cache.lookup(baked.key) is None
    rebuilt = cache.get_or_build_ex(desc(2), make_builder(counter, 2))
    assert rebuilt.outcome == "built" and rebuilt.entry.path.is_relative_to(root) and _loads(rebuilt.entry)
    assert cache.get_or_build_ex(desc(2), make_builder(counter, 2)).entry == rebuilt.entry
    assert build_counts(counter) == {2: 1}
    assert KernelCache(root=root, layers=[layer]).lookup(baked.key) == rebuilt.entry  # the root comes first


def test_discard_in_a_read_only_cache_skips_the_entry(tmp_path):
    root = tmp_path / "root"
    bad = cache_for(root).get_or_build(desc(3), _rejected_build)
    ro = cache_for(root, read_only=True)
    entry = ro.lookup(bad.key)
    ro.discard(entry, "OSError: invalid ELF header")
    assert bad.path.exists() and ro.lookup(bad.key) is None
    with pytest.raises(CacheError, match="read-only"):
        ro.get_or_build(desc(3), make_builder(tmp_path / "c", 3))
    assert cache_for(root).lookup(bad.key) == bad  # other instances are not affected


def test_discard_leaves_a_rebuild_published_meanwhile_alone(tmp_path):
    """A stale discard (the entry was already replaced by another process) moves nothing."""
    root, counter = tmp_path / "root", tmp_path / "builds.log"
    slow, fast = cache_for(root), cache_for(root)
    bad = slow.get_or_build(desc(4), _rejected_build)
    fast.discard(fast.lookup(bad.key), "OSError: invalid ELF header")
    good = fast.get_or_build(desc(4), make_builder(counter, 4))

    slow.discard(bad, "OSError: invalid ELF header")  # same path, but not the same files any more
    assert len(_quarantined(root)) == 1 and good.path.exists()
    assert slow.lookup(bad.key) == good and _loads(slow.lookup(bad.key))
    assert slow.get_or_build_ex(desc(4), make_builder(counter, 4)).outcome == "hit"
    assert build_counts(counter) == {4: 1}
