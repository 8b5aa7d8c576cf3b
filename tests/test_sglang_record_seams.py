"""Recording an sglang start whose code calls ``load_jit``, and a recording started before sglang is imported.

A ``load_jit`` call was recorded as a replayable call and its build never stored, so ``jitwarm capture`` of such a
start refused it ("recorded units are not in cache"); and ``record()`` started before sglang's import tapped no
``load_jit`` and took the process for no server, so its Inductor unit was restored to ``$TMPDIR`` and not to
``$SGLANG_CACHE_DIR/inductor`` where sglang looks (srt/environ.py:2308-2336).

Against the real sglang 0.5.23 wheel (``sglang_env``) and the real CLI, on this CPU-only box with
``CUDA_HOME=/usr/local/cuda`` and sglang's arch set to 9.0: the stand-in server (tests/workers/capture_stand_in.py,
run as ``sglang serve``) starts recording as a plain process, then imports sglang and calls ``load_jit`` for
``clamp_position`` (one nvcc build, about 7 s here: the module links no ``-lcuda``, so the load runs too). Its
capture, a prestart of it on a fresh node, and an API recording on that node (sglang's loader served by the
restored build, ``SGLANG_CRASH_ON_JIT_COMPILE=1``) share that one build.
"""

from __future__ import annotations

import getpass
import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from workers.capture_harness import StandIn

from jitwarm.kernels.tap import when_imported

CUDA_HOME = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
MODULE = "sgl_kernel_jit_clamp_position_int32_t"
UNIT = "fxgraph/ab/fabc123/entry"  # the stand-in's Inductor unit (capture_stand_in.DEFAULT_UNIT)
API_UNIT = "fxgraph/cd/fcde456/entry"  # the API recording's, on the node that holds UNIT already
TIMEOUT_S = 900  # a loaded 2-core box: sglang imports and one nvcc build, each a few seconds quiet

# The API: record() first, in a process that has not imported sglang; then sglang's kernel module, a load_jit
# that sglang serves from the prestarted build (it may not compile), and an Inductor unit where sglang's import
# put Inductor's cache.
RECORD_FIRST = """
import json, os, sys
from pathlib import Path
from jitwarm.cache import KernelCache
from jitwarm.precompile import record
recorder = record(sys.argv[1], KernelCache(sys.argv[2]))
imported_first = "sglang" in sys.modules
waiting = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "jitwarm.kernels.tap"]
import torch
from sglang.kernels.jit.utils import override_jit_cuda_arch
from sglang.kernels.ops.attention import clamp_position
with override_jit_cuda_arch(9, 0):
    clamp_position._jit_clamp_position_module(torch.int32)
inductor = os.environ["TORCHINDUCTOR_CACHE_DIR"]
unit = Path(inductor) / sys.argv[3]
unit.parent.mkdir(parents=True)
unit.write_bytes(b"a pickled FX graph, as Inductor writes it")
hooked = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "jitwarm.kernels.tap"]
recorder.stop()
print(json.dumps({"imported_first": imported_first, "waiting": waiting, "under": recorder.under, "inductor": inductor,
                  "hooked": hooked, "after_stop": [type(f).__name__ for f in sys.meta_path
                                                   if type(f).__module__ == "jitwarm.kernels.tap"]}))
"""


def _jitwarm(env: dict[str, str], *args: str | Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "jitwarm", *map(str, args), "--json"], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _node(root: Path, env: dict[str, str]) -> dict[str, str]:
    """A fresh node's environment: its own sglang cache, sglang JIT cache, TMPDIR and HOME, all empty."""
    for d in ("sglang", "jit", "tmp", "home"):
        (root / d).mkdir(parents=True)
    return {**env, "SGLANG_CACHE_DIR": str(root / "sglang"), "SGLANG_JIT_CACHE_DIR": str(root / "jit"),
            "TMPDIR": str(root / "tmp"), "HOME": str(root / "home")}


def _records(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text().splitlines()]


@pytest.fixture(scope="module")
def seams(sglang_env, tmp_path_factory) -> dict:
    """One capture of the stand-in's sglang start, its prestart on a fresh node, an API recording on that node."""
    if not (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        pytest.skip(f"no nvcc at {CUDA_HOME}/bin/nvcc: sglang's JIT builds with $CUDA_HOME/bin/nvcc (set CUDA_HOME)")
    tmp = tmp_path_factory.mktemp("sglang-seams")
    stand_in = StandIn(tmp)
    launcher = tmp / "bin" / "sglang"  # `sglang serve ...`: the stand-in, with the real wheel importable
    launcher.write_text((tmp / "bin" / "vllm").read_text())
    launcher.chmod(0o755)
    env = {k: v for k, v in stand_in.env.items() if not k.startswith(("SGLANG_", "TORCHINDUCTOR_"))}
    env.update(sglang_env, CUDA_HOME=CUDA_HOME, PYTHONWARNINGS="ignore", SGLANG_JIT_CACHE_DIR=str(tmp / "server-jit"))
    line = ["sglang", "serve", "--model-path", "stand-in/model", "--port", str(stand_in.port)]
    try:
        proc = subprocess.run(stand_in.argv("capture", "--manifest", str(stand_in.manifest), "--json", "--", *line),
                              cwd=tmp, env={**env, "STAND_IN_LOAD_JIT": "9.0"}, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    finally:
        stand_in.kill()
    log = stand_in.manifest.with_suffix(".log")
    assert proc.returncode == 0, proc.stderr[-4000:] + (log.read_text()[-4000:] if log.exists() else "")
    captured = json.loads(proc.stdout.strip().splitlines()[-1])
    node_env = _node(tmp / "node", env)
    prestart = _jitwarm(node_env, "prestart", "--manifest", stand_in.manifest, "--cache-dir", stand_in.cache,
                        "--offline")
    api_manifest, api_cache = tmp / "api.jsonl", tmp / "api-cache"
    api = subprocess.run([sys.executable, "-c", RECORD_FIRST, str(api_manifest), str(api_cache), API_UNIT],
                         env={**node_env, "SGLANG_CRASH_ON_JIT_COMPILE": "1", "JITWARM_RECORD_CACHES": "inductor"},
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert api.returncode == 0, api.stderr[-4000:]
    return {"tmp": tmp, "captured": captured, "records": _records(stand_in.manifest), "cache": stand_in.cache,
            "prestart": prestart, "api": json.loads(api.stdout.strip().splitlines()[-1]),
            "api_stderr": api.stderr, "api_records": _records(api_manifest), "api_cache": api_cache}


def _leaf(root: Path) -> Path:
    [library] = root.glob(f"*/{MODULE}/build-*/deps-*/{MODULE}.so")
    return library


@pytest.mark.nvcc
def test_capture_of_an_sglang_start_that_calls_load_jit_stores_its_build(seams):
    """The capture succeeds: the build the server's load_jit published is the entry of its record, byte for byte."""
    captured, records = seams["captured"], seams["records"]
    assert captured["units"] == {"inductor": 1, "sglang_jit": 1}, captured
    assert captured["entries"] == 2 and captured["warnings"] == [], captured
    [call] = [r for r in records if r["kind"] == "sglang_jit"]
    assert (call["module"], call["target"], call["arch"]) == (MODULE, "sm_90", {"major": 9, "minor": 0, "suffix": "a"})
    [entry] = [Path(p).parent for p in seams["cache"].rglob("sglang_jit.json")]
    doc = json.loads((entry / "sglang_jit.json").read_text())
    assert doc["driver"] == "captured" and doc["leaf"].split("/")[1] == MODULE
    built = _leaf(seams["tmp"] / "server-jit")
    assert (entry / doc["leaf"] / f"{MODULE}.so").read_bytes() == built.read_bytes()


@pytest.mark.nvcc
def test_a_recording_started_before_sglangs_import_records_under_sglang(seams):
    """The stand-in started recording as a plain process: the Inductor unit sglang's import moved is stored under
    sglang, and the capture's prestart puts both where that node's sglang looks, compiling nothing."""
    [unit] = [r for r in seams["records"] if r["kind"] == "jit_cache"]
    assert (unit["library"], unit["unit"], unit["under"]) == ("inductor", UNIT, "sglang")
    prestart, node = seams["prestart"], seams["tmp"] / "node"
    assert prestart["ready"] and prestart["handed_over"] == 2, prestart
    assert (node / "sglang" / "inductor" / UNIT).is_file()
    assert not list((node / "tmp").glob(f"torchinductor_{getpass.getuser()}/**/entry"))
    restored = _leaf(node / "jit")
    assert hashlib.sha256(restored.read_bytes()).digest() == hashlib.sha256(
        _leaf(seams["tmp"] / "server-jit").read_bytes()).digest()


@pytest.mark.nvcc
def test_the_api_taps_sglang_imported_after_record_and_resolves_the_server_at_stop(seams):
    """record() before sglang's import: the hook waits for sglang's loader, the load_jit call sglang serves from
    the prestarted build (SGLANG_CRASH_ON_JIT_COMPILE=1: no compile) is recorded and its build stored, and the
    Inductor unit is stored under sglang, from sglang's cache dir (where prestart puts such a unit: the test
    above). The hook is gone once it fired, and nothing of it is left after the recording."""
    api, node = seams["api"], seams["tmp"] / "node"
    assert api["imported_first"] is False and api["under"] == "sglang", api
    assert api["waiting"] == ["_AfterImport"] and api["hooked"] == [] and api["after_stop"] == [], api
    assert api["inductor"] == str(node / "sglang" / "inductor")
    kinds = sorted((r["kind"], r.get("module") or r.get("unit"), r.get("under")) for r in seams["api_records"])
    assert kinds == [("jit_cache", API_UNIT, "sglang"), ("sglang_jit", MODULE, None)], seams["api_stderr"][-2000:]
    # Both stored: the unit as it is under sglang's directory, the build as sglang's loader found it there.
    [stored_unit] = seams["api_cache"].rglob(API_UNIT)
    assert stored_unit.read_bytes() == (node / "sglang" / "inductor" / API_UNIT).read_bytes()
    [entry] = [Path(p).parent for p in seams["api_cache"].rglob("sglang_jit.json")]
    doc = json.loads((entry / "sglang_jit.json").read_text())
    assert (entry / doc["leaf"] / f"{MODULE}.so").read_bytes() == _leaf(node / "jit").read_bytes()


def test_an_import_hook_calls_back_after_the_module_ran_and_leaves_no_trace(tmp_path, monkeypatch):
    """kernels/tap.py's hook: ``then`` sees the executed module, which keeps its own loader; the finder is gone
    after it fired, and an undo before the import leaves the import alone."""
    (tmp_path / "jitwarm_hooked_a.py").write_text("VALUE = 1\n")
    (tmp_path / "jitwarm_hooked_b.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("jitwarm_hooked_a", lambda module: seen.append((module.__name__, module.VALUE)))
    undo = when_imported("jitwarm_hooked_b", seen.append)
    undo()
    try:
        a, b = importlib.import_module("jitwarm_hooked_a"), importlib.import_module("jitwarm_hooked_b")
    finally:
        sys.modules.pop("jitwarm_hooked_a", None)
        sys.modules.pop("jitwarm_hooked_b", None)
    assert seen == [("jitwarm_hooked_a", 1)]
    assert type(a.__loader__).__name__ == "SourceFileLoader" and a.__spec__.loader is a.__loader__
    assert b.VALUE == 2
    assert not [f for f in sys.meta_path if type(f).__module__ == "jitwarm.kernels.tap"]
