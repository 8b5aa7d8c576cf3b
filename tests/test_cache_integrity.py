"""Verification: corrupt entries are detected, quarantined, never returned, and rebuilt."""

from __future__ import annotations

import os

import pytest
from workers.cache_harness import build_counts, cache_for, desc, make_builder

from jitwarm.cache import KernelCache


def _writable(path):
    path.chmod(0o644)
    return path


def corrupt(entry, how):
    """Damage a published entry the way a disk, a person or a bad copy would."""
    lib = entry.path / "kernel.bin"
    if how == "flip_byte":
        data = bytearray(lib.read_bytes())
        data[10] ^= 0x01
        _writable(lib).write_bytes(bytes(data))
    elif how == "truncate":
        os.truncate(_writable(lib), 50)
    elif how == "delete":
        lib.unlink()
    elif how == "garbage_manifest":
        _writable(entry.path / "entry.json").write_text("{\"format\": 1, \"files\": [tr")
    elif how == "empty_manifest":
        _writable(entry.path / "entry.json").write_text("")
    elif how == "unlisted_file":
        (entry.path / "extra.so").write_bytes(b"planted")
    elif how == "symlinked_file":
        lib.unlink()
        lib.symlink_to("/etc/hostname")
    elif how == "wrong_key":
        other = entry.path.parent.parent / "00" / ("0" * 64)
        other.parent.mkdir()
        entry.path.rename(other)
        return other
    return entry.path


KINDS = ["flip_byte", "truncate", "delete", "garbage_manifest", "empty_manifest", "unlisted_file",
         "symlinked_file"]


@pytest.mark.parametrize("how", KINDS)
def test_corruption_is_quarantined_and_rebuilt(tmp_path, how):
    root, counter = tmp_path / "root", tmp_path / "builds.log"
    entry = cache_for(root).get_or_build(desc(0), make_builder(counter, 0))
    corrupt(entry, how)

    fresh = cache_for(root)  # a new process would see it the same way: first sight, full verification
    assert fresh.lookup(entry.key) is None
    assert fresh.stats().corrupt == 1
    assert not entry.path.exists()
    quarantined = [p for p in (root / "v1" / "quarantine").iterdir() if p.is_dir()]
    assert len(quarantined) == 1 and quarantined[0].name.startswith(entry.key)
    assert (root / "v1" / "quarantine" / (quarantined[0].name + ".reason")).read_text()

    rebuilt = fresh.get_or_build_ex(desc(0), make_builder(counter, 0))
    assert rebuilt.outcome == "built" and build_counts(counter) == {0: 2}
    assert cache_for(root).lookup(entry.key) == rebuilt.entry


@pytest.mark.parametrize("how", ["truncate", "delete", "unlisted_file"])
def test_same_instance_notices_changes_after_first_verification(tmp_path, how):
    cache = cache_for(tmp_path / "root")
    entry = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    assert cache.lookup(entry.key) == entry
    corrupt(entry, how)
    if how == "unlisted_file":
        # Extra files are invisible to the cheap stat check; a full verify finds them.
        report = cache.verify([entry.key], repair=True)
        assert list(report.corrupt) == [entry.key] and report.quarantined == (entry.key,)
    assert cache.lookup(entry.key) is None


def test_entry_under_the_wrong_key_is_rejected(tmp_path):
    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    moved = corrupt(entry, "wrong_key")
    report = cache_for(root).verify()
    assert moved.name in report.corrupt and "key" in report.corrupt[moved.name]


@pytest.mark.parametrize("fmt", [1.0, True, "1"])
def test_a_manifest_whose_format_only_equals_1_in_python_is_corrupt(tmp_path, fmt):
    """``"format": 1.0`` (or ``true``) was accepted: 1.0 == True == 1 in Python, never in this format."""
    import json

    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    manifest = entry.path / "entry.json"
    doc = json.loads(manifest.read_text())
    doc["format"] = fmt
    _writable(manifest).write_text(json.dumps(doc))
    assert "format" in cache_for(root).verify().corrupt[entry.key]  # only looks: reported, left in place
    assert cache_for(root).lookup(entry.key) is None  # a miss (and quarantined)


@pytest.fixture
def good_and_bad(tmp_path):
    """A root with two entries, the second with a flipped byte: ``(root, good, bad)``."""
    root = tmp_path / "root"
    cache = cache_for(root)
    good = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    bad = cache.get_or_build(desc(1), make_builder(tmp_path / "c", 1))
    corrupt(bad, "flip_byte")
    return root, good, bad


def test_verify_reports_ok_corrupt_missing(good_and_bad):
    root, good, bad = good_and_bad
    absent = cache_for(root).key(desc(2))

    report = cache_for(root).verify([good.key, bad.key, absent], repair=True)
    assert report.ok == (good.key,)
    assert list(report.corrupt) == [bad.key] and "sha256" in report.corrupt[bad.key]
    assert report.missing == (absent,) and report.quarantined == (bad.key,)
    assert not report.clean
    assert report.to_json()["missing"] == [absent]
    assert cache_for(root).verify().clean


def test_corrupt_entry_in_read_only_layer_is_skipped_not_moved(tmp_path):
    layer, counter = tmp_path / "layer", tmp_path / "builds.log"
    entry = cache_for(layer).get_or_build(desc(0), make_builder(counter, 0))
    corrupt(entry, "flip_byte")

    cache = KernelCache(root=tmp_path / "root", layers=[layer])
    assert cache.lookup(entry.key) is None
    assert cache.stats().corrupt == 1
    assert entry.path.exists() and not (layer / "v1" / "quarantine").exists()
    result = cache.get_or_build_ex(desc(0), make_builder(counter, 0))
    assert result.outcome == "built" and result.entry.path.is_relative_to(tmp_path / "root")
    report = cache.verify()
    assert report.ok == (entry.key,) and entry.key in report.corrupt and report.quarantined == ()


def test_read_only_cache_skips_corrupt_root_entry(tmp_path):
    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    corrupt(entry, "truncate")
    ro = cache_for(root, read_only=True)
    assert ro.lookup(entry.key) is None and ro.stats().corrupt == 1
    assert entry.path.exists(), "a read-only cache never moves anything"


def test_verify_only_looks_unless_asked_to_repair(good_and_bad):
    """``jitwarm status`` and ``verify`` without ``--repair`` call verify(repair=False): nothing on disk changes."""
    root, good, bad = good_and_bad
    for stamp in (root / "v1" / "verified").rglob("*.json"):
        stamp.unlink()
    before = sorted((str(p), p.lstat().st_mtime_ns) for p in root.rglob("*"))

    looker = cache_for(root)
    report = looker.verify([good.key, bad.key])
    assert report.ok == (good.key,) and list(report.corrupt) == [bad.key] and report.quarantined == ()
    assert looker.verify(None).corrupt.keys() == {bad.key} and looker.stats().corrupt == 2
    assert sorted((str(p), p.lstat().st_mtime_ns) for p in root.rglob("*")) == before  # no move, no stamp, no lock

    repaired = cache_for(root).verify(None, repair=True)
    assert list(repaired.corrupt) == [bad.key] and repaired.quarantined == (bad.key,) and not bad.path.exists()
    assert cache_for(root).verify(None).clean
