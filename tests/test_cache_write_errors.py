"""Write failures are CacheWriteError (path and OS reason, nothing half-written), and every cache error is one line.

A full disk during ``import_bundle`` said "cannot read bundle" (and the CLI exited 4, "corrupt"): a write
failure is now its own error naming the file and the reason, nothing is published and staging is gone. The
full-disk cases mount a 4 MiB tmpfs (root only; skipped otherwise).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess

import pytest
from workers.cache_harness import cache_for, desc, make_builder

from jitwarm.cache import BuildError, CacheError, CacheWriteError, LockTimeout, RemoteUnavailable
from jitwarm.cache.errors import CorruptEntry

needs_mount = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@contextlib.contextmanager
def small_tmpfs(path, size="4m"):
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def big_bundle(tmp_path):
    """A bundle of two entries of 3 MiB of random bytes each (more than a 4 MiB disk holds)."""
    src = cache_for(tmp_path / "src")
    keys = [src.get_or_build(desc(n), make_builder(tmp_path / "c", n, extra={"big.bin": os.urandom(3 << 20)})).key
            for n in range(2)]
    return src, keys, src.export_bundle(keys, tmp_path / "big.tar.gz")


@needs_mount
def test_import_on_a_full_disk_is_a_write_error_and_publishes_nothing(tmp_path, big_bundle):
    _src, keys, bundle = big_bundle
    with small_tmpfs(tmp_path / "disk") as disk:
        dest = cache_for(disk / "cache")
        with pytest.raises(CacheWriteError) as info:
            dest.import_bundle(bundle)
        err = info.value
        assert "No space left on device" in str(err) and err.os_reason == "No space left on device"
        assert err.path.startswith(str(disk / "cache" / "v1" / "staging")) and err.path in str(err)
        assert "cannot read bundle" not in str(err) and "\n" not in str(err)
        assert not any((disk / "cache" / "v1" / "entries").iterdir())
        assert not (disk / "cache" / "v1" / "staging").exists()
        assert all(dest.lookup(k) is None for k in keys)


@needs_mount
def test_export_onto_a_full_disk_leaves_no_partial_file(tmp_path, big_bundle):
    src, keys, _bundle = big_bundle
    with small_tmpfs(tmp_path / "disk") as disk:
        with pytest.raises(CacheWriteError, match="No space left on device") as info:
            src.export_bundle(keys, disk / "plan.tar")
        assert info.value.path == str(disk / "plan.tar") and list(disk.iterdir()) == []


@needs_mount
def test_a_download_onto_a_full_disk_is_a_write_error(tmp_path, remote):
    counter = tmp_path / "c"
    key = remote.cache(tmp_path / "a").get_or_build(
        desc(7), make_builder(counter, 7, extra={"big.bin": os.urandom(5 << 20)})).key
    with small_tmpfs(tmp_path / "disk") as disk:
        node = remote.cache(disk / "cache")
        with pytest.raises(CacheWriteError, match="No space left on device"):
            node.get_or_build(desc(7), make_builder(counter, 7))
        assert node.lookup(key) is None and not (disk / "cache" / "v1" / "staging").exists()


def test_export_into_a_directory_or_a_missing_one(tmp_path, big_bundle):
    src, keys, _bundle = big_bundle
    (tmp_path / "out").mkdir()
    with pytest.raises(CacheWriteError, match="it is a directory") as info:
        src.export_bundle(keys, tmp_path / "out")
    assert info.value.path == str(tmp_path / "out") and list((tmp_path / "out").iterdir()) == []
    with pytest.raises(CacheWriteError, match="No such file or directory") as info:
        src.export_bundle(keys, tmp_path / "missing" / "plan.tar")
    assert str(tmp_path / "missing" / "plan.tar") in str(info.value)
    assert not (tmp_path / "missing").exists()


def _errors(tmp_path):
    """One of each error a cache raises on purpose, made the way a caller meets it."""
    root = tmp_path / "root"
    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    out = []
    for call in (lambda: cache_for(open_root).get_or_build(desc(0), make_builder(tmp_path / "c", 0)),
                 lambda: cache_for(root, read_only=True).get_or_build(desc(0), make_builder(tmp_path / "c", 0)),
                 lambda: cache_for(root, read_only=True).prune(max_bytes=0),
                 lambda: cache_for(root).export_bundle([cache_for(root).key(desc(9))], tmp_path / "x.tar"),
                 lambda: cache_for(root).import_bundle(tmp_path / "missing.tar"),
                 lambda: cache_for(tmp_path / "file" / "root").get_or_build(desc(0), make_builder(tmp_path / "c", 0))):
        (tmp_path / "file").touch()
        with pytest.raises(CacheError) as info:
            call()
        out.append(info.value)
    return out + [LockTimeout("ab" * 32, None, 3.0), BuildError("cd" * 32, "RuntimeError: boom"),
                  RemoteUnavailable("redis://:***@host:6379/0", "ConnectionError: refused"),
                  CacheWriteError("write the bundle", "/x/plan.tar", "No space left on device"),
                  CorruptEntry("/x/entry.json is not a valid manifest")]


def test_every_cache_error_is_one_line_with_a_reason_and_a_hint(tmp_path):
    errors = _errors(tmp_path)
    for err in errors:
        text = str(err)
        assert "\n" not in text and text and "--" not in text, text  # no command-line flag: the CLI adds its own
        assert err.hint is None or err.hint in text
        if not isinstance(err, (BuildError, RemoteUnavailable)):  # their .reason is what failed (older meaning)
            assert text == (f"{err.reason}; {err.hint}" if err.hint else err.reason)
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == text and again.hint == err.hint
    shared, read_only, *_ = errors
    assert shared.hint == "pass KernelCache(allow_shared=True) or set JITWARM_ALLOW_SHARED=1 to accept it"
    assert shared.reason.endswith("it is writable by every user and has no sticky bit")
    assert read_only.hint.startswith("build it with a writable KernelCache")
