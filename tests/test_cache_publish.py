"""get_or_build in one process: entries, manifests, failed builds, stats, plan records, size."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import time

import pytest
from workers.cache_harness import artifact_bytes, build_counts, cache_for, desc, make_builder

from jitwarm.cache import BuildError, CacheError, Entry, KernelCache, LockHolder, LockTimeout
from jitwarm.cache.locks import KeyLock, this_host

# CI's floor pass (-m floor) reruns these on filelock's floor: before 3.30 KeyLock's preserve_lock_file is ignored.
pytestmark = pytest.mark.floor


def test_build_then_hit(tmp_path):
    cache = cache_for(tmp_path / "root")
    counter = tmp_path / "builds.log"
    first = cache.get_or_build_ex(desc(0), make_builder(counter, 0))
    second = cache.get_or_build_ex(desc(0), make_builder(counter, 0))

    assert (first.outcome, second.outcome) == ("built", "hit")
    entry = first.entry
    assert isinstance(entry, Entry) and second.entry == entry
    assert entry.key == cache.key(desc(0))
    assert entry.path == tmp_path / "root" / "v1" / "entries" / entry.key[:2] / entry.key
    assert entry.files == ("kernel.bin", "meta/info.json")
    assert entry.file("kernel.bin").read_bytes() == artifact_bytes(0)
    assert entry.description == {"family": "test", "n": 0, "flags": ["-O2"]}
    assert entry.preimage == cache.key_preimage(desc(0))
    assert build_counts(counter) == {0: 1}
    with pytest.raises(KeyError):
        entry.file("missing.so")


def test_manifest_is_relocatable_and_complete(tmp_path):
    root = tmp_path / "root"
    entry = cache_for(root).get_or_build(desc(1), make_builder(tmp_path / "c", 1))
    raw = (entry.path / "entry.json").read_text()
    assert str(tmp_path) not in raw and "/root/" not in raw
    doc = json.loads(raw)
    assert doc["key"] == entry.key and doc["preimage"] == entry.preimage
    assert [(f["path"], f["size"]) for f in doc["files"]] == [
        ("kernel.bin", len(artifact_bytes(1))), ("meta/info.json", len(json.dumps({"n": 1})))]
    # Files are sealed read-only; nothing is left in staging.
    assert not entry.file("kernel.bin").stat().st_mode & 0o222
    assert not (root / "v1" / "staging").exists()


def test_failed_build_leaves_nothing_and_releases_lock(tmp_path):
    root = tmp_path / "root"
    cache = cache_for(root)
    key = cache.key(desc(2))

    def broken(staging):
        (staging / "half.bin").write_bytes(b"x")
        raise RuntimeError("nvcc exploded")

    with pytest.raises(BuildError) as info:
        cache.get_or_build(desc(2), broken)
    assert key in str(info.value) and "nvcc exploded" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError) and info.value.key == key
    assert cache.lookup(key) is None
    assert not (root / "v1" / "entries" / key[:2] / key).exists()
    assert not (root / "v1" / "staging").exists()
    lock = KeyLock(cache.lock_dir, key)
    assert lock.try_acquire(), "the lock must be released after a failed build"
    lock.release()
    # A retry with a working build succeeds at once.
    assert cache.get_or_build(desc(2), make_builder(tmp_path / "c", 2), timeout_s=0.5).key == key


@pytest.mark.parametrize("bad", ["nothing", "symlink", "manifest_name"])
def test_unusable_build_output_is_an_error(tmp_path, bad):
    cache = cache_for(tmp_path / "root")

    def build(staging):
        if bad == "symlink":
            (staging / "lib.so").symlink_to("/etc/hostname")
        elif bad == "manifest_name":
            (staging / "entry.json").write_text("{}")

    with pytest.raises(BuildError, match={"nothing": "wrote no files", "symlink": "symlink",
                                          "manifest_name": "reserves"}[bad]):
        cache.get_or_build(desc(3), build)
    assert cache.lookup(cache.key(desc(3))) is None
    assert not (tmp_path / "root" / "v1" / "staging").exists()


def test_stats_count_this_instance(tmp_path):
    cache = cache_for(tmp_path / "root")
    counter = tmp_path / "c"
    cache.get_or_build(desc(0), make_builder(counter, 0))
    cache.get_or_build(desc(0), make_builder(counter, 0))
    cache.get_or_build(desc(1), make_builder(counter, 1))
    with pytest.raises(BuildError):
        cache.get_or_build(desc(2), lambda staging: None)
    s = cache.stats()
    assert (s.hits, s.misses, s.builds, s.waits, s.corrupt) == (1, 3, 3, 0, 0)
    assert s.to_json()["builds"] == 3


def test_nothing_created_before_first_write(tmp_path):
    root = tmp_path / "root"
    cache = KernelCache(root=root, layers=(), lock_dir=tmp_path / "locks")
    assert cache.lookup(cache.key(desc(0))) is None
    assert cache.read_plan_record("p") is None
    assert cache.size_bytes() == 0 and cache.verify().clean
    assert not root.exists() and not (tmp_path / "locks").exists()
    cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    assert root.exists() and any((tmp_path / "locks").iterdir())


def test_plan_records(tmp_path):
    layer_cache = cache_for(tmp_path / "layer")
    layer_cache.write_plan_record("layer-plan", {"keys": ["b"], "complete": True})
    cache = KernelCache(root=tmp_path / "root", layers=[tmp_path / "layer"])
    path = cache.write_plan_record("plan-1", {"keys": ["a"], "complete": True})
    assert path == tmp_path / "root" / "v1" / "plans" / "plan-1.json"
    assert cache.read_plan_record("plan-1") == {"keys": ["a"], "complete": True}
    assert cache.read_plan_record("layer-plan") == {"keys": ["b"], "complete": True}
    assert cache.read_plan_record("absent") is None
    (tmp_path / "root" / "v1" / "plans" / "garbage.json").write_text("{not json")
    assert cache.read_plan_record("garbage") is None
    for bad in ("../evil", "", ".hidden", "a/b"):
        with pytest.raises(ValueError):
            cache.write_plan_record(bad, {})
    with pytest.raises(CacheError, match="read-only"):
        KernelCache(root=tmp_path / "root", layers=(), read_only=True).write_plan_record("p", {})
    assert [p.name for p in (tmp_path / "root" / "v1" / "plans").iterdir() if p.name.startswith(".")] == []


def test_size_bytes_counts_entries(tmp_path):
    cache = cache_for(tmp_path / "root")
    a = cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    b = cache.get_or_build(desc(1), make_builder(tmp_path / "c", 1))
    on_disk = sum(f.stat().st_size for e in (a, b) for f in e.path.rglob("*") if f.is_file())
    assert cache.size_bytes() == on_disk > a.size_bytes + b.size_bytes


def test_two_caches_share_one_lock_dir(tmp_path):
    """JITWARM_LOCK_DIR-style node-local locks: the lock dir is separate from the root."""
    lock_dir = tmp_path / "shm-locks"
    cache = KernelCache(root=tmp_path / "root", layers=(), lock_dir=lock_dir)
    entry = cache.get_or_build(desc(5), make_builder(tmp_path / "c", 5))
    assert (lock_dir / f"{entry.key}.lock").exists()
    assert not (tmp_path / "root" / "v1" / "locks").exists()
    assert not (lock_dir / f"{entry.key}.holder").exists(), "holder record is dropped on release"


def test_unwritable_root_is_a_clear_cache_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CacheError, match="cannot create the cache root.*read_only=True"):
        cache_for(blocker / "root").get_or_build(desc(0), make_builder(tmp_path / "c", 0))


def test_errors_survive_pickling_for_process_pools():
    holder = LockHolder(host="node-1", pid=42, since=1.0)
    timeout = pickle.loads(pickle.dumps(LockTimeout("ab" * 32, holder, 5.0)))
    assert timeout.holder == holder and timeout.key == "ab" * 32 and "pid 42 on node-1" in str(timeout)
    build = pickle.loads(pickle.dumps(BuildError("cd" * 32, "boom")))
    assert build.key == "cd" * 32 and str(build) == f"build of cache key {'cd' * 32} failed: boom"


def test_stale_holder_record_of_dead_process_is_ignored(tmp_path):
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    cache = cache_for(tmp_path / "root")
    lock = KeyLock(cache.lock_dir, cache.key(desc(0)))
    cache.lock_dir.mkdir(parents=True)
    lock.holder_path.write_text(json.dumps({"host": this_host(), "pid": dead, "since": 1.0}))
    assert lock.read_holder() is None
    lock.holder_path.write_text(json.dumps({"host": "elsewhere", "pid": dead, "since": 1.0}))
    assert lock.read_holder() == LockHolder(host="elsewhere", pid=dead, since=1.0)


def _foreground_sigint() -> None:
    """In the child: SIGINT as a terminal's foreground process has it. A test run started in the background of a
    non-interactive shell (``cmd &``) inherits SIGINT ignored, and a Python child then never raises
    KeyboardInterrupt: the Ctrl-C under test would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_a_build_leaves_no_staging_directory(tmp_path):
    """After Ctrl-C an empty v1/staging/ was left: staging/ exists only while something is staged."""
    root, started = tmp_path / "root", tmp_path / "started"
    code = ("import sys, time, pathlib\nfrom jitwarm.cache import KernelCache\n"
            "def build(d):\n    pathlib.Path(sys.argv[2]).touch()\n    time.sleep(60)\n"
            "try:\n    KernelCache(root=sys.argv[1], layers=()).get_or_build({'n': 1}, build)\n"
            "except KeyboardInterrupt:\n    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(root), str(started)], preexec_fn=_foreground_sigint)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (root / "v1" / "staging").is_dir() and len(list((root / "v1" / "staging").iterdir())) == 1
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
    assert not (root / "v1" / "staging").exists() and sorted(p.name for p in (root / "v1").iterdir()) == [
        "entries", "locks"]
    built = cache_for(root).get_or_build_ex(desc(0), make_builder(tmp_path / "c", 0))  # and after a build
    assert built.outcome == "built" and not (root / "v1" / "staging").exists()


def test_a_reservation_holds_the_key_until_it_is_published_failed_or_abandoned(tmp_path):
    """KernelCache.reserve: the key's lock is held from the reservation to its end, whichever end it has, and
    only publish() publishes (what Triton's get_group/put_group use; get_or_build is one whose build runs at once)."""
    import gc

    cache, other = KernelCache(root=tmp_path, layers=()), KernelCache(root=tmp_path, layers=())
    description = {"kind": "reserved", "n": 1}

    def reserved_elsewhere() -> bool:
        try:
            got = other.reserve(description, timeout_s=0.3)
        except LockTimeout:
            return True
        got.abandon()
        return False

    for end in ("abandon", "fail", "collected"):
        held = cache.reserve(description)
        assert held.result is None and held.staging.is_dir() and reserved_elsewhere()
        (held.staging / "kernel.bin").write_bytes(b"never published")
        if end == "abandon":
            held.abandon()
            held.abandon()  # idempotent
        elif end == "fail":
            with pytest.raises(BuildError, match="RuntimeError: nvcc exploded"):
                held.fail(RuntimeError("nvcc exploded"))
        else:
            del held
            gc.collect()
        assert not reserved_elsewhere() and cache.lookup(cache.key(description)) is None
        assert not list((tmp_path / "v1" / "staging").glob("*"))  # its staging directory went with it

    held = cache.reserve(description)
    (held.staging / "kernel.bin").write_bytes(b"published")
    entry, outcome = held.publish()
    assert outcome == "built" and entry.file("kernel.bin").read_bytes() == b"published"
    assert other.reserve(description).result == (other.lookup(entry.key), "hit")
    with pytest.raises(RuntimeError, match="has ended"):
        held.publish()
