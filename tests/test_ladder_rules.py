"""The built-in sglang 0.5.23 resolution rules, on the cases the issue names (the oracle test checks a grid)."""

import json

import pytest

from jitwarm.precompile import ServingConfig, WarmPlan, capture_shapes
from jitwarm.precompile.cli import main
from jitwarm.precompile.servers.sglang import rules

H200_MIB = 143771


def shapes(**kw):
    kw.setdefault("targets", ("cpu",))
    return capture_shapes(ServingConfig(**kw))


def dspark(**kw):
    return dict(draft_algorithm="DSPARK", draft_tokens=6, ragged_verify_mode="compact", **kw)


@pytest.mark.parametrize("tp, max_bs", [(1, 256), (2, 256), (4, 512), (8, 512)])
def test_h200_default_max_batch_follows_tp(tp, max_bs):
    assert shapes(gpu_memory_mb=H200_MIB, tp=tp)[0].bs == max_bs


def test_memory_tiers():
    assert [rules.default_max_bs(m, 1) for m in (16_000, 24_000, 40_000, 81_559, H200_MIB, 190_000, None)] == [
        8, 48, 32, 256, 256, 512, 160]
    assert rules.default_max_bs(24_000, 4) == 160


def test_running_requests_cap_the_default_but_not_an_explicit_max():
    assert shapes(gpu_memory_mb=H200_MIB, max_requests=100)[0].bs == 100
    explicit = shapes(graph_max_bs=256, max_requests=100, gpu_memory_mb=H200_MIB)
    assert explicit[0].bs == 100  # no cap on the max, but the runner's pool cut still applies
    assert [s.bs for s in explicit][:3] == [100, 96, 88]


def test_explicit_list_sets_the_max():
    out = shapes(graph_bs=(3, 17, 9))
    assert [s.bs for s in out] == [17, 9, 3]


def test_readme_profile_without_running_requests_captures_23_graphs_up_to_48():
    out = shapes(**dspark(graph_max_bs=128))
    assert len(out) == 23 and out[0].bs == 48 and out[0].layout.verify_lens == (6,) * 48


def test_with_512_running_requests_the_ladder_goes_to_128_and_bs60_is_the_incident():
    out = shapes(**dspark(graph_max_bs=128, max_requests=512))
    assert len(out) == 35 and out[0].bs == 128
    bs60 = next(s for s in out if s.bs == 60)
    assert bs60.layout.run_length() == "[3]*104+[2]*24" and bs60.graph_key == 360


def test_pool_size_below_the_max_is_appended():
    out = shapes(**dspark(graph_max_bs=128, max_requests=50))
    assert [s.bs for s in out][:3] == [50, 48, 44]


def test_dp_attention_drops_sizes_whose_tokens_do_not_divide():
    plain = {s.bs for s in shapes(graph_max_bs=32, tp=4)}
    dp = {s.bs for s in shapes(graph_max_bs=32, tp=4, attn_dp=2)}
    assert 1 in plain and dp == plain - {1}
    # the deprecated spelling --dp-size 2 --enable-dp-attention means the same
    assert {s.bs for s in shapes(graph_max_bs=32, tp=4, dp=2, dp_attention=True)} == dp
    # speculative tokens count: 6 tokens per request divide by 2 for every bs
    spec = shapes(graph_max_bs=32, tp=4, attn_dp=2, max_requests=64,
                  draft_algorithm="EAGLE", draft_steps=5, draft_topk=1)
    assert 1 in {s.bs for s in spec}


def test_the_pool_is_per_attention_dp_rank():
    out = shapes(graph_max_bs=128, tp=4, attn_dp=2, max_requests=96)
    assert out[0].bs == 48


def test_draft_tokens_alone_give_the_plain_ladder():
    plain = [s.bs for s in shapes(graph_max_bs=64)]
    assert [s.bs for s in shapes(graph_max_bs=64, draft_tokens=6)] == plain
    assert all(s.layout.verify_lens == (1,) * s.bs for s in shapes(graph_max_bs=64,
                                                                   draft_tokens=6))


def test_eagle_with_the_compact_env_stays_uniform(monkeypatch):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
    out = shapes(graph_max_bs=64, max_requests=64, draft_algorithm="EAGLE",
                 draft_steps=3, draft_topk=1)
    assert all(s.layout.uniform and s.graph_key == s.bs for s in out)
    compact = shapes(graph_max_bs=64, max_requests=64, draft_algorithm="DSPARK",
                     draft_tokens=4)
    assert all(s.graph_key == 4 * s.bs for s in compact) and not all(s.layout.uniform for s in compact)


def test_nextn_is_eagle():
    chain = dict(graph_max_bs=16, draft_steps=2, draft_topk=1)
    a = shapes(draft_algorithm="NEXTN", **chain)
    b = shapes(draft_algorithm="EAGLE", **chain)
    assert a == b


def test_graph_config_json_wins_over_the_flags():
    out = shapes(graph_max_bs=128, graph_config={"decode": {"max_bs": 24}})
    assert out[0].bs == 24
    assert shapes(graph_max_bs=128, graph_config={"decode": {"bs": [2, 5]}})[0].bs == 5


@pytest.mark.parametrize("flag", ["no_graphs", "no_decode_graphs"])
def test_disabled_decode_graphs_capture_nothing(flag):
    cfg = ServingConfig(targets=("cpu",), **{flag: True})
    plan = WarmPlan.build(cfg)
    assert plan.shapes == () and plan.specs == () and plan.ladder.disabled


def test_plan_json_gives_bs_graph_key_verify_lens_and_the_source(capsys):
    argv = ["plan", "--json", "--target", "cpu", "--ladder-source", "builtin", "--speculative-algorithm", "DSPARK",
            "--speculative-num-draft-tokens", "6", "--ragged-verify-mode", "compact", "--cuda-graph-max-bs-decode",
            "128", "--max-running-requests", "512"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ladder"]["source"] == f"built-in rules of sglang {rules.VERSION}"
    bs60 = next(s for s in data["shapes"] if s["bs"] == 60)
    assert bs60["graph_key"] == 360 and bs60["verify_lens"] == [3] * 104 + [2] * 24


def test_dspark_block_size_sets_the_draft_tokens():
    from jitwarm.precompile.servers.sglang.argv import ServerArgvError, _to_inputs

    dspark = {"speculative_algorithm": "DSPARK"}
    assert _to_inputs({**dspark, "speculative_dspark_block_size": 5})["speculative_num_draft_tokens"] == 6
    with pytest.raises(ServerArgvError, match="must equal"):
        _to_inputs({**dspark, "speculative_dspark_block_size": 5, "speculative_num_draft_tokens": 4})
    # only DSpark reads it (speculative_hook.py:807)
    assert "speculative_num_draft_tokens" not in _to_inputs({"speculative_algorithm": "EAGLE",
                                                             "speculative_dspark_block_size": 5})
