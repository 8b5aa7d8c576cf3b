"""The start-up ledger: what a served start still compiled, per family, by each library's own signal.

Real things: Inductor's ``torch.compile`` on the CPU in a child process whose cache ``prestart`` restored (its
``counters["inductor"]``); Triton's real JIT for sm_90 through jitwarm's cache manager, on a driver that only
reports that target (the mock, ``workers/gpu_stub.py``); the sglang 0.5.23 wheel's ``load_plugins()`` and loader,
with the device module and the TP group mocked as in ``test_sglang_plugin.py`` and ``ModelRunner.init_cuda_graphs``
a stand-in that captures through sglang's own backends (its body needs a model); the families without a hit
signal as trees in their library's layout (``jit_cache_trees.py``). The child processes all start at once.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jit_cache_trees
import pytest
from precompile_fixtures import jitwarm

from jitwarm.precompile import ledger

WORKER = Path(__file__).with_name("workers") / "ledger_worker.py"
WORKERS = str(WORKER.parent)
INDUCTOR_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "JITWARM_RECORD_CACHES": "inductor"}
TRITON_ENV = {"PYTHONPATH": os.pathsep.join([WORKERS, os.environ.get("PYTHONPATH", "")]),
              "TRITON_DEFAULT_FP_FUSION": "1", "SERVER_KERNELS_BUCKETS": "1"}  # fill_lens BLOCK 1, scaled_copy


def private_caches(root: Path) -> dict[str, str]:
    """Every family's cache variable pointed under ``root``: other processes' compiles in the box's default caches
    (~/.triton/cache, /tmp/torchinductor_<user>) are not this start's."""
    return jit_cache_trees.env_for(root)


@pytest.fixture
def own_caches(monkeypatch, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("caches")
    for var, path in private_caches(root).items():
        monkeypatch.setenv(var, path)
    return root


def start(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env})


def answer(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.fixture(scope="module")
def starts(request, tmp_path_factory) -> dict:
    """Every child start of this module, begun together; name -> (its JSON answer, its stderr)."""
    tmp = tmp_path_factory.mktemp("ledger")
    manifest, cache, own, restored = tmp / "m.jsonl", tmp / "cache", tmp / "own", tmp / "restored"
    caches = private_caches(tmp / "caches")
    # Inductor keeps its precompiled headers in $TMPDIR/torchinductor_<user> whatever TORCHINDUCTOR_CACHE_DIR says
    # (torch/_inductor/codecache.py, _HEADER_DIR): the children's own $TMPDIR, not the box's.
    caches["TMPDIR"] = str(tmp / "tmpdir")
    Path(caches["TMPDIR"]).mkdir()
    triton_env = {**caches, **TRITON_ENV, "JITWARM_CACHE_DIR": str(tmp / "triton-cache")}
    inductor_cold = start("inductor", "record", str(manifest), str(cache),
                          env={**caches, **INDUCTOR_ENV, "TORCHINDUCTOR_CACHE_DIR": str(own)})
    triton = start("triton", env=triton_env)
    sglang = None
    try:
        sglang_env = request.getfixturevalue("sglang_env")
    except pytest.skip.Exception:
        sglang_env = None
    if sglang_env is not None:
        jit_cache_trees.tilelang(tmp / "tilelang", key="restored")  # a unit prestart would have put there
        base = {k: v for k, v in os.environ.items() if not k.startswith(("JITWARM_", "SGLANG_"))}
        sglang = subprocess.Popen(
            [sys.executable, str(WORKER), "sglang"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**base, **sglang_env, "PYTHONPATH": os.pathsep.join([sglang_env["PYTHONPATH"], WORKERS]),
                 "SGLANG_PLUGINS": "jitwarm", "PYTHONWARNINGS": "ignore", "JITWARM_CACHE_DIR": str(tmp / "sgl"),
                 "TILELANG_CACHE_DIR": str(tmp / "tilelang"), "SGLANG_JIT_CACHE_DIR": str(tmp / "sgl-jit"),
                 "SGLANG_CACHE_DIR": str(tmp / "sglang-cache"), "JITWARM_LEDGER": str(tmp / "ledger.json")})
    runs = {"inductor_cold": answer(inductor_cold)}
    ready = jitwarm("prestart", "--manifest", str(manifest), "--cache-dir", str(cache), "--offline",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(restored)})
    assert ready.returncode == 0, ready.stderr
    inductor_warm = start("inductor", "serve", env={**caches, **INDUCTOR_ENV, "TORCHINDUCTOR_CACHE_DIR": str(restored)})
    runs["triton"] = answer(triton)
    runs["inductor_warm"] = answer(inductor_warm)
    if sglang is not None:
        runs["sglang"] = answer(sglang)
    runs["tmp"] = tmp
    return runs


def test_a_restored_inductor_cache_is_served_and_a_different_function_is_compiled_by_its_key(starts):
    cold = starts["inductor_cold"][0]["ledger"]["families"]["inductor"]
    assert (cold["served"], cold["compiled"]) == (0, 1)
    assert cold["present_at_start"] == 0 and len(cold["keys"]) == 1  # the FX graph key it wrote
    (warm, err) = starts["inductor_warm"]
    inductor = warm["ledger"]["families"]["inductor"]
    assert (inductor["served"], inductor["compiled"]) == (1, 1)  # f from the restored cache; g compiled now
    assert inductor["present_at_start"] >= 3 and inductor["root"] == str(starts["tmp"] / "restored")
    [key] = inductor["keys"]
    assert key.startswith("fxgraph f") and key != cold["keys"][0]  # g's graph, not the restored one
    assert warm["ledger"]["compiled_after_restore"] == [
        {"family": "inductor", "keys": [key], "present_at_start": inductor["present_at_start"]}]
    line = next(x for x in warm["lines"] if x.startswith("jitwarm: ledger: inductor compiled 1 although"))
    assert key in line and str(starts["tmp"] / "restored") in line
    assert "jitwarm: ledger: inductor: served from cache 1, compiled now 1 (" in warm["lines"][0]


def test_jitwarms_triton_manager_counts_what_it_compiled_and_what_it_served(starts):
    result = starts["triton"][0]
    cold = result["cold"]["families"]["triton"]
    assert cold["signal"] == "jitwarm's Triton cache manager"
    assert (cold["served"], cold["compiled"]) == (0, 2)
    assert sorted(k.split()[0] for k in cold["keys"]) == ["fill_lens", "scaled_copy"]
    both = result["ledger"]["families"]["triton"]  # the reloaded kernels' compiles: each found in the cache
    assert (both["served"], both["compiled"], both["keys"]) == (2, 2, cold["keys"])
    assert result["ledger"]["compiled"] == 2
    assert "jitwarm: ledger: triton: served from cache 2, compiled now 2 (jitwarm's Triton cache manager)" in (
        result["lines"][1])


def test_the_sglang_plugin_writes_the_ledger_after_the_last_capture(starts):
    if "sglang" not in starts:
        pytest.skip("the sglang wheel is not installable here")
    result, err = starts["sglang"]
    assert [name for name, _ in result["captured"]] == ["full", "breakable", "tc_piecewise"]
    written = json.loads((starts["tmp"] / "ledger.json").read_text())
    families = written["families"]
    assert list(families) == sorted(ledger.FAMILIES)
    assert (families["load_jit"]["served"], families["load_jit"]["compiled"]) == (1, 1)
    assert families["load_jit"]["keys"] == ["sgl_kernel_jit_new build-4567"]
    assert families["load_jit"]["present_at_start"] == 1  # the build published before the start
    tilelang = families["tilelang"]
    assert tilelang["served"] is None and tilelang["compiled"] == 1 and tilelang["present_at_start"] == 1
    assert tilelang["keys"] == ["0.1.12/linux-x86_64/kernels/compiled-in-capture"]
    assert families["triton"]["signal"] == "jitwarm's Triton cache manager"  # the plugin set the manager
    assert written["compiled"] == 2
    logged = [x.split(" ", 3)[3] for x in err.splitlines() if x.startswith("LOG jitwarm.ledger ")]
    assert len(logged) == len(ledger.FAMILIES) + 2, logged  # one line per family, a warning per family that
    load_jit, tilelang = logged[-2:]                         # compiled although units of it were there
    assert load_jit.startswith("jitwarm: ledger: load_jit compiled 1 although 1 unit(s) of load_jit were present "
                               "at start") and "sgl_kernel_jit_new build-4567" in load_jit
    assert tilelang.startswith("jitwarm: ledger: tilelang compiled 1 although 1 unit(s) of tilelang were "
                               "present at start") and "compiled-in-capture" in tilelang
    assert [w["family"] for w in written["compiled_after_restore"]] == ["load_jit", "tilelang"]
    # the lines come after the last graph: the hook ran around sglang's (stand-in) init_cuda_graphs
    assert "Applied 1 hook(s) to sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs" in err


def test_a_family_without_a_hit_signal_is_counted_from_the_new_units_in_its_cache(own_caches):
    root = own_caches / "deep_gemm"
    jit_cache_trees.deep_gemm(root, digest="0restored")
    start_snapshot = ledger.Ledger()
    jit_cache_trees.deep_gemm(root, digest="1compiled")
    (root / "cache" / "sm90_fp8_gemm_1d2d.2torn").mkdir()  # a compile not committed: no unit yet
    (root / "cache" / "sm90_fp8_gemm_1d2d.2torn" / "kernel.cu").write_text("// no cubin, no .committed yet")
    count = start_snapshot.report().family("deep_gemm")
    assert (count.served, count.compiled, count.present) == (None, 1, 1)
    assert count.keys == ("cache/sm90_fp8_gemm_1d2d.1compiled",)
    assert count.line().startswith("jitwarm: ledger: deep_gemm: compiled now 1, served from cache unknown (no hit "
                                   f"signal: counted from the new units in {root}, 1 unit(s) there at start)")


@pytest.mark.parametrize("where", ["a directory", "under a file", "unwritable"])
def test_a_ledger_path_that_cannot_be_written_is_one_warning_and_the_start_goes_on(own_caches, monkeypatch, tmp_path,
                                                                                     caplog, where):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = {"a directory": tmp_path, "under a file": blocker / "ledger.json",
            "unwritable": Path("/proc/ledger.json")}[where]
    monkeypatch.setenv("JITWARM_LEDGER", str(path))
    with caplog.at_level(logging.WARNING, logger="jitwarm"):
        report = ledger.report_after_capture(ledger.Ledger())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"jitwarm: ledger not written to JITWARM_LEDGER={path}: ")
    assert report.compiled == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no temporary left behind


@pytest.mark.parametrize("kind", ["fifo", "link to a file", "link to /dev/null", "device"])
def test_a_ledger_path_that_is_no_regular_file_is_never_replaced(own_caches, monkeypatch, tmp_path, caplog, kind):
    """``JITWARM_LEDGER`` is treated like an export target (issue #31, N6): a FIFO, a device or a link there gets
    one warning and stays what it was (the rename used to replace it, ``/dev/null`` itself when run as root)."""
    path, target = tmp_path / "ledger.json", tmp_path / "real.json"
    target.write_text("theirs")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    else:
        path.symlink_to(target if kind == "link to a file" else Path("/dev/null"))
    before = path.lstat()
    monkeypatch.setenv("JITWARM_LEDGER", str(path))
    with caplog.at_level(logging.WARNING, logger="jitwarm"):
        ledger.report_after_capture(ledger.Ledger())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "left as it is" in warnings[0], warnings
    after = path.lstat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode) and target.read_text() == "theirs"


def test_the_ledger_file_is_written_whole_and_the_capture_hook_reports_the_same(own_caches, monkeypatch, tmp_path):
    from jitwarm.precompile import CaptureHook, WarmPlan

    root = own_caches / "tilelang"
    monkeypatch.setenv("JITWARM_LEDGER", str(tmp_path / "ledger.json"))
    monkeypatch.setattr(ledger, "_process", None)  # this process's ledger starts with the hook
    hook = CaptureHook(WarmPlan.empty(), device=SimpleNamespace(target="cpu", synchronize=lambda: None),
                       barrier=lambda: None)
    try:
        assert hook.ledger is ledger.begin()
        jit_cache_trees.tilelang(root, key="compiled-now")
        report = ledger.report_after_capture()
        assert hook.ledger_report() == report
    finally:
        hook.close()
    written = json.loads((tmp_path / "ledger.json").read_text())
    assert written == report.as_json() and written["pid"] == os.getpid()
    assert written["families"]["tilelang"]["keys"] == ["0.1.12/linux-x86_64/kernels/compiled-now"]
    assert written["compiled_after_restore"] == []  # nothing of tilelang was there at start
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_importing_the_ledger_imports_no_library():
    code = ("import json, sys, jitwarm.precompile.ledger; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'tvm_ffi', "
            "'sglang'})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          cwd=WORKERS)
    assert json.loads(proc.stdout) == []


def test_a_vllm_compile_after_restore_is_named_by_the_cache_key_factor_that_differs(own_caches):
    """vLLM's tree laid by hand in its layout (``jit_cache_trees.vllm_compile``; the wheel writes one in
    ``test_vllm_caches.py``): a start whose config hash differs writes a new hash directory, named with that factor."""
    tree = jit_cache_trees.home(own_caches, "vllm_compile") / "torch_compile_cache"
    jit_cache_trees.vllm_compile(tree, digest="0restored0")  # config_hash "c0"
    start_snapshot = ledger.Ledger()
    new = tree / "1compiled1" / "rank_0_0" / "backbone"
    jit_cache_trees.write(new / "cache_key_factors.json", json.dumps(
        {"env": {"VLLM_TARGET_DEVICE": "cuda"}, "config_hash": "c9", "code_hash": "c1", "compiler_hash": "c2"}))
    jit_cache_trees.write(new / "computation_graph.py", "#")
    report = start_snapshot.report()
    count = report.family("vllm_compile")
    assert (count.served, count.compiled, count.present) == (None, 1, 1)  # vLLM's counter is not imported here
    assert count.keys == ("1compiled1/rank_0_0/backbone (vllm:config_hash 'c0' (now 'c9'))",)
    assert report.warnings()[0].startswith("jitwarm: ledger: vllm_compile compiled 1 although 1 unit(s) of "
                                           f"vllm_compile were present at start in {tree}: 1compiled1/")


def test_the_ledger_reads_only_the_rooms_public_names():
    """#21 review: no layout of a library in the ledger, no private name of another module imported by it."""
    import ast

    tree = ast.parse(Path(ledger.__file__).read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("jitwarm") for alias in node.names]
    assert imported and not [name for name in imported if name.startswith("_")]
    from jitwarm.kernels.libraries.jit_caches.inductor import graph_keys

    assert graph_keys(["fxgraph/q3/fq3abc/e1", "3f9a0c1b2d/rank_0_0/inductor_cache/fxgraph/z1/fz1def/e2",
                       "aotautograd/ae/x"]) == ["fq3abc", "fz1def"]
