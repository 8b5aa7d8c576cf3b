"""The server's own Triton kernels: record what a run compiles, replay it on a box without a GPU, serve it.

The one mock is the GPU: ``workers/triton_server.py`` runs Triton's real JIT with a driver that only reports
device 0 and target sm_90, so Triton compiles real cubins and its compilation listener says, for each compile
it starts, whether its stages ran (``cache_hit`` False) or a cache answered. Each server process has a private
empty Triton cache, so a hit there came from jitwarm's cache through ``TRITON_CACHE_MANAGER``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from precompile_fixtures import jitwarm

from jitwarm.cache import KernelCache
from jitwarm.precompile import CaptureHook, KernelsNotReady, WarmPlan
from jitwarm.precompile.manifest import append_records, read_manifest

WORKERS = Path(__file__).with_name("workers")
MANAGER = "jitwarm.kernels.libraries.triton.cache:CacheManager"
ENV = {"PYTHONPATH": os.pathsep.join([str(WORKERS), os.environ.get("PYTHONPATH", "")]),
       "TRITON_DEFAULT_FP_FUSION": "1",  # Triton 3.9 warns without it; the value is Triton's default
       "JITWARM_RECORD_CACHES": "none"}  # kernel records only: Triton's own directory is test_jit_caches_real.py's
SPECIALIZATIONS = 4  # server_kernels.warm_up: fill_lens for BLOCK 1, 4, 64 and one scaled_copy


def server(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKERS / "triton_server.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV, **(env or {})})


def result_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return jitwarm(*args, env={**ENV, **(env or {})})


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    """Two server processes recording their warmups into one manifest at once."""
    path = tmp_path_factory.mktemp("record") / "server.jsonl"
    procs = [server("record", str(path)) for _ in range(2)]
    results = [result_of(p) for p in procs]
    assert sum(r["recorded"] for r in results) == SPECIALIZATIONS  # each record appended once, by one of them
    return path


def test_record_holds_each_specialization_once_with_what_replays_it(manifest):
    records = read_manifest(manifest)
    assert len(records) == len(manifest.read_text().splitlines()) == SPECIALIZATIONS
    assert sorted(r["kernel"] for r in records) == ["server_kernels:fill_lens"] * 3 + ["server_kernels:scaled_copy"]
    assert {r["target"] for r in records} == {"sm_90"}
    blocks = sorted(json.loads(r["specialization"])["constant_vals"][-1] for r in records
                    if r["kernel"].endswith("fill_lens"))
    assert blocks == [1, 4, 64]  # one compile per power-of-two bucket, as Triton made them


def test_replay_without_a_gpu_then_export_prestart_and_serve_with_zero_compiles(manifest, tmp_path):
    build, node = tmp_path / "build", tmp_path / "node"
    first = cli("warm", "--manifest", str(manifest), "--target", "sm_90", "--cache-dir", str(build), "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["totals"]["built"] == SPECIALIZATIONS
    again = cli("warm", "--manifest", str(manifest), "--target", "sm_90", "--cache-dir", str(build), "--json")
    assert json.loads(again.stdout)["totals"]["hit"] == SPECIALIZATIONS  # built exactly once
    assert cli("status", "--manifest", str(manifest), "--target", "sm_90", "--cache-dir", str(build)).returncode == 0

    bundle = tmp_path / "server-kernels.tar.gz"
    assert cli("export", "--manifest", str(manifest), "--target", "sm_90", "--cache-dir", str(build),
               str(bundle)).returncode == 0
    ready = cli("prestart", "--manifest", str(manifest), "--target", "sm_90", "--cache-dir", str(node),
                "--bundle", str(bundle), "--json")
    assert ready.returncode == 0, ready.stderr
    assert json.loads(ready.stdout.splitlines()[-1])["bundle"]["supplied"] == SPECIALIZATIONS

    served = result_of(server("serve", env={"TRITON_CACHE_MANAGER": MANAGER, "JITWARM_CACHE_DIR": str(node)}))
    assert len(served["compiles"]) == SPECIALIZATIONS
    assert all(c["cache_hit"] for c in served["compiles"]), served  # Triton's stages never ran


def test_processes_starting_together_compile_each_specialization_once(tmp_path):
    """Four ranks, an empty cache: one compiles each specialization, the others wait for it and load it.

    (bench/server_kernels.py counts the compiles of eight against Triton's own manager.)
    """
    start = tmp_path / "start"
    env = {"TRITON_CACHE_MANAGER": MANAGER, "JITWARM_CACHE_DIR": str(tmp_path / "cache")}
    procs = [server("serve-after", str(start), env=env) for _ in range(4)]
    deadline = time.monotonic() + 240
    while len(list(tmp_path.glob("start.ready-*"))) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.05)  # each has imported torch and Triton: they reach the first compile together
    start.touch()
    results = [result_of(p) for p in procs]
    compiled = [sum(not r["compiles"][i]["cache_hit"] for r in results) for i in range(SPECIALIZATIONS)]
    assert compiled == [1] * SPECIALIZATIONS, results


def test_a_record_that_cannot_be_replayed_is_a_failed_spec_naming_it(manifest, tmp_path):
    broken = tmp_path / "broken.jsonl"
    good = read_manifest(manifest)[0]
    append_records(broken, [good, {**good, "kernel": "no_such_server_module:fill_lens"}])
    proc = cli("warm", "--manifest", str(broken), "--target", "sm_90", "--cache-dir", str(tmp_path / "c"), "--json")
    assert proc.returncode == 1
    results = {r["spec"].split("/")[0]: r for r in json.loads(proc.stdout)["specs"]}
    assert results["server_kernels:fill_lens"]["outcome"] == "built"
    failed = results["no_such_server_module:fill_lens"]
    assert failed["outcome"] == "failed" and "cannot import no_such_server_module" in failed["error"]


def test_a_manifest_for_another_target_or_a_broken_one_is_a_usage_error(manifest, tmp_path):
    other = cli("plan", "--manifest", str(manifest), "--target", "sm_100")
    assert other.returncode == 2 and "no records for the targets asked for" in other.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(manifest.read_text() + "[" * 100_000 + "\n")
    proc = cli("plan", "--manifest", str(bad))
    assert proc.returncode == 2 and f"{bad}:{SPECIALIZATIONS + 1}: not JSON" in proc.stderr
    assert proc.stderr.count("\n") == 1


class _Sm90:
    """The hook's device: target sm_90 without a GPU (the mock); nothing to drain."""

    target = "sm_90"

    def synchronize(self) -> None:
        pass


def test_the_hook_given_a_manifest_makes_every_recorded_kernel_present(manifest, tmp_path, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(WORKERS))
    cache = KernelCache(root=tmp_path / "cache", layers=())
    strict = CaptureHook(WarmPlan.empty(), cache=cache, device=_Sm90(), policy="strict", manifest=manifest)
    with pytest.raises(KernelsNotReady, match="server_kernels:fill_lens"):
        strict()
    assert cli("warm", "--manifest", str(manifest), "--target", "sm_90",
               "--cache-dir", str(tmp_path / "cache")).returncode == 0
    hook = CaptureHook(WarmPlan.empty(), cache=cache, device=_Sm90(), policy="strict", manifest=manifest)
    try:
        report = hook()
    finally:
        hook.close()
    assert report.hits == report.loaded == SPECIALIZATIONS


def test_jitwarms_own_triton_builds_ignore_a_process_wide_jitwarm_manager(tmp_path, monkeypatch):
    """A server with TRITON_CACHE_MANAGER set still builds jitwarm's own Triton kernels into their own entries."""
    from jitwarm.kernels import KernelSpec
    from jitwarm.kernels.artifacts import artifact

    monkeypatch.setenv("TRITON_CACHE_MANAGER", MANAGER)
    monkeypatch.setenv("JITWARM_CACHE_DIR", str(tmp_path / "served"))
    spec = KernelSpec("plan", "triton", "sm_90", {"ratio": 4, "threads": 32})
    result = artifact(spec).get_or_build(KernelCache(root=tmp_path / "cache", layers=()))
    assert result.outcome == "built" and any(f.endswith(".cubin") for f in result.entry.files)
    assert not (tmp_path / "served").exists()  # the manager was not used for it


def test_a_record_whose_module_exits_or_prints_on_import_is_a_failed_spec_and_stdout_stays_json(manifest, tmp_path):
    """A manifest names modules that replay imports: their sys.exit() and their prints are not the command's."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "exits_on_import.py").write_text("import sys\nprint('leaving')\nsys.exit(0)\n")
    (modules / "prints_on_import.py").write_text("print('hello from an import')\n"
                                                 "from server_kernels import fill_lens\n")
    good = read_manifest(manifest)[0]
    records = tmp_path / "hostile.jsonl"
    append_records(records, [{**good, "kernel": "exits_on_import:fill_lens"},
                             {**good, "kernel": "prints_on_import:fill_lens"}])
    env = {"PYTHONPATH": os.pathsep.join([str(modules), ENV["PYTHONPATH"]])}
    warm = cli("warm", "--manifest", str(records), "--target", "sm_90", "--cache-dir", str(tmp_path / "c"), "--json",
               env=env)
    report = json.loads(warm.stdout)  # nothing the imports printed is on stdout
    assert warm.returncode == 1, warm.stderr  # a failed spec, not the command's exit(0)
    assert "hello from an import" in warm.stderr and "hello" not in warm.stdout
    (failed,) = [r for r in report["specs"] if r["spec"].startswith("exits_on_import:")]
    assert failed["outcome"] == "failed" and "SystemExit" in failed["error"], failed
    status = cli("status", "--manifest", str(records), "--target", "sm_90", "--cache-dir", str(tmp_path / "c"),
                 "--json", env=env)
    assert status.returncode == 5 and json.loads(status.stdout)["missing"] == 1, status.stderr  # not ready
    assert "cannot import exits_on_import: SystemExit: 0" in status.stderr
    built = json.loads(cli("warm", "--manifest", str(records), "--target", "sm_90", "--cache-dir",
                           str(tmp_path / "c"), "--json", env=env).stdout)
    assert {r["spec"].split("/")[0]: r["outcome"] for r in built["specs"]}["prints_on_import:fill_lens"] == "hit"


def test_a_prune_while_triton_reads_a_served_group_never_loses_a_file(tmp_path, monkeypatch):
    """What the cache manager hands Triton is read under the entry's claim: a prune then keeps the entry."""
    from jitwarm.kernels.artifacts import artifact
    from jitwarm.kernels.libraries.triton import cache as triton_cache
    from jitwarm.kernels.libraries.triton import driver

    cache = KernelCache(root=tmp_path / "cache", layers=())
    triton_key, group = "ab" * 32, "fill_lens.json"
    art = artifact(triton_cache.served_group(triton_key, group))
    files = {group: b'{"name": "fill_lens"}', "fill_lens.cubin": b"\x7fELF a cubin", "fill_lens.ptx": b"// ptx"}

    def captured(staging):  # what a server's Triton compile put, captured as the cache manager does
        for name, data in files.items():
            (staging / name).write_bytes(data)
        driver.write_group(staging, group, list(files))

    assert art.get_or_build(cache, capture=captured).outcome == "built"
    triton_cache.use_cache(cache)
    monkeypatch.setattr(triton_cache, "_cache", lambda: cache)
    real_copy, pruned = triton_cache.CacheManager._copy_group, []

    def prune_then_copy(self, entry):  # the race made certain: a full prune while the claim is held
        pruned.append(cache.prune(max_bytes=0))
        return real_copy(self, entry)

    monkeypatch.setattr(triton_cache.CacheManager, "_copy_group", prune_then_copy)
    handed = triton_cache.CacheManager(triton_key).get_group(group)
    assert list(pruned[0].skipped_locked) == [art.key] and not pruned[0].removed
    assert {child: Path(path).read_bytes() for child, path in handed.items()} == files
    # Once handed over, the entry may go: Triton reads its own copies (CompiledKernel reads them right after)
    monkeypatch.setattr(triton_cache.CacheManager, "_copy_group", real_copy)
    again = triton_cache.CacheManager(triton_key).get_group(group)
    assert cache.prune(max_bytes=0).removed and art.lookup(cache) is None
    assert {child: Path(path).read_bytes() for child, path in again.items()} == files


def test_a_captured_group_is_checked_before_it_is_sealed(tmp_path):
    from jitwarm.cache import BuildError
    from jitwarm.kernels.artifacts import artifact
    from jitwarm.kernels.libraries.triton import cache as triton_cache
    from jitwarm.kernels.libraries.triton import driver

    cache = KernelCache(root=tmp_path / "cache", layers=())
    art = artifact(triton_cache.served_group("cd" * 32, "k.json"))

    def not_a_cubin(staging):
        (staging / "k.json").write_text("{}")
        (staging / "k.cubin").write_bytes(b"not an ELF image")
        driver.write_group(staging, "k.json", ["k.json", "k.cubin"])

    with pytest.raises(BuildError, match="k.cubin is not a cubin"):
        art.get_or_build(cache, capture=not_a_cubin)
    assert art.lookup(cache) is None

