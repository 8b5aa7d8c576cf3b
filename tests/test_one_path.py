"""The one path from a spec to an entry and a loaded kernel: computed once, loaded before publish, rebuilt once.

Real compilers, real worker processes, real files; the "broken compilers" are small shell scripts standing in
for g++ (they print a diagnostic or write junk where the library should be).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from precompile_fixtures import SMALL, TINY, jitwarm, plan_of

from jitwarm.cache import KernelCache
from jitwarm.kernels import CompileError, KernelSpec, LoadError, Target, TargetError, dispatch, tvm_backend
from jitwarm.kernels.artifacts import KernelLoadError, artifact
from jitwarm.precompile import CaptureHook, KernelLoadFailed
from jitwarm.precompile.builders import Failure

# tvm_ffi: the tests whose subject is loading a tvm-ffi library (the others test the protocol around it, which
# does not change with the library); floor: those CI's floor pass reruns on the oldest tvm-ffi, what its loader
# answers for a library that is junk or another spec's.
tvm_ffi = pytest.mark.tvm_ffi
floor = pytest.mark.floor


def fake_cxx(tmp_path, body: str):
    """A stand-in for g++: logs every call, then runs ``body`` (sh) with the real g++ as $REAL."""
    log = tmp_path / "cxx.log"
    script = tmp_path / "fake-c++"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nREAL=g++\n[ "$1" = --version ] && exec $REAL "$@"\n{body}\n')
    script.chmod(0o755)
    return str(script), log


def test_a_cold_warm_computes_each_description_once_in_the_parent_only(tmp_path):
    cxx, log = fake_cxx(tmp_path, 'exec $REAL "$@"')
    proc = jitwarm("warm", *TINY, "--cache-dir", str(tmp_path / "cache"), "--jobs", "2", "--json",
                   env={"CXX": cxx})
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    # one `--version` (the toolchain fingerprint) in the planning process; the workers are handed the
    # descriptions and keys, and only compile
    assert [c for c in calls if c == "--version"] == ["--version"]
    assert len([c for c in calls if "-o" in c.split()]) == 3


def test_a_compilers_identity_is_kept_until_its_binary_changes(tmp_path):
    # A copy of the real compiler driver (an ELF binary, so its identity can be kept), beside a lib/ that
    # leads it to the system's cc1plus as its install prefix would.
    (tmp_path / "bin").mkdir()
    compiler = tmp_path / "bin" / "g++"
    shutil.copy2(os.path.realpath(shutil.which("g++")), compiler)
    (tmp_path / "lib").symlink_to("/usr/lib")
    root, env = str(tmp_path / "cache"), {"CXX": str(compiler)}
    assert jitwarm("warm", *TINY, "--cache-dir", root, env=env).returncode == 0
    (fact,) = (tmp_path / "cache" / "v1" / "facts").glob("compiler-*.json")
    assert "g++" in json.loads(fact.read_text())["value"]
    assert jitwarm("status", *TINY, "--cache-dir", root, env=env).returncode == 0
    # the next processes take the identity from the cache, not from `--version`: a forged one changes the keys
    fact.write_text(json.dumps({"value": "another compiler 99"}))
    assert jitwarm("status", *TINY, "--cache-dir", root, env=env).returncode == 5
    # a changed binary is another fact: probed again, the real identity, the entries found again
    with compiler.open("ab") as f:
        f.write(b"\0")
    assert jitwarm("status", *TINY, "--cache-dir", root, env=env).returncode == 0


def test_the_tvm_ffi_version_is_kept_until_its_package_changes(tmp_path, monkeypatch):
    from importlib.metadata import version

    root = str(tmp_path / "cache")
    assert jitwarm("warm", *TINY, "--cache-dir", root).returncode == 0
    (fact,) = (tmp_path / "cache" / "v1" / "facts").glob("tvm-ffi-*.json")
    assert json.loads(fact.read_text())["value"] == version("apache-tvm-ffi")
    # the next processes take it from the cache, not from the package metadata: a forged one changes the keys
    fact.write_text(json.dumps({"value": "0.0.0"}))
    assert jitwarm("status", *TINY, "--cache-dir", root).returncode == 5
    fact.unlink()
    assert jitwarm("status", *TINY, "--cache-dir", root).returncode == 0
    # the fact is named by the package's __init__.py: another file (a reinstall, an upgrade) is another fact
    package = tmp_path / "site" / "jitwarm_probe_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    before = tvm_backend._package_fact("jitwarm_probe_pkg")
    (package / "__init__.py").write_text("# reinstalled\n")
    assert before.startswith("tvm-ffi-") and tvm_backend._package_fact("jitwarm_probe_pkg") not in ("", before)
    assert tvm_backend._package_fact("jitwarm_no_such_package") == ""


@tvm_ffi
@floor
def test_a_library_that_cannot_be_loaded_is_never_published(tmp_path):
    # exits 0 but writes garbage where the shared library should be
    cxx, _ = fake_cxx(tmp_path, 'for a; do [ "$prev" = -o ] && out=$a; prev=$a; done\n'
                                '[ -n "$out" ] && echo "not a library" > "$out"\nexit 0')
    root = tmp_path / "cache"
    for _ in range(2):  # and the next warm tries again: nothing was recorded as present
        proc = jitwarm("warm", *TINY, "--cache-dir", str(root), "--json", env={"CXX": cxx})
        assert proc.returncode == 1
        specs = json.loads(proc.stdout)["specs"]
        assert {s["outcome"] for s in specs} == {"failed"}
        assert {s["error_kind"] for s in specs} == {"load"} and all("does not load" in s["error"] for s in specs)
    assert not list(root.glob("v1/entries/*/*"))
    assert jitwarm("verify", *TINY, "--cache-dir", str(root)).returncode != 0


def test_the_compilers_whole_diagnostic_reaches_the_user(tmp_path):
    cxx, _ = fake_cxx(tmp_path, "echo \"kernel.cc:3:5: error: 'frobnicate' was not declared in this scope\" >&2\n"
                                "echo '    3 |     frobnicate();' >&2\nexit 1")
    proc = jitwarm("warm", *TINY, "--cache-dir", str(tmp_path / "cache"), env={"CXX": cxx})
    assert proc.returncode == 1
    assert "error: 'frobnicate' was not declared" in proc.stderr and "frobnicate();" in proc.stderr
    as_json = jitwarm("warm", *TINY, "--cache-dir", str(tmp_path / "cache"), "--json", env={"CXX": cxx})
    spec = json.loads(as_json.stdout)["specs"][0]
    assert spec["error_kind"] == "compile" and spec["error_type"] == "CompileError"
    assert "compile failed (exit 1)" in spec["error"] and "'frobnicate' was not declared" in spec["detail"]


@tvm_ffi
@floor
def test_an_entry_that_fails_to_load_at_run_time_is_quarantined_and_rebuilt_once(tmp_path):
    cache = KernelCache(root=tmp_path / "cache", layers=())
    spec = plan_of(TINY).specs[-1]
    art = artifact(spec)

    def junk(staging):  # published straight through the cache, as a corrupted-at-build library would be
        (staging / tvm_backend.LIBRARY).write_bytes(b"\x7fELF but no library")

    bad = cache.get_or_build_ex(art.description, junk, key=art.key).entry
    dispatcher = dispatch.Dispatcher(cache)
    kernel = dispatcher.ensure_loaded(spec)
    assert kernel.spec == spec and dispatcher.counters()["builds"] == 0  # the rebuild ran inside load()
    assert cache.stats().builds == 2  # the junk one, then exactly one rebuild
    quarantined = [p for p in (tmp_path / "cache" / "v1" / "quarantine").glob(f"{art.key}-*") if p.is_dir()]
    assert len(quarantined) == 1 and (bad.path.exists() and art.lookup(cache).path == bad.path)


@tvm_ffi
def test_prune_cannot_remove_an_entry_while_it_loads_and_a_pruned_lookup_is_got_again(tmp_path, monkeypatch):
    """prune beside a starting hook failed its loads (20 of 20 trials): the entry is claimed while it loads."""
    cache = KernelCache(root=tmp_path / "cache", layers=())
    spec = plan_of(TINY).specs[-1]
    art = artifact(spec)
    entry = art.get_or_build(cache).entry
    real_load, kept = tvm_backend.load, []

    def prune_then_load(spec, entry):  # the race made certain: a full prune between the claim and the dlopen
        kept.extend(cache.prune(max_bytes=0).skipped_locked)
        return real_load(spec, entry)

    monkeypatch.setattr(tvm_backend, "load", prune_then_load)
    assert art.load(cache, entry).spec == spec
    assert kept == [art.key] and art.lookup(cache) is not None and cache.stats().builds == 1

    monkeypatch.setattr(tvm_backend, "load", real_load)
    assert cache.prune(max_bytes=0).removed and art.lookup(cache) is None  # now pruned after its lookup ...
    assert art.load(cache, entry).spec == spec  # ... so load gets it again (one rebuild) instead of failing
    assert cache.stats().builds == 2 and art.lookup(cache) is not None


def test_the_hook_names_a_spec_that_never_loads(tmp_path, monkeypatch, prestarted):
    plan = plan_of(SMALL)
    root = tmp_path / "cache"
    shutil.copytree(prestarted[0], root)  # the session's SMALL cache: the rebuild is the only build here

    def refuse(spec, entry):
        raise LoadError(f"{spec.id}: pretend dlopen said no")

    monkeypatch.setattr(tvm_backend, "load", refuse)
    dispatch.reset()
    hook = CaptureHook(plan, cache=KernelCache(root=root), device="cpu", policy="build")
    with pytest.raises(KernelLoadFailed) as info:
        hook()
    assert info.value.spec in plan.specs and "pretend dlopen said no" in str(info.value)
    assert isinstance(info.value.__cause__, KernelLoadError)


@pytest.mark.parametrize("how", ["policy", "JITWARM_STRICT=1"])
def test_strict_builds_nothing_an_entry_that_fails_to_load_is_an_error_naming_it(tmp_path, monkeypatch, prestarted,
                                                                                 how):
    """Issue #31, N8: under strict a present entry that fails to load was quarantined and rebuilt inside the hook."""
    plan = plan_of(SMALL)
    root = tmp_path / "cache"
    shutil.copytree(prestarted[0], root)
    cache = KernelCache(root=root)
    builds = cache.stats().builds

    def refuse(spec, entry):
        raise LoadError(f"{spec.id}: pretend dlopen said no")

    monkeypatch.setattr(tvm_backend, "load", refuse)
    if how != "policy":
        monkeypatch.setenv("JITWARM_STRICT", "1")
    dispatch.reset()
    hook = CaptureHook(plan, cache=cache, device="cpu", policy="strict" if how == "policy" else "build")
    with pytest.raises(KernelLoadFailed) as info:
        hook()
    assert info.value.spec in plan.specs and "strict mode builds nothing" in str(info.value)
    assert "pretend dlopen said no" in str(info.value) and "quarantined" in str(info.value)
    assert cache.stats().builds == builds  # nothing built
    assert list((root / "v1" / "quarantine").iterdir())  # the entry that does not load is set aside, not loaded


def test_failures_travel_as_kinds_not_strings():
    from jitwarm.cache import BuildError, LockTimeout

    compile_failure = BuildError("ab" * 32, "x")
    compile_failure.__cause__ = CompileError("plan/...: compile failed (exit 1)", "line one\nline two")
    failure = Failure.of(compile_failure)
    assert (failure.kind, failure.type, failure.message) == ("compile", "CompileError",
                                                             "plan/...: compile failed (exit 1)")
    assert failure.detail == "line one\nline two"
    assert Failure.of(LockTimeout("cd" * 32, None, 1.0)).kind == "timeout"
    assert Failure.of(TargetError("unknown target 'x'")).kind == "spec"
    assert Failure.of(ZeroDivisionError()).kind == "internal"


@pytest.mark.parametrize("text, message", [
    ("sm_90a", "use sm_90"), ("sm_٩٠", "unknown target"), ("sm_70", ">= sm_75"), ("gpu", "unknown target"),
])
def test_one_target_type(text, message):
    with pytest.raises(TargetError, match=message):
        Target.parse(text)
    assert Target.parse("sm_100").arch == 100 and not Target.parse("cpu").is_cuda


def test_an_arch_specific_target_is_refused_at_plan_time():
    proc = jitwarm("plan", *TINY[:-1], "sm_90a")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "use sm_90" in proc.stderr


@tvm_ffi
def test_the_dispatcher_resets(tmp_path):
    dispatcher = dispatch.Dispatcher(KernelCache(root=tmp_path / "c", layers=()))
    spec = KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 4, "threads": 32})
    dispatcher.add_miss_hook(lambda s, shape: None)
    dispatcher.ensure_loaded(spec)
    assert dispatcher.is_loaded(spec) and dispatcher.counters()["loads"] == 1
    dispatcher.reset()
    assert not dispatcher.is_loaded(spec) and dispatcher.counters() == {"builds": 0, "loads": 0, "misses": 0}


@tvm_ffi
@floor
def test_an_entry_holding_another_loadable_library_is_rebuilt_and_the_rebuild_loads(tmp_path, caplog):
    """dlopen answers a path it loaded before with the library it loaded then: the rebuild must not get the swap."""
    cache = KernelCache(root=tmp_path / "cache", layers=())
    spec, other = plan_of(TINY).specs[-1], plan_of(TINY).specs[0]
    art, other_entry = artifact(spec), artifact(other).get_or_build(cache).entry

    def swapped(staging):  # another spec's library, which loads fine, published under this spec's key
        shutil.copy2(other_entry.file(tvm_backend.LIBRARY), staging / tvm_backend.LIBRARY)

    cache.get_or_build_ex(art.description, swapped, key=art.key)
    with caplog.at_level("WARNING", logger="jitwarm.kernels"):
        kernel = dispatch.Dispatcher(cache).ensure_loaded(spec)
    assert kernel.spec == spec and cache.stats().builds == 3  # other, the swap, exactly one rebuild
    assert f"holds {other.id}" in caplog.text and "rebuilt; the rebuild loads" in caplog.text


@pytest.mark.parametrize("kind", ["sglang_jit", "triton_jit"])
def test_a_plan_asking_to_build_a_kind_that_can_only_be_replayed_is_a_usage_error(kind, tmp_path):
    """Kinds declare what they can do: the server's kernels are replayed from a record, never built from a plan."""
    from jitwarm.kernels.backend import BUILDABLE, abilities

    assert BUILDABLE == ("tvm_ffi", "triton") and "replay" in abilities(kind) and "build" not in abilities(kind)
    for command in ("plan", "warm"):
        cache = ["--cache-dir", str(tmp_path / "cache")] if command == "warm" else []
        proc = jitwarm(command, *TINY, "--backend", kind, *cache)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == (f"jitwarm: error: --backend {kind!r} cannot build: it can only "
                               f"{' and '.join(sorted(abilities(kind)))} (jitwarm warm --manifest replays its "
                               "records); choose from tvm_ffi, triton\n")
    assert not (tmp_path / "cache").exists()
