"""vLLM 0.33.0's compile caches in the zero-JIT-boot flow: captured, restored by prestart, refused, counted.

A first worker start (``workers/vllm_caches_worker.py``, the real wheel, loaded by vLLM's own
``load_general_plugins()``) writes vLLM's torch.compile tree with vLLM's own functions where they import without a
GPU and hand-lays the rest in vLLM's layout (the worker's docstring says which is which: torch.compile inside
vLLM cannot run on this CPU box), then runs the real V1 ``GPUModelRunner.capture_model`` through the plugin with the
device and the parallel groups as recording fakes (the ONLY fakes; the runner is vLLM's class made without its
``__init__``). With ``JITWARM_RECORD`` the plugin stores the new units; ``prestart`` restores them into a fresh
``VLLM_CACHE_ROOT`` (the node's env factors computed by vLLM's own ``compile_factors()`` in a child) or refuses
them, exit 4, naming the env factor that differs; a second start whose config differs is named in the ledger.
The three slow processes after the first run at once. vLLM's AOT loader itself is run with vLLM's CPU build
(``workers/vllm_aot_worker.py``): the plugin's ``finalize_loading`` makes it load a torch backend's artifact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_wheel

WORKER = Path(__file__).resolve().parent / "workers" / "vllm_caches_worker.py"
AOT_WORKER = WORKER.with_name("vllm_aot_worker.py")


def _env(tmp: Path, root: str, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JITWARM_", "VLLM_", "TRITON_", "TORCHINDUCTOR_"))}
    return {**base, **vllm_wheel.vllm_env(), "JITWARM_CACHE_DIR": str(tmp / "cache"), "JITWARM_JOBS": "1",
            "VLLM_CACHE_ROOT": str(tmp / root), "VLLM_PLUGINS": "jitwarm", "PYTHONWARNINGS": "ignore", **extra}


def _start(tmp: Path, name: str, tag: str, **extra: str) -> subprocess.Popen:
    env = _env(tmp, "server", JITWARM_RECORD=str(tmp / f"{name}.jsonl"), JITWARM_LEDGER=str(tmp / f"{name}.json"),
               **extra)
    return subprocess.Popen([sys.executable, str(WORKER), str(tmp / f"{name}.out.json"), tag], env=env,
                            stdout=subprocess.DEVNULL, stderr=(tmp / f"{name}.err").open("w"), text=True)


def _prestart(tmp: Path, root: str, **extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "jitwarm.precompile", "prestart", "--manifest", str(tmp / "first.jsonl"),
               "--cache-dir", str(tmp / "cache"), "--offline"]
    return subprocess.Popen(command, env=_env(tmp, root, **extra), cwd=tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The first start, then at once: prestart on a fresh node, prestart with another env factor, a second start."""
    tmp = tmp_path_factory.mktemp("vllm_caches")
    first = _start(tmp, "first", "config-a")
    assert first.wait(timeout=900) == 0, (tmp / "first.err").read_text()[-6000:]
    node = _prestart(tmp, "node")
    other = _prestart(tmp, "other", VLLM_BATCH_INVARIANT="1")
    second = _start(tmp, "second", "config-b")  # the same node, the model's config changed: a new hash directory
    done = {"node": node.communicate(timeout=900), "other": other.communicate(timeout=900)}
    assert second.wait(timeout=900) == 0, (tmp / "second.err").read_text()[-6000:]
    return {"tmp": tmp, "first": json.loads((tmp / "first.out.json").read_text()),
            "node": (node.returncode, *done["node"]), "other": (other.returncode, *done["other"]),
            "ledger": json.loads((tmp / "first.json").read_text()),
            "second": json.loads((tmp / "second.json").read_text())}


def test_the_plugin_captures_vllms_units_after_capture_model(runs):
    first = runs["first"]
    assert first["captured"] == {"vllm_compile": 3}  # its prefix and AOT directories, Inductor's unit in its tree
    records = [json.loads(line) for line in (runs["tmp"] / "first.jsonl").read_text().splitlines()]
    units = {(r["library"], r["unit"]) for r in records}
    key = first["wrote"]["hash_key"]
    assert ("vllm_compile", f"{key}/rank_0_0/backbone") in units
    assert any(lib == "vllm_compile" and unit.startswith("torch_aot_compile/") for lib, unit in units)
    assert any(lib == "vllm_compile" and unit.startswith(f"{key}/rank_0_0/inductor_cache/fxgraph/")
               for lib, unit in units)
    assert all(r["under"] == "vllm" for r in records)
    backbone = next(r for r in records if r["unit"] == f"{key}/rank_0_0/backbone")
    fingerprint = backbone["fingerprint"]
    assert fingerprint["vllm"] == vllm_wheel.VLLM_VERSION and fingerprint["vllm:env:VLLM_PLUGINS"] == '["jitwarm"]'
    assert {"vllm:config_hash", "vllm:code_hash", "vllm:compiler_hash", "torch", "triton", "arch"} <= set(fingerprint)
    # the drain still runs before each capture inside the real capture_model, which both runners have wrapped
    calls = first["calls"]
    assert calls.index("barrier[jitwarm]") < calls.index("forward(FULL 16 capture)")
    assert first["wrapped"] == {"v1": True, "v2": True}


def test_the_v2_runners_profiling_capture_reports_no_ledger(monkeypatch):
    """``capture_model(profile_only=True)`` (``v1/worker/gpu/cudagraph_utils.py:1000``) captures graphs vLLM throws
    away: the wrap reports after the real call only (vLLM's method is a stand-in here)."""
    from jitwarm.precompile import ledger
    from jitwarm.precompile.servers.vllm import plugin

    reports = []
    monkeypatch.setattr(ledger, "report_after_capture", lambda *a: reports.append(a))
    wrapped = plugin._capture_model(lambda self, *, profile_only=False: 7)
    assert wrapped(object(), profile_only=True) == 7 and reports == []
    assert wrapped(object()) == 7 and len(reports) == 1


def test_prestart_restores_them_into_a_fresh_cache_root_where_vllm_looks(runs):
    code, out, err = runs["node"]
    assert code == 0, err
    tmp, key = runs["tmp"], runs["first"]["wrote"]["hash_key"]
    for rel in (f"{key}/rank_0_0/backbone/vllm_compile_cache.py", f"{key}/rank_0_0/backbone/cache_key_factors.json",
                f"{key}/rank_0_0/inductor_cache/fxgraph"):
        assert (tmp / "node" / "torch_compile_cache" / rel).exists(), rel
    src = tmp / "server" / "torch_compile_cache" / key / "rank_0_0" / "backbone"
    dst = tmp / "node" / "torch_compile_cache" / key / "rank_0_0" / "backbone"
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())
    assert (dst / "vllm_compile_cache.py").read_bytes() == (src / "vllm_compile_cache.py").read_bytes()
    assert list((tmp / "node" / "torch_compile_cache" / "torch_aot_compile").glob("*/rank_0_0/model"))
    assert "placed 3" in err


def test_prestart_refuses_them_where_a_vllm_cache_key_factor_differs_naming_it(runs):
    code, out, err = runs["other"]
    assert code == 4, err
    assert err.startswith("jitwarm: error: vllm_compile unit ")
    assert "recorded with vllm:env:VLLM_BATCH_INVARIANT 'false', this node has 'true'" in err
    assert err.count("\n") == 1 and "--allow-fingerprint-mismatch" in err
    assert not (runs["tmp"] / "other").exists()  # refused before anything was restored


def test_the_ledger_counts_them_and_names_the_factor_a_later_start_missed_by(runs):
    first = runs["ledger"]["families"]["vllm_compile"]
    assert first["compiled"] == 2 and first["present_at_start"] == 0 and first["served"] == 0
    assert runs["ledger"]["families"]["inductor"]["keys"] == [f"fxgraph fq3{_tag_hash('config-a')}"]
    second = runs["second"]
    vllm = second["families"]["vllm_compile"]
    assert vllm["present_at_start"] == 2 and vllm["compiled"] == 2  # its own prefix and AOT directories
    named = [k for k in vllm["keys"] if "/rank_0_0/backbone" in k]
    assert len(named) == 1 and named[0].endswith(
        f"/rank_0_0/backbone (vllm:config_hash '{_tag_hash('config-a')}' (now '{_tag_hash('config-b')}'))")
    # the new config's FX graph, written into vLLM's tree, is Inductor's unit: a compile of Inductor's too
    assert [e["family"] for e in second["compiled_after_restore"]] == ["inductor", "vllm_compile"]
    assert f"fxgraph fq3{_tag_hash('config-b')}" in second["compiled_after_restore"][0]["keys"]


def _tag_hash(tag: str) -> str:
    import hashlib

    return hashlib.sha256(tag.encode()).hexdigest()[:10]


def test_vllms_own_aot_loader_loads_a_torch_backends_artifact_once_the_plugin_gave_it_finalize_loading(vllm_cpu,
                                                                                                       tmp_path):
    """vLLM's CPU build (its venv, ``workers/vllm_aot_worker.py``): vLLM's loader fails on an artifact torch compiled
    with an AOTAutograd backend, naming ``finalize_loading``; the plugin gives torch's wrapper one where the config
    compiles with a torch backend (not vLLM's own, not ``eager``) and torch has none, says so once, and then vLLM's
    loader loads the artifact, counts it, and it computes what the function computes."""
    env = vllm_cpu.env(tmp_path / "node")
    del env["VLLM_USE_AOT_COMPILE"]  # vLLM's default: on (envs.py:377-386)
    out = tmp_path / "aot.json"
    proc = subprocess.run([str(vllm_cpu.python), str(AOT_WORKER), str(out), str(tmp_path / "work")], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(out.read_text())
    assert seen["needed"]["VLLM_COMPILE inductor"] is None and seen["needed"]["DYNAMO_TRACE_ONCE eager"] is None
    assert "has no finalize_loading" in seen["needed"]["DYNAMO_TRACE_ONCE aot_eager"]
    assert seen["before"] is False
    assert any("Compiling model again due to a load failure" in line and "'finalize_loading'" in line
               for line in seen["before_lines"]), seen["before_lines"]
    assert seen["torch_handles_it"] == [None, False]  # a torch that defines it is left alone
    assert seen["applied"] == [True, True] and seen["after"] is True
    assert seen["loads_counted"] == 1 and seen["same_output"] is True
    said = [line for line in seen["after_lines"] if "given one that does nothing" in line]
    assert len(said) == 1 and any("Directly load AOT compilation" in line for line in seen["after_lines"])


# -- without the wheel: where each family is under vLLM, and what a complete unit of vLLM's tree is ----------------


def test_under_vllm_each_family_resolves_the_directory_vllm_uses(tmp_path):
    """vLLM's tree is the ``vllm_compile`` family's, with the Inductor and Triton directories vLLM sets in it; the
    ``inductor`` and ``triton`` families are those libraries' own directories, where they write when vLLM does not
    redirect them (vLLM's CPU build without AOT compile: issue #30). The vLLM room says so: the libraries know no
    server."""
    import getpass

    from jitwarm.kernels.libraries.jit_caches.census import library
    from jitwarm.precompile.servers import cache_dirs

    def at(name, environ, server):
        return library(name).root(environ, cache_dirs(server, environ))

    env = {"VLLM_CACHE_ROOT": str(tmp_path / "v"), "TMPDIR": str(tmp_path / "t"), "TRITON_HOME": str(tmp_path / "h")}
    tree = tmp_path / "v" / "torch_compile_cache"
    assert at("vllm_compile", env, "vllm") == tree
    assert at("vllm_modelinfo", env, "vllm") == tmp_path / "v" / "modelinfos"  # registry.py:969
    assert at("inductor", env, "vllm") == tmp_path / "t" / f"torchinductor_{getpass.getuser()}"
    assert at("triton", env, "vllm") == tmp_path / "h" / ".triton" / "cache"
    assert at("deep_gemm", env, "vllm") == tmp_path / "v" / "deep_gemm"  # utils/deep_gemm.py:281-285
    assert at("vllm_compile", {"XDG_CACHE_HOME": str(tmp_path / "x")}, "vllm") == \
        tmp_path / "x" / "vllm" / "torch_compile_cache"  # envs.py:340-344, :714-719
    assert library("vllm_compile").root(env) is None  # the library knows no server ...
    assert at("vllm_compile", env, "") == tree  # ... and a process that has not imported vLLM yet finds its tree
    assert at("deep_gemm", {**env, "DJ_JIT_CACHE_DIR": str(tmp_path / "dj")}, "vllm") == tmp_path / "v" / "deep_gemm"
    # A directory vLLM set in its tree (compiler_interface.py:29-42) is the tree's; one outside is the user's.
    ours = {"TORCHINDUCTOR_CACHE_DIR": str(tree / "h" / "rank_0_0" / "inductor_cache"),
            "TRITON_CACHE_DIR": str(tree / "h" / "rank_0_0" / "triton_cache")}
    assert at("inductor", {**env, **ours}, "vllm") == at("inductor", env, "vllm")
    assert at("triton", {**env, **ours}, "vllm") == at("triton", env, "vllm")
    mine = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine"), "TRITON_CACHE_DIR": str(tmp_path / "mine-t")}
    assert at("inductor", {**env, **mine}, "vllm") == tmp_path / "mine"
    assert at("triton", {**env, **mine}, "vllm") == tmp_path / "mine-t"
    off = {**env, "VLLM_DISABLE_COMPILE_CACHE": "1", **ours}
    assert at("vllm_compile", off, "vllm") is None  # and the tree's directories are plain ones again
    assert at("inductor", off, "vllm") == tree / "h" / "rank_0_0" / "inductor_cache"
    assert at("inductor", {**env, "SGLANG_CACHE_DIR": str(tmp_path / "sg")}, "sglang") == \
        tmp_path / "sg" / "inductor"  # sglang's as before


def test_the_units_of_vllms_tree_are_the_complete_ones_each_family_named_by_its_path(tmp_path):
    import jit_cache_trees as trees

    from jitwarm.kernels.libraries.jit_caches.census import library

    tree = tmp_path / "torch_compile_cache"
    rank = tree / "3f9a0c1b2d" / "rank_0_0"
    trees.vllm_compile(tree)  # backbone/: factors and computation_graph.py
    trees.write(rank / "eagle_head" / "cache_key_factors.json", "{}")  # a prefix vLLM is still compiling
    index = "{((1, 8), 0, 'inductor_standalone'): {'cache_key': 'k', 'graph_handle': ('artifact_a', '/x')}}"
    trees.write(rank / "mtp" / "computation_graph.py", "#")
    trees.write(rank / "mtp" / "vllm_compile_cache.py", index)  # names an artifact not there (as save_to_file)
    aot = tree / "torch_aot_compile" / ("ab" * 32)
    trees.write(aot / "rank_0_0" / "model", b"aot")
    trees.write(aot / "rank_1_0" / "model.4242.tmp", b"a save in flight")  # decorators.py:748-750
    trees.inductor(rank / "inductor_cache")
    trees.inductor(aot / "inductor_cache")
    trees.triton(rank / "triton_cache")
    trees.triton(aot / "inductor_cache" / "triton" / "0")
    vllm = library("vllm_compile")
    units = vllm.present(tree)
    by_rules: dict[str, list[str]] = {}
    for unit in units:
        by_rules.setdefault(vllm.part(unit).name, []).append(unit)
    assert sorted(by_rules["vllm_compile"]) == ["3f9a0c1b2d/rank_0_0/backbone",
                                                f"torch_aot_compile/{'ab' * 32}/rank_0_0"]
    inductor = by_rules["inductor"]
    assert len(inductor) == 8 and all("/inductor_cache/" in unit and "/triton/" not in unit for unit in inductor)
    triton = by_rules["triton"]
    assert sorted(unit.rsplit("/", 1)[0] for unit in triton) == [
        "3f9a0c1b2d/rank_0_0/triton_cache", f"torch_aot_compile/{'ab' * 32}/inductor_cache/triton/0"]
    trees.write(rank / "mtp" / "artifact_a", b"now it is")
    assert "3f9a0c1b2d/rank_0_0/mtp" in library("vllm_compile").present(tree)


@pytest.mark.parametrize("under", ["vllm", ""], ids=["under-vllm", "a-script"])
def test_prestart_warns_where_this_nodes_vllm_will_not_load_its_restored_aot_artifacts(tmp_path, monkeypatch, capsys,
                                                                                       under):
    """The vLLM room says so where its CPU build cannot load its own AOT artifact: the server runs without jitwarm's
    plugin (``VLLM_PLUGINS`` leaves it out, or ``JITWARM_VLLM_PLUGIN=0``), which makes the artifact load; for units
    a vLLM server recorded and for units a script that ran vLLM's code itself recorded (``under`` empty). Not with
    the plugin loaded (vLLM's default loads every plugin), not with AOT compile off."""
    import hashlib

    from jitwarm.kernels.libraries.jit_caches.backend import unit_spec
    from jitwarm.kernels.libraries.jit_caches.census import library
    from jitwarm.precompile.handover import say_unloadable
    from jitwarm.precompile.manifest import append_records, unit_record
    from jitwarm.precompile.plan import WarmPlan

    unit = "torch_aot_compile/3f2a/rank_0_0"
    spec = unit_spec(library("vllm_compile"), unit, {f"{unit}/model": hashlib.sha256(b"m").hexdigest()},
                     {"vllm": "0.32.0"}, "cpu", under)
    manifest = tmp_path / "m.jsonl"
    append_records(manifest, [unit_record(spec)])
    plan = WarmPlan.empty().with_manifests([manifest])
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    said = []
    for plugins, inert in ((None, None), ("other,jitwarm", None), ("other", None), (None, "0")):
        for name, value in (("VLLM_PLUGINS", plugins), ("JITWARM_VLLM_PLUGIN", inert)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        say_unloadable(plan)
        said.append(capsys.readouterr().err)
    assert said[:2] == ["", ""]  # the plugin loaded: it makes the artifact load
    for err in said[2:]:
        assert "1 AOT artifact(s) of vllm_compile restored, but vLLM's CPU build cannot load its own AOT artifact " \
               "without jitwarm's vLLM plugin" in err, err
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")
    say_unloadable(plan)
    assert capsys.readouterr().err == ""
