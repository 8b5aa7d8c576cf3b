"""The documented pod runs as written against a real vLLM server (vLLM's CPU build, tests/vllm_cpu.py).

The vLLM pod of docs/deployment.md ("In the server: the vLLM plugin") is read from the docs' YAML: its init
container's command and env, and its server container's env, are taken as written. Each container gets a HOME, TMPDIR
and XDG_CACHE_HOME of its own (what two containers of one image have); only the volume is shared. What is
substituted, and only that: the volume's ``mountPath`` (``/cache``) by a folder both see; the image's bundle
(``/opt/jitwarm/kernels.tar``) by the one made in staging (``jitwarm capture --export``); the server's line (the
pod's ``args``, a GPU model at ``-tp 8``) by the tiny model's CPU line on a loopback port; the GPU arch of
``--target`` (``sm_90``) by this box's (``cpu``). vLLM runs on its defaults (AOT compile on), as the pod does: the
restored starts load vLLM's own AOT artifact.

One module fixture: the run's one capture (``vllm_captured``, shared with tests/test_real_server.py, whose restored
start is the bundle alone: ``prestart --bundle B --offline``), then the pod: prestart, then a start. The restored
start must compile nothing: the ledger's total is 0, it names no restore elsewhere, and no compiled artifact appears
in any cache root of the server's container during it.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import vllm_cpu as server
import yaml
from compiled_files import COMPILED_SUFFIXES

from jitwarm.precompile.capture import ServerProcess, answers

DOCS = Path(__file__).resolve().parents[1] / "docs"
VOLUME, BUNDLE_IN_IMAGE, GPU_ARCH = "/cache", "/opt/jitwarm/kernels.tar", "sm_90"


def documented_pod() -> dict:
    """The vLLM pod with a bundle in docs/deployment.md, as the YAML parser reads it."""
    text = (DOCS / "deployment.md").read_text()
    section = text[text.index("## In the server: the vLLM plugin"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    return next(d for d in yaml.safe_load_all(block) if d and d["kind"] == "Pod")


def image_env(vllm_cpu, own: Path, **extra: str) -> dict[str, str]:
    """The image's environment on a node whose own caches are ``own``: vLLM's defaults (AOT compile on), as the
    documented pod runs it."""
    return server.on_defaults(vllm_cpu).env(own, **extra)


def container_env(container: dict, own: Path, shared: Path, vllm_cpu) -> dict[str, str]:
    """The container's environment: the image's (HOME, TMPDIR, XDG_CACHE_HOME its own), then the YAML's env."""
    env = image_env(vllm_cpu, own)
    for var in ("VLLM_CACHE_ROOT", "JITWARM_CACHE_DIR"):  # the image sets neither: their defaults are under HOME
        env.pop(var)
    for item in container.get("env", []):
        env[item["name"]] = str(item["value"]).replace(VOLUME, str(shared), 1) if str(item["value"]).startswith(
            VOLUME) else str(item["value"])
    return env


def cache_files(roots: list[Path]) -> dict[str, int]:
    found = {}
    for root in roots:
        for path in root.rglob("*") if root.is_dir() else ():
            if path.is_file():
                found[str(path)] = path.stat().st_size
    return found


def compiled(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return sorted(f for f, size in after.items() if before.get(f) != size and "/locks/" not in f
                  and (f.endswith(COMPILED_SUFFIXES) or "/fxgraph/" in f or "/aotautograd/" in f)
                  and not f.endswith(("ledger.json", "restore-receipt.json")) and "/jitwarm/v1/" not in f)


def start(vllm_cpu, env: dict[str, str], folder: Path, timeout: float = 900) -> dict:
    """A real ``vllm serve`` of the tiny model with ``env`` until ready, one completion, stopped."""
    port = server.free_port()
    log = folder / "server.log"
    proc = ServerProcess.start(vllm_cpu.serve(port), env, log)
    try:
        while not answers(f"http://127.0.0.1:{port}/health"):
            if proc.exited() is not None or time.monotonic() - proc.started > timeout:
                raise AssertionError("vllm serve did not get ready:\n" + "\n".join(proc.tail(40)))
            time.sleep(0.25)
        answer = server.complete(port, vllm_cpu.model)
    finally:
        proc.stop()
    return {"answer": answer, "log": log.read_text(errors="replace")}


@pytest.fixture(scope="module")
def pod(vllm_cpu, vllm_captured, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_pod")
    bundle = vllm_captured["bundle"]  # capture --export in staging: the bundle carries its manifest

    spec = documented_pod()["spec"]
    init, serving = spec["initContainers"][0], spec["containers"][0]
    shared = tmp / "volume"
    shared.mkdir()
    argv = [*init["command"], *init.get("args", [])]
    own = argv[1:argv.index("--")]
    own = [str(bundle) if a == BUNDLE_IN_IMAGE else "cpu" if a == GPU_ARCH else a for a in own]
    line = vllm_cpu.serve(server.free_port())
    init_env = container_env(init, tmp / "init-container", shared, vllm_cpu)
    prestart = vllm_cpu.jitwarm(*own, "--json", "--", *line, env=init_env)
    assert prestart.returncode == 0, prestart.stderr

    server_env = container_env(serving, tmp / "server-container", shared, vllm_cpu)
    roots = [shared, tmp / "server-container"]
    before = cache_files(roots)
    run = start(vllm_cpu, server_env, tmp)
    ledger_path = Path(server_env["JITWARM_LEDGER"])

    return {"captured": json.loads(vllm_captured["stdout"]), "prestart": json.loads(prestart.stdout),
            "prestart_err": prestart.stderr, "shared": shared, "init_env": init_env, "server_env": server_env,
            "before": before, "after": cache_files(roots), "ledger": json.loads(ledger_path.read_text()), **run}


def test_the_containers_have_their_own_home_and_share_only_the_volume(pod):
    """Each container's own HOME stays its own; the pod's env moves TMPDIR (Inductor's cache) into the volume."""
    init, srv = pod["init_env"], pod["server_env"]
    assert init["HOME"] != srv["HOME"] and init["XDG_CACHE_HOME"] != srv["XDG_CACHE_HOME"]
    assert init["TMPDIR"] == srv["TMPDIR"] and Path(srv["TMPDIR"]).is_relative_to(pod["shared"])


def test_prestart_names_each_familys_destination_on_the_shared_volume(pod):
    restored = pod["prestart"]["restored"]
    # vLLM's AOT tree (its rank directory, Inductor's units it redirected); no precompiled header: capture ran
    # with Inductor's precompiled headers off (TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0), as the pod runs
    assert pod["prestart"]["ready"] is True and restored["vllm_compile"]["placed"] >= 10, pod["prestart"]
    assert restored.get("inductor", {}).get("placed", 0) == 0, pod["prestart"]
    assert all(Path(fam["root"]).is_relative_to(pod["shared"]) for fam in restored.values() if fam.get("placed")), \
        restored
    assert f"vllm_compile: {restored['vllm_compile']['placed']} unit(s) in {pod['shared']}/vllm" in pod["prestart_err"]
    receipt = json.loads(Path(pod["prestart"]["receipt"]).read_text())
    assert receipt["families"]["vllm_compile"]["root"] == restored["vllm_compile"]["root"]


def test_the_documented_pods_server_compiles_nothing(pod):
    ledger = pod["ledger"]
    assert ledger["compiled"] == 0, ledger
    assert ledger["restored_elsewhere"] == []
    assert ledger["families"]["vllm_compile"]["served"] >= 1  # vLLM loaded its AOT artifact
    assert server.LOADED in pod["log"] and server.LOAD_FAILED not in pod["log"]
    assert compiled(pod["before"], pod["after"]) == []
    assert "jitwarm: restore: " not in pod["log"]
    assert pod["answer"]["usage"]["completion_tokens"] == 5


#: The variables that place a library's cache, as the rooms and the libraries read them.
CACHE_VARIABLES = ("VLLM_CACHE_ROOT", "SGLANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                   "FLASHINFER_WORKSPACE_BASE", "CUDA_CACHE_PATH", "TILELANG_CACHE_DIR", "DG_JIT_CACHE_DIR",
                   "JITWARM_CACHE_DIR", "HOME", "TMPDIR", "XDG_CACHE_HOME")


@pytest.mark.parametrize("page, section", [("deployment.md", "## Kubernetes"), ("deployment.md", "## In the server: "
                                           "the vLLM plugin"), ("vllm.md", "## Deployment")])
def test_every_documented_pod_gives_both_containers_the_same_cache_roots_on_the_volume(page, section):
    """No server run: each documented pod's init and server containers set the same cache variables, each inside a
    volume both mount; a vLLM pod moves TMPDIR, Inductor's own cache (vLLM's CPU build leaves Inductor there)."""
    text = (DOCS / page).read_text()
    part = text[text.index(section):]
    block = re.search(r"```yaml\n(.*?)```", part, re.S).group(1)
    pod = next(d for d in yaml.safe_load_all(block) if d and d["kind"] == "Pod")["spec"]
    init, srv = pod["initContainers"][0], pod["containers"][0]

    def roots(container: dict) -> dict[str, str]:
        env = {e["name"]: str(e["value"]) for e in container.get("env", [])}
        return {k: v for k, v in env.items() if k in CACHE_VARIABLES}

    assert roots(init) == roots(srv) and roots(init), (roots(init), roots(srv))
    shared = {m["mountPath"] for m in init["volumeMounts"]} & {m["mountPath"] for m in srv["volumeMounts"]}
    for var, value in roots(init).items():
        assert any(Path(value).is_relative_to(mount) for mount in shared), (var, value, shared)
    if "vllm" in srv["name"]:
        # Inductor's precompiled headers follow TMPDIR whatever TORCHINDUCTOR_CACHE_DIR says (codecache.py:3542)
        assert "TMPDIR" in roots(init) and "VLLM_CACHE_ROOT" in roots(init)
