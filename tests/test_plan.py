import json
import subprocess
import sys

import pytest

from jitwarm.kernels import KernelSpec, VerifyLayout, plan_threads
from jitwarm.precompile import ServingConfig, WarmPlan, capture_batch_sizes, capture_shapes, verify_lens_for
from jitwarm.precompile.cli import main

# The DSpark-128 profile: 35 graphs, 30 specs (a request pool of 128; sglang's speculative default is 48).
DSPARK = dict(graph_max_bs=128, max_requests=128, draft_algorithm="DSPARK",
              draft_tokens=6, ragged_verify_mode="compact")
DSPARK_FLAGS = ["--cuda-graph-max-bs-decode", "128", "--max-running-requests", "128", "--speculative-algorithm",
                "DSPARK", "--speculative-num-draft-tokens", "6", "--ragged-verify-mode", "compact", "--target", "cpu"]


def config(**kw):
    kw.setdefault("targets", ("cpu",))
    return ServingConfig(**kw)


def test_dspark_ladder_has_35_shapes_largest_first():
    shapes = capture_shapes(config(**DSPARK))
    assert len(shapes) == 35
    assert [s.bs for s in shapes] == sorted((s.bs for s in shapes), reverse=True)
    assert shapes[0].bs == 128 and shapes[-1].bs == 1


def test_bs60_is_the_incident_layout():
    shape = next(s for s in capture_shapes(config(**DSPARK)) if s.bs == 60)
    assert shape.layout.verify_lens == (3,) * 104 + (2,) * 24
    assert shape.layout.run_length() == "[3]*104+[2]*24"
    assert (shape.num_tokens, shape.layout.slots, shape.layout.max_len) == (360, 128, 3)


def test_uniform_shapes_are_128_64_and_small():
    uniform = {s.bs for s in capture_shapes(config(**DSPARK)) if s.layout.uniform}
    ladder = set(capture_batch_sizes(config(**DSPARK)))
    assert uniform == {128, 64} | {b for b in ladder if b <= 20}


def test_every_compact_layout_conserves_tokens():
    cfg = config(**DSPARK)
    for bs in capture_batch_sizes(cfg):
        lens = verify_lens_for(cfg, bs)
        assert sum(lens) == bs * 6 and len(lens) == min(bs * 6, 128)
        assert min(lens) >= 1 and max(lens) - min(lens) <= 1
        assert list(lens) == sorted(lens, reverse=True)


def test_speculative_ladder_for_max_bs_80():
    expected = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 81, 8)]
    cfg = config(graph_max_bs=80, max_requests=80, draft_algorithm="EAGLE",
                 draft_steps=5, draft_topk=1)
    assert capture_batch_sizes(cfg) == expected


def test_plain_ladder_without_an_algorithm():
    expected = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, 601, 32), 600]
    assert capture_batch_sizes(config(graph_max_bs=600)) == expected
    # draft tokens alone do not switch sglang to the speculative ladder
    assert capture_batch_sizes(config(graph_max_bs=600, draft_tokens=6)) == expected
    assert all(s.layout.verify_lens == (1,) * s.bs for s in capture_shapes(config(graph_max_bs=64)))


def test_max_bs_is_appended_when_off_the_ladder():
    cfg = config(graph_max_bs=100, max_requests=100, draft_algorithm="EAGLE",
                 draft_steps=1, draft_topk=1)
    assert capture_batch_sizes(cfg)[-3:] == [88, 96, 100]


def test_no_padding_ladder_and_explicit_list():
    assert capture_batch_sizes(config(graph_max_bs=12, no_graph_padding=True)) == list(
        range(1, 13))
    assert capture_batch_sizes(config(graph_bs=(16, 2, 2, 7))) == [2, 7, 16]
    older_alias = ServingConfig.from_mapping({"cuda-graph-bs": [16, 2, 2, 7], "target": "cpu"})
    assert capture_batch_sizes(older_alias) == [2, 7, 16]


def test_max_running_requests_cuts_the_ladder_and_is_appended():
    sizes = capture_batch_sizes(config(graph_max_bs=128, max_requests=50,
                                       draft_algorithm="DSPARK", draft_tokens=6))
    assert max(sizes) == 50 and 48 in sizes and 52 not in sizes


def test_speculative_default_of_48_running_requests():
    shapes = capture_shapes(config(graph_max_bs=128, draft_algorithm="DSPARK",
                                   draft_tokens=6, ragged_verify_mode="compact"))
    assert len(shapes) == 23 and shapes[0].bs == 48
    assert shapes[0].layout.verify_lens == (6,) * 48 and shapes[0].graph_key == 288


@pytest.mark.parametrize("mode", ["static", "cap-accept"])
def test_static_modes_verify_full_blocks(mode):
    cfg = config(**{**DSPARK, "ragged_verify_mode": mode})
    assert all(s.layout.verify_lens == (6,) * s.bs for s in capture_shapes(cfg))
    assert len(WarmPlan.build(cfg).specs) == 9


def test_dspark_plan_has_30_specs():
    plan = WarmPlan.build(config(**DSPARK))
    assert plan.by_family() == {"norm_rope": 8, "compressor": 16, "plan": 6}
    norm = {(s["uniform"], s["max_len"]) for s in plan.specs if s.family == "norm_rope"}
    assert norm == {(1, 6), (1, 3), (1, 1), (0, 6), (0, 5), (0, 4), (0, 3), (0, 2)}
    assert {(s["ratio"], s["threads"]) for s in plan.specs if s.family == "plan"} == {
        (r, t) for r in (4, 128) for t in (32, 64, 128)}
    assert len(set(plan.specs)) == len(plan.specs)


def test_bs60_introduces_new_compressor_and_norm_rope_specs():
    plan = WarmPlan.build(config(**DSPARK))
    new = next(plan.introduced[shape] for shape in plan.shapes if shape.bs == 60)
    assert {s.family for s in new} == {"compressor", "norm_rope"}
    assert all(s["max_len"] == 3 and s["uniform"] == 0 for s in new)
    assert all(60 in plan.needed_by[s] for s in new)


def test_every_shape_is_covered_and_first_needed_order():
    plan = WarmPlan.build(config(**DSPARK))
    seen = []
    for shape in plan.shapes:
        seen.extend(plan.introduced[shape])
    assert tuple(seen) == plan.specs
    for sizes in plan.needed_by.values():
        assert list(sizes) == sorted(sizes, reverse=True)


@pytest.mark.parametrize("field, values", [("targets", ("cpu", "sm_90")), ("backends", ("tvm_ffi", "triton"))])
def test_two_targets_or_backends_double_the_specs(field, values):
    one = WarmPlan.build(config(**DSPARK))
    two = WarmPlan.build(config(**DSPARK, **{field: values}))
    assert len(two.specs) == 2 * len(one.specs)
    strip = lambda s: (s.family, s.params)  # noqa: E731
    attr = field[:-1]
    for value in values:
        subset = [s for s in two.specs if getattr(s, attr) == value]
        assert [strip(s) for s in subset] == [strip(s) for s in one.specs]
    assert two.plan_id != one.plan_id


def test_plan_id_is_stable_and_order_free():
    a = WarmPlan.build(config(**DSPARK))
    b = WarmPlan.build(config(**DSPARK, compress_ratios=(128, 4)))
    assert a.plan_id == b.plan_id and len(a.plan_id) == 16


def test_plan_threads_rule():
    assert [plan_threads(n) for n in (1, 6, 32, 33, 64, 65, 128, 1000, 5000)] == [
        32, 32, 32, 64, 64, 128, 128, 1024, 1024]


def test_kernel_spec_json_round_trip_and_hash():
    spec = KernelSpec("compressor", "tvm_ffi", "sm_90", {"ratio": 4, "dtype": "bfloat16", "max_len": 3})
    again = KernelSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec and hash(again) == hash(spec)
    assert KernelSpec("plan", "tvm_ffi", "cpu", {"threads": 32, "ratio": 4}) == KernelSpec(
        "plan", "tvm_ffi", "cpu", {"ratio": 4, "threads": 32})
    with pytest.raises(TypeError):
        KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 4.0})


def test_verify_layout_rejects_bad_lengths():
    with pytest.raises(ValueError, match="below 1"):
        VerifyLayout((2, 0))
    with pytest.raises(ValueError, match="empty"):
        VerifyLayout(())


def test_plan_json_output(capsys):
    assert main(["plan", "--json", *DSPARK_FLAGS]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["totals"] == {"shapes": 35, "specs": 30,
                              "by_family": {"norm_rope": 8, "compressor": 16, "plan": 6}, "recorded": 0}
    bs60 = next(s for s in data["shapes"] if s["bs"] == 60)
    assert bs60["verify_lens"] == [3] * 104 + [2] * 24 and bs60["uniform"] is False
    assert bs60["num_tokens"] == 360 and bs60["slots"] == 128
    ids = {s["id"] for s in data["specs"]}
    assert set(bs60["new_specs"]) <= ids
    spec = data["specs"][0]
    assert set(spec) == {"id", "family", "backend", "target", "params", "needed_by_bs"}
    assert KernelSpec.from_json(spec).id == spec["id"]


def test_plan_table_output(capsys):
    assert main(["plan", *DSPARK_FLAGS]) == 0
    out = capsys.readouterr().out
    row60 = next(line for line in out.splitlines() if line.split()[:1] == ["60"])
    assert "[3]*104+[2]*24" in row60 and "compressor(" in row60 and "norm_rope(" in row60
    assert "30 specs for 35 shapes (norm_rope 8, compressor 16, plan 6)" in out


def test_plan_cli_imports_no_heavy_modules_and_is_fast(tmp_path):
    code = ("import sys, time; t=time.perf_counter(); from jitwarm.precompile.cli import main; "
            "import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()): rc = main(sys.argv[1:])\n"
            "heavy = [m for m in ('torch', 'triton', 'tvm_ffi', 'numpy') if m in sys.modules]\n"
            "print(rc, time.perf_counter() - t, heavy)")
    before = set(tmp_path.iterdir())
    out = subprocess.run([sys.executable, "-c", code, "plan", *DSPARK_FLAGS], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout.split(maxsplit=2)
    assert out[0] == "0" and out[2].strip() == "[]"
    # Not a latency claim (bench/plan_latency.py measures that, docs/performance.md): a guard against an import
    # that takes seconds, such as sglang's (21-67 s), with room for a loaded 2-core CI box.
    assert float(out[1]) < 15
    assert set(tmp_path.iterdir()) == before


def test_plan_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "jitwarm.precompile", "plan", "--json", *DSPARK_FLAGS],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["totals"]["specs"] == 30


# --- which of jitwarm's families the served model runs (DeepSeek-V4's only) ----------------------------------

SERVER = ["--", "python", "-m", "sglang.launch_server", "--cuda-graph-max-bs-decode", "128", "--max-running-requests",
          "128", "--speculative-algorithm", "DSPARK", "--speculative-num-draft-tokens", "6"]
COMPACT = ["--target", "cpu", "--ragged-verify-mode", "compact"]


def checkpoint(tmp_path, config) -> str:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def run_plan(capsys, argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"])
def test_a_local_model_that_is_not_deepseek_v4_plans_none_of_jitwarm_s_families(capsys, tmp_path, architecture):
    model = checkpoint(tmp_path, {"architectures": [architecture], "hidden_size": 4096})
    plan = WarmPlan.build(ServingConfig.from_args([*COMPACT, *SERVER, "--model-path", model]))
    assert len(plan.shapes) == 35 and plan.specs == ()
    assert plan.families.skipped == ("norm_rope", "compressor", "plan") and plan.families.architecture == architecture
    code, out, err = run_plan(capsys, [*COMPACT, "--json", *SERVER, "--model-path", model])
    assert code == 0 and json.loads(out)["families"]["skipped"] == ["norm_rope", "compressor", "plan"]
    assert err.count("\n") == 1 and "nothing to warm" in err and architecture in err
    assert "the model runs none of jitwarm's kernel families" in err


def test_a_local_deepseek_v4_checkpoint_plans_every_family(capsys, tmp_path):
    model = checkpoint(tmp_path, {"architectures": ["DeepseekV4ForCausalLM"]})
    code, out, _ = run_plan(capsys, [*COMPACT, *SERVER, "--model-path", model])
    assert code == 0 and "30 specs for 35 shapes" in out
    assert f"model: architectures ['DeepseekV4ForCausalLM'] in {model}/config.json: DeepSeek-V4" in out


@pytest.mark.parametrize("model, planned, said", [
    ("deepseek-ai/DeepSeek-V4-Flash", 30, "its name says DeepSeek-V4: every family planned"),  # the README's
    ("meta-llama/Llama-3.1-8B", 30, "architecture unknown, every family planned"),
])
def test_a_hub_id_is_judged_by_its_name_and_the_plan_says_how(capsys, model, planned, said):
    code, out, _ = run_plan(capsys, [*COMPACT, "--json", *SERVER, "--model-path", model])
    data = json.loads(out)
    assert code == 0 and data["totals"]["specs"] == planned and said in data["families"]["why"]
    code, out, _ = run_plan(capsys, [*COMPACT, *SERVER, "--model-path", model])
    assert f"model: {model} is not a local path" in out


def test_model_architecture_says_it_for_a_path_that_is_not_local(capsys):
    argv = [*COMPACT, "--json", "--model-architecture", "Qwen3ForCausalLM", *SERVER, "--model-path", "Qwen/Qwen3-8B"]
    code, out, err = run_plan(capsys, argv)
    assert code == 0 and json.loads(out)["totals"]["specs"] == 0 and "Qwen3ForCausalLM (--model-architecture" in err
    argv[argv.index("Qwen3ForCausalLM")] = "DeepseekV4ForCausalLM"
    code, out, _ = run_plan(capsys, argv)
    assert code == 0 and json.loads(out)["totals"]["specs"] == 30


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ("[" * 100000, "is not valid JSON"),
    ('{"architectures": "LlamaForCausalLM"}', '"architectures" must be a list of names'),
    ("[1, 2]", "is not a JSON object"),
    ("x" * (5 << 20), "larger than"),
])
def test_a_malformed_local_config_json_is_one_line_exit_2(capsys, tmp_path, content, message):
    model = checkpoint(tmp_path, content)
    code, out, err = run_plan(capsys, [*COMPACT, *SERVER, "--model-path", model])
    assert (code, out) == (2, "") and err.count("\n") == 1 and message in err, err


def test_a_fifo_planted_as_config_json_neither_blocks_nor_is_read(capsys, tmp_path):
    import os

    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    code, _, err = run_plan(capsys, [*COMPACT, *SERVER, "--model-path", str(model)])
    assert code == 2 and "not a regular file" in err and err.count("\n") == 1


def test_a_local_checkpoint_without_config_json_plans_every_family(capsys, tmp_path):
    (tmp_path / "model").mkdir()
    code, out, _ = run_plan(capsys, [*COMPACT, "--json", *SERVER, "--model-path", str(tmp_path / "model")])
    assert code == 0 and json.loads(out)["totals"]["specs"] == 30
    assert "has no config.json: architecture unknown" in json.loads(out)["families"]["why"]


# --- where the ladder comes from: the built-in rules unless another sglang release is installed ------------

PLAN_CODE = ("import contextlib, io, json, sys\nfrom jitwarm.precompile.cli import main\nout, err = io.StringIO(), "
             "io.StringIO()\nwith contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
             "    rc = main(sys.argv[1:])\nprint(json.dumps({'rc': rc, 'out': out.getvalue(), 'err': err.getvalue(), "
             "'sglang': 'sglang' in sys.modules}))")


def plan_with_sglang_release(tmp_path, version):
    """`jitwarm plan` where the installed sglang says ``version`` (a dist-info only: its code cannot be imported)."""
    site = tmp_path / "site"
    dist = site / f"sglang-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(site), "JITWARM_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", PLAN_CODE, "plan", "--json", *COMPACT, *SERVER], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_auto_takes_the_built_in_rules_for_the_release_they_mirror_without_importing_it(tmp_path):
    from jitwarm.precompile.servers.sglang import VERSION

    run = plan_with_sglang_release(tmp_path, VERSION)
    assert run["rc"] == 0 and not run["sglang"], run
    assert json.loads(run["out"])["ladder"]["source"] == f"built-in rules of sglang {VERSION}"
    assert not (tmp_path / "cache" / "ladders").exists()


def test_auto_keeps_another_release_s_answer_and_reads_it_back(tmp_path):
    """Another release: sglang's own functions, once; the answer is kept, keyed by the release and the inputs."""
    from jitwarm.cache import settings
    from jitwarm.precompile.servers import resolution_memo
    from jitwarm.precompile.servers.sglang import rules

    failed = plan_with_sglang_release(tmp_path, "9.9.9")  # no memo: its functions run, and cannot import sglang
    assert failed["rc"] == 2 and failed["err"].count("\n") == 1
    assert "sglang's own ladder functions failed" in failed["err"]
    cfg = ServingConfig.from_args([*COMPACT, *SERVER])
    inputs = {**rules.INPUT_KEYS, **cfg.room.ladder_inputs(cfg)}
    answer = {**rules.resolve(inputs), "source": "sglang 9.9.9 (installed)"}
    key = resolution_memo.key("sglang", "9.9.9", inputs)
    with settings.override(cache_dir=tmp_path / "cache"):
        resolution_memo.store(key, answer)
        memo = resolution_memo.directory() / f"{key}.json"
    assert memo.stat().st_mode & 0o077 == 0
    run = plan_with_sglang_release(tmp_path, "9.9.9")
    assert run["rc"] == 0 and not run["sglang"], run
    data = json.loads(run["out"])
    assert data["ladder"]["source"] == "sglang 9.9.9 (installed)" and data["totals"]["specs"] == 30
    # a damaged memo is ignored: resolved again (and here, again, sglang cannot be imported)
    memo.write_text(memo.read_text()[:-20])
    again = plan_with_sglang_release(tmp_path, "9.9.9")
    assert again["rc"] == 2 and "sglang's own ladder functions failed" in again["err"]


def test_a_ladder_memo_of_another_format_is_resolved_again(tmp_path):
    """A memo names its result's keys by its format (the pool is ``max_requests``): one kept in another format is
    never read as this one's, so a pool under another key cannot be read as no pool."""
    from jitwarm.cache import settings
    from jitwarm.precompile.servers import resolution_memo

    answer = {"source": "sglang 9.9.9 (installed)", "shapes": [{"bs": 1, "graph_key": 1, "verify_lens": [1]}],
              "capture_bs": [1], "max_requests": 8}
    with settings.override(cache_dir=tmp_path):
        key = resolution_memo.key("sglang", "9.9.9", {"tp_size": 1})
        resolution_memo.store(key, answer)
        assert resolution_memo.load(key) == answer
        path = resolution_memo.directory() / f"{key}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "format": resolution_memo.FORMAT - 1}))
        assert resolution_memo.load(key) is None
