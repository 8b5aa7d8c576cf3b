import textwrap

import pytest

from jitwarm.precompile import ConfigError, ServingConfig
from jitwarm.precompile.cli import main

DSPARK = ["--cuda-graph-max-bs", "128", "--speculative-num-draft-tokens", "6", "--ragged-verify-mode", "compact"]


def run_cli(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs must be a positive integer, got 0"),
    (["--cuda-graph-max-bs", "-4"], "--cuda-graph-max-bs must be a positive integer, got -4"),
    (["--max-running-requests", "0"], "--max-running-requests must be a positive integer"),
    (["--head-dim", "0"], "--head-dim must be a positive integer"),
    (["--num-q-heads", "-1"], "--num-q-heads must be a positive integer"),
    (["--num-kv-heads", "0"], "--num-kv-heads must be a positive integer"),
    (["--speculative-num-draft-tokens", "-1"], "--speculative-num-draft-tokens must be 0"),
    (["--head-dim", "64", "--rope-dim", "128"], "--rope-dim 128 is larger than --head-dim 64"),
    (["--rope-dim", "63"], "--rope-dim must be a positive even integer, got 63"),
    (["--compress-ratios", "4", "0"], "--compress-ratios needs positive integers, got [0]"),
    (["--ragged-verify-mode", "ragged"], "unknown --ragged-verify-mode 'ragged'"),
    (["--dtype", "float16"], "unknown --dtype 'float16'"),
    (["--backend", "cutlass"], "unknown --backend 'cutlass'"),
    (["--target", "sm_70"], "unknown --target 'sm_70'"),
    (["--target", "gpu"], "unknown --target 'gpu'"),
    (["--speculative-num-draft-tokens", "6", "--ragged-verify-mode", "compact", "--disable-cuda-graph-padding"],
     "compact cannot be used with --disable-cuda-graph-padding"),
    (["--ragged-verify-mode", "compact"], "--ragged-verify-mode compact needs speculative decoding"),
    (["--ragged-verify-mode", "cap-accept"], "--ragged-verify-mode cap-accept needs speculative decoding"),
    (["--cuda-graph-bs", "0", "8"], "--cuda-graph-bs needs positive batch sizes, got [0]"),
    (["--cuda-graph-bs", "-8", "8"], "--cuda-graph-bs needs positive batch sizes, got [-8]"),
    (["--cuda-graph-max-bs", "many"], "argument --cuda-graph-max-bs: invalid int value: 'many'"),
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
        ServingConfig(cuda_graph_max_bs=0, dtype="fp8", rope_dim=3, targets=("cpu",))
    assert len(info.value.problems) == 3


def test_mode_from_environment(monkeypatch):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
    cfg = ServingConfig(speculative_num_draft_tokens=6, targets=("cpu",))
    assert cfg.ragged_verify_mode == "compact"
    with pytest.raises(ConfigError, match="compact \\(from SGLANG_RAGGED_VERIFY_MODE\\) needs speculative"):
        ServingConfig(targets=("cpu",))
    assert ServingConfig(ragged_verify_mode="static", targets=("cpu",)).ragged_verify_mode == "static"


def test_mode_defaults_to_static():
    assert ServingConfig(targets=("cpu",)).ragged_verify_mode == "static"


def test_lists_are_normalised():
    cfg = ServingConfig(cuda_graph_bs=(8, 1, 8, 4), compress_ratios=(128, 4, 4),
                        backends=("triton", "tvm_ffi", "triton"), targets=("sm_90", "cpu", "sm_90"))
    assert cfg.cuda_graph_bs == (1, 4, 8)
    assert cfg.compress_ratios == (4, 128)
    assert cfg.backends == ("triton", "tvm_ffi")
    assert cfg.targets == ("sm_90", "cpu")


def test_toml_file_and_flags_override_it(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(textwrap.dedent("""
        cuda-graph-max-bs = 64
        speculative_num_draft_tokens = 4
        ragged-verify-mode = "compact"
        compress_ratios = [8]
        target = "sm_90"
    """))
    from_file = ServingConfig.from_args(["--config", str(path)])
    assert (from_file.cuda_graph_max_bs, from_file.speculative_num_draft_tokens) == (64, 4)
    assert from_file.ragged_verify_mode == "compact" and from_file.compress_ratios == (8,)
    assert from_file.targets == ("sm_90",)
    merged = ServingConfig.from_args(["--config", str(path), "--cuda-graph-max-bs", "32", "--target", "cpu"])
    assert merged.cuda_graph_max_bs == 32 and merged.targets == ("cpu",)
    assert merged.speculative_num_draft_tokens == 4


def test_toml_to_json_round_trip(tmp_path):
    cfg = ServingConfig(cuda_graph_max_bs=96, speculative_num_draft_tokens=3, ragged_verify_mode="compact",
                        targets=("cpu", "sm_100"), backends=("tvm_ffi", "triton"))
    lines = [f"{k} = {v!r}".replace("'", '"').replace("None", '""').replace("True", "true")
             .replace("False", "false") for k, v in cfg.to_json().items() if v is not None]
    path = tmp_path / "c.toml"
    path.write_text("\n".join(lines))
    assert ServingConfig.from_toml(path) == cfg


@pytest.mark.parametrize("content, message", [
    ("cuda_graph_max_bs = \n", "is not valid TOML"),
    ("max_batch = 3\n", "unknown key 'max_batch'"),
    ("cuda_graph_max_bs = -1\n", "--cuda-graph-max-bs must be a positive integer, got -1"),
])
def test_bad_config_file_exits_2(capsys, tmp_path, content, message):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    code, _, err = run_cli(capsys, ["plan", "--config", str(path), "--target", "cpu"])
    assert code == 2 and message in err and err.count("\n") == 1


def test_missing_config_file_exits_2(capsys, tmp_path):
    code, _, err = run_cli(capsys, ["plan", "--config", str(tmp_path / "nope.toml")])
    assert code == 2 and "cannot read --config" in err
