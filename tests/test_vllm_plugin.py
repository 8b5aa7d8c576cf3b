"""The vLLM plugin against the real vLLM 0.33.0 wheel, loaded by vLLM's own ``load_general_plugins()``.

Each scenario is one real process (``workers/vllm_plugin_worker.py``) with the wheel importable: vLLM discovers
the ``jitwarm`` entry point of the group ``vllm.general_plugins`` from jitwarm's installed metadata (filtered by
``VLLM_PLUGINS``), and the worker runs vLLM's own capture code: the V2 runner's ``CudaGraphManager.capture`` and
the V1 runner's ``GPUModelRunner._capture_cudagraphs`` / ``_warmup_and_capture``. The ONLY fakes are what a CPU
box lacks: the device (``torch.accelerator.synchronize``, CUDA streams, ``torch.cuda.CUDAGraph`` and
``torch.cuda.graph``) and the parallel groups (TP, PP, DP: ``barrier`` and ``graph_capture``); each records its
calls, tagged ``[vllm]`` or ``[jitwarm]`` by caller. Not faked but not fully built either: the manager and the V1
runner are vLLM's classes made without their ``__init__`` (which needs a loaded model); the model forward is a
recorder (the V2 factory handed to ``capture``; V1's ``_dummy_run``, replaced before the plugins load). The
scenarios run at once, forked after one import of vLLM (tests/plugin_scenarios.py). Run with ``-rP`` to see
the recorded orders.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

import pytest
import vllm_wheel
from plugin_scenarios import probes, run_scenarios

WORKER = Path(__file__).resolve().parent / "workers" / "vllm_plugin_worker.py"
#: What the worker imports of vLLM, imported once before the scenarios fork (none of it loads the plugins).
PRELOAD = ("torch", "triton", "torch._inductor.compile_fx", "vllm.plugins", "vllm.distributed.parallel_state",
           "vllm.config.compilation", "vllm.forward_context", "vllm.v1.worker.gpu.cudagraph_utils",
           "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner")
DRAIN = ["synchronize[jitwarm]", "barrier[jitwarm]"]
TINY_TOML = """\
compress_ratios = [4]
head_dim = 64
rope_dim = 32
num_q_heads = 2
dtype = "float32"
targets = ["cpu"]
"""
PROBE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "{tmp}/inductor", "TRITON_CACHE_DIR": "{tmp}/triton"}
SCENARIOS = {
    "without_plugin": ({"VLLM_PLUGINS": "someone_else"}, ()),
    "with_plugin": ({"VLLM_PLUGINS": "jitwarm", "JITWARM_RECORD": "{tmp}/server.jsonl", "CUDA_CACHE_PATH": "{tmp}/nv"},
                    ()),
    "inert": ({"VLLM_PLUGINS": "jitwarm", "JITWARM_VLLM_PLUGIN": "0"}, ()),
    "with_plan": ({"VLLM_PLUGINS": "jitwarm", "JITWARM_CONFIG": "{tmp}/jitwarm.toml"}, ("--plan",)),
    # a new Triton kernel and Inductor graph outside capture, then inside the first capture of each path
    "sealed": ({**PROBE_ENV, "VLLM_PLUGINS": "jitwarm"}, ("--probe",)),
    "sealed_strict": ({**PROBE_ENV, "VLLM_PLUGINS": "jitwarm", "JITWARM_STRICT": "1"}, ("--probe",)),
}
CAPTURES = ("v2 PIECEWISE capture", "v2 FULL capture", "v1 FULL capture")
SEALED = {"triton": "Triton kernel capture_probes:add_one add_one[", "inductor": "Inductor compile of "}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, list[str]]]:
    """Run every scenario's worker, all at once; name -> (result, the plugin's log lines)."""
    plugins = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("jitwarm") == "jitwarm.precompile.servers.vllm.plugin:register", (
        "jitwarm's installed metadata lacks its vllm.general_plugins entry point: reinstall it (pip install -e .)")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JITWARM_", "VLLM_"))}
    return run_scenarios(WORKER, SCENARIOS, {**base, **vllm_wheel.vllm_env(), "JITWARM_JOBS": "1",
                                             "PYTHONWARNINGS": "ignore"},
                         PRELOAD, tmp_path_factory, TINY_TOML, "jitwarm.precompile.servers.vllm.plugin", timeout=900)


def between(order: list[str], warmup: str, capture: str) -> list[list[str]]:
    """For each capture, the calls between the last warmup forward before it and it."""
    spans, last = [], None
    for i, call in enumerate(order):
        if call.startswith(warmup):
            last = i
        elif call.startswith(capture) and last is not None:
            spans.append(order[last + 1:i])
            last = None
    return spans


def v2_spans(order: list[str]) -> list[list[str]]:
    """V2: between each warmup forward and its capture (the capturing PIECEWISE forward, or CUDAGraph())."""
    spans, last = [], None
    for i, call in enumerate(order):
        if call == "forward(NONE)" and (i + 1 >= len(order) or order[i + 1] != "graph.exit"):
            last = i
        elif call in ("forward(PIECEWISE)", "CUDAGraph()") and last is not None:
            spans.append([c for c in order[last + 1:i] if not c.startswith("prepare(")])
            last = None
    return spans


def show(title: str, result: dict) -> None:
    print(f"\n{title}\n  V2: {' > '.join(result['v2'])}\n  V1: {' > '.join(result['v1'])}")


def test_inside_vllm_s_real_captures_the_plugin_names_every_jit_compile_and_lets_it_run(runs):
    """Default (vLLM's --jit-monitor-mode warn): a Triton compile or an Inductor compile inside the V2 manager's
    PIECEWISE and FULL captures and the V1 runner's capture is logged by name, and runs; outside, nothing is said."""
    result, lines = runs["sealed"]
    seen = probes(result)
    assert set(seen) == {"outside", *CAPTURES}, seen
    assert all(outcome == {"triton": "ran", "inductor": "ran"} for outcome in seen.values()), seen
    assert any("seals inside each capture:" in line and "logged (JITWARM_STRICT=1 refuses them)" in line
               for line in lines), lines
    warned = [line.split("jitwarm: ", 1)[1] for line in lines if "during CUDA-graph capture" in line]
    for prefix in SEALED.values():
        assert sum(w.startswith(prefix) for w in warned) == len(CAPTURES), (prefix, warned)
    assert len(warned) == len(SEALED) * len(CAPTURES), warned


def test_under_strict_the_plugin_refuses_every_jit_compile_inside_vllm_s_real_captures(runs):
    result, lines = runs["sealed_strict"]
    seen = probes(result)
    assert seen.pop("outside") == {"triton": "ran", "inductor": "ran"}
    assert set(seen) == set(CAPTURES), seen
    for where, outcome in seen.items():
        for library, prefix in SEALED.items():
            assert outcome[library].startswith(f"refused: {prefix}"), (where, library, outcome)
    assert any("refused (JITWARM_STRICT=1)" in line for line in lines), lines


def test_without_the_plugin_nothing_meets_between_warmup_and_capture(runs):
    result, lines = runs["without_plugin"]
    show("without the plugin (VLLM_PLUGINS=someone_else):", result)
    assert lines == [] and not result["manager"]
    assert v2_spans(result["v2"]) == [[], [], [], []]  # V2: neither a synchronize nor a barrier
    assert between(result["v1"], "forward(NONE", "forward(FULL") == [["synchronize[vllm]"]] * 2  # V1: no barrier


def test_the_plugin_drains_and_meets_before_every_capture(runs):
    result, lines = runs["with_plugin"]
    show("with the plugin (VLLM_PLUGINS=jitwarm, no plan):", result)
    assert v2_spans(result["v2"]) == [DRAIN] * 4
    assert between(result["v1"], "forward(NONE", "forward(FULL") == [["synchronize[vllm]", *DRAIN]] * 2
    # vLLM's own calls are all still there, in their order: the plugin wraps, it replaces nothing
    without = runs["without_plugin"][0]
    for runner in ("v2", "v1"):
        assert [c for c in result[runner] if "[jitwarm]" not in c] == without[runner]
    assert result["v2"].count("CUDAGraph()") == 2 and result["v1"].count("forward(FULL 16 capture)") == 1


def test_the_plugin_is_found_through_its_entry_point_and_says_one_line(runs):
    result, lines = runs["with_plugin"]
    installed = [line for line in lines if "vllm plugin installed" in line]
    assert len(installed) == 1 and "no plan (JITWARM_CONFIG unset)" in installed[0]
    assert any("capture drain active in CudaGraphManager" in line for line in lines)
    assert result["manager"]  # TRITON_CACHE_MANAGER set for the process and its children


def test_inert_plugin_says_so_once_and_changes_nothing(runs):
    result, lines = runs["inert"]
    assert lines == ["LOG jitwarm.precompile.servers.vllm.plugin jitwarm: vllm plugin inert (JITWARM_VLLM_PLUGIN=0): "
                     "nothing installed"]
    without = runs["without_plugin"][0]
    assert result["v2"] == without["v2"] and result["v1"] == without["v1"] and not result["manager"]


def test_plan_mode_runs_the_capture_hook_before_the_first_capture(runs):
    result, lines = runs["with_plan"]
    show("plan mode (JITWARM_CONFIG):", result)
    assert result["runner_init"] != "constructed"  # vLLM's own __init__ body ran (and failed on this CPU box)
    assert result["plan_specs"] and result["plan_specs"] > 0
    assert any("capture hook ready" in line for line in lines), lines
    assert v2_spans(result["v2"]) == [DRAIN] * 4  # the hook synchronizes and meets, first and later calls alike


def test_recording_stores_the_units_a_capture_compiled_right_after_it(runs):
    """JITWARM_RECORD: the driver's PTX cache entry written at the first capture (by the device fake) is stored as a
    jit_cache unit when that capture returns, not only at exit (a worker is stopped by a signal)."""
    result, lines = runs["with_plugin"]
    assert result["captured"] == {"ptx": 1}  # read by the worker before it exits
    records = [json.loads(line) for line in (Path(result["tmp"]) / "server.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["library"], r["unit"]) for r in records] == [("jit_cache", "ptx", ".")]
    assert any("recording every Triton kernel" in line for line in lines)
