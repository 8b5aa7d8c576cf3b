"""vLLM 0.33.0's own code as the oracle of the vLLM room's built-in capture rules.

The real wheel is installed once per machine (``tests/vllm_wheel.py``) and imported once, in one worker
subprocess (``workers/vllm_oracle_worker.py``), which runs ``jitwarm.precompile.servers.vllm.native`` (vLLM's
``EngineArgs`` defaults, ``VllmConfig._set_cudagraph_sizes``, ``CompilationConfig.resolve_cudagraph_mode_and_sizes``,
the V2 runner's ``CudaGraphManager._init_candidates`` and the V1 runner's ``CudagraphDispatcher``) over the whole
grid. Its answers are checked against facts of the release stated here and against the pure-Python mirror
``servers.vllm.rules``, config by config (the device is a stand-in ``Platform``: capability, memory, name).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import vllm_wheel

from jitwarm.precompile.servers.vllm import rules

WORKER = Path(__file__).resolve().parent / "workers" / "vllm_oracle_worker.py"
H200, B200, A100, H100 = (143771, 90), (183359, 100), (81920, 80), (81559, 90)
DEVICES = (H200, B200, A100, H100, (40960, 90), (131072, 121), (None, None), (24576, 89), (183359, 90))
MODES = (None, "NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def cfg(device=H200, **settings: Any) -> dict[str, Any]:
    return {**rules.INPUT_KEYS, "gpu_memory_mb": device[0], "device_capability": device[1], **settings}


NAMED: dict[str, dict[str, Any]] = {
    "h200": cfg(), "b200": cfg(B200), "a100": cfg(A100), "unknown_device": cfg((None, None)),
    "gb10": cfg((131072, 121)), "throughput": cfg(performance_mode="throughput"),
    "interactivity": cfg(performance_mode="interactivity", max_num_seqs=16),
    **{f"spec{k}_{runner}": cfg(num_speculative_tokens=k, max_num_seqs=64, model_runner=runner)
       for k in range(8) for runner in ("v2", "v1")},
    **{f"mode_{m}": cfg(cudagraph_mode=m) for m in MODES[1:]},
    **{f"support_{s}_spec2": cfg(attention_cudagraph_support=s, num_speculative_tokens=2, cudagraph_mode="FULL")
       for s in rules.SUPPORT},
    "explicit_sizes": cfg(cudagraph_capture_sizes=[64, 8, 8, 9000, 1]),
    "explicit_max": cfg(max_cudagraph_capture_size=100),
    "inconsistent_max": cfg(cudagraph_capture_sizes=[1, 8], max_cudagraph_capture_size=16),
    "tokens_below_seqs": cfg(max_num_seqs=512, max_num_batched_tokens=256),
    "enforce_eager": cfg(enforce_eager=True), "O0": cfg(optimization_level=0), "O1": cfg(optimization_level=1),
    "O3": cfg(optimization_level=3),
    "short_model_no_chunked": cfg(max_model_len=4096, enable_chunked_prefill=False, max_num_seqs=2),
    "v1_spec_rounding_to_nothing": cfg(model_runner="v1", num_speculative_tokens=7, cudagraph_capture_sizes=[1, 2],
                                       max_cudagraph_capture_size=2),
}


def random_grid(n: int, seed: int = 33) -> list[dict[str, Any]]:
    """``n`` configs drawn over every input the rules read."""
    rng = random.Random(seed)
    grid = []
    for _ in range(n):
        settings: dict[str, Any] = {
            "max_num_seqs": rng.choice((None, None, 1, 2, 7, 8, 16, 48, 64, 100, 128, 256, 512, 1024)),
            "max_num_batched_tokens": rng.choice((None, None, 8, 64, 100, 256, 512, 2048, 8192, 16384)),
            "num_speculative_tokens": rng.choice((0, 0, 0, *range(1, 8))),
            "cudagraph_mode": rng.choice(MODES),
            "performance_mode": rng.choice(("balanced", "balanced", "interactivity", "throughput")),
            "model_runner": rng.choice(("v2", "v2", "v1")),
            "attention_cudagraph_support": rng.choice(("ALWAYS", "ALWAYS", *rules.SUPPORT)),
            "optimization_level": rng.choice((2, 2, 3, 1)),
        }
        if rng.random() < 0.15:
            settings["cudagraph_capture_sizes"] = sorted(rng.sample(range(1, 1200), rng.randint(1, 10)))
        if rng.random() < 0.15:
            settings["max_cudagraph_capture_size"] = rng.choice((1, 4, 16, 100, 512, 2000))
        if rng.random() < 0.1:
            settings.update(max_model_len=rng.choice((16, 512, 4096)), enable_chunked_prefill=rng.random() < 0.5)
        grid.append(cfg(rng.choice(DEVICES), **settings))
    return grid


GRID = [*NAMED.values(), *random_grid(300)]

#: Server lines (after `python -m vllm.entrypoints.openai.api_server`), read by vLLM's own parser and by jitwarm's.
ARGV_CASES = [
    ["--model", "m", "--max_num_seqs", "128", "-tp", "2", "-O3", "-cc.cudagraph_mode=FULL_DECODE_ONLY",
     "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}', "--max-model-len", "32K",
     "--cudagraph-capture-sizes", "1", "2", "4", "--enforce-eager"],
    ["--model=/m", "--max-num-batched-tokens=4096", "--compilation-config",
     '{"cudagraph_capture_sizes": [8, 16], "max_cudagraph_capture_size": 16}', "--performance-mode", "interactivity"],
    ["--model", "m", "--trust-remote-code", "--port", "8000", "--host", "0.0.0.0", "--gpu-memory-utilization", "0.9",
     "--max-cudagraph-capture-size", "256", "--no-enable-chunked-prefill", "--spec-tokens", "2"],
    ["--model", "m", "-O", "1", "--max-model-len", "4k", "--tensor-parallel-size=4", "-cc",
     '{"cudagraph_mode": "PIECEWISE"}', "--max-num-seqs=64"],
    ["--model", "m", "--cudagraph-capture-sizes", "8", "-cc.cudagraph_capture_sizes=[8]"],
    ["--model", "m", "--spec-tokens", "2", "--speculative-config", '{"num_speculative_tokens": 3}'],
]
ARGV_DEFAULTS = {"model_path": None, "max_num_seqs": None, "max_num_batched_tokens": None, "tensor_parallel_size": 1,
                 "optimization_level": 2, "enforce_eager": False, "performance_mode": "balanced",
                 "enable_chunked_prefill": None, "max_model_len": None, "cudagraph_mode": None,
                 "cudagraph_capture_sizes": None, "max_cudagraph_capture_size": None, "num_speculative_tokens": 0}


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The worker's answers to the whole grid (one vLLM import for the module)."""
    env = vllm_wheel.vllm_env()
    out = tmp_path_factory.mktemp("vllm-oracle") / "answer.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], input=json.dumps({"grid": GRID, "argv": ARGV_CASES}),
                          text=True,
                          capture_output=True, env={**os.environ, **env}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(out.read_text(encoding="utf-8"))
    assert answer["version"] == vllm_wheel.VLLM_VERSION
    return answer


def named(native, name: str) -> dict[str, Any]:
    result = native["grid"][list(NAMED).index(name)]
    assert "ok" in result, f"{name}: {result}"
    return result["ok"]


def refused(native, name: str) -> str:
    result = native["grid"][list(NAMED).index(name)]
    assert "error" in result, f"{name} should be refused: {result}"
    return result["error"]


# --- facts of vLLM 0.33.0, on vLLM's side ---------------------------------------------------------------------


def test_h200_defaults(native):
    out = named(native, "h200")
    assert (out["max_num_seqs"], out["max_num_batched_tokens"], out["max_capture_size"]) == (1024, 8192, 512)
    assert len(out["capture_sizes"]) == 51 and len(out["shapes"]) == 102
    assert [s["mode"] for s in out["shapes"]] == ["PIECEWISE"] * 51 + ["FULL"] * 51


def test_device_defaults(native):
    b200 = named(native, "b200")
    assert b200["max_capture_size"] == 1024 and b200["max_num_batched_tokens"] == 16384
    for name in ("a100", "unknown_device", "gb10"):
        assert (named(native, name)["max_num_seqs"], named(native, name)["max_num_batched_tokens"]) == (256, 2048)
    assert named(native, "throughput")["max_num_batched_tokens"] == 16384
    assert named(native, "interactivity")["capture_sizes"] == list(range(1, 33))


def test_speculative_widths_and_v1_rounding(native):
    for k in range(8):
        v2, v1 = named(native, f"spec{k}_v2"), named(native, f"spec{k}_v1")
        assert v2["width"] == v1["width"] == k + 1
        assert all(s["num_tokens"] % (k + 1) == 0 for s in v2["shapes"] if s["mode"] == "FULL")
        assert all(size % (k + 1) == 0 for size in v1["capture_sizes"])


def test_modes_and_refusals(native):
    assert named(native, "mode_NONE")["shapes"] == [] and named(native, "enforce_eager")["shapes"] == []
    assert {s["mode"] for s in named(native, "mode_PIECEWISE")["shapes"]} == {"PIECEWISE"}
    assert {s["mode"] for s in named(native, "mode_FULL_DECODE_ONLY")["shapes"]} == {"FULL"}
    assert named(native, "support_UNIFORM_BATCH_spec2")["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert named(native, "support_UNIFORM_SINGLE_TOKEN_DECODE_spec2")["cudagraph_mode"] == "PIECEWISE"
    assert "not supported" in refused(native, "support_NEVER_spec2")
    assert "consistent" in refused(native, "inconsistent_max")
    assert "max_num_seqs" in refused(native, "tokens_below_seqs")


# --- the oracle: vLLM's functions against jitwarm's mirror of them ---------------------------------------------


def _comparable(result: dict[str, Any]) -> Any:
    if "error" in result:
        return "refused"
    out = {k: v for k, v in result["ok"].items() if k != "source"}
    if "disabled" in out:
        out = {"disabled": True, "shapes": out["shapes"]}  # the reason's wording is each side's own
    return out


def _mirror(inputs: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"ok": rules.resolve(dict(inputs))}
    except ValueError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # a crash is a mismatch, not a refusal
        return {"ok": {"crash": f"{type(exc).__name__}: {exc}"}}


def _diff(inputs, theirs, ours) -> str:
    a, b = _comparable(theirs), _comparable(ours)
    settings = {k: v for k, v in inputs.items() if v != rules.INPUT_KEYS[k]}
    if not isinstance(a, dict) or not isinstance(b, dict):
        return f"{settings}: vLLM {str(theirs)[:300]}, mirror {str(ours)[:300]}"
    fields = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    return f"{settings}: " + "; ".join(f"{k}: vLLM {str(x)[:160]} / mirror {str(y)[:160]}" for k, (x, y) in
                                       fields.items())


def test_capture_oracle(native):
    pairs = [(inputs, got, _mirror(inputs)) for inputs, got in zip(GRID, native["grid"], strict=True)]
    diffs = [_diff(*pair) for pair in pairs if _comparable(pair[1]) != _comparable(pair[2])]
    graphs = sum(len(got["ok"]["shapes"]) for _, got, _ in pairs if "ok" in got)
    refusals = sum(1 for _, got, _ in pairs if "error" in got)
    print(f"\nvLLM oracle: {len(pairs) - len(diffs)} configs equal / {len(pairs)} ({refusals} refused by vLLM, "
          f"{graphs} graphs compared; vLLM's side took {native['seconds']:.1f} s)")
    assert not diffs, f"{len(diffs)} of {len(pairs)} configs differ; first ones:\n" + "\n".join(diffs[:6])


def test_argv_oracle(native):
    """jitwarm's reading of each server line against vLLM's own serve parser (and its refusals)."""
    from jitwarm.precompile.servers.vllm.argv import ServerArgvError, parse_server_argv

    disagreements = []
    for args, theirs in zip(ARGV_CASES, native["argv"], strict=True):
        try:
            read = parse_server_argv(["python", "-m", "vllm.entrypoints.openai.api_server", *args])
            ours = {"ok": {**ARGV_DEFAULTS, **{k: v for k, v in read.items() if k in ARGV_DEFAULTS}}}
        except ServerArgvError as exc:
            ours = {"error": str(exc)}
        if ("ok" in ours) != ("ok" in theirs) or ours.get("ok") != theirs.get("ok"):
            disagreements.append(f"{args}: vLLM {theirs}, jitwarm {ours}")
    print(f"\nvLLM argv oracle: {len(ARGV_CASES) - len(disagreements)} command lines agree / {len(ARGV_CASES)}")
    assert not disagreements, "\n".join(disagreements)
    assert [("error" in r) for r in native["argv"]] == [False] * 4 + [True] * 2


def test_plan_never_imports_vllm_torch_triton_or_tvm_ffi(tmp_path):
    """``jitwarm plan -- vllm serve ...`` with the wheel installed: the built-in rules (auto), nothing imported."""
    env = {**os.environ, **vllm_wheel.vllm_env(), "JITWARM_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import contextlib, io, json, sys\nfrom jitwarm.precompile.cli import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out): rc = main(sys.argv[1:])\n"
            "bad = [m for m in ('vllm', 'torch', 'triton', 'tvm_ffi') if m in sys.modules]\n"
            "print(json.dumps({'rc': rc, 'plan': json.loads(out.getvalue()) if rc == 0 else None, 'bad': bad}))")
    argv = ["plan", "--json", "--target", "sm_90", "--gpu-memory-mb", "143771", "--", "vllm", "serve", "m",
            "--max-num-seqs", "64", "--spec-tokens", "3"]
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["rc"] == 0 and got["bad"] == [], got
    assert got["plan"]["ladder"]["source"] == f"built-in rules of vLLM {vllm_wheel.VLLM_VERSION}"
    assert got["plan"]["shapes"][0]["key"].startswith("PIECEWISE num_tokens=")


def test_the_cpu_platform_is_inferred_as_vllm_infers_it(tmp_path):
    """vLLM's own ``cpu_platform_plugin`` (platforms/__init__.py:174-199) and the room's ``on_cpu_platform`` agree
    for each ``VLLM_TARGET_DEVICE``, with the wheel's version and with a CPU build's (``0.32.0+cpu`` metadata
    ahead of the wheel on the path, as ``vllm_version_matches_substr`` reads it, :18-34)."""
    env = {**os.environ, **vllm_wheel.vllm_env()}
    cpu_build = tmp_path / "cpu-build" / "vllm-0.32.0+cpu.dist-info"
    cpu_build.mkdir(parents=True)
    (cpu_build / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n", encoding="utf-8")
    code = ("import json, os\nfrom vllm.platforms import cpu_platform_plugin\n"
            "from jitwarm.precompile.servers.vllm.fields import on_cpu_platform\nout = []\n"
            "for device in ('', 'cpu', 'CPU', 'cuda'):\n    os.environ['VLLM_TARGET_DEVICE'] = device\n"
            "    out.append([cpu_platform_plugin() is not None, on_cpu_platform()])\nprint(json.dumps(out))")
    answers, wheel = {}, env["PYTHONPATH"]
    for name, path in (("wheel", wheel), ("cpu build", f"{cpu_build.parent}{os.pathsep}{wheel}")):
        proc = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": path}, capture_output=True,
                              text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        answers[name] = json.loads(proc.stdout.splitlines()[-1])
    assert answers == {"wheel": [[False, False], [True, True], [True, True], [False, False]],
                       "cpu build": [[True, True]] * 4}, answers
