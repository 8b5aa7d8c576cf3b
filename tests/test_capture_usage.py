"""What the command line tells an operator before a capture: each usage, prestart's help, and plan's pointers."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from jitwarm.precompile import cli


def jitwarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jitwarm", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_usage_shows_the_server_line_where_the_command_takes_one(name):
    usage = cli.build_parser()._subparsers._group_actions[0].choices[name].format_usage()

    if name == "capture":
        assert usage.rstrip().endswith(" -- SERVER LINE") and "[-- SERVER LINE]" not in usage
    elif name in cli.PLANLESS:
        assert "SERVER LINE" not in usage
    else:
        assert usage.rstrip().endswith("[SERVER FLAGS] [-- SERVER LINE]"), usage
        assert "--graph-max-bs" not in usage and "--cuda-graph-max-bs-decode" not in usage  # one word there


def test_prestart_help_groups_the_server_flags_by_server():
    text = jitwarm("prestart", "--help").stdout
    sections = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]

    assert "-- SERVER LINE:" in sections
    line_section = text[text.index("-- SERVER LINE:"):text.index("serving settings as flags")]
    assert "vllm 0.33.0" in line_section and "sglang 0.5.23" in line_section
    assert any(s.startswith("serving settings as flags (") for s in sections), sections
    serving = text[text.index("serving settings as flags"):text.index("model (")]
    assert "--graph-max-bs N" in serving and "sglang's flag names are aliases: --cuda-graph-max-bs-decode" in serving
    assert "--speculative-num-steps" not in serving  # an alias is said once, not listed as a flag
    assert len(text.splitlines()) < 126  # it was 126 lines, 23 of them one usage


def test_plan_without_graphs_says_capture_still_applies_and_names_the_installed_release():
    done = jitwarm("plan", "--", "vllm", "serve", "m", "--enforce-eager")

    assert done.returncode == 0, done.stderr
    assert len(done.stderr.splitlines()) == 1  # said once
    assert "nothing to warm" in done.stderr and "`jitwarm capture -- SERVER LINE` records them" in done.stderr
    assert "vllm is not installed here" in done.stderr  # this test environment has no vLLM


def test_plan_names_the_installed_release_it_planned_with():
    done = jitwarm("plan", "--gpu-memory-mb", "143771", "--", "python", "-m", "sglang.launch_server", "--model-path",
                   "m", "--cuda-graph-max-bs-decode", "8")

    assert done.returncode == 0, done.stderr
    ladder = next(line for line in done.stdout.splitlines() if line.startswith("ladder: "))
    try:
        assert ladder.endswith(f"installed here: sglang {version('sglang')}")
    except ImportError:
        assert ladder.endswith("sglang is not installed here")
