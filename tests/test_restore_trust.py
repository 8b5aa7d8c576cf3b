"""Restore trusts its destination as the cache trusts its root (issue #31, N1, N5): another real user's folder or
link on the way, a folder anyone can write, a FIFO or a link to ``/dev/zero`` where a unit's file goes are refused,
exit 2 naming the path, before anything is written or opened; ``JITWARM_ALLOW_SHARED=1`` accepts a shared folder,
never a link or a FIFO.

Each case restores one captured Inductor module (its ``.cpp`` and ``.so``) with the real ``jitwarm prestart``
into ``TORCHINDUCTOR_CACHE_DIR``, prepared by the hostile user as the issue found it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jit_cache_trees as trees
import pytest
from precompile_fixtures import jitwarm

from jitwarm.cache import KernelCache
from jitwarm.kernels.libraries.jit_caches.backend import store
from jitwarm.kernels.libraries.jit_caches.census import library
from jitwarm.precompile.manifest import append_records, unit_record

SO = Path("ha") / "chamodule.main.so"


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """One Inductor module stored in a cache and named in a manifest, as a recording stores it."""
    tmp = tmp_path_factory.mktemp("restore_trust")
    src = tmp / "src"
    trees.write(src / "ha" / "chamodule.main.cpp", "extern \"C\" void kernel() {}")
    trees.write(src / SO, trees.ELF)
    lib = library("inductor")
    append_records(tmp / "m.jsonl", [unit_record(store(lib, src, unit, files, KernelCache(root=tmp / "cache")))
                                     for unit, files in lib.present(src).items()])
    return tmp


def restore(captured: Path, dst: Path, **env: str):
    return jitwarm("prestart", "--manifest", str(captured / "m.jsonl"), "--cache-dir", str(captured / "cache"),
                   "--offline", env={"TORCHINDUCTOR_CACHE_DIR": str(dst), **env})


def refused(proc, path: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"refusing to restore into {path}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("whose", ["another user's folder", "this user's folder, shared allowed"])
def test_a_link_on_the_way_is_refused(captured, tmp_path, other_user, whose):
    """The link the issue found: root's files written through it into a root-only folder. In this user's own folder,
    and with shared folders allowed, a link jitwarm did not place is refused all the same."""
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    dst = tmp_path / "inductor"
    dst.mkdir()
    (dst / "ha").symlink_to(private)
    if whose == "another user's folder":
        os.lchown(dst / "ha", other_user, -1)
        os.chown(dst, other_user, -1)
        proc = restore(captured, dst)
        assert proc.returncode == 2 and "owned by uid" in proc.stderr, proc.stderr
    else:
        refused(restore(captured, dst, JITWARM_ALLOW_SHARED="1"), dst / "ha")
    assert list(private.iterdir()) == []


def test_the_cache_variable_as_another_users_link_is_refused(captured, tmp_path, other_user):
    real = tmp_path / "real"
    real.mkdir()
    dst = tmp_path / "inductor"
    dst.symlink_to(real)
    os.lchown(dst, other_user, -1)
    proc = restore(captured, dst)
    assert proc.returncode == 2 and "symlink owned by uid" in proc.stderr, proc.stderr
    assert list(real.iterdir()) == []


def test_a_folder_anyone_can_write_is_refused_unless_shared_on_purpose(captured, tmp_path):
    dst = tmp_path / "inductor"
    (dst / "ha").mkdir(parents=True)
    (dst / "ha").chmod(0o777)
    refused(restore(captured, dst), dst / "ha")
    assert not (dst / SO).exists()
    shared = restore(captured, dst, JITWARM_ALLOW_SHARED="1")
    assert shared.returncode == 0, shared.stderr
    assert (dst / SO).read_bytes() == trees.ELF


@pytest.mark.parametrize("what", ["fifo", "link to /dev/zero"])
def test_a_fifo_or_a_device_link_where_a_file_goes_is_refused_and_never_opened(captured, tmp_path, what):
    dst = tmp_path / "inductor"
    (dst / "ha").mkdir(parents=True)
    if what == "fifo":
        os.mkfifo(dst / SO)
    else:
        (dst / SO).symlink_to("/dev/zero")
    start = time.monotonic()
    refused(restore(captured, dst), dst / SO)
    assert time.monotonic() - start < 30  # the FIFO was never opened (it hung the restore forever)
    assert (dst / SO).is_fifo() if what == "fifo" else (dst / SO).is_symlink()
