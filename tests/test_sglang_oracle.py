"""sglang 0.5.23's own code as the oracle: the capture ladder, the server command line and its flag table.

The real wheel is installed for the session (``tests/sglang_wheel.py``) and imported once, in one worker
subprocess, which runs sglang's functions, called (``jitwarm.precompile.servers.sglang.native`` for the ladder,
``tests/sglang_parser_oracle.py`` for the command line), over every request below. Its answers are checked
against facts of sglang 0.5.23 stated here, against the pure-Python mirror ``servers.sglang.rules``, against
jitwarm's own argv parser ``servers.sglang.argv.parse_server_argv``, and against the committed
``precompile/servers/sglang/flags.json``.
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
import sglang_wheel

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "workers" / "sglang_oracle_worker.py"
FLAGS_JSON = ROOT / "precompile" / "servers" / "sglang" / "flags.json"

H200, H100 = 143771, 81559
RAW_DEFAULTS: dict[str, Any] = {
    "cuda_graph_max_bs_decode": None, "cuda_graph_bs_decode": None, "cuda_graph_config": None,
    "disable_cuda_graph": False, "disable_decode_cuda_graph": False, "disable_cuda_graph_padding": False,
    "speculative_algorithm": None, "speculative_num_draft_tokens": None, "speculative_num_steps": None,
    "speculative_eagle_topk": None, "max_running_requests": None,
    "tp_size": 1, "dp_size": 1, "attn_dp_size": 1, "enable_dp_attention": False, "gpu_memory_mb": None,
    "ragged_verify_mode": "static", "kv_capacity": None,
}
#: The ladder's inputs: the command line's, and the CPU graph runner's settings (the room's server_options).
LADDER_DEFAULTS = {**RAW_DEFAULTS, "device": None, "enable_torch_compile": False, "torch_compile_max_bs": None}
CPU = {"device": "cpu", "enable_torch_compile": True}
SPEC_LADDER_128 = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 129, 8)]
PLAIN_LADDER_128 = [1, 2, 4, 8, 12, *range(16, 129, 8)]
DSPARK6 = {"speculative_algorithm": "DSPARK", "speculative_num_draft_tokens": 6, "ragged_verify_mode": "compact",
           "cuda_graph_max_bs_decode": 128}


def cfg(**settings: Any) -> dict[str, Any]:
    return {**LADDER_DEFAULTS, **settings}


# Named configs: the facts below are asserted on them, and they open the oracle grid.
NAMED: dict[str, dict[str, Any]] = {
    "dspark6_compact_128": cfg(**DSPARK6),
    "dspark6_compact_128_mrr512": cfg(**DSPARK6, max_running_requests=512),
    **{f"h200_tp{tp}": cfg(gpu_memory_mb=H200, tp_size=tp) for tp in (1, 2, 4, 8)},
    "h100_tp2": cfg(gpu_memory_mb=H100, tp_size=2),
    "unknown_memory": cfg(),
    "h200_tp4_attn_dp2": cfg(gpu_memory_mb=H200, tp_size=4, attn_dp_size=2),
    "h200_tp4_dp2_enable_dp_attention": cfg(gpu_memory_mb=H200, tp_size=4, dp_size=2, enable_dp_attention=True),
    "eagle4_compact_128": cfg(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
                              ragged_verify_mode="compact", cuda_graph_max_bs_decode=128, max_running_requests=512),
    "eagle_topk1_rewrites_draft_tokens": cfg(speculative_algorithm="EAGLE3", speculative_num_steps=3,
                                             speculative_eagle_topk=1, speculative_num_draft_tokens=8,
                                             cuda_graph_max_bs_decode=64),
    "eagle_topk4_keeps_draft_tokens": cfg(speculative_algorithm="EAGLE", speculative_num_steps=3,
                                          speculative_eagle_topk=4, speculative_num_draft_tokens=8,
                                          cuda_graph_max_bs_decode=64),
    "eagle_without_steps": cfg(speculative_algorithm="EAGLE", speculative_num_draft_tokens=4, gpu_memory_mb=H200),
    "draft_tokens_without_algorithm": cfg(speculative_num_draft_tokens=6, cuda_graph_max_bs_decode=128),
    "nextn_lowercase": cfg(speculative_algorithm="nextn", speculative_num_steps=2, speculative_eagle_topk=1,
                           gpu_memory_mb=H200),
    "uno_no_running_default": cfg(speculative_algorithm="UNO", speculative_num_draft_tokens=4, gpu_memory_mb=H200),
    "disable_cuda_graph": cfg(disable_cuda_graph=True),
    "disable_decode_cuda_graph": cfg(disable_decode_cuda_graph=True),
    "json_disables_decode": cfg(cuda_graph_config={"decode": {"backend": "disabled"}}),
    "json_reenables_decode": cfg(disable_cuda_graph=True, cuda_graph_config={"decode": {"backend": "full"}}),
    "json_max_bs_wins": cfg(cuda_graph_max_bs_decode=256, cuda_graph_config={"decode": {"max_bs": 64},
                                                                             "prefill": {"backend": "breakable"}}),
    "json_bs_list": cfg(cuda_graph_config={"decode": {"bs": [3, 1, 7]}}, speculative_algorithm="DSPARK",
                        speculative_num_draft_tokens=4, ragged_verify_mode="compact"),
    "explicit_list_caps_nothing_by_running": cfg(cuda_graph_bs_decode=[1, 2, 4, 96], max_running_requests=8),
    "kv_capacity_cut": cfg(gpu_memory_mb=H200, kv_capacity=100),
    "running_below_attn_dp": cfg(gpu_memory_mb=H200, tp_size=8, attn_dp_size=4, max_running_requests=2),
    "compact_without_padding": cfg(**DSPARK6, disable_cuda_graph_padding=True),
    "dspark_without_draft_tokens": cfg(speculative_algorithm="DSPARK"),
    "unknown_algorithm": cfg(speculative_algorithm="MEDUSA"),
    "bad_mode_with_eagle": cfg(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
                               ragged_verify_mode="Compact"),
    "bad_mode_without_algorithm": cfg(ragged_verify_mode="Compact"),
    "empty_after_alignment": cfg(cuda_graph_bs_decode=[1, 3], tp_size=4, attn_dp_size=2),
    # sglang's CPU graph runner (--device cpu --enable-torch-compile): one torch.compile graph per size
    "cpu_default": cfg(**CPU),
    "cpu_max_bs_100": cfg(**CPU, torch_compile_max_bs=100),
    "cpu_max_bs_2": cfg(**CPU, torch_compile_max_bs=2),
    "cpu_no_padding": cfg(**CPU, torch_compile_max_bs=5, disable_cuda_graph_padding=True),
    "cpu_list": cfg(**CPU, cuda_graph_bs_decode=[5, 1, 3]),
    "cpu_pool_cut": cfg(**CPU, torch_compile_max_bs=8, max_running_requests=4),
    "cpu_ignores_disable_cuda_graph": cfg(**CPU, torch_compile_max_bs=3, disable_cuda_graph=True),
    "cpu_without_torch_compile": cfg(device="cpu"),
}


def random_grid(n: int, seed: int = 23) -> list[dict[str, Any]]:
    """``n`` configs drawn over every input the resolution reads (valid tp / attention-DP pairs only)."""
    rng = random.Random(seed)
    speculative = [(None, None), (None, 6), *((alg, k) for alg in ("DSPARK", "EAGLE", "NGRAM") for k in range(2, 9))]
    topologies = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]
    grid = []
    for _ in range(n):
        alg, draft = rng.choice(speculative)
        tp, attn_dp = rng.choice(topologies)
        if alg == "EAGLE":  # a linear chain of k - 1 steps verifies k tokens; a tree (top-k 2) verifies k
            steps, topk = (draft - 1, 1) if rng.random() < 0.7 else (max(1, draft // 2), 2)
            alg = rng.choice(("EAGLE", "EAGLE3", "NEXTN"))
        else:
            steps = topk = None
        settings = {
            "speculative_algorithm": alg, "speculative_num_draft_tokens": draft, "tp_size": tp,
            "speculative_num_steps": steps, "speculative_eagle_topk": topk,
            "ragged_verify_mode": rng.choice(("static", "cap-accept", "compact")),
            "gpu_memory_mb": rng.choice((H200, H100, 40960, 24576, None)),
            "cuda_graph_max_bs_decode": rng.choice((None, None, None, 128, 64, 200, 8)),
            "max_running_requests": rng.choice((None, None, 8, 48, 60, 512)),
            "disable_cuda_graph_padding": rng.random() < 0.15,
            "kv_capacity": rng.choice((None, None, None, 40, 100, 1000, 20000)),
        }
        if attn_dp > 1 and rng.random() < 0.3:  # the deprecated spelling of the same layout
            settings.update(dp_size=attn_dp, enable_dp_attention=True)
        else:
            settings.update(attn_dp_size=attn_dp)
        if rng.random() < 0.1:
            settings["cuda_graph_bs_decode"] = sorted(rng.sample(range(1, 300), rng.randint(1, 8)))
        if rng.random() < 0.05:
            settings["cuda_graph_config"] = {"decode": {"max_bs": rng.choice((16, 96, 300))}}
        if rng.random() < 0.03:
            settings[rng.choice(("disable_cuda_graph", "disable_decode_cuda_graph"))] = True
        grid.append(cfg(**settings))
    return grid


GRID = [*NAMED.values(), *random_grid(420)]

# (server command line, what sglang's parser makes of it: the settings that differ from RAW_DEFAULTS).
ARGV_CASES: list[tuple[list[str], dict[str, Any]]] = [
    (["python", "-m", "sglang.launch_server", "--model-path", "deepseek-ai/DeepSeek-V3", "--tp", "8",
      "--trust-remote-code", "--port", "30000", "--host", "0.0.0.0", "--mem-fraction-static", "0.85",
      "--cuda-graph-max-bs-decode", "256"],
     {"tp_size": 8, "cuda_graph_max_bs_decode": 256}),
    (["python3", "-m", "sglang.launch_server", "--model-path=/models/x", "--tp-size=4", "--dp-size", "2",
      "--enable-dp-attention", "--cuda-graph-bs-decode", "1", "2", "4", "8", "--disable-cuda-graph-padding"],
     {"tp_size": 4, "attn_dp_size": 2, "cuda_graph_bs_decode": [1, 2, 4, 8], "disable_cuda_graph_padding": True}),
    (["sglang", "serve", "Qwen/Qwen3-8B", "--speculative-algorithm", "DSPARK", "--speculative-num-draft-tokens", "6",
      "--max-running-requests", "512", "--cuda-graph-max-bs-decode", "128", "--port", "8000"],
     {"speculative_algorithm": "DSPARK", "speculative_num_draft_tokens": 6, "max_running_requests": 512,
      "cuda_graph_max_bs_decode": 128}),
    (["sglang", "serve", "--model-path", "m", "--cuda-graph-config", '{"decode": {"max_bs": 64, "backend": "full"}}',
      "--tensor-parallel-size", "2", "--attn-dp-size", "2", "--enable-dp-attention"],
     {"cuda_graph_config": {"decode": {"max_bs": 64, "backend": "full"}}, "tp_size": 2, "attn_dp_size": 2}),
    (["/usr/bin/python3.11", "-u", "-m", "sglang.launch_server", "--model-path", "m", "--disable-cuda-graph"],
     {"disable_cuda_graph": True}),
    (["--model-path", "m", "--disable-decode-cuda-graph", "--speculative-algo", "eagle",
      "--speculative-num-draft=4", "--max-running=60", "--mem-frac", "0.8"],
     {"disable_decode_cuda_graph": True, "speculative_algorithm": "eagle", "speculative_num_draft_tokens": 4,
      "max_running_requests": 60}),
    (["sglang", "serve", "m", "--model-type", "llm", "--dp", "2", "--attn-dp", "2", "--tp", "4"],
     {"dp_size": 2, "attn_dp_size": 2, "tp_size": 4}),
]
# (command line, the message sglang's parser refuses it with).
ARGV_REJECTED = [
    (["--model-path", "m", "--cuda-graph-max-bs", "8"],
     "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"),
    (["--model-path", "m", "--cuda-graph-bs", "8"],
     "ambiguous option: --cuda-graph-bs could match --cuda-graph-bs-decode, --cuda-graph-bs-prefill"),
    (["--model-path", "m", "--tp", "four"], "argument --tp-size/--tensor-parallel-size: invalid int value: 'four'"),
    (["--model-path", "m", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]
ENV_ARGV = ["SGLANG_RAGGED_VERIFY_MODE=compact", "python", "-m", "sglang.launch_server", "--model-path", "m"]
# The child-process entry point takes inputs only (the command line is jitwarm's to parse: servers.sglang.argv).
CLI_REQUESTS = [json.dumps({"inputs": NAMED["dspark6_compact_128"]}), json.dumps({"argv": ARGV_CASES[2][0]}),
                json.dumps({"inputs": {"tp_size": 1}}), json.dumps({"inputs": NAMED["compact_without_padding"]}),
                "{not json", "[" * 30000]


@pytest.fixture(scope="module")
def native(sglang_env, tmp_path_factory):
    """The worker's answers to the whole request (one sglang import for the module)."""
    request = {"grid": GRID, "argv": [case for case, _ in ARGV_CASES] + [c for c, _ in ARGV_REJECTED] + [ENV_ARGV],
               "cli": CLI_REQUESTS}
    out = tmp_path_factory.mktemp("sglang-oracle") / "answer.json"
    env = {**os.environ, **sglang_env, "TORCHINDUCTOR_CACHE_DIR": str(out.parent / "inductor")}  # not ~/.cache/sglang
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], input=json.dumps(request), text=True,
                          capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(out.read_text(encoding="utf-8"))
    assert answer["version"] == sglang_wheel.SGLANG_VERSION
    return answer


def named(native, name: str) -> dict[str, Any]:
    result = native["grid"][list(NAMED).index(name)]
    assert "ok" in result, f"{name}: {result}"
    return result["ok"]


def named_error(native, name: str) -> str:
    result = native["grid"][list(NAMED).index(name)]
    assert "error" in result, f"{name} should be refused: {result}"
    return result["error"]


# --- facts of sglang 0.5.23, on the native side -------------------------------------------------------------


def test_dspark_compact_without_running_limit_stops_at_the_speculative_default(native):
    out = named(native, "dspark6_compact_128")
    assert out["max_requests"] == 48 and out["decode_max_bs"] == 128 and out["decode_bs"] == SPEC_LADDER_128
    assert len(out["shapes"]) == 23 and out["compact"] and out["width"] == 6
    largest = out["shapes"][0]
    assert largest == {"bs": 48, "graph_key": 288, "verify_lens": [6] * 48}


def test_dspark_compact_with_512_running_has_the_incident_shape(native):
    out = named(native, "dspark6_compact_128_mrr512")
    assert len(out["shapes"]) == 35 and out["capture_bs"] == SPEC_LADDER_128
    assert [s["bs"] for s in out["shapes"]] == SPEC_LADDER_128[::-1]  # capture order: largest first
    bs60 = next(s for s in out["shapes"] if s["bs"] == 60)
    assert bs60["graph_key"] == 360 and bs60["verify_lens"] == [3] * 104 + [2] * 24
    assert all(s["graph_key"] == s["bs"] * 6 and sum(s["verify_lens"]) == s["graph_key"] for s in out["shapes"])


def test_default_max_bs_follows_memory_and_tp(native):
    assert [named(native, f"h200_tp{tp}")["decode_max_bs"] for tp in (1, 2, 4, 8)] == [256, 256, 512, 512]
    assert named(native, "h100_tp2")["decode_max_bs"] == 256
    assert named(native, "unknown_memory")["decode_max_bs"] == 160
    tp4 = named(native, "h200_tp4")
    assert tp4["capture_bs"][-1] == 512 and tp4["max_requests"] is None


def test_attention_dp_aligns_to_attention_tp(native):
    out = named(native, "h200_tp4_attn_dp2")
    assert 1 in out["decode_bs"] and out["capture_bs"][0] == 2 and all(bs % 2 == 0 for bs in out["capture_bs"])
    assert named(native, "h200_tp4_dp2_enable_dp_attention") == out  # the deprecated spelling, same layout
    # max(1, 2 // 4) requests per attention-DP rank, padded to the attention-TP size of 2.
    assert named(native, "running_below_attn_dp")["capture_bs"] == [2]


def test_eagle_with_compact_env_stays_uniform(native):
    out = named(native, "eagle4_compact_128")
    assert not out["compact"] and out["width"] == 4
    assert all(s["graph_key"] == s["bs"] and s["verify_lens"] == [4] * s["bs"] for s in out["shapes"])


def test_eagle_width_follows_steps_and_topk(native):
    assert named(native, "eagle_topk1_rewrites_draft_tokens")["width"] == 4  # steps + 1 with top-k 1
    assert named(native, "eagle_topk4_keeps_draft_tokens")["width"] == 8
    assert "--speculative-num-steps" in named_error(native, "eagle_without_steps")


def test_cpu_graph_runner_ladder_is_capped_by_torch_compile_max_bs(native):
    """cuda_graph_hook.py:535-553 through memory_hook.py:208-231 and cpu_graph_runner.py:135-150, by sglang."""
    def capture_bs(name: str) -> list[int]:
        return native["grid"][list(NAMED).index(name)]["ok"]["capture_bs"]

    assert capture_bs("cpu_default") == [*range(1, 17), *range(18, 31, 2), 32]
    assert capture_bs("cpu_max_bs_100") == [*range(1, 17), *range(18, 31, 2), *range(32, 81, 4), 84, 92, 100]
    assert capture_bs("cpu_max_bs_2") == [1, 2]
    assert capture_bs("cpu_no_padding") == [1, 2, 3, 4, 5]
    assert capture_bs("cpu_list") == [1, 3, 5]
    assert capture_bs("cpu_pool_cut") == [1, 2, 3, 4]
    assert capture_bs("cpu_ignores_disable_cuda_graph") == [1, 2, 3]
    assert native["grid"][list(NAMED).index("cpu_without_torch_compile")]["ok"]["shapes"] == []


def test_draft_tokens_without_an_algorithm_give_the_plain_ladder(native):
    out = named(native, "draft_tokens_without_algorithm")
    assert out["decode_bs"] == PLAIN_LADDER_128 and out["width"] == 1 and not out["compact"]
    assert out["max_requests"] is None and out["shapes"][0] == {"bs": 128, "graph_key": 128,
                                                                "verify_lens": [1] * 128}


def test_algorithm_names_and_running_defaults(native):
    assert named(native, "nextn_lowercase")["max_requests"] == 48  # NEXTN is EAGLE
    uno = named(native, "uno_no_running_default")  # _handle_uno sets no max_running_requests default
    assert uno["max_requests"] is None and uno["capture_bs"][-1] == 256
    assert "Unknown speculative algorithm name: MEDUSA" in named_error(native, "unknown_algorithm")
    assert "SGLANG_RAGGED_VERIFY_MODE='Compact'" in named_error(native, "bad_mode_with_eagle")
    assert named(native, "bad_mode_without_algorithm")["decode_max_bs"] == 160  # never read without one


def test_running_default_table_is_the_installed_source(native):
    from jitwarm.precompile.servers.sglang import native as sglang_native

    declared = {name: lines for name, lines in native["running_defaults"].items() if lines}
    assert declared == {name: [line] for name, line in sglang_native._DEFAULTS_48_RUNNING.items()}
    assert native["running_defaults"]["_handle_uno"] == []


def test_cuda_graph_config_json_wins_over_flags(native):
    for name in ("disable_cuda_graph", "disable_decode_cuda_graph", "json_disables_decode"):
        assert named(native, name)["shapes"] == [] and named(native, name)["disabled"]
    assert named(native, "json_reenables_decode")["capture_bs"][-1] == 160
    assert named(native, "json_max_bs_wins")["decode_bs"] == PLAIN_LADDER_128[:12]
    listed = named(native, "json_bs_list")
    assert listed["decode_max_bs"] == 7 and listed["capture_bs"] == [1, 3, 7]
    assert listed["shapes"][1] == {"bs": 3, "graph_key": 12, "verify_lens": [2, 2, 2, 2, 2, 1, 1]}


def test_pool_cuts(native):
    listed = named(native, "explicit_list_caps_nothing_by_running")
    assert listed["decode_max_bs"] == 96 and listed["capture_bs"] == [1, 2, 4, 8]  # the pool size is appended
    assert named(native, "kv_capacity_cut")["capture_bs"][-2:] == [48, 50]


def test_refusals(native):
    assert "disable-cuda-graph-padding" in named_error(native, "compact_without_padding")
    assert "--speculative-num-draft-tokens" in named_error(native, "dspark_without_draft_tokens")
    assert "AssertionError" in named_error(native, "empty_after_alignment")


def test_resolve_restores_the_process(native):
    assert native["state_before"] == native["state_after"]
    assert native["state_after"]["env"]["SGLANG_RAGGED_VERIFY_MODE"] == "cap-accept"
    assert not native["state_after"]["published"]


# --- the ladder oracle: sglang's functions against jitwarm's mirror of them ---------------------------------


def _comparable(result: dict[str, Any]) -> Any:
    if "error" in result:
        return "refused"
    out = {k: v for k, v in result["ok"].items() if k != "source"}
    if "disabled" in out:
        out["disabled"] = True  # the reason's wording is each side's own
    return out


def _mirror(inputs: dict[str, Any]) -> dict[str, Any]:
    from jitwarm.precompile.servers.sglang import rules as sglang_rules

    try:
        return {"ok": sglang_rules.resolve(dict(inputs))}
    except ValueError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # a crash is a mismatch, not a refusal
        return {"ok": {"crash": f"{type(exc).__name__}: {exc}"}}


def _diff(inputs, native_result, mirror_result) -> str:
    a, b = _comparable(native_result), _comparable(mirror_result)
    settings = {k: v for k, v in inputs.items() if v != LADDER_DEFAULTS[k]}
    if not isinstance(a, dict) or not isinstance(b, dict):
        return f"{settings}: sglang {native_result}, mirror {mirror_result}"[:600]
    fields = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    return f"{settings}: " + "; ".join(f"{k}: sglang {str(x)[:120]} / mirror {str(y)[:120]}" for k, (x, y) in
                                       fields.items())


def test_ladder_oracle(native):
    pairs = [(inputs, got, _mirror(inputs)) for inputs, got in zip(GRID, native["grid"], strict=True)]
    diffs = [_diff(*pair) for pair in pairs if _comparable(pair[1]) != _comparable(pair[2])]
    equal = len(pairs) - len(diffs)
    refused = sum(1 for _, got, _ in pairs if "error" in got)
    print(f"\nsglang oracle: {equal} configs equal / {len(pairs)} ({refused} refused by sglang)")
    assert not diffs, f"{len(diffs)} of {len(pairs)} configs differ; first ones:\n" + "\n".join(diffs[:6])


# --- the argv oracle: sglang's parser ------------------------------------------------------------------------


def test_sglang_parser_reads_server_command_lines(native):
    for (argv, expected), got in zip(ARGV_CASES, native["argv"], strict=False):
        assert got == {"ok": {**RAW_DEFAULTS, **expected}}, argv


def test_sglang_parser_refusals(native):
    got = native["argv"][len(ARGV_CASES):len(ARGV_CASES) + len(ARGV_REJECTED)]
    assert [g.get("error") for g in got] == [message for _, message in ARGV_REJECTED]


def test_verify_mode_comes_from_the_command_lines_environment(native):
    assert native["argv"][-1] == {"ok": {**RAW_DEFAULTS, "ragged_verify_mode": "compact"}}


def test_jitwarm_argv_parser_agrees_with_sglangs(native):
    from jitwarm.precompile.servers.sglang.argv import parse_server_argv as parse

    command_keys = [k for k in RAW_DEFAULTS if k not in ("gpu_memory_mb", "kv_capacity", "ragged_verify_mode")]
    disagreements = []
    for (argv, _), got in zip(ARGV_CASES, native["argv"], strict=False):
        try:
            ours = {**RAW_DEFAULTS, **parse(argv)}
        except ValueError as exc:
            disagreements.append(f"{argv}: refused ({exc}); sglang reads it")
            continue
        if ours["enable_dp_attention"]:  # kept as given there; sglang maps it (parallel_hook.py:39-61)
            if ours["attn_dp_size"] == 1:
                ours.update(attn_dp_size=ours["dp_size"], dp_size=1)
            ours["enable_dp_attention"] = False
        theirs = {k: got["ok"][k] for k in command_keys}
        if {k: ours[k] for k in command_keys} != theirs:
            disagreements.append(f"{argv}: jitwarm {ours}, sglang {theirs}")
    for argv, message in ARGV_REJECTED:
        try:
            parse(argv)
        except ValueError:
            continue
        disagreements.append(f"{argv}: accepted; sglang refuses it ({message})")
    total = len(ARGV_CASES) + len(ARGV_REJECTED)
    print(f"\nargv oracle: {total - len(disagreements)} command lines agree / {total}")
    assert not disagreements, "\n".join(disagreements)


def test_committed_flag_table_is_the_wheels(native):
    assert json.loads(FLAGS_JSON.read_text(encoding="utf-8")) == native["flags"], (
        "precompile/servers/sglang/flags.json is stale: regenerate it with bench/gen_sglang_flags.py")
    options = native["flags"]["options"]
    assert native["flags"]["allow_abbrev"] is True
    assert options["--tensor-parallel-size"] == options["--tp-size"] == {"nargs": 1, "dest": "tp_size"}
    assert options["--cuda-graph-bs-decode"]["nargs"] == "+"
    assert options["--enable-dp-attention"] == {"nargs": 0, "dest": "enable_dp_attention", "const": True}
    assert options["--no-enable-tf32-matmul"] == {"nargs": 0, "dest": "enable_tf32_matmul", "const": False}


# --- the child-process entry point --------------------------------------------------------------------------


def test_entry_point_answers_one_json_object(native):
    ok_inputs, argv_request, missing, refused, malformed, deep = native["cli"]
    assert ok_inputs["code"] == 0 and json.loads(ok_inputs["stdout"])["shapes"][0]["bs"] == 48
    prefix = "jitwarm.precompile.servers.sglang.native:"
    for bad in (argv_request, missing, refused, malformed, deep):
        lines = [line for line in bad["stderr"].splitlines() if line.startswith(prefix)]
        assert bad["code"] == 2 and bad["stdout"] == "" and len(lines) == 1, bad
    assert '{"inputs": {...}}' in argv_request["stderr"]


def test_module_imports_neither_sglang_nor_torch(sglang_env):
    code = ("import sys, jitwarm.precompile.servers.sglang.native as n; "
            f"assert n.installed_version() == {sglang_wheel.SGLANG_VERSION!r}; "
            "bad = [m for m in ('sglang', 'torch') if m in sys.modules]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **sglang_env}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "jitwarm.precompile.servers.sglang.native"], input="[1, 2]",
                          env={**os.environ, **sglang_env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr


def _plan(argv, env, cwd):
    """``jitwarm plan --json`` in a child process: its JSON, and whether sglang got imported into it."""
    code = ("import contextlib, io, json, sys\nfrom jitwarm.precompile.cli import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out): rc = main(sys.argv[1:])\n"
            "print(json.dumps({'rc': rc, 'plan': json.loads(out.getvalue()) if rc == 0 else None, "
            "'sglang_imported': 'sglang' in sys.modules}))")
    proc = subprocess.run([sys.executable, "-c", code, "plan", *argv], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


PLAN_ARGV = ["--json", "--target", "cpu", "--ragged-verify-mode", "compact", "--", "sglang", "serve", "m",
             "--speculative-algorithm", "DSPARK", "--speculative-num-draft-tokens", "6", "--cuda-graph-max-bs-decode",
             "128", "--port", "8000"]


def test_plan_with_the_mirrored_release_installed_never_imports_it(sglang_env, tmp_path):
    """auto takes the built-in rules for the release they mirror; sglang's own functions only when asked, in a
    child that makes nothing outside the cache (it imports sglang and torch, which made
    ``~/.cache/sglang/inductor`` before the child ran in a scratch directory)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**sglang_env, "JITWARM_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(home)}
    runs = {source: _plan(["--ladder-source", source, *PLAN_ARGV], env, tmp_path)[0]
            for source in ("auto", "builtin", "sglang")}
    for source in ("auto", "builtin"):
        assert runs[source]["rc"] == 0 and not runs[source]["sglang_imported"], runs[source]
        assert runs[source]["plan"]["ladder"]["source"] == f"built-in rules of sglang {sglang_wheel.SGLANG_VERSION}"
    asked = runs["sglang"]["plan"]
    assert asked["ladder"]["source"] == f"sglang {sglang_wheel.SGLANG_VERSION} (installed)"  # in a child process
    assert not runs["sglang"]["sglang_imported"]
    assert asked["shapes"] == runs["auto"]["plan"]["shapes"] and len(asked["shapes"]) == 23
    assert not (tmp_path / "cache" / "ladders").exists()  # the mirrored release needs no memo
    assert sorted(home.rglob("*")) == []


def test_another_release_is_resolved_by_its_own_functions_once_then_from_the_memo(sglang_env, tmp_path):
    """A dist-info saying 0.5.99 ahead of the wheel: auto runs sglang's functions once; the second plan of the same
    line reads the memo, even with sglang gone from the path."""
    overlay = tmp_path / "overlay" / "sglang-0.5.99.dist-info"
    overlay.mkdir(parents=True)
    (overlay / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.99\n")
    env = {**sglang_env, "JITWARM_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": f"{overlay.parent}{os.pathsep}{sglang_env['PYTHONPATH']}"}
    first, _ = _plan(PLAN_ARGV, env, tmp_path)
    assert first["rc"] == 0 and first["plan"]["ladder"]["source"] == "sglang 0.5.99 (installed)"
    memos = list((tmp_path / "cache" / "ladders").glob("*.json"))
    assert len(memos) == 1 and memos[0].stat().st_mode & 0o077 == 0
    second, _ = _plan(PLAN_ARGV, {**env, "PYTHONPATH": str(overlay.parent)}, tmp_path)  # sglang cannot be imported now
    assert second["rc"] == 0 and second["plan"]["shapes"] == first["plan"]["shapes"]
    assert second["plan"]["ladder"]["source"] == "sglang 0.5.99 (installed)"
