"""A bundle describes itself: ``bundle.json`` carries what it holds, ``prestart --bundle`` alone restores all of it,
and a prestart that would restore nothing expected is exit 5, never "ready".

The units are written in Inductor's layout (tests/jit_cache_trees.py) during a real recording; every command is the
real CLI in a subprocess, each "node" a fresh cache root and fresh library directories.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import jit_cache_trees as trees
import pytest
from precompile_fixtures import jitwarm, json_out
from workers.cache_harness import cache_for, desc, make_builder

from jitwarm.cache import CacheError, KernelCache
from jitwarm.precompile import record
from jitwarm.precompile.manifest import read_manifest

UNITS = 4  # tests/jit_cache_trees.py's Inductor tree: a graph, an AOT entry, a module, a C++ kernel


@pytest.fixture
def staged(tmp_path, monkeypatch):
    """A recording of Inductor's units in staging: (manifest, cache dir, the staging environment)."""
    env = trees.env_for(tmp_path / "staging")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("JITWARM_RECORD_CACHES", "inductor")
    manifest, cache_dir = tmp_path / "server.jsonl", tmp_path / "staging-cache"
    with record(manifest, KernelCache(cache_dir)) as recorder:
        trees.inductor(Path(env["TORCHINDUCTOR_CACHE_DIR"]))
    assert recorder.captured == {"inductor": UNITS}
    return manifest, cache_dir, env


def node(tmp_path: Path, name: str) -> dict[str, str]:
    """A fresh node's environment: its own jitwarm cache root and library directories."""
    return {**trees.env_for(tmp_path / name), "JITWARM_CACHE_DIR": str(tmp_path / name / "jitwarm")}


def test_the_about_object_round_trips_and_a_bundle_without_one_still_imports(tmp_path):
    src = cache_for(tmp_path / "src")
    entries = [src.get_or_build(desc(n), make_builder(tmp_path / "c", n)) for n in range(2)]
    about = {"v": 1, "manifest": [{"kind": "x"}], "made": {"server": "vllm"}}
    described = src.export_bundle([e.key for e in entries], tmp_path / "new.tar", about=about)
    with tarfile.open(described) as tar:
        head = json.loads(tar.extractfile("bundle.json").read())
    assert head == {"format": 1, "keys": sorted(e.key for e in entries), "about": about}
    assert cache_for(tmp_path / "a").import_bundle(described).about == about

    plain = src.export_bundle([entries[0].key], tmp_path / "plain.tar")  # no about: as before
    with tarfile.open(plain) as tar:
        assert set(json.loads(tar.extractfile("bundle.json").read())) == {"format", "keys"}
    assert cache_for(tmp_path / "b").import_bundle(plain).about is None
    # an older jitwarm's bundle with no bundle.json at all
    old = tmp_path / "old.tar"
    with tarfile.open(plain) as tar, tarfile.open(old, "w") as out:
        for member in tar.getmembers():
            if member.name != "bundle.json":
                out.addfile(member, tar.extractfile(member))
    report = cache_for(tmp_path / "c2").import_bundle(old)
    assert report.imported == (entries[0].key,) and report.about is None


def test_an_about_that_is_not_an_object_is_refused(tmp_path):
    src = cache_for(tmp_path / "src")
    entry = src.get_or_build(desc(0), make_builder(tmp_path / "c", 0))
    bad = tmp_path / "bad.tar"
    with tarfile.open(src.export_bundle([entry.key], tmp_path / "ok.tar")) as tar, tarfile.open(bad, "w") as out:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            if member.name == "bundle.json":
                data = json.dumps({"format": 1, "keys": [entry.key], "about": ["not", "an", "object"]}).encode()
                member.size = len(data)
            out.addfile(member, io.BytesIO(data))
    with pytest.raises(CacheError, match="bundle.json is malformed"):
        cache_for(tmp_path / "dst").import_bundle(bad)
    with pytest.raises(TypeError):
        src.export_bundle([entry.key], tmp_path / "x.tar", about=["a list"])
    assert not (tmp_path / "x.tar").exists()


def test_export_manifest_puts_the_records_it_holds_in_the_bundle(staged, tmp_path):
    manifest, cache_dir, _ = staged
    bundle = tmp_path / "kernels.tar"
    proc = jitwarm("export", "--manifest", str(manifest), "--cache-dir", str(cache_dir), str(bundle))
    assert proc.returncode == 0, proc.stderr
    about = KernelCache(tmp_path / "elsewhere").import_bundle(bundle).about
    assert sorted(map(json.dumps, about["manifest"])) == sorted(map(json.dumps, read_manifest(manifest)))
    assert about["specs"] == [] and about["made"]["roots"] == {"inductor": str(staged[2]["TORCHINDUCTOR_CACHE_DIR"])}
    assert about["made"]["environment"]["TORCHINDUCTOR_CACHE_DIR"] == staged[2]["TORCHINDUCTOR_CACHE_DIR"]


def test_prestart_with_the_bundle_alone_restores_everything_it_holds(staged, tmp_path):
    manifest, cache_dir, _ = staged
    bundle = tmp_path / "kernels.tar"
    assert jitwarm("export", "--manifest", str(manifest), "--cache-dir", str(cache_dir), str(bundle)).returncode == 0
    env = node(tmp_path, "node")
    proc = jitwarm("prestart", "--bundle", str(bundle), "--offline", "--json", env=env)  # no manifest, no server
    assert proc.returncode == 0, proc.stderr
    done = json_out(proc)
    assert done["ready"] is True and done["bundle"]["supplied"] == UNITS and done["bundle"]["manifest"] is True
    dest = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    assert done["restored"]["inductor"]["root"] == str(dest) and done["restored"]["inductor"]["placed"] == UNITS
    src = Path(staged[2]["TORCHINDUCTOR_CACHE_DIR"])
    assert sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file()) == \
        sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file() and "locks" not in p.parts
               and not p.name.startswith("."))  # the tree's writer's temporary and lock are no unit's
    text = jitwarm("prestart", "--bundle", str(bundle), "--offline", env=env)  # again, as text: present
    assert text.returncode == 0, text.stderr
    assert f"jitwarm: inductor: {UNITS} unit(s) in {dest} (placed 0, present {UNITS}, kept 0)" in text.stderr
    assert "jitwarm: ready: " in text.stdout


def test_a_bundle_that_says_nothing_of_what_it_holds_is_exit_5_never_ready(staged, tmp_path):
    manifest, cache_dir, _ = staged
    keys = [line for line in (cache_dir / "v1" / "entries").glob("*/*")]
    old = KernelCache(cache_dir).export_bundle([k.name for k in keys], tmp_path / "old.tar")  # no about
    env = node(tmp_path, "node")
    alone = jitwarm("prestart", "--bundle", str(old), "--offline", "--json", env=env)
    assert alone.returncode == 5, alone.stderr
    assert "carries no manifest of what it holds" in alone.stderr and json_out(alone)["ready"] is False
    # The server line of a start with no graphs plans nothing: the bundle is still imported, and still exit 5.
    line = jitwarm("prestart", "--bundle", str(old), "--offline", "--", "vllm", "serve", "/m", "--enforce-eager",
                   env=env)
    assert line.returncode == 5 and "nothing to warm" not in line.stderr, line.stderr
    # With the manifest, the same bundle restores everything.
    given = jitwarm("prestart", "--bundle", str(old), "--manifest", str(manifest), "--offline", env=env)
    assert given.returncode == 0 and f"placed {UNITS}" in given.stderr, given.stderr


def test_a_bundle_whose_records_are_all_for_another_target_is_exit_5(staged, tmp_path):
    manifest, cache_dir, _ = staged
    bundle = tmp_path / "kernels.tar"
    assert jitwarm("export", "--manifest", str(manifest), "--cache-dir", str(cache_dir), str(bundle)).returncode == 0
    proc = jitwarm("prestart", "--bundle", str(bundle), "--offline", "--target", "sm_100",
                   env=node(tmp_path, "node"))
    assert proc.returncode == 5, proc.stderr
    assert "would restore nothing" in proc.stderr and "jitwarm inspect" in proc.stderr
    assert "ready" not in proc.stdout


def test_a_fingerprint_refusal_names_the_variable_both_values_and_the_fix(tmp_path):
    """An environment factor differs: the fix is the pod's environment, never "build in the server's image"."""
    import hashlib

    from jitwarm.kernels.libraries.jit_caches import fingerprint
    from jitwarm.kernels.libraries.jit_caches.backend import unit_spec
    from jitwarm.kernels.libraries.jit_caches.census import library
    from jitwarm.precompile.manifest import append_records, unit_record

    unit = "1b01927fc6/rank_0_0/backbone"
    spec = unit_spec(library("vllm_compile"), unit, {f"{unit}/computation_graph.py": hashlib.sha256(b"g").hexdigest()},
                     {"vllm:env:VLLM_PLUGINS": '["jitwarm"]'}, "cpu", "vllm")
    manifest = tmp_path / "m.jsonl"
    append_records(manifest, [unit_record(spec)])
    proc = jitwarm("prestart", "--manifest", str(manifest), "--offline", env=node(tmp_path, "node"))
    assert proc.returncode == 4 and proc.stderr.count("\n") == 1, proc.stderr
    assert "recorded with vllm:env:VLLM_PLUGINS '[\"jitwarm\"]', this node has \"unknown (" in proc.stderr
    assert "set VLLM_PLUGINS=jitwarm as at capture in this node's environment, or capture again with this node's " \
           "value" in proc.stderr
    assert "build in the server's image" not in proc.stderr and "--allow-fingerprint-mismatch" in proc.stderr

    fix = fingerprint.remedy
    assert fix("vllm:env:VLLM_BATCH_INVARIANT", "false", "true").startswith(
        "vllm hashes the environment variable VLLM_BATCH_INVARIANT into its key: set VLLM_BATCH_INVARIANT so that "
        "it reads false as at capture")
    assert fix("vllm:env:VLLM_PLUGINS", "null", '["jitwarm"]').startswith(
        "vllm hashes the environment variable VLLM_PLUGINS into its key: unset VLLM_PLUGINS as at capture")
    assert fix("torch", "2.13.0", "2.14.1") == ("install torch 2.13.0 here as at capture (the server's image), or "
                                                "capture again in this node's image")
    assert "--target sm_90" in fix("arch", "sm_90", "cpu")


def test_a_manifest_of_the_operators_own_names_what_is_restored_from_a_bundle(staged, tmp_path):
    manifest, cache_dir, _ = staged
    bundle = tmp_path / "kernels.tar"
    assert jitwarm("export", "--manifest", str(manifest), "--cache-dir", str(cache_dir), str(bundle)).returncode == 0
    one = tmp_path / "one.jsonl"
    one.write_text(manifest.read_text().splitlines(keepends=True)[0])
    proc = jitwarm("prestart", "--bundle", str(bundle), "--manifest", str(one), "--offline", "--json",
                   env=node(tmp_path, "node"))
    assert proc.returncode == 0, proc.stderr
    done = json_out(proc)
    assert done["handed_over"] == 1 and done["restored"]["inductor"]["placed"] == 1
