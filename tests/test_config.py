import json
import textwrap

import pytest

from jitwarm.precompile import ConfigError, ServingConfig
from jitwarm.precompile.cli import main


def run_cli(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["--cuda-graph-max-bs-decode", "0"], "--cuda-graph-max-bs-decode must be a positive integer, got 0"),
    (["--cuda-graph-max-bs", "-4"], "--cuda-graph-max-bs must be a positive integer, got -4"),  # as typed
    (["--graph-max-bs", "-4"], "--graph-max-bs must be a positive integer, got -4"),
    (["--max-requests", "0"], "--max-requests must be a positive integer"),
    (["--cuda-graph-max-bs-decode", "1000000"], "--cuda-graph-max-bs-decode 1000000 is larger than any real"),
    (["--max-running-requests", "0"], "--max-running-requests must be a positive integer"),
    (["--tp-size", "0"], "--tp-size must be a positive integer"),
    (["--gpu-memory-mb", "-1"], "--gpu-memory-mb must be a positive integer"),
    (["--speculative-algorithm", "MEDUSA"], "unknown speculative algorithm 'MEDUSA'"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE needs --speculative-num-steps"),
    (["--speculative-algorithm", "DSPARK"], "--speculative-algorithm DSPARK needs --speculative-num-draft-tokens"),
    (["--cuda-graph-config", "[1]"], "must be a JSON object"),
    (["--cuda-graph-config", "{"], "not JSON"),
    (["--head-dim", "0"], "--head-dim must be a positive integer"),
    (["--num-q-heads", "-1"], "--num-q-heads must be a positive integer"),
    (["--num-kv-heads", "0"], "--num-kv-heads must be a positive integer"),
    (["--speculative-num-draft-tokens", "-1"], "--speculative-num-draft-tokens must be a positive integer"),
    (["--head-dim", "64", "--rope-dim", "128"], "--rope-dim 128 is larger than --head-dim 64"),
    (["--rope-dim", "63"], "--rope-dim must be a positive even integer, got 63"),
    (["--compress-ratios", "4", "0"], "--compress-ratios needs positive integers, got [0]"),
    (["--ragged-verify-mode", "ragged"], "unknown ragged verify mode 'ragged'"),
    (["--dtype", "float16"], "unknown --dtype 'float16'"),
    (["--backend", "cutlass"], "unknown --backend 'cutlass'"),
    (["--target", "sm_70"], "--target: unknown target 'sm_70'; use cpu or a CUDA arch such as sm_90 (>= sm_75)"),
    (["--target", "gpu"], "--target: unknown target 'gpu'"),
    (["--target", "sm_90a"], "--target: target 'sm_90a': use sm_90"),
    (["--speculative-algorithm", "DSPARK", "--speculative-num-draft-tokens", "6", "--ragged-verify-mode", "compact",
      "--disable-cuda-graph-padding", "--cuda-graph-max-bs-decode", "8"],
     "compact ragged verify (SGLANG_RAGGED_VERIFY_MODE=compact) cannot be used with --disable-cuda-graph-padding"),
    (["--cuda-graph-bs", "0", "8"], "--cuda-graph-bs needs positive batch sizes up to 4096, got [0]"),
    (["--cuda-graph-bs-decode", "-8", "8"], "--cuda-graph-bs-decode needs positive batch sizes up to 4096, got [-8]"),
    (["--cuda-graph-max-bs", "many"], "argument --cuda-graph-max-bs: invalid"),
    (["--tp", "2", "--tp-size", "2"], "--tp and --tp-size are one setting (tp); give one"),
    (["--disable-cuda-graph-padding", "--no-graph-padding"],
     "--disable-cuda-graph-padding and --no-graph-padding are one setting (no_graph_padding); give one"),
    (["--cuda-graph-max-bs-decode", "8", "--model-path", "x"], "unrecognized arguments: --model-path x"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_validation_exits_2_with_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, ["plan", "--target", "cpu", *argv])
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("jitwarm: error: ")
    assert message in err
    assert "Traceback" not in err


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        ServingConfig(graph_max_bs=0, dtype="fp8", rope_dim=3, targets=("cpu",))
    assert len(info.value.problems) == 3


def test_mode_from_environment(monkeypatch):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
    cfg = ServingConfig(draft_algorithm="DSPARK", draft_tokens=6, targets=("cpu",))
    assert cfg.ragged_verify_mode == "compact" and cfg.mode_from_env
    # sglang reads the variable only for a ragged-verify algorithm: a bad value elsewhere is ignored, as there
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "ragged")
    assert ServingConfig(graph_max_bs=8, targets=("cpu",)).ragged_verify_mode == "ragged"
    with pytest.raises(ConfigError, match="unknown ragged verify mode 'ragged' \\(from SGLANG_RAGGED_VERIFY_MODE\\)"):
        ServingConfig(draft_algorithm="DSPARK", draft_tokens=6, targets=("cpu",))
    assert ServingConfig(ragged_verify_mode="static", targets=("cpu",)).ragged_verify_mode == "static"


def test_mode_defaults_to_static():
    assert ServingConfig(targets=("cpu",)).ragged_verify_mode == "static"


def test_lists_are_normalised():
    cfg = ServingConfig(graph_bs=(8, 1, 8, 4), compress_ratios=(128, 4, 4),
                        backends=("triton", "tvm_ffi", "triton"), targets=("sm_90", "cpu", "sm_90"),
                        draft_algorithm="dspark", draft_tokens=4)
    assert cfg.graph_bs == (1, 4, 8)
    assert cfg.compress_ratios == (4, 128)
    assert cfg.backends == ("triton", "tvm_ffi")
    assert cfg.targets == ("sm_90", "cpu")
    assert cfg.draft_algorithm == "DSPARK"


def test_toml_file_and_flags_override_it(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(textwrap.dedent("""
        cuda-graph-max-bs = 64
        draft_algorithm = "DSPARK"
        draft_tokens = 4
        ragged-verify-mode = "compact"
        compress_ratios = [8]
        target = "sm_90"
    """))
    from_file = ServingConfig.from_args(["--config", str(path)])
    assert (from_file.graph_max_bs, from_file.draft_tokens) == (64, 4)
    assert from_file.ragged_verify_mode == "compact" and from_file.compress_ratios == (8,)
    assert from_file.targets == ("sm_90",)
    merged = ServingConfig.from_args(["--config", str(path), "--cuda-graph-max-bs-decode", "32", "--target", "cpu"])
    assert merged.graph_max_bs == 32 and merged.targets == ("cpu",)
    assert merged.draft_tokens == 4


def test_toml_to_json_round_trip(tmp_path):
    cfg = ServingConfig(graph_max_bs=96, draft_algorithm="DSPARK", draft_tokens=3,
                        ragged_verify_mode="compact", targets=("cpu", "sm_100"), backends=("tvm_ffi", "triton"),
                        graph_config={"decode": {"max_bs": 64}}, tp=2)
    lines = []
    for k, v in cfg.to_json().items():
        text = json.dumps(v)
        lines.append(f"{k} = {text}" if not isinstance(v, dict) else f"{k} = {{ decode = {{ max_bs = 64 }} }}")
    path = tmp_path / "c.toml"
    path.write_text("\n".join(lines))
    assert ServingConfig.from_toml(path) == cfg


#: Every serving setting, under jitwarm's names and sglang's (the aliases a config written for sglang uses).
NEUTRAL = {"graph_bs": [4, 1], "graph_config": {"decode": {"max_bs": 64}}, "no_graph_padding": True,
           "draft_algorithm": "EAGLE", "draft_tokens": 4, "draft_steps": 3, "draft_topk": 1, "max_requests": 64,
           "tp": 4, "dp": 2, "attn_dp": 1, "dp_attention": True, "no_graphs": False, "no_decode_graphs": False}
SGLANG = {"cuda_graph_bs_decode": [4, 1], "cuda_graph_config": {"decode": {"max_bs": 64}},
          "disable_cuda_graph_padding": True, "speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 4,
          "speculative_num_steps": 3, "speculative_eagle_topk": 1, "max_running_requests": 64, "tp_size": 4,
          "dp_size": 2, "attn_dp_size": 1, "enable_dp_attention": True, "disable_cuda_graph": False,
          "disable_decode_cuda_graph": False}


def _toml(settings):
    return "".join(f"{k} = {json.dumps(v) if not isinstance(v, dict) else '{ decode = { max_bs = 64 } }'}\n"
                   for k, v in {**settings, "targets": ["cpu"]}.items())


def _flags(settings):
    argv = ["--target", "cpu"]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not False:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def test_sglang_names_are_aliases_of_jitwarm_s_own(tmp_path):
    """A TOML file and jitwarm's flags with sglang's names give the config jitwarm's names give, setting for
    setting; the plan reads each as the same graph (``--cuda-graph-max-bs-decode`` is the 64 of the JSON's)."""
    from jitwarm.precompile import servers

    assert set(NEUTRAL) <= set(ServingConfig.__dataclass_fields__)
    sglang_flags = {flag[2:].replace("-", "_") for flag in servers.adapter("sglang").FIELD_FLAGS.values()}
    assert sglang_flags == {*SGLANG, "cuda_graph_max_bs_decode", "model_path"}  # every sglang name is tried
    neutral, sglang = tmp_path / "neutral.toml", tmp_path / "sglang.toml"
    neutral.write_text(_toml(NEUTRAL))
    sglang.write_text(_toml(SGLANG))
    want = ServingConfig.from_toml(neutral)
    assert want.tp == 4 and want.draft_steps == 3 and want.graph_bs == (1, 4) and want.dp_attention
    assert ServingConfig.from_toml(sglang) == want
    assert ServingConfig.from_args(_flags(SGLANG)) == ServingConfig.from_args(_flags(NEUTRAL)) == want
    assert ServingConfig.from_args(["--target", "cpu", "--tensor-parallel-size", "4"]).tp == 4
    assert ServingConfig.from_args(["--target", "cpu", "--cuda-graph-max-bs-decode", "8"]) == ServingConfig(
        graph_max_bs=8, targets=("cpu",))


@pytest.mark.parametrize("content, message", [
    ("tp = 2\ntp_size = 2\n", "'tp' and 'tp_size' both set tp; give one"),
    ("tp-size = 2\ntp_size = 2\n", "'tp-size' and 'tp_size' both set tp; give one"),
    ("draft_tokens = 4\nspeculative-num-draft-tokens = 4\n",
     "'draft_tokens' and 'speculative-num-draft-tokens' both set draft_tokens; give one"),
    ("[jitwarm]\ncuda_graph_max_bs = 8\ncuda_graph_max_bs_decode = 8\n",
     "'cuda_graph_max_bs' and 'cuda_graph_max_bs_decode' both set graph_max_bs; give one"),
])
def test_a_setting_under_two_names_is_exit_2(capsys, tmp_path, content, message):
    path = tmp_path / "twice.toml"
    path.write_text(content)
    code, out, err = run_cli(capsys, ["plan", "--config", str(path), "--target", "cpu"])
    assert (code, out) == (2, "") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("content, message", [
    ("cuda_graph_max_bs = \n", "is not valid TOML"),
    ("max_batch = 3\n", "unknown key 'max_batch'"),
    ("cuda_graph_max_bs = -1\n", "--cuda-graph-max-bs-decode must be a positive integer, got -1"),
])
def test_bad_config_file_exits_2(capsys, tmp_path, content, message):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    code, _, err = run_cli(capsys, ["plan", "--config", str(path), "--target", "cpu"])
    assert code == 2 and message in err and err.count("\n") == 1


def test_missing_config_file_exits_2(capsys, tmp_path):
    code, _, err = run_cli(capsys, ["plan", "--config", str(tmp_path / "nope.toml")])
    assert code == 2 and "cannot read --config" in err


def test_ladder_that_depends_on_memory_needs_it(capsys):
    code, _, err = run_cli(capsys, ["plan", "--target", "cpu", "--speculative-algorithm", "EAGLE",
                                    "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                    "--max-running-requests", "256"])
    assert code == 2 and "--gpu-memory-mb" in err and err.count("\n") == 1
    code, out, _ = run_cli(capsys, ["plan", "--target", "cpu", "--json", "--gpu-memory-mb", "143771"])
    assert code == 0 and max(s["bs"] for s in json.loads(out)["shapes"]) == 256
    # a small request pool makes every memory tier give the same ladder: no memory needed
    code, out, _ = run_cli(capsys, ["plan", "--target", "cpu", "--json", "--max-running-requests", "4",
                                    "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1",
                                    "--speculative-eagle-topk", "1"])
    assert code == 0 and [s["bs"] for s in json.loads(out)["shapes"]] == [4, 3, 2, 1]


# The server's own command line after `--`: what sglang refuses is one line and exit 2, never a traceback.
SERVER = ["--", "python", "-m", "sglang.launch_server", "--model-path", "m"]


@pytest.mark.parametrize("server_flags, message", [
    # tp 2 with 4 attention-DP groups: the attention-TP size would be 0 (a ZeroDivisionError before)
    (["--tp", "2", "--dp", "4", "--enable-dp-attention", "--cuda-graph-max-bs-decode", "8"],
     "--tp-size 2 is not a multiple of the attention-DP size 4"),
    (["--tp", "2", "--attn-dp-size", "\u0664", "--cuda-graph-max-bs-decode", "8"],  # sglang's int() reads '٤' as 4
     "--tp-size 2 is not a multiple of the attention-DP size 4"),
    (["--tp", "6", "--attn-dp-size", "4", "--cuda-graph-max-bs-decode", "8"],
     "--tp-size 6 is not a multiple of the attention-DP size 4"),
    (["--tp", "4", "--dp", "2", "--attn-dp-size", "2", "--cuda-graph-max-bs-decode", "8"],
     "--dp-size 2 with --attn-dp-size 2: data-parallel replicas combined with attention data parallelism"),
    (["--cuda-graph-config", "[" * 30000 + "]" * 30000], "argument --cuda-graph-config: invalid value"),
    (["--cuda-graph-config", '{"a": ' * 5000 + "{}" + "}" * 5000], "JSON nested deeper than 8 levels"),
    (["--cuda-graph-config", '{"decode": {"max_bs": 8}}' + " " * 70000], "longer than 65536 characters"),
])
def test_server_lines_sglang_refuses_exit_2_with_one_line(capsys, server_flags, message):
    code, out, err = run_cli(capsys, ["plan", "--target", "cpu", "--ladder-source", "builtin", *SERVER,
                                      *server_flags])
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("jitwarm: error: ") and message in err, err
    assert len(err) < 1000


def test_the_same_layout_that_divides_is_planned(capsys):
    code, out, _ = run_cli(capsys, ["plan", "--json", "--target", "cpu", *SERVER, "--tp", "8", "--dp", "4",
                                    "--enable-dp-attention", "--cuda-graph-max-bs-decode", "8"])
    assert code == 0 and all(s["bs"] % 2 == 0 for s in json.loads(out)["shapes"])  # attention-TP size 2


def test_jitwarm_s_own_cuda_graph_config_flag_takes_the_same_bounded_parser(capsys):
    code, _, err = run_cli(capsys, ["plan", "--target", "cpu", "--cuda-graph-config", "[" * 30000])
    assert code == 2 and err.count("\n") == 1 and "--cuda-graph-config" in err and "Traceback" not in err


def test_the_jitwarm_alias_cuda_graph_max_bs_is_refused_after_the_separator(capsys):
    """--cuda-graph-max-bs is jitwarm's alias; sglang 0.5.23's parser refuses it as ambiguous, and so does the
    server line after `--` (docs/sglang.md says so where the alias is documented)."""
    code, out, _ = run_cli(capsys, ["plan", "--json", "--target", "cpu", "--cuda-graph-max-bs", "8"])
    assert code == 0 and json.loads(out)["shapes"][0]["bs"] == 8
    code, _, err = run_cli(capsys, ["plan", "--target", "cpu", *SERVER, "--cuda-graph-max-bs", "8"])
    assert code == 2 and "ambiguous option: --cuda-graph-max-bs could match" in err


def test_the_ladder_is_resolved_once_per_config(monkeypatch):
    """Construction checks the settings with the built-in rules; the plan reuses that answer."""
    from jitwarm.precompile import WarmPlan
    from jitwarm.precompile.servers.sglang import rules

    calls = []
    real = rules.resolve
    monkeypatch.setattr(rules, "resolve", lambda inputs: calls.append(1) or real(inputs))
    rules._builtin.cache_clear()  # earlier tests of this process resolved some of these inputs already
    cfg = ServingConfig(graph_max_bs=96, max_requests=96, targets=("cpu",),
                        ladder_source="builtin")
    WarmPlan.build(cfg)
    assert len(calls) == 1
    # unknown memory that the ladder reads: checked on an assumed device at construction, resolved for the real
    # one (given here) by the plan; never a third time
    calls.clear()
    rules._builtin.cache_clear()
    WarmPlan.build(ServingConfig(gpu_memory_mb=143771, targets=("cpu",), ladder_source="builtin"))
    assert len(calls) == 1


PROBE = """
import json
from jitwarm.kernels.libraries.jit_caches import fingerprint
from jitwarm.precompile.config import local_gpu_memory_mb, local_target
print(json.dumps([local_target(), local_gpu_memory_mb(), fingerprint.value("arch"), fingerprint.value("driver")]))
"""


@pytest.mark.parametrize("smi, seen", [
    ("9.0, 143771, 570.86.15\n9.0, 81559, 570.86.15", ["sm_90", 81559, "sm_90", "570.86.15"]),
    ("[N/A], [N/A], 570.86.15", ["cpu", None, "cpu", None]),
    (None, ["cpu", None, "cpu", None]),
], ids=["two-gpus", "unreadable", "no-nvidia-smi"])
def test_the_node_gpus_are_probed_once_for_the_plan_and_the_fingerprint(tmp_path, smi, seen):
    """A fake nvidia-smi (the GPU is the one thing faked) answers the plan's default target and memory and the
    fingerprint's arch and driver alike, from one run per process; a row it cannot fill is no GPU."""
    import os
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi is not None:
        script = bin_dir / "nvidia-smi"
        script.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'runs'}\nprintf '%s\\n' '{smi}'\n")
        script.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    driver = seen[3] if seen[3] is not None else got[3]  # without a GPU the driver comes from /proc, or "absent"
    assert got == [*seen[:3], driver]
    if smi is not None:
        assert (tmp_path / "runs").read_text().count("run") == 1
