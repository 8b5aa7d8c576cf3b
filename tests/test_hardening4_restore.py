"""A restore walks its destination from ``/`` (no folder or link another user controls at any depth) and never keeps
a file another user put where a unit's file goes; each refusal has its must-still-work twin beside it.

Each case restores one captured Inductor module with the real ``jitwarm prestart`` into ``TORCHINDUCTOR_CACHE_DIR``
(or under ``SGLANG_CACHE_DIR``, where sglang puts it), prepared by another real user (``useradd``; ownership by
``chown``) as the attack found it.
"""

from __future__ import annotations

import os
from pathlib import Path

import jit_cache_trees as trees
import pytest
from precompile_fixtures import jitwarm

from jitwarm.cache import KernelCache
from jitwarm.kernels.libraries.jit_caches.backend import store
from jitwarm.kernels.libraries.jit_caches.census import library
from jitwarm.precompile.manifest import append_records, unit_record

SO = Path("ha") / "chamodule.main.so"


def _capture(tmp: Path, under: str = "") -> Path:
    src = tmp / "src"
    trees.write(src / "ha" / "chamodule.main.cpp", "extern \"C\" void kernel() {}")
    trees.write(src / SO, trees.ELF)
    lib = library("inductor")
    append_records(tmp / "m.jsonl", [unit_record(store(lib, src, unit, files, KernelCache(root=tmp / "cache"),
                                                       under=under))
                                     for unit, files in lib.present(src).items()])
    return tmp


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """One Inductor module stored in a cache and named in a manifest, as a recording stores it."""
    return _capture(tmp_path_factory.mktemp("hardening4_restore"))


@pytest.fixture(scope="module")
def captured_in_sglang(tmp_path_factory):
    """The same module recorded inside sglang: restored where sglang puts Inductor's cache."""
    return _capture(tmp_path_factory.mktemp("hardening4_restore_sglang"), under="sglang")


def restore(captured: Path, env: dict[str, str]):
    return jitwarm("prestart", "--manifest", str(captured / "m.jsonl"), "--cache-dir", str(captured / "cache"),
                   "--offline", env=env)


def refused(proc, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def restored(proc, dst: Path) -> None:
    assert proc.returncode == 0, proc.stderr
    assert (dst / SO).read_bytes() == trees.ELF


def root_only(tmp_path: Path) -> Path:
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    return private


def test_a_parent_that_is_another_users_link_is_refused(captured, tmp_path, other_user):
    """TORCHINDUCTOR_CACHE_DIR=<link>/sub, the link another user's, into a root-only folder: exit 2 naming the link
    and its owner, and nothing written there (root's files landed in the private folder)."""
    private = root_only(tmp_path)
    link = tmp_path / "theirs"
    link.symlink_to(private)
    os.lchown(link, other_user, -1)
    proc = restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(link / "sub")})
    refused(proc, f"{link} is a symlink owned by uid {other_user}")
    assert list(private.iterdir()) == []


def test_a_parent_that_is_roots_link_still_works(captured, tmp_path):
    """The twin: a link this user (root) owns, as /var/run -> /run, is followed and its target walked."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "ours"
    link.symlink_to(real)
    proc = restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(link / "sub")})
    restored(proc, real / "sub")


def test_sglang_cache_dir_as_another_users_link_is_refused(captured_in_sglang, tmp_path, other_user):
    """SGLANG_CACHE_DIR names a base whose children are the libraries' caches: the attack's exact form."""
    private = root_only(tmp_path)
    link = tmp_path / "sglang-cache"
    link.symlink_to(private)
    os.lchown(link, other_user, -1)
    proc = restore(captured_in_sglang, {"SGLANG_CACHE_DIR": str(link)})
    refused(proc, f"{link} is a symlink owned by uid {other_user}")
    assert list(private.iterdir()) == []


def test_sglang_cache_dir_of_this_user_still_works(captured_in_sglang, tmp_path):
    base = tmp_path / "sglang-cache"
    restored(restore(captured_in_sglang, {"SGLANG_CACHE_DIR": str(base)}), base / "inductor")


@pytest.mark.parametrize("how", ["0777 without sticky bit", "owned by another user"])
def test_a_base_others_control_is_refused_naming_its_owner_or_mode(captured, tmp_path, other_user, how):
    base = tmp_path / "base"
    base.mkdir()
    if how == "owned by another user":
        os.chown(base, other_user, -1)
        words = (f"{base} (mode 0755) is owned by uid {other_user}",)
    else:
        base.chmod(0o777)
        words = (f"{base} (mode 0777) is writable by every user and has no sticky bit", "JITWARM_ALLOW_SHARED=1")
    refused(restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(base / "a" / "inductor")}), *words)
    assert list(base.iterdir()) == []


def test_a_base_others_may_write_is_filled_when_shared_on_purpose(captured, tmp_path):
    base = tmp_path / "base"
    base.mkdir(mode=0o777)
    base.chmod(0o777)
    proc = restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"), "JITWARM_ALLOW_SHARED": "1"})
    restored(proc, base / "inductor")


def test_a_sticky_folder_is_a_passage_but_another_users_name_in_it_is_refused(captured, tmp_path, other_user):
    """/tmp-style (root's, 1777): what this user makes in it is restored into; what another user made is not."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    restored(restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(sticky / "mine")}), sticky / "mine")
    theirs = sticky / "theirs"
    theirs.mkdir()
    os.chown(theirs, other_user, -1)
    refused(restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(theirs / "inductor")}), f"{theirs} (mode 0755) is "
            f"owned by uid {other_user}")
    assert list(theirs.iterdir()) == []


def test_a_file_another_user_planted_at_a_units_path_is_replaced(captured, tmp_path, other_user):
    """In a root-owned sticky folder another user wrote the unit's .so first: it is replaced by the recorded bytes
    (root's now), never kept as "the library's own"."""
    dst = tmp_path / "inductor"
    (dst / "ha").mkdir(parents=True)
    (dst / "ha").chmod(0o1777)
    (dst / SO).write_bytes(b"\x7fELF planted")
    os.chown(dst / SO, other_user, -1)
    proc = restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(dst)})
    restored(proc, dst)
    assert (dst / SO).stat().st_uid == os.geteuid()
    said = proc.stdout + proc.stderr
    assert "kept 0)" in said and "holds the library's own" not in said  # prestart names what it kept per family
    assert [p.name for p in (dst / "ha").iterdir() if p.name.startswith(".")] == []


def test_a_file_this_user_wrote_at_a_units_path_is_kept(captured, tmp_path):
    """The twin: the library's own compile (this user's file, other bytes) is kept, with the warning."""
    dst = tmp_path / "inductor"
    (dst / "ha").mkdir(parents=True)
    (dst / SO).write_bytes(b"\x7fELF the library's own")
    proc = restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(dst)})
    assert proc.returncode == 0, proc.stderr
    assert (dst / SO).read_bytes() == b"\x7fELF the library's own"
    assert "holds the library's own" in proc.stdout + proc.stderr  # the warning, not only a count


@pytest.mark.parametrize("what", ["fifo", "link"])
def test_the_hint_for_a_fifo_or_link_names_no_setting(captured, tmp_path, what):
    """JITWARM_ALLOW_SHARED never accepts a FIFO or a link at a unit's path: the hint must not offer it."""
    dst = tmp_path / "inductor"
    (dst / "ha").mkdir(parents=True)
    if what == "fifo":
        os.mkfifo(dst / SO)
    else:
        (dst / SO).symlink_to(tmp_path / "elsewhere")
    proc = restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(dst)})
    refused(proc, f"refusing to restore into {dst / SO}")
    assert "JITWARM_ALLOW_SHARED" not in proc.stderr
    assert restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(dst), "JITWARM_ALLOW_SHARED": "1"}).returncode == 2


def test_the_hint_for_a_shared_folder_names_the_setting_that_accepts_it(captured, tmp_path):
    dst = tmp_path / "inductor"
    (dst / "ha").mkdir(parents=True)
    (dst / "ha").chmod(0o777)
    refused(restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(dst)}), "JITWARM_ALLOW_SHARED=1")
    restored(restore(captured, {"TORCHINDUCTOR_CACHE_DIR": str(dst), "JITWARM_ALLOW_SHARED": "1"}), dst)
