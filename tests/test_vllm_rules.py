"""The vLLM room's pure parts: its command line and its built-in capture rules, without the wheel.

The facts asserted here are vLLM 0.33.0's (the file:line each rule cites); ``tests/test_vllm_oracle.py`` checks
the same rules against vLLM's own functions over a grid.
"""

from __future__ import annotations

import pytest

from jitwarm.precompile import servers
from jitwarm.precompile.servers.vllm import argv, fields, rules

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
        "model_runner": "v1", "model_path": "Qwen/Qwen3-8B", "max_num_seqs": 128, "tp_size": 2,
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
        "model_path": "m", "max_running_requests": 8, "server_options": {"num_speculative_tokens": 2}}
    assert fields.target_capability(["sm_100a"]) == 100 and fields.target_capability(["cpu", "sm_90"]) == 90
    assert fields.target_capability(["sm_90", "sm_100"]) is None


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
    import json

    from precompile_fixtures import jitwarm

    env = {"JITWARM_CACHE_DIR": str(tmp_path / "cache")}
    proc = jitwarm("plan", "--json", "--target", "sm_100", "--gpu-memory-mb", "183359", "--model-architecture",
                   "LlamaForCausalLM", "--", "vllm", "serve", "meta-llama/Llama-3.1-8B", "--max-num-seqs", "32",
                   env=env)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["ladder"]["source"] == "built-in rules of vLLM 0.33.0" and plan["ladder"]["max_running_requests"] == 32
    keys = [s["key"] for s in plan["shapes"]]
    assert keys[0] == "PIECEWISE num_tokens=64 num_reqs=None" and keys[-1] == "FULL num_tokens=1 num_reqs=1 uniform=1"
    assert plan["families"]["skipped"] and plan["specs"] == []  # a Llama runs none of jitwarm's families
    bad = jitwarm("plan", "--", "vllm", "serve", "m", "--max-num-seqs", "lots", env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("jitwarm: error: ") and bad.stderr.count("\n") == 1, bad.stderr
