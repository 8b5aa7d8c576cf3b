"""The sglang plugin against the real sglang 0.5.23 wheel, loaded by sglang's own ``load_plugins()``.

Each scenario is one real process (``workers/sglang_plugin_worker.py``) with the wheel importable: sglang
discovers the ``jitwarm`` entry point from jitwarm's installed metadata (``SGLANG_PLUGINS``), applies its hooks,
and the worker runs ``capture_one`` of sglang's own backend classes. The ONLY fakes are what a CPU box lacks:
the GPU device module (``synchronize``, ``graph(...)``), the TP group (``barrier``) and ``torch.cuda.CUDAGraph``
(the CPU torch build raises on it); each records its calls, tagged ``[sglang]`` or ``[jitwarm]`` by caller.
Not faked but not fully built either: the runner the backends are given is sglang's ``DecodeCudaGraphRunner``
and the tc-piecewise backend is sglang's class, both made without their ``__init__`` (which needs a loaded
model); plan mode's ``server_args`` is a namespace holding the capture fields.
The scenarios run at once, forked after one import of sglang (tests/plugin_scenarios.py). Run with ``-rP`` (or
``-s``) to see the recorded orders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_scenarios import probes, run_scenarios

WORKER = Path(__file__).resolve().parent / "workers" / "sglang_plugin_worker.py"
#: What the worker imports of sglang, imported once before the scenarios fork (none of it loads the plugins).
PRELOAD = ("torch", "triton", "torch._inductor.compile_fx", "sglang.srt.plugins",
           "sglang.srt.model_executor.model_runner",
           "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
           "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend",
           "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend",
           "sglang.srt.model_executor.runner_backend.tc_piecewise_cuda_graph_backend")
BACKENDS = ("full", "breakable", "tc_piecewise")
HOWS = ("keyword", "positional", "absent")  # how the server's post_warmup_hook is passed to capture_one
SGLANG_DRAIN = ["synchronize[sglang]", "barrier[sglang]"]
JITWARM_DRAIN = ["synchronize[jitwarm]", "barrier[jitwarm]"]
CAPTURE = {"full": ["CUDAGraph()", "graph.enter", "forward", "graph.exit"],
           "breakable": ["CUDAGraph()", "capture_begin", "forward", "capture_end"],
           "tc_piecewise": []}  # tc-piecewise: the second forward IS the capture (tc_piecewise...backend.py:241-245)
TINY_TOML = """\
compress_ratios = [4]
head_dim = 64
rope_dim = 32
num_q_heads = 2
dtype = "float32"
targets = ["cpu"]
ladder_source = "builtin"  # sglang's rules as jitwarm mirrors them: no child process per plan
"""


#: The probes' caches, each the scenario's own; load_jit stops where it would run nvcc (loader.py:150-156).
PROBE_ENV = {"SGLANG_JIT_CACHE_DIR": "{tmp}/sglang-jit", "SGLANG_CRASH_ON_JIT_COMPILE": "1",
             "TORCHINDUCTOR_CACHE_DIR": "{tmp}/inductor", "TRITON_CACHE_DIR": "{tmp}/triton",
             "CUDA_HOME": os.environ.get("CUDA_HOME") or "/usr/local/cuda"}
#: scenario -> (environment, worker flags); ``{tmp}`` is the scenario's own directory.
SCENARIOS = {
    # sglang loads its plugins, but SGLANG_PLUGINS names another one: jitwarm's entry point is skipped
    "without_plugin": ({"SGLANG_PLUGINS": "someone_else"}, ()),
    "with_plugin": ({"SGLANG_PLUGINS": "jitwarm"}, ()),
    "inert": ({"SGLANG_PLUGINS": "jitwarm", "JITWARM_SGLANG_PLUGIN": "0"}, ()),
    "with_plan": ({"SGLANG_PLUGINS": "jitwarm", "JITWARM_CONFIG": "{tmp}/jitwarm.toml"}, ("--plan", "--tp", "2")),
    "bad_config": ({"SGLANG_PLUGINS": "jitwarm", "JITWARM_CONFIG": "{tmp}/missing.toml"},
                   ("--plan", "--then-strict")),
    # a new Triton kernel, Inductor graph and load_jit module outside capture, then inside each backend's capture
    "sealed": ({**PROBE_ENV, "SGLANG_PLUGINS": "jitwarm"}, ("--probe",)),
    "sealed_strict": ({**PROBE_ENV, "SGLANG_PLUGINS": "jitwarm", "JITWARM_STRICT": "1"}, ("--probe",)),
}


@pytest.fixture(scope="module")
def runs(sglang_env, tmp_path_factory) -> dict[str, tuple[dict, list[str]]]:
    """Run every scenario's worker (forked after one sglang import: tests/plugin_scenarios.py)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JITWARM_", "SGLANG_"))}
    return run_scenarios(WORKER, SCENARIOS, {**base, **sglang_env, "PYTHONWARNINGS": "ignore"}, PRELOAD,
                         tmp_path_factory, TINY_TOML, "jitwarm.precompile.servers.sglang.plugin", timeout=600)


def expected(backend: str, how: str, drained: bool) -> list[str]:
    """The call order of one capture_one: two warmups, each followed by the server's hook (and the drain)."""
    hook = [] if how == "absent" else ["server_post_warmup_hook"]
    warmup = SGLANG_DRAIN + ["forward"] + hook + (JITWARM_DRAIN if drained else [])
    return warmup + warmup + CAPTURE[backend]


def before_capture(order: list[str], backend: str) -> list[str]:
    """The calls between the last warmup (its forward and the server's hook) and the start of capture."""
    forwards = [i for i, call in enumerate(order) if call == "forward"]
    if backend == "tc_piecewise":
        last_warmup, capture = forwards[0], forwards[1]
    else:
        capture = next(i for i, call in enumerate(order) if call.startswith("CUDAGraph()"))
        last_warmup = max(i for i in forwards if i < capture)
    between = order[last_warmup + 1:capture]
    return between[1:] if between[:1] == ["server_post_warmup_hook"] else between


def show(title: str, orders: dict, backend: str) -> None:
    """Print one backend's recorded orders (``-rP`` shows them): the closing note quotes these."""
    print(f"\n{title}")
    for how, order in orders[backend].items():
        print(f"  {backend:12} {how:10} {' > '.join(order)}")


@pytest.fixture(scope="module")
def without_plugin(runs):
    return runs["without_plugin"]


@pytest.fixture(scope="module")
def with_plugin(runs):
    return runs["with_plugin"]


@pytest.fixture(scope="module")
def with_plan(runs):
    return runs["with_plan"]


SEALED = {"triton": "Triton kernel capture_probes:add_one add_one[", "inductor": "Inductor compile of ",
          "load_jit": "sglang load_jit module sgl_kernel_jit_clamp_position_int32_t (compile of "}


def test_inside_each_real_capture_the_plugin_names_every_jit_compile_and_lets_it_run(runs):
    """The default, like vLLM's --jit-monitor-mode warn: each compile inside a capture is logged by name, once per
    capture, and runs (load_jit then meets sglang's own SGLANG_CRASH_ON_JIT_COMPILE); outside capture, nothing is
    said."""
    result, lines = runs["sealed"]
    seen = probes(result)
    assert set(seen) == {"outside", *(f"{b} capture" for b in BACKENDS)}, seen
    for where, outcome in seen.items():
        assert outcome == {"triton": "ran", "inductor": "ran",
                           "load_jit": "sglang's own refusal (SGLANG_CRASH_ON_JIT_COMPILE)"}, (where, outcome)
    assert any("seals inside each capture: tvm-ffi build and load, Triton compile, Inductor compile, sglang "
               "load_jit, logged (JITWARM_STRICT=1 refuses them)" in line for line in lines), lines
    armed = [line for line in lines if "capture seals armed:" in line]
    assert len(armed) == 1 and "tvm-ffi build and load, Triton compile, Inductor compile, sglang load_jit (logged;" \
        in armed[0], armed
    warned = [line.split("jitwarm: ", 1)[1].split(" is compiled or loaded during CUDA-graph capture")[0]
              for line in lines if "is compiled or loaded during CUDA-graph capture" in line]
    # per capture: its new Triton kernel, its new Inductor graph and the load_jit module, each said once
    for prefix in SEALED.values():
        assert sum(w.startswith(prefix) for w in warned) == len(BACKENDS), (prefix, warned)
    assert len(warned) == len(SEALED) * len(BACKENDS), warned


def test_under_strict_the_plugin_refuses_every_jit_compile_inside_a_real_capture(runs):
    result, lines = runs["sealed_strict"]
    seen = probes(result)
    assert seen.pop("outside") == {"triton": "ran", "inductor": "ran",
                                   "load_jit": "sglang's own refusal (SGLANG_CRASH_ON_JIT_COMPILE)"}
    assert set(seen) == {f"{b} capture" for b in BACKENDS}, seen
    for where, outcome in seen.items():
        for library, prefix in SEALED.items():
            assert outcome[library].startswith(f"refused: {prefix}"), (where, library, outcome)
    assert any("refused (JITWARM_STRICT=1)" in line for line in lines), lines
    assert not [line for line in lines if "is compiled or loaded during CUDA-graph capture" in line]


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_the_plugin_nothing_drains_between_the_last_warmup_and_capture(without_plugin, backend):
    result, lines = without_plugin
    show("without the plugin (SGLANG_PLUGINS=someone_else):", result["orders"], backend)
    assert any("Skipping plugin jitwarm (not in SGLANG_PLUGINS)" in line for line in result["log"])
    assert lines == []
    for how in HOWS:
        order = result["orders"][backend][how]
        assert order == expected(backend, how, drained=False)
        # tc-piecewise already synchronizes and meets before its capturing forward; the others do not
        assert before_capture(order, backend) == (SGLANG_DRAIN if backend == "tc_piecewise" else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_plugin_drains_and_meets_after_every_warmup_hook(with_plugin, backend):
    result, lines = with_plugin
    show("with the plugin (SGLANG_PLUGINS=jitwarm, no plan):", result["orders"], backend)
    for how in HOWS:
        order = result["orders"][backend][how]
        assert order == expected(backend, how, drained=True)
        assert order.count("server_post_warmup_hook") == (0 if how == "absent" else 2)  # kept, never dropped
        assert before_capture(order, backend)[:2] == JITWARM_DRAIN


def test_the_plugin_is_found_through_its_entry_point_and_says_what_it_installed(with_plugin):
    result, lines = with_plugin
    assert any("Loaded plugin jitwarm from group sglang.srt.plugins" in line for line in result["log"])
    for cls in ("full_cuda_graph_backend.FullCudaGraphBackend",
                "breakable_cuda_graph_backend.BreakableCudaGraphBackend",
                "tc_piecewise_cuda_graph_backend.TcPiecewiseCudaGraphBackend"):
        assert any(f"Applied 1 hook(s) to sglang.srt.model_executor.runner_backend.{cls}.capture_one "
                   "(from: plugin=jitwarm, dist=jitwarm)" in line for line in result["log"]), cls
    assert len(lines) == 3, lines  # what it installed; then, at the first capture (logging is set up by then)
    assert " INFO jitwarm: sglang plugin installed: drain " in lines[0] and "no plan (JITWARM_CONFIG unset)" in lines[0]
    assert " INFO jitwarm: capture seals armed: " in lines[1]  # what this process imported (probed: test above)
    assert lines[2].endswith(" INFO jitwarm: capture drain active in FullCudaGraphBackend: device synchronize + TP "
                             "barrier after every warmup")
    assert not any("model_runner.ModelRunner.__init__" in line for line in result["log"])  # drain only: no warm hook


def test_off_switch_is_inert_with_one_log_line(runs, without_plugin):
    result, lines = runs["inert"]
    assert lines == ["LOG jitwarm.precompile.servers.sglang.plugin INFO jitwarm: sglang plugin inert "
                     "(JITWARM_SGLANG_PLUGIN=0): nothing installed"]
    assert any("Executed general plugin: jitwarm" in line for line in result["log"])
    assert not any("Applied" in line for line in result["log"])
    assert result["orders"] == without_plugin[0]["orders"]


def test_plan_mode_runs_the_capture_hook_before_the_graph(with_plan):
    result, lines = with_plan
    plan = result["plan"]
    for backend in BACKENDS:
        show(f"with JITWARM_CONFIG (plan {plan['plan_id']}, {len(plan['specs'])} specs):", result["orders"], backend)
    # the warm started from sglang's real (patched) ModelRunner.__init__, whose own body then stopped where it
    # needs a published config: our hook ran first, with the faked server_args it was given
    assert plan["model_runner_stopped_at"] == [
        "RuntimeError: config not published for role 'scheduler': nothing is published in this process. The "
        "process entry publishes -- add publish(server_args, role=...) there rather than publishing from a "
        "constructor."]
    assert plan["warm_started"] and len(plan["specs"]) == 3, plan
    assert {s.split("/")[0] for s in plan["specs"]} == {"norm_rope", "compressor", "plan"}
    assert all("/cpu/" in s for s in plan["specs"])
    assert plan["jobs"] == max(1, (os.cpu_count() or 1) // 2)  # --tp 2: two local ranks share the cores
    assert plan["loaded_before_capture"] == 0 and plan["armed_before_capture"] is False
    assert plan["device_target"] == "cpu"  # no CUDA in this torch: the adapter falls back to the host target
    loaded = " loaded=3/3 armed=True"
    for backend in BACKENDS:
        for how in HOWS:
            order = result["orders"][backend][how]
            graphs = [call for call in order if call.startswith("CUDAGraph()")]
            assert graphs == ([] if backend == "tc_piecewise" else [f"CUDAGraph(){loaded}"])
            want = expected(backend, how, drained=True)
            if (backend, how) == ("full", "keyword"):  # the process's first capture: the hook's first call
                want = JITWARM_DRAIN + want              # comes before the first warmup too
            assert [c.removesuffix(loaded) for c in order] == want, (backend, how)
    assert " INFO jitwarm: sglang plugin installed: capture hook after every capture warmup of " in lines[0], lines
    assert any(f"jitwarm: plan {plan['plan_id']}: 3 specs (0 recorded) for cpu; warming in the background with "
               f"{plan['jobs']} jobs" in line for line in lines), lines
    assert any(f"jitwarm: capture hook ready: plan {plan['plan_id']}, 3 specs loaded on cpu" in line
               for line in lines), lines
    assert not any(" ERROR " in line for line in lines), lines


def test_a_bad_config_keeps_the_drain_and_is_fatal_only_under_strict(runs, with_plugin):
    result, lines = runs["bad_config"]
    missing = Path(result["tmp"]) / "missing.toml"
    assert any(" ERROR jitwarm: reading JITWARM_CONFIG=" in line and "ConfigError" in line for line in lines), lines
    assert any("no plan (JITWARM_CONFIG unusable, see above)" in line for line in lines), lines
    normal, strict = result["plan"]["model_runner_stopped_at"]
    assert normal.startswith("RuntimeError: config not published")  # not ours: sglang's body ran on
    assert strict.startswith("ConfigError: cannot read --config") and str(missing) in strict  # ours stopped it
    assert result["orders"] == with_plugin[0]["orders"]  # the drain is still installed


def test_importing_the_plugin_imports_neither_sglang_nor_torch(sglang_env):
    code = ("import json, sys, jitwarm.precompile.servers.sglang.plugin; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'torch'})))")
    env = {**os.environ, **sglang_env}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    assert json.loads(proc.stdout) == []


def test_the_plugin_sets_triton_s_cache_manager_unless_told_otherwise_and_starts_recording(monkeypatch, tmp_path):
    """What register() does before it hooks anything (no sglang needed for this part)."""
    import triton

    from jitwarm.precompile.servers.sglang import plugin as sglang_plugin

    manager = "jitwarm.kernels.libraries.triton.cache:CacheManager"
    # register() writes os.environ itself: record the variable's absence first, so the test leaves it unset.
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "placeholder")
    monkeypatch.delenv("TRITON_CACHE_MANAGER")
    for preset, off, want in ((None, None, manager), ("my.pkg:Manager", None, "my.pkg:Manager"), (None, "0", None)):
        monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
        if preset:
            monkeypatch.setenv("TRITON_CACHE_MANAGER", preset)
        if off:
            monkeypatch.setenv("JITWARM_TRITON_CACHE", off)
        else:
            monkeypatch.delenv("JITWARM_TRITON_CACHE", raising=False)
        sglang_plugin._record_and_serve()
        assert os.environ.get("TRITON_CACHE_MANAGER") == want
    monkeypatch.setenv("JITWARM_RECORD", str(tmp_path / "server.jsonl"))
    monkeypatch.setattr(sglang_plugin, "_recorder", None)
    before = triton.knobs.runtime.jit_cache_hook
    sglang_plugin._record_and_serve()
    try:
        assert sglang_plugin._recorder is not None and triton.knobs.runtime.jit_cache_hook is not before
        assert sglang_plugin._recorder.path == tmp_path / "server.jsonl"
    finally:
        sglang_plugin._recorder.stop()
    assert triton.knobs.runtime.jit_cache_hook is before


def test_a_setting_that_does_not_parse_is_logged_and_its_default_taken_fatal_under_strict(monkeypatch, caplog):
    """docs/sglang.md: the plugin reads its variables through jitwarm.cache.settings, the one boolean parser."""
    from jitwarm.cache import settings
    from jitwarm.precompile.servers.sglang import plugin as sglang_plugin

    manager = "jitwarm.kernels.libraries.triton.cache:CacheManager"
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "placeholder")
    monkeypatch.delenv("TRITON_CACHE_MANAGER")  # recorded absent: _record_and_serve writes os.environ itself
    monkeypatch.setenv("JITWARM_TRITON_CACHE", "maybe")
    with caplog.at_level("ERROR", logger="jitwarm"):
        sglang_plugin._record_and_serve()
    assert os.environ.get("TRITON_CACHE_MANAGER") == manager  # the default (on) taken
    assert any("JITWARM_TRITON_CACHE='maybe' is not a boolean" in r.getMessage() for r in caplog.records)
    monkeypatch.delenv("TRITON_CACHE_MANAGER")
    for strict in ("1", "sometimes"):  # a JITWARM_STRICT that does not parse counts as strict
        monkeypatch.setenv("JITWARM_STRICT", strict)
        with pytest.raises(settings.SettingError, match="JITWARM_TRITON_CACHE"):
            sglang_plugin._record_and_serve()
        assert "TRITON_CACHE_MANAGER" not in os.environ


@pytest.mark.parametrize("architectures, specs", [(["LlamaForCausalLM"], 0), (["DeepseekV4ForCausalLM"], 3),
                                                  (None, 3)])
def test_plan_mode_plans_the_families_of_the_model_the_runner_was_given(monkeypatch, tmp_path, architectures, specs):
    """The runner's model_config carries the checkpoint's architectures: a Llama server warms none of jitwarm's
    families. (No sglang needed: the runner's __init__ is a stand-in with its signature.)"""
    from types import SimpleNamespace

    from jitwarm.precompile.servers.sglang import plugin as sglang_plugin

    (tmp_path / "jitwarm.toml").write_text(TINY_TOML)
    monkeypatch.setenv("JITWARM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sglang_plugin, "_plan", sglang_plugin._Plan(str(tmp_path / "jitwarm.toml")))

    def init(self, model_config, mem_fraction_static, gpu_id, nccl_port, server_args):
        return "constructed"

    model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=architectures))
    server_args = SimpleNamespace(cuda_graph_bs_decode=[1, 2], tp_size=1, model_path="org/some-model")
    from jitwarm.precompile import warming

    monkeypatch.setattr(warming, "start_warm", lambda plan, jobs: None)  # the plan is what is checked, not its warm
    runner = object()
    assert sglang_plugin._around_model_runner_init(init, runner, model_config, 0.8, 0, 0, server_args) == "constructed"
    plan = sglang_plugin._plan.plan
    assert len(plan.specs) == specs and plan.families.architecture == (architectures or [None])[0]


def test_plan_mode_ignores_a_capture_key_of_the_file_under_either_name(tmp_path, caplog):
    """The server's own arguments decide the capture: a JITWARM_CONFIG key that sets one, by jitwarm's name or by
    sglang's alias, is dropped with a warning naming the setting."""
    from jitwarm.precompile.servers.sglang import plugin as sglang_plugin

    (tmp_path / "jitwarm.toml").write_text("cuda_graph_max_bs_decode = 8\ngraph_bs = [1]\ntp-size = 2\nhead_dim = 64\n")
    with caplog.at_level("WARNING", logger=sglang_plugin.log.name):
        mode = sglang_plugin._Plan(str(tmp_path / "jitwarm.toml"))
    assert mode.error is None and mode.fields == {"head_dim": 64}
    assert "sets graph_bs, graph_max_bs, tp: ignored" in caplog.text
