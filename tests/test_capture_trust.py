"""A recording takes only the server's own files (issue #31, N7): what another real user (``useradd``) planted in a
library's cache, a file or folder others can write, a file with another hard link, is not stored: a warning names
it, the rest of the run's units are stored, and under ``JITWARM_STRICT=1`` it is an error. ``JITWARM_ALLOW_SHARED=1``
takes them (a cache the operator shares on purpose).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jit_cache_trees as trees
import pytest
from precompile_fixtures import jitwarm

from jitwarm.cache import KernelCache
from jitwarm.cache.errors import UntrustedPath
from jitwarm.precompile import record
from jitwarm.precompile.manifest import read_manifest

pytest_plugins = ["s3_fixtures"]  # the moto_server endpoint and a bucket per test, shared with other modules

GOOD, PLANTED = ("ha", "cgood"), ("pl", "cplanted")


def write_unit(root: Path, where: tuple[str, str]) -> Path:
    """One Inductor C++ module: its .cpp and the .so built from it."""
    trees.write(root / where[0] / f"{where[1]}.main.cpp", "extern \"C\" void kernel() {}")
    return trees.write(root / where[0] / f"{where[1]}.main.so", trees.ELF + where[1].encode())


@pytest.fixture
def inductor(tmp_path, monkeypatch):
    root = tmp_path / "inductor"
    root.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
    monkeypatch.setenv("JITWARM_RECORD_CACHES", "inductor")
    return root


def run(tmp_path: Path, root: Path, plant) -> list[str]:
    """Record a run that writes one good unit and one ``plant``-ed one; the units it stored."""
    with record(tmp_path / "m.jsonl", KernelCache(tmp_path / "cache")):
        write_unit(root, GOOD)
        plant(root)
    return sorted(r["unit"] for r in read_manifest(tmp_path / "m.jsonl"))


def planted_by(uid: int):
    def plant(root: Path) -> None:
        so = write_unit(root, PLANTED)
        for path in (so, so.with_name(f"{PLANTED[1]}.main.cpp")):
            os.chown(path, uid, -1)
    return plant


def world_writable(root: Path) -> None:
    write_unit(root, PLANTED).chmod(0o666)


def in_an_open_folder(root: Path) -> None:
    write_unit(root, PLANTED)
    (root / PLANTED[0]).chmod(0o777)  # anyone may swap a file in it (no sticky bit)


def hard_linked(root: Path) -> None:
    so = write_unit(root, PLANTED)
    os.link(so, root.parent / "elsewhere.so")


@pytest.mark.parametrize("plant", ["another user", "world-writable", "an open folder", "hard-linked"])
def test_a_planted_unit_is_not_recorded_and_a_warning_names_it(tmp_path, inductor, other_user, caplog, plant):
    planting = {"another user": planted_by(other_user), "world-writable": world_writable,
                "an open folder": in_an_open_folder, "hard-linked": hard_linked}[plant]
    with caplog.at_level(logging.WARNING, logger="jitwarm"):
        units = run(tmp_path, inductor, planting)
    assert units == ["ha/cgood"]  # the server's own unit is stored, the planted one is not
    said = [r.getMessage() for r in caplog.records if "cannot capture inductor unit pl/cplanted" in r.getMessage()]
    assert len(said) == 1 and str(inductor / "pl") in said[0], [r.getMessage() for r in caplog.records]
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.name.startswith("cplanted")]


def test_under_strict_a_planted_unit_is_an_error(tmp_path, inductor, other_user, monkeypatch):
    monkeypatch.setenv("JITWARM_STRICT", "1")
    recorder = record(tmp_path / "m.jsonl", KernelCache(tmp_path / "cache"))
    planted_by(other_user)(inductor)
    try:
        with pytest.raises(UntrustedPath, match=f"uid {other_user}"):
            recorder.capture()
    finally:
        monkeypatch.delenv("JITWARM_STRICT")
        recorder.stop()


def test_a_cache_setting_that_does_not_parse_fails_the_unit_not_the_server(tmp_path, inductor, monkeypatch, caplog):
    """The recorder opens its cache on the first unit; a bad setting then is that unit's warning, never a raise
    into the server's capture (``capture()`` never raises), and the run records on."""
    monkeypatch.setenv("JITWARM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JITWARM_REMOTE", "ftp://not-a-store")
    recorder = record(tmp_path / "m.jsonl")
    try:
        write_unit(inductor, GOOD)
        with caplog.at_level(logging.WARNING, logger="jitwarm"):
            assert recorder.capture() == 0
        said = [r.getMessage() for r in caplog.records if "cannot capture inductor unit ha/cgood" in r.getMessage()]
        assert len(said) == 1 and "JITWARM_REMOTE" in said[0], [r.getMessage() for r in caplog.records]
    finally:
        recorder.stop()


def test_a_shared_cache_the_operator_allows_is_recorded(tmp_path, inductor, other_user, monkeypatch):
    monkeypatch.setenv("JITWARM_ALLOW_SHARED", "1")
    units = run(tmp_path, inductor, planted_by(other_user))
    assert units == ["ha/cgood", "pl/cplanted"]


def test_a_private_file_is_stored_private(tmp_path, inductor):
    """A unit file the library wrote 0600 is stored 0400, never readable by others; a 0644 one is 0444. Restored
    where the library looks, it is 0600 again, the other 0644."""
    with record(tmp_path / "m.jsonl", KernelCache(tmp_path / "cache")):
        so = write_unit(inductor, GOOD)
        so.chmod(0o600)
    stored = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "cache").rglob("cgood.main.*")}
    assert stored == {"cgood.main.so": 0o400, "cgood.main.cpp": 0o444}, stored
    node = tmp_path / "node-inductor"
    restored = jitwarm("prestart", "--manifest", str(tmp_path / "m.jsonl"), "--cache-dir", str(tmp_path / "cache"),
                       "--offline", env={"TORCHINDUCTOR_CACHE_DIR": str(node)})
    assert restored.returncode == 0, restored.stderr
    placed = {p.name: p.stat().st_mode & 0o777 for p in node.rglob("cgood.main.*")}
    assert placed == {"cgood.main.so": 0o600, "cgood.main.cpp": 0o644}, placed


@pytest.mark.parametrize("via", ["bundle", "redis", "s3"])
def test_a_private_file_stays_private_through_a_bundle_and_the_remote(tmp_path, via, request):
    """Shipped to another node, a 0400 entry file is still 0400 there, an executable private one 0500; the rest
    is 0444 and 0555 as before (the mode travels in the tar header, the Redis meta and the S3 record)."""
    def build(staging: Path) -> None:
        for name, mode in (("private.so", 0o700), ("private.json", 0o600), ("public.cpp", 0o644)):
            trees.write(staging / name, name.encode()).chmod(mode)

    desc = {"kind": "private-modes", "via": via}
    if via == "bundle":
        first = KernelCache(tmp_path / "a", layers=())
        first.export_bundle([first.get_or_build(desc, build).key], tmp_path / "k.tar")
        KernelCache(tmp_path / "b", layers=()).import_bundle(tmp_path / "k.tar")
    else:
        store = request.getfixturevalue("remote" if via == "redis" else "bucket")
        store.cache(tmp_path / "a").get_or_build(desc, build)
        got = store.cache(tmp_path / "b").get_or_build_ex(desc, lambda d: pytest.fail("must download"))
        assert got.outcome == "downloaded"
    shipped = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "b").rglob("p*.*")}
    assert shipped == {"private.so": 0o500, "private.json": 0o400, "public.cpp": 0o444}, shipped
