"""Nothing the cache opens can make it block: FIFOs planted where it reads files, and every wait's deadline.

A FIFO at ``<lock_dir>/<key>.holder`` made waiters block in ``open`` and ignore their timeout (still stuck
at 15 s with ``timeout_s=3``); in a shared sticky lock dir another user can plant one. Every open of a file
another process could have replaced is non-blocking, does not follow a link, and checks for a regular file.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
from workers.cache_harness import as_user, cache_for, desc, make_builder, other_user, shared_dir

from jitwarm.cache import CacheError, KernelCache, LockTimeout
from jitwarm.cache.layout import RootLayout
from jitwarm.cache.locks import KeyLock

needs_other_user = pytest.mark.skipif(other_user() is None, reason="needs root and the user jwtest")


def within(seconds: float, fn, fifos=()):
    """Run ``fn`` in a thread and return what it returned (or raised) if it ends within ``seconds``.

    If it does not, open each FIFO for writing, which frees a reader blocked in open(), and fail.
    """
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"still blocked after {seconds} s")
    out["seconds"] = time.monotonic() - start
    return out


def test_fifo_holder_record_does_not_outlast_the_waiters_deadline(tmp_path):
    cache = cache_for(tmp_path / "root")
    key = cache.key(desc(0))
    holder = KeyLock(cache.lock_dir, key)
    assert holder.try_acquire()
    fifo = cache.lock_dir / f"{key}.holder"
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        seen = []
        got = within(60, lambda: cache.get_or_build(desc(0), make_builder(tmp_path / "c", 0), timeout_s=3,
                                                   on_wait=seen.append), [fifo])
        assert isinstance(got.get("error"), LockTimeout) and got["seconds"] < 30 and seen == [None]
        got = within(60, lambda: cache.wait_for(key, timeout_s=1), [fifo])
        assert isinstance(got.get("error"), LockTimeout) and got["seconds"] < 30
    finally:
        holder.release()
    assert cache.get_or_build_ex(desc(0), make_builder(tmp_path / "c", 0), timeout_s=3).outcome == "built"


@needs_other_user
def test_fifo_planted_by_another_user_in_a_shared_sticky_lock_dir(tmp_path):
    user = other_user()
    base = shared_dir()
    try:
        lock_dir = base / "locks"
        lock_dir.mkdir()
        lock_dir.chmod(0o1777)  # a /tmp-style lock dir every user may create files in
        cache = cache_for(tmp_path / "root", lock_dir=lock_dir)
        key = cache.key(desc(1))
        fifo = lock_dir / f"{key}.holder"
        as_user(user, os.mkfifo, fifo)
        assert fifo.stat().st_uid == user.pw_uid
        holder = KeyLock(lock_dir, key)  # a real holder; its record cannot replace the other user's FIFO
        assert holder.try_acquire()
        try:
            got = within(60, lambda: cache.get_or_build(desc(1), make_builder(tmp_path / "c", 1), timeout_s=2),
                         [fifo])
            assert isinstance(got.get("error"), LockTimeout) and got["seconds"] < 30
        finally:
            holder.release()
        got = within(60, lambda: cache.get_or_build_ex(desc(1), make_builder(tmp_path / "c", 1), timeout_s=2), [fifo])
        assert got["value"].outcome == "built"
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def _plant(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.chmod(0o644)
        path.unlink()
    os.mkfifo(path)
    return path


def test_fifos_where_the_cache_reads_files_never_block(tmp_path):
    root = tmp_path / "root"
    cache = cache_for(root)
    entry = cache.get_or_build(desc(2), make_builder(tmp_path / "c", 2))
    other = cache.get_or_build(desc(3), make_builder(tmp_path / "c", 3))
    layout = RootLayout(root)
    fifos = [_plant(p) for p in (root / "v1" / "verified").rglob(f"{entry.key}-*.json")]
    fifos += [_plant(layout.facts / "cc.json"), _plant(layout.plan_path("plan-a")), _plant(tmp_path / "b.tar")]
    fifos += [_plant(other.path / "entry.json")]

    assert within(30, lambda: cache_for(root).lookup(entry.key), fifos)["value"] == entry  # no stamp: hashed instead
    assert within(30, lambda: cache.read_fact("cc"), fifos)["value"] is None
    assert within(30, lambda: cache.read_plan_record("plan-a"), fifos)["value"] is None
    got = within(30, lambda: cache.import_bundle(tmp_path / "b.tar"), fifos)
    assert isinstance(got.get("error"), CacheError) and "not a regular file" in str(got["error"])
    fresh = cache_for(root)
    assert within(30, lambda: fresh.lookup(other.key), fifos)["value"] is None and fresh.stats().corrupt == 1
    assert within(30, lambda: fresh.prune(older_than_s=10**9), fifos)["value"].removed == ()


def test_fifo_at_the_lock_file_is_locked_not_waited_on(tmp_path):
    cache = cache_for(tmp_path / "root")
    key = cache.key(desc(4))
    cache.lock_dir.mkdir(parents=True)
    fifo = cache.lock_dir / f"{key}.lock"
    os.mkfifo(fifo, 0o644)
    got = within(60, lambda: cache.get_or_build_ex(desc(4), make_builder(tmp_path / "c", 4), timeout_s=2), [fifo])
    assert got["value"].outcome == "built"
    entry = got["value"].entry

    def claim_it():
        with cache.claim(entry) as claimed:
            return claimed

    assert within(60, claim_it, [fifo])["value"] == entry


def test_a_file_swapped_for_a_fifo_after_listing_is_corrupt_not_a_hang(tmp_path, monkeypatch):
    """The listing saw a regular file; by the time it is hashed, a FIFO stands there (open is O_NONBLOCK)."""
    from jitwarm.cache import entry as entry_module

    root = tmp_path / "root"
    built = cache_for(root).get_or_build(desc(5), make_builder(tmp_path / "c", 5))
    real_walk = entry_module._walk_files

    def walk_then_swap(path, *, error):
        found = real_walk(path, error=error)
        if (path / "kernel.bin").is_file() and not (path / "kernel.bin").is_fifo():
            _plant(path / "kernel.bin")
        return found

    monkeypatch.setattr(entry_module, "_walk_files", walk_then_swap)
    for stamp in (root / "v1" / "verified").rglob("*.json"):
        stamp.unlink()
    fresh = KernelCache(root=root, layers=())
    got = within(30, lambda: fresh.lookup(built.key), [built.path / "kernel.bin"])
    assert got["value"] is None and fresh.stats().corrupt == 1
