"""Relocatable bundles: export, import elsewhere, and rejection of unsafe or corrupt archives."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest
from workers.cache_harness import artifact_bytes, cache_for, desc, make_builder

from jitwarm.cache import CacheError, CacheWriteError


@pytest.fixture
def exported(tmp_path):
    """A cache with three entries, and a gzip'd bundle of two of them."""
    src = cache_for(tmp_path / "build-box" / "cache")
    entries = [src.get_or_build(desc(n), make_builder(tmp_path / "c", n)) for n in range(3)]
    bundle = src.export_bundle([entries[0].key, entries[2].key], tmp_path / "plan.tar.gz")
    return entries, bundle


def test_bundle_imports_at_another_path_and_verifies(tmp_path, exported):
    entries, bundle = exported
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
    assert names[0] == "bundle.json"
    assert all(not n.startswith("/") and ".." not in n.split("/") for n in names)
    assert str(tmp_path) not in bundle.read_bytes().decode("latin-1")

    dest = cache_for(tmp_path / "gpu-box" / "somewhere" / "else")
    report = dest.import_bundle(bundle)
    assert report.imported == tuple(sorted([entries[0].key, entries[2].key])) and report.present == ()
    verified = dest.verify()
    assert verified.clean and verified.ok == report.imported
    got = dest.lookup(entries[2].key)
    assert got.path.is_relative_to(tmp_path / "gpu-box")
    assert got.file("kernel.bin").read_bytes() == artifact_bytes(2)
    assert dest.lookup(entries[1].key) is None
    assert not (tmp_path / "gpu-box" / "somewhere" / "else" / "v1" / "staging").exists()
    # Importing again finds everything present.
    assert dest.import_bundle(bundle).present == report.imported


def test_plain_tar_bundle(tmp_path, exported):
    entries, _ = exported
    src = cache_for(tmp_path / "build-box" / "cache")
    plain = src.export_bundle([entries[1].key], tmp_path / "one.tar")
    assert cache_for(tmp_path / "other").import_bundle(plain).imported == (entries[1].key,)


def test_export_of_missing_key_fails_and_writes_nothing(tmp_path, exported):
    src = cache_for(tmp_path / "build-box" / "cache")
    with pytest.raises(CacheError, match="not in the cache"):
        src.export_bundle([src.key(desc(9))], tmp_path / "missing.tar")
    assert not (tmp_path / "missing.tar").exists()


@pytest.mark.parametrize("kind", ["fifo", "link-to-fifo"])
def test_export_onto_a_special_file_refuses_and_leaves_it(tmp_path, exported, kind):
    # The atomic rename replaced whatever was there: as root, `jitwarm export ... /dev/null` replaced the device.
    entries, _ = exported
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = fifo if kind == "fifo" else tmp_path / "link"
    if kind == "link-to-fifo":
        target.symlink_to(fifo)
    with pytest.raises(CacheWriteError, match="not a regular file"):
        cache_for(tmp_path / "build-box" / "cache").export_bundle([entries[0].key], target)
    assert stat.S_ISFIFO(target.stat().st_mode) and not list(tmp_path.glob(".*.tmp"))


def _rewrite(bundle, out, mutate):
    """Copy a bundle member by member through ``mutate(info, data) -> [(info, data), ...]``."""
    with tarfile.open(bundle) as src, tarfile.open(out, "w:gz") as dst:
        for info in src.getmembers():
            data = src.extractfile(info).read() if info.isreg() else b""
            for new_info, new_data in mutate(info, data):
                dst.addfile(new_info, io.BytesIO(new_data) if new_info.isreg() else None)
    return out


def _extra(name, kind=tarfile.REGTYPE, data=b"evil", linkname=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, 0o644
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


BAD_ARCHIVES = {
    "absolute_path": ("absolute path", lambda key: [_extra("/tmp/jitwarm-evil")]),
    "dotdot": ("'..'", lambda key: [_extra(f"entries/{key[:2]}/{key}/../../../../evil")]),
    "symlink": ("symbolic link", lambda key: [
        _extra(f"entries/{key[:2]}/{key}/link.so", tarfile.SYMTYPE, linkname="/etc/passwd")]),
    "hardlink": ("hard link", lambda key: [
        _extra(f"entries/{key[:2]}/{key}/hard.so", tarfile.LNKTYPE, linkname="bundle.json")]),
    "device": ("device", lambda key: [_extra(f"entries/{key[:2]}/{key}/null", tarfile.CHRTYPE)]),
    "stray_file": ("neither", lambda key: [_extra("README")]),
}


@pytest.mark.parametrize("kind", [*BAD_ARCHIVES, "corrupted_file", "truncated", "entry_dropped", "not_a_tar"])
def test_unsafe_or_corrupt_bundle_imports_nothing(tmp_path, exported, kind):
    entries, bundle = exported
    key = entries[0].key
    bad = tmp_path / "bad.tar.gz"
    if kind == "corrupted_file":
        expect = "does not verify"

        def flip(info, data):
            if info.name.endswith(f"{key}/kernel.bin"):
                data = data[:-1] + bytes([data[-1] ^ 1])
            return [(info, data)]

        _rewrite(bundle, bad, flip)
    elif kind == "entry_dropped":
        expect = "incomplete"
        _rewrite(bundle, bad, lambda info, data: [] if f"/{entries[2].key}/" in info.name else [(info, data)])
    elif kind == "truncated":
        expect = "cannot read bundle"
        bad.write_bytes(bundle.read_bytes()[: bundle.stat().st_size // 2])
    elif kind == "not_a_tar":  # tarfile names each compression it tried, a line each: one line is said
        expect = r"cannot read bundle .*: not a tar archive \(plain, gzip, bz2 or xz\)$"
        bad.write_bytes(bytes(range(256)) * 12)
    else:
        expect, extra = BAD_ARCHIVES[kind]
        def add(info, data):
            return [(info, data), *(extra(key) if info.name == "bundle.json" else [])]

        _rewrite(bundle, bad, add)

    dest_root = tmp_path / "dest"
    dest = cache_for(dest_root)
    with pytest.raises(CacheError, match=expect) as refused:
        dest.import_bundle(bad)
    assert "\n" not in str(refused.value)  # the CLI's one line says it all
    assert not list((dest_root / "v1" / "entries").rglob("*"))
    assert not (dest_root / "v1" / "staging").exists()
    assert dest.lookup(key) is None and dest.lookup(entries[2].key) is None
    assert not (tmp_path / "evil").exists() and not (tmp_path.parent / "evil").exists()
    assert not Path("/tmp/jitwarm-evil").exists()


# -- layout: a bundle is a cache root ---------------------------------------------------------------------------

def test_members_are_laid_out_as_a_root_and_extract_into_a_working_layer(tmp_path, exported):
    entries, bundle = exported
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
        assert names[0] == "bundle.json"
        assert all(n.startswith("v1/entries/") for n in names[1:])
        layer = tmp_path / "opt" / "layer"
        layer.mkdir(parents=True)
        tar.extractall(layer, filter="data")  # what `tar xf kernels.tar -C /opt/layer` does
    from jitwarm.cache import KernelCache
    from jitwarm.cache.settings import override

    with override(cache_dir=tmp_path / "root", cache_path=[layer]):
        cache = KernelCache()
        hit = cache.get_or_build_ex(desc(2), make_builder(tmp_path / "c", 2))
    assert hit.outcome == "hit" and hit.entry.read_only and hit.entry.path.is_relative_to(layer)
    assert hit.entry.file("kernel.bin").read_bytes() == artifact_bytes(2)
    assert cache.verify(None).ok == tuple(sorted([entries[0].key, entries[2].key]))


def test_bundles_of_the_old_layout_still_import(tmp_path, exported):
    entries, bundle = exported
    old = _rewrite(bundle, tmp_path / "old.tar.gz", lambda info, data: [
        (_renamed(info, info.name.removeprefix("v1/")), data)])
    with tarfile.open(old) as tar:
        assert tar.getnames()[1].startswith("entries/")
    dest = cache_for(tmp_path / "dest")
    assert dest.import_bundle(old).imported == tuple(sorted([entries[0].key, entries[2].key]))
    both = _rewrite(bundle, tmp_path / "both.tar.gz", lambda info, data: [(info, data)] + (
        [(_renamed(info, info.name.removeprefix("v1/")), data)] if info.name.startswith("v1/") else []))
    with pytest.raises(CacheError, match="appears twice"):
        cache_for(tmp_path / "dest2").import_bundle(both)


def _renamed(info, name):
    new = tarfile.TarInfo(name)
    new.size, new.mode, new.mtime, new.type = info.size, info.mode, info.mtime, info.type
    return new


# -- size caps: nothing is read whole, nothing over the caps is written ----------------------------------------

def test_member_and_bundle_caps_refuse_before_writing(tmp_path, exported, monkeypatch):
    entries, bundle = exported
    dest_root = tmp_path / "dest"
    for var, value, expect in (("JITWARM_BUNDLE_MAX_FILE_BYTES", "1000", "over the cap of 1000"),
                               ("JITWARM_BUNDLE_MAX_BYTES", "3000", "over its cap of 3000")):
        monkeypatch.setenv(var, value)
        with pytest.raises(CacheError, match=expect) as info:
            cache_for(dest_root).import_bundle(bundle)
        assert var in str(info.value) and "\n" not in str(info.value)
        assert not (dest_root / "v1" / "staging").exists()
        assert not (dest_root / "v1" / "entries").exists() or not list((dest_root / "v1" / "entries").iterdir())
        monkeypatch.delenv(var)
    monkeypatch.setenv("JITWARM_BUNDLE_MAX_FILE_BYTES", "lots")
    with pytest.raises(ValueError, match="JITWARM_BUNDLE_MAX_FILE_BYTES='lots' is not an integer"):
        cache_for(dest_root).import_bundle(bundle)
    monkeypatch.delenv("JITWARM_BUNDLE_MAX_FILE_BYTES")
    assert len(cache_for(dest_root).import_bundle(bundle).imported) == 2


def test_a_6_gib_member_header_is_refused_at_once(tmp_path, exported):
    """A tiny .tar.gz whose member claims 6 GiB (the data never needs to exist): refused by its header."""
    import gzip
    import time

    entries, _bundle = exported
    key = entries[0].key
    bomb = tmp_path / "bomb.tar.gz"
    head = tarfile.TarInfo("bundle.json")
    head.size = 2
    huge = tarfile.TarInfo(f"v1/entries/{key[:2]}/{key}/kernel.bin")
    huge.size = 6 << 30
    data = head.tobuf(tarfile.PAX_FORMAT) + b"{}".ljust(512, b"\0") + huge.tobuf(tarfile.PAX_FORMAT) + b"\0" * 4096
    bomb.write_bytes(gzip.compress(data))
    start = time.monotonic()
    with pytest.raises(CacheError, match=r"is 6442450944 bytes, over the cap of 2147483648"):
        cache_for(tmp_path / "dest").import_bundle(bomb)
    assert time.monotonic() - start < 20  # reading 6 GiB would take minutes


def test_members_are_streamed_not_read_whole(tmp_path):
    import tracemalloc

    src = cache_for(tmp_path / "src")
    big = src.get_or_build(desc(5), make_builder(tmp_path / "c", 5, extra={"big.bin": b"\0" * (48 << 20)}))
    bundle = src.export_bundle([big.key], tmp_path / "big.tar.gz")
    dest = cache_for(tmp_path / "dest")
    tracemalloc.start()
    try:
        assert dest.import_bundle(bundle).imported == (big.key,)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB"
    assert dest.lookup(big.key).file("big.bin").stat().st_size == 48 << 20


def test_prestart_looks_each_entry_up_once_and_hashes_each_file_once(tmp_path, monkeypatch, capsys):
    """A bundle's entries, imported by ``prestart --offline``: one lookup each (under its lock) and one hash per
    file (at unpacking); the readiness check after trusts this host's stamps, as the hook's lookups do. Counted
    by wrapping the cache's own functions, which still run."""
    import collections
    import json

    from precompile_fixtures import TINY

    import jitwarm.cache.entry as entry_module
    from jitwarm.cache.store import KernelCache
    from jitwarm.precompile.cli import main

    assert main(["warm", *TINY, "--cache-dir", str(tmp_path / "a"), "--json"]) == 0
    assert main(["export", str(tmp_path / "k.tar"), *TINY, "--cache-dir", str(tmp_path / "a"), "--json"]) == 0
    calls: collections.Counter[str] = collections.Counter()
    for owner, name in ((KernelCache, "lookup"), (entry_module, "_hash_file")):
        real = getattr(owner, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    capsys.readouterr()
    assert main(["prestart", *TINY, "--bundle", str(tmp_path / "k.tar"), "--cache-dir", str(tmp_path / "b"),
                 "--offline", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ready"] is True
    entries = [p for p in (tmp_path / "b" / "v1" / "entries").glob("*/*")]
    files = sum(len(json.loads((p / "entry.json").read_text())["files"]) for p in entries)
    assert entries and calls == {"lookup": len(entries), "_hash_file": files}, calls


def test_importing_a_bundle_again_while_its_entries_are_claimed_does_not_wait(tmp_path, exported):
    """An entry the cache holds already is found without the key's lock: a reader's claim (a loaded kernel) must
    not hold a second prestart's import up for its lock timeout."""
    import time

    entries, bundle = exported
    dest = cache_for(tmp_path / "gpu-box")
    dest.import_bundle(bundle)
    with dest.claim(dest.lookup(entries[0].key), timeout_s=5) as claimed:
        assert claimed is not None
        started = time.monotonic()
        report = dest.import_bundle(bundle, timeout_s=30)
        assert report.present == tuple(sorted([entries[0].key, entries[2].key])) and report.imported == ()
        assert time.monotonic() - started < 20  # not the 30 s lock timeout
