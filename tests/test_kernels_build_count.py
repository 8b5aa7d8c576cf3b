"""Build counting across real processes: a spec is compiled once per cache, never again by a later process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kernel_checks import FLOOR

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec, tvm_backend

WORKER = Path(__file__).resolve().parent / "workers" / "kernel_build_worker.py"
SMALL = [
    KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 3, "threads": 32}),
    KernelSpec("compressor", "tvm_ffi", "cpu",
               {"ratio": 3, "head_dim": 32, "dtype": "float32", "uniform": 1, "max_len": 2}),
    KernelSpec("norm_rope", "tvm_ffi", "cpu", {"head_dim": 32, "rope_dim": 16, "num_q_heads": 2,
                                                "num_kv_heads": 1, "dtype": "float32", "uniform": 1,
                                                "max_len": 2}),
]


def spawn(root: Path, specs: list[KernelSpec], tmp: Path, go: Path | None = None) -> subprocess.Popen:
    specs_file = tmp / f"specs-{len(list(tmp.iterdir()))}.json"
    specs_file.write_text(json.dumps([s.to_json() for s in specs]))
    cmd = [sys.executable, str(WORKER), str(root), str(specs_file), *([str(go)] if go else [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_second_process_builds_nothing_for_the_planned_specs(kernel_cache, tmp_path):
    """The session cache holds the host correctness plans; a new process loads all 22 with 0 builds."""
    res = result(spawn(kernel_cache.cache.root, list(kernel_cache.specs), tmp_path))
    assert res["builds"] == 0
    assert res["dispatch"]["builds"] == 0
    assert res["dispatch"]["loads"] == len(kernel_cache.specs) == (9 if FLOOR else 22)
    assert res["loaded"] == [s.id for s in kernel_cache.specs]


def test_concurrent_processes_build_each_spec_exactly_once(tmp_path):
    root, go = tmp_path / "cache", tmp_path / "go"
    work = tmp_path / "specs"
    work.mkdir()
    procs = [spawn(root, SMALL, work, go) for _ in range(2)]
    go.touch()
    first = [result(p) for p in procs]
    assert sum(r["builds"] for r in first) == len(SMALL)
    again = result(spawn(root, SMALL, work))
    assert again["builds"] == 0 and again["dispatch"]["loads"] == len(SMALL)


def test_entry_holds_only_the_library_and_its_manifest(tmp_path):
    cache = KernelCache(tmp_path / "cache", layers=())
    spec = SMALL[0]
    entry = cache.get_or_build(tvm_backend.description(spec), lambda d: tvm_backend.build(spec, d))
    assert entry.files == ("kernel.json", "kernel.so")
    manifest = json.loads((entry.path / "kernel.json").read_text())
    assert manifest["spec"] == spec.to_json() and manifest["exports"] == ["run", "preload", "spec_id"]
    text = json.dumps(manifest) + json.dumps(entry.description)
    assert str(tmp_path) not in text and "/tmp" not in text and "/work" not in text
