"""The JIT cache families with the real libraries that run here: Inductor (torch.compile on the CPU) and Triton's
own cache directory (Triton's real compile for sm_90 with a driver that only reports that target, the one mock:
tests/workers/gpu_stub.py).

Each is recorded once per module in a fresh process, exported, restored by ``prestart`` into an empty cache
directory, and then a second process of the library itself proves it used the restored copy: Inductor's own
counters say ``fxgraph_cache_hit`` and no miss; Triton's compilation listener says every compile was a cache hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from precompile_fixtures import jitwarm

from jitwarm.precompile.manifest import append_records, read_manifest

WORKERS = Path(__file__).with_name("workers")
# One compile thread: Inductor starts no pool of compile workers for one small kernel (a minute here otherwise).
INDUCTOR_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "JITWARM_RECORD_CACHES": "inductor"}
TRITON_ENV = {"PYTHONPATH": os.pathsep.join([str(WORKERS), os.environ.get("PYTHONPATH", "")]),
              "TRITON_DEFAULT_FP_FUSION": "1", "JITWARM_RECORD_CACHES": "triton"}


def worker(name: str, *args: str, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, str(WORKERS / name), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def inductor(tmp_path_factory) -> dict:
    """One torch.compile recorded: its manifest, the jitwarm cache it was stored in, the worker's answer."""
    tmp = tmp_path_factory.mktemp("inductor")
    manifest, cache = tmp / "m.jsonl", tmp / "cache"
    result = worker("inductor_compile.py", "record", str(manifest), str(cache),
                    env={**INDUCTOR_ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp / "own")})
    return {"tmp": tmp, "manifest": manifest, "cache": cache, "result": result}


def test_a_torch_compile_inside_record_captures_its_inductor_units(inductor):
    assert inductor["result"]["inductor"].get("fxgraph_cache_miss") == 1  # it compiled
    records = read_manifest(inductor["manifest"])
    assert {r["library"] for r in records} == {"inductor"}
    assert inductor["result"]["captured"] == {"inductor": len(records)}
    units = {r["unit"].split("/")[0] for r in records}
    assert {"fxgraph", "aotautograd"} <= units and len(units) >= 3  # the graph, its AOT entry, generated code
    import torch

    assert all(r["fingerprint"]["torch"] == torch.__version__ and r["target"] == "cpu" for r in records)
    # status checks each unit where Inductor looks too: in the environment of the process that compiled it
    status = jitwarm("status", "--manifest", str(inductor["manifest"]), "--cache-dir", str(inductor["cache"]),
                     env={"TORCHINDUCTOR_CACHE_DIR": str(inductor["tmp"] / "own")})
    assert status.returncode == 0, status.stdout + status.stderr
    gone = inductor["tmp"] / "elsewhere"
    status = jitwarm("status", "--manifest", str(inductor["manifest"]), "--cache-dir", str(inductor["cache"]),
                     env={"TORCHINDUCTOR_CACHE_DIR": str(gone)})  # a node where nothing was restored
    assert status.returncode == 5 and f"missing at {gone}/fxgraph/" in status.stdout, status.stdout


def test_a_node_restored_from_the_bundle_hits_inductors_fx_graph_cache(inductor):
    tmp = inductor["tmp"]
    bundle, node, restored = tmp / "units.tar.gz", tmp / "node", tmp / "restored"
    exported = jitwarm("export", "--manifest", str(inductor["manifest"]), "--cache-dir", str(inductor["cache"]),
                       str(bundle))
    assert exported.returncode == 0, exported.stderr
    ready = jitwarm("prestart", "--manifest", str(inductor["manifest"]), "--cache-dir", str(node), "--bundle",
                    str(bundle), "--offline", "--json", env={"TORCHINDUCTOR_CACHE_DIR": str(restored)})
    assert ready.returncode == 0, ready.stderr
    assert json.loads(ready.stdout.splitlines()[-1])["ready"]
    second = worker("inductor_compile.py", "run", env={**INDUCTOR_ENV, "TORCHINDUCTOR_CACHE_DIR": str(restored)})
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1, second
    assert "fxgraph_cache_miss" not in second["inductor"], second
    print(f"inductor: cold {inductor['result']['seconds']:.1f} s, restored {second['seconds']:.1f} s")


def test_a_node_whose_compiler_differs_refuses_the_units_unless_told(inductor, tmp_path):
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'clang version 99.0.0'\n")
    fake.chmod(0o755)
    env = {"CXX": str(fake), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "restored")}
    args = ("prestart", "--manifest", str(inductor["manifest"]), "--cache-dir", str(inductor["cache"]), "--offline")
    refused = jitwarm(*args, env=env)
    assert refused.returncode == 4, refused.stderr
    assert "inductor unit" in refused.stderr and "recorded with cxx" in refused.stderr
    assert "this node has 'clang version 99.0.0'" in refused.stderr
    assert not (tmp_path / "restored").exists()
    anyway = jitwarm(*args, "--allow-fingerprint-mismatch", env=env)
    assert anyway.returncode == 0, anyway.stderr
    assert anyway.stderr.count("restoring it anyway") == len(read_manifest(inductor["manifest"]))


def test_triton_s_own_cache_directory_is_captured_and_a_restored_copy_is_all_hits(tmp_path):
    own, cache, manifest = tmp_path / "own-triton", tmp_path / "cache", tmp_path / "m.jsonl"
    recorded = worker("triton_server.py", "record", str(manifest), env={
        **TRITON_ENV, "SERVER_TRITON_CACHE_DIR": str(own), "JITWARM_CACHE_DIR": str(cache)})
    assert recorded["compiles"] and not any(c["cache_hit"] for c in recorded["compiles"])  # Triton compiled
    units = [r for r in read_manifest(manifest) if r["kind"] == "jit_cache"]
    assert {r["library"] for r in units} == {"triton"} and {r["target"] for r in units} == {"sm_90"}
    assert len(units) >= len(recorded["compiles"])  # each compile's key directory (and its launcher's)
    only_units = tmp_path / "units.jsonl"
    append_records(only_units, units)
    fresh = tmp_path / "restored-triton"
    ready = jitwarm("prestart", "--manifest", str(only_units), "--target", "sm_90", "--cache-dir", str(cache),
                    "--offline", env={**TRITON_ENV, "TRITON_CACHE_DIR": str(fresh)})
    assert ready.returncode == 0, ready.stderr
    served = worker("triton_server.py", "serve", env={**TRITON_ENV, "SERVER_TRITON_CACHE_DIR": str(fresh)})
    assert len(served["compiles"]) == len(recorded["compiles"])
    assert all(c["cache_hit"] for c in served["compiles"]), served  # Triton's own manager found every group
