"""The vLLM room's pure parts: its command line and its built-in capture rules, without the wheel.

The facts asserted here are vLLM 0.33.0's (the file:line each rule cites); ``tests/test_vllm_oracle.py`` checks
the same rules against vLLM's own functions over a grid.
"""

from __future__ import annotations

import json

import pytest

from jitwarm.precompile import servers
from jitwarm.precompile.servers.vllm import VERSION, argv, fields, rules

H200, B200 = 143771, 183359
HOPPER = {"gpu_memory_mb": H200, "device_capability": 90}


def resolve(**settings):
    return rules.resolve({**HOPPER, **settings})


def test_h200_serve_defaults_capture_51_sizes_in_102_graphs():
    out = resolve()
    assert (out["max_num_seqs"], out["max_num_batched_tokens"]) == (1024, 8192)
    assert out["cudagraph_mode"] == "FULL_AND_PIECEWISE" and out["max_capture_size"] == 512
    assert out["capture_sizes"] == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert len(out["capture_sizes"]) == 51 and len(out["shapes"]) == 102
    modes = [s["mode"] for s in out["shapes"]]
    assert modes == ["PIECEWISE"] * 51 + ["FULL"] * 51  # PIECEWISE first, then FULL (cudagraph_utils.py:440-452)
    assert [s["num_tokens"] for s in out["shapes"][:51]] == out["capture_sizes"][::-1]  # largest first
    first_full = out["shapes"][51]
    assert first_full["num_reqs"] == 512 and first_full["uniform"] and first_full["verify_lens"] == [1] * 512
    assert out["shapes"][0]["num_reqs"] is None  # a PIECEWISE graph replays any request count


def test_blackwell_doubles_the_ceiling():
    out = rules.resolve({"gpu_memory_mb": B200, "device_capability": 100})
    assert out["max_num_batched_tokens"] == 16384 and out["max_capture_size"] == 1024
    assert rules.resolve({"gpu_memory_mb": B200, "device_capability": 90})["max_capture_size"] == 512


def test_small_devices_and_unknown_memory_take_the_small_defaults():
    for memory, capability in ((40960, 90), (81920, 80), (None, None), (131072, 121)):
        out = rules.resolve({"gpu_memory_mb": memory, "device_capability": capability})
        assert (out["max_num_seqs"], out["max_num_batched_tokens"]) == (256, 2048), (memory, capability)


def test_throughput_doubles_and_interactivity_is_fine_grained():
    assert resolve(performance_mode="throughput")["max_num_batched_tokens"] == 16384
    sizes = resolve(performance_mode="interactivity", max_num_seqs=16)["capture_sizes"]
    assert sizes == list(range(1, 33))  # min(16 * 2, 512) = 32


def test_speculative_decoding_adds_the_decode_sizes_and_v1_rounds_them():
    v2 = resolve(num_speculative_tokens=3, max_num_seqs=64)
    assert v2["width"] == 4 and v2["max_capture_size"] == 512
    decode = [s for s in v2["shapes"] if s["mode"] == "FULL"]
    assert all(s["num_tokens"] % 4 == 0 and s["num_reqs"] * 4 == s["num_tokens"] for s in decode)
    v1 = resolve(num_speculative_tokens=3, max_num_seqs=64, model_runner="v1")
    assert all(size % 4 == 0 for size in v1["capture_sizes"])  # compilation.py:1537-1565


def test_explicit_sizes_are_deduplicated_and_cut():
    out = resolve(cudagraph_capture_sizes=[64, 8, 8, 9000, 1], max_num_batched_tokens=8192)
    assert out["capture_sizes"] == [1, 8, 64] and out["max_capture_size"] == 64
    with pytest.raises(rules.ResolutionError, match="consistent"):
        resolve(cudagraph_capture_sizes=[1, 8], max_cudagraph_capture_size=16)


def test_modes_and_backend_support():
    assert [s["mode"] for s in resolve(cudagraph_mode="PIECEWISE")["shapes"]] == ["PIECEWISE"] * 51
    assert resolve(enforce_eager=True)["shapes"] == []
    assert resolve(optimization_level=0)["disabled"]
    downgraded = resolve(cudagraph_mode="FULL", attention_cudagraph_support="UNIFORM_BATCH")
    assert downgraded["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert resolve(num_speculative_tokens=2, attention_cudagraph_support="UNIFORM_SINGLE_TOKEN_DECODE")[
        "cudagraph_mode"] == "PIECEWISE"
    with pytest.raises(rules.ResolutionError):
        resolve(cudagraph_mode="FULL", attention_cudagraph_support="NEVER")
    with pytest.raises(rules.ResolutionError, match="max_num_seqs"):
        resolve(max_num_seqs=512, max_num_batched_tokens=256)


ARGV = ["VLLM_USE_V2_MODEL_RUNNER=0", "vllm", "serve", "Qwen/Qwen3-8B", "--max_num_seqs", "128", "-tp", "2",
        "--trust-remote-code", "--port", "8000", "-O3", "-cc.cudagraph_mode=FULL_DECODE_ONLY",
        "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}', "--max-model-len", "32K",
        "--cudagraph-capture-sizes", "1", "2", "4", "--enforce-eager"]


def test_the_command_line_is_read_as_vllm_reads_it():
    assert argv.parse_server_argv(ARGV) == {
        "model_runner": "v1", "model_path": "Qwen/Qwen3-8B", "max_num_seqs": 128, "tensor_parallel_size": 2,
        "optimization_level": 3, "cudagraph_mode": "FULL_DECODE_ONLY", "num_speculative_tokens": 3,
        "max_model_len": 32768, "cudagraph_capture_sizes": [1, 2, 4], "enforce_eager": True}
    api = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model=/m", "--max-num-batched-tokens=4096",
           "--compilation-config", '{"cudagraph_capture_sizes": [8, 16], "max_cudagraph_capture_size": 16}']
    assert argv.parse_server_argv(api) == {"model_path": "/m", "max_num_batched_tokens": 4096,
                                           "cudagraph_capture_sizes": [8, 16], "max_cudagraph_capture_size": 16}


def test_the_room_is_chosen_from_the_launcher_and_maps_its_fields():
    assert argv.is_server_command(["vllm", "serve", "m"]) and not argv.is_server_command(["sglang", "serve", "m"])
    assert servers.adapter_for(["vllm", "serve", "m"]).NAME == "vllm"
    assert fields.parse_argv(["vllm", "serve", "m", "--max-num-seqs", "8", "--spec-tokens", "2"]) == {
        "model_path": "m", "max_requests": 8, "server_options": {"num_speculative_tokens": 2}}
    assert fields.target_capability(["sm_100a"]) == 100 and fields.target_capability(["cpu", "sm_90"]) == 90
    assert fields.target_capability(["sm_90", "sm_100"]) is None
    assert fields.parse_argv(["vllm", "serve", "m", "-tp", "2"]) == {"model_path": "m", "tp": 2}


@pytest.mark.parametrize("given", [["--graph-max-bs", "8"], ["--cuda-graph-max-bs-decode", "8"],
                                   ["--draft-tokens", "3"], ["--speculative-num-draft-tokens", "3"]])
def test_a_setting_vllm_has_not_is_refused_naming_the_flag_as_given(capsys, given):
    from jitwarm.precompile.cli import main

    assert main(["plan", "--target", "cpu", *given, "--", "vllm", "serve", "m"]) == 2
    assert f"{given[0]} is not a vLLM setting" in capsys.readouterr().err


def test_a_bad_value_names_vllm_s_own_flag(capsys):
    from jitwarm.precompile.cli import main

    assert main(["plan", "--target", "cpu", "--", "vllm", "serve", "m", "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("line, message", [
    (["vllm", "serve", "m", "--max-num-seqs"], "expected one argument"),
    (["vllm", "serve", "m", "--max-num-seqs", "many"], "invalid value"),
    (["vllm", "serve", "m", "--enable-lora"], "LoRA"),
    (["vllm", "serve", "m", "-cc", "[1]"], "not a JSON object"),
    (["vllm", "serve", "m", "extra"], "unexpected argument"),
    (["vllm", "bench", "m"], "not a vLLM server command line"),
])
def test_refusals_are_one_usage_error(line, message):
    with pytest.raises(argv.ServerArgvError, match=message) as caught:
        argv.parse_server_argv(line)
    assert caught.value.exit_code == 2


def test_jitwarm_plan_reads_a_vllm_line_end_to_end(tmp_path):
    """The real CLI: ``jitwarm plan --json -- vllm serve ...`` names vLLM's rules, modes and dispatch keys; a bad
    line is one ``jitwarm: error:`` line and exit 2."""
    from precompile_fixtures import jitwarm

    env = {"JITWARM_CACHE_DIR": str(tmp_path / "cache")}
    proc = jitwarm("plan", "--json", "--target", "sm_100", "--gpu-memory-mb", "183359", "--model-architecture",
                   "LlamaForCausalLM", "--", "vllm", "serve", "meta-llama/Llama-3.1-8B", "--max-num-seqs", "32",
                   env=env)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["ladder"]["source"] == f"built-in rules of vLLM {VERSION}"
    assert plan["ladder"]["max_requests"] == 32
    keys = [s["key"] for s in plan["shapes"]]
    assert keys[0] == "PIECEWISE num_tokens=64 num_reqs=None" and keys[-1] == "FULL num_tokens=1 num_reqs=1 uniform=1"
    assert plan["families"]["skipped"] and plan["specs"] == []  # a Llama runs none of jitwarm's families
    bad = jitwarm("plan", "--", "vllm", "serve", "m", "--max-num-seqs", "lots", env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("jitwarm: error: ") and bad.stderr.count("\n") == 1, bad.stderr


# --- a server that captures no graphs: the CPU platform, --enforce-eager, -O0, cudagraph_mode NONE ------------

def empty_line(why: str, installed: str = VERSION) -> str:
    """What ``plan`` says of a line that captures no graphs: capture still applies, with the release it planned for."""
    return (f"jitwarm: nothing to warm: the plan is empty ({why}): the server captures no decode CUDA graphs; its "
            "start still fills its own JIT caches (Inductor, Triton, ...): `jitwarm capture -- SERVER LINE` records "
            f"them (installed here: vllm {installed})\n")



def installed(tmp_path, version: str) -> dict[str, str]:
    """The environment of a CLI subprocess that finds vLLM ``version`` installed (its metadata alone: a
    ``vllm-<version>.dist-info`` on PYTHONPATH, as pip leaves one), no ``VLLM_TARGET_DEVICE``, a cache of its own."""
    import os

    site = tmp_path / f"site-{version}"
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n", encoding="utf-8")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            "JITWARM_CACHE_DIR": str(tmp_path / "cache"), "VLLM_TARGET_DEVICE": ""}


def test_the_cpu_platform_captures_nothing_and_reads_no_device():
    cpu = {**rules.INPUT_KEYS, "platform": "cpu"}
    out = rules.resolve(cpu)
    assert out["shapes"] == [] and out["capture_bs"] == [] and out["disabled"] == rules.CPU_PLATFORM
    assert not rules.reads_device(cpu) and not fields.needs_memory(cpu)
    assert rules.reads_device(rules.INPUT_KEYS) and fields.needs_memory(rules.INPUT_KEYS)  # the CUDA one does
    # No child for it, from any source: with no vLLM installed, vLLM's own functions could not run at all.
    from jitwarm.precompile.servers.vllm import native

    assert native.resolve_ladder(cpu, "vllm")["disabled"] == rules.CPU_PLATFORM
    with pytest.raises(rules.ResolutionError, match="platform 'tpu'"):
        rules.resolve({"platform": "tpu"})


@pytest.mark.parametrize("word, platform", [("VLLM_TARGET_DEVICE=cpu", "cpu"), ("VLLM_TARGET_DEVICE=CPU", "cpu"),
                                            ("VLLM_TARGET_DEVICE=cuda", None)])
def test_the_lines_target_device_is_read_as_vllm_reads_it(word, platform):
    assert argv.parse_server_argv([word, "vllm", "serve", "m"]).get("platform") == platform  # envs.py:623 lowers


@pytest.mark.parametrize("how", ["installed 0.32.0+cpu", "VLLM_TARGET_DEVICE in the environment",
                                 "VLLM_TARGET_DEVICE on the line", "--target cpu"])
def test_a_cpu_server_plans_no_graphs_and_never_asks_for_gpu_memory(tmp_path, how):
    """One line, exit 0, no --gpu-memory-mb, and no child: the 0.32.0 on PYTHONPATH is metadata alone, so any
    attempt to run its functions would fail the plan."""
    from precompile_fixtures import jitwarm

    release = "0.32.0+cpu" if how.startswith("installed") else VERSION
    env = installed(tmp_path, release)
    flags, line = [], ["vllm", "serve", "m"]
    if how == "VLLM_TARGET_DEVICE in the environment":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    elif how == "VLLM_TARGET_DEVICE on the line":
        line.insert(0, "VLLM_TARGET_DEVICE=cpu")
    elif how == "--target cpu":
        flags = ["--target", "cpu"]
    proc = jitwarm("plan", *flags, "--", *line, env=env)
    said = empty_line("vLLM's CPU platform", release)
    assert (proc.returncode, proc.stderr, proc.stdout) == (0, said, ""), proc.stderr
    plan = json.loads(jitwarm("plan", "--json", *flags, "--", *line, env=env).stdout)
    assert plan["shapes"] == [] and plan["ladder"]["disabled"] == "vLLM's CPU platform"
    assert plan["ladder"]["gpu_memory_mb"] is None


@pytest.mark.parametrize("flag, why", [("--enforce-eager", "--enforce-eager"), ("-O0", "cudagraph_mode NONE (-O0)"),
                                       ("-cc.cudagraph_mode=NONE", "cudagraph_mode NONE")])
def test_a_server_that_captures_nothing_plans_nothing_on_a_gpu_too(tmp_path, flag, why):
    """On a CUDA device (``--target sm_90``), where the same line without the flag needs the device's memory."""
    from precompile_fixtures import jitwarm

    env = installed(tmp_path, VERSION)
    proc = jitwarm("plan", "--target", "sm_90", "--", "vllm", "serve", "m", flag, env=env)
    assert (proc.returncode, proc.stderr) == (0, empty_line(why)), proc.stderr
    assert fields.needs_memory({**rules.INPUT_KEYS, **argv.parse_server_argv(["vllm", "serve", "m", flag])}) is False


def test_another_installed_release_plans_with_its_own_functions_memoised(tmp_path):
    """0.32.0+cpu installed, a CUDA server asked for (``--target sm_90``): not the rules of 0.33.0 but the installed
    release's functions, in a child; a memo of that release and those inputs answers instead of the child."""
    from precompile_fixtures import jitwarm

    from jitwarm.cache import settings
    from jitwarm.precompile.servers import resolution_memo

    env = installed(tmp_path, "0.32.0+cpu")
    line = ["plan", "--json", "--target", "sm_90", "--gpu-memory-mb", "143771", "--", "vllm", "serve", "m",
            "--max-num-seqs", "8"]
    child = jitwarm(*line, env=env)  # only the metadata is installed: the child cannot import vLLM
    assert child.returncode == 2 and child.stderr.count("\n") == 1, child.stderr
    assert "vLLM's own ladder functions failed" in child.stderr and "cannot import vllm" in child.stderr
    inputs = {**rules.INPUT_KEYS, "max_num_seqs": 8, "gpu_memory_mb": 143771, "device_capability": 90}
    theirs = {**rules.resolve({**inputs, "cudagraph_mode": "PIECEWISE"}), "source": "vLLM 0.32.0+cpu (installed)"}
    with settings.override(cache_dir=env["JITWARM_CACHE_DIR"]):
        resolution_memo.store(resolution_memo.key("vllm", "0.32.0+cpu", inputs), theirs)
    memo = jitwarm(*line, env=env)
    assert memo.returncode == 0, memo.stderr
    plan = json.loads(memo.stdout)
    assert plan["ladder"]["source"] == "vLLM 0.32.0+cpu (installed)"
    assert [s["key"] for s in plan["shapes"]] == [s["key"] for s in theirs["shapes"]]  # PIECEWISE only: the memo's
    same = jitwarm(*line, env=installed(tmp_path / "same", VERSION))  # the release the rules mirror: the rules
    assert json.loads(same.stdout)["ladder"]["source"] == f"built-in rules of vLLM {VERSION}", same.stderr


# --- docs/vllm.md: its `jitwarm plan ... -- vllm serve ...` examples run as written ---------------------------


def docs_examples() -> list[tuple[list[str], str | None]]:
    """Each ``jitwarm plan`` line of the docs' section "Plans from vLLM's own command line" (continuations joined),
    with the output line the docs show under it (a ``# jitwarm: ...`` comment), if any."""
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text(encoding="utf-8")
    section = text[text.index("## Plans from vLLM's own command line"):text.index("## The plugin")]
    lines = "\n".join(block.split("```")[0] for block in section.split("```bash\n")[1:]).split("\n")
    examples: list[tuple[list[str], str | None]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.endswith("\\"):
            i += 1
            line = line[:-1] + lines[i]
        if line.startswith("jitwarm plan "):
            examples.append((shlex.split(line)[1:], None))
        elif line.startswith("# jitwarm: ") and examples:
            examples[-1] = (examples[-1][0], line[2:])
        i += 1
    return examples


def test_the_docs_examples_run_as_written(tmp_path):
    from precompile_fixtures import jitwarm

    examples = docs_examples()
    assert len(examples) >= 3 and all("vllm" in args for args, _ in examples)
    for n, (args, shown) in enumerate(examples):
        proc = jitwarm(*args, env=installed(tmp_path / str(n), VERSION))
        assert proc.returncode == 0, (args, proc.stderr)
        if shown is not None:
            assert proc.stderr == shown + "\n", (args, proc.stderr)


def test_the_plan_table_has_a_row_per_graph_with_its_mode_and_each_spec_once():
    """vLLM captures a PIECEWISE and a FULL graph of one size: each is a row, and a spec is listed where it is first
    needed, once (issue #31: the new specs were kept per batch size, so the second graph of a size overwrote the
    first's and the table listed none)."""
    from precompile_fixtures import jitwarm

    proc = jitwarm("plan", "--gpu-memory-mb", "143771", "--target", "sm_90", "--model-architecture",
                   "DeepseekV4ForCausalLM", "--", "vllm", "serve", "m", "--max-num-seqs", "16")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = lines[1:lines.index("")]
    assert lines[0].split()[:2] == ["mode", "bs"] and len(rows) == 12
    assert [r.split()[0] for r in rows] == ["PIECEWISE"] * 7 + ["FULL"] * 5
    labels = [label for r in rows for label in r.split()[7:] if label != "-"]
    assert len(labels) == len(set(labels)) == 11  # "11 specs for 12 shapes": each once
    assert "11 specs for 12 shapes" in proc.stdout
