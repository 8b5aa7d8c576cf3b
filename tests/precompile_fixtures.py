"""Shared helpers for the warm / hook / CLI tests: small plans, a prestarted cache, CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jitwarm.precompile import ServingConfig, WarmPlan

WORKERS = Path(__file__).with_name("workers")

# 7 specs (norm_rope 3, compressor 3, plan 1), float32, host target: ragged and uniform shapes.
SMALL = ["--cuda-graph-max-bs-decode", "4", "--speculative-algorithm", "DSPARK", "--speculative-num-draft-tokens", "2",
         "--ragged-verify-mode", "compact",
         "--compress-ratios", "4", "--head-dim", "64", "--rope-dim", "32", "--num-q-heads", "2",
         "--dtype", "float32", "--target", "cpu"]
# 3 specs (one per family): for tests that build again from nothing.
TINY = ["--cuda-graph-bs", "1", "--compress-ratios", "4", "--head-dim", "64", "--rope-dim", "32",
        "--num-q-heads", "2", "--dtype", "float32", "--target", "cpu"]
# TINY on the Triton backend for the host (its interpreter): a build writes one small file, so tests of the warm
# and publish protocol, where what the compiler does is not the point, spend no seconds compiling.
TINY_FAST = [*TINY, "--backend", "triton"]


def plan_of(flags: list[str]) -> WarmPlan:
    """The plan the CLI builds for these flags."""
    return WarmPlan.build(ServingConfig.from_args(flags))


def jitwarm(*args: str, env: dict[str, str] | None = None, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess; returns the completed process (stdout/stderr as text)."""
    return subprocess.run([sys.executable, "-m", "jitwarm.precompile", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def start_jitwarm(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the real CLI in a subprocess without waiting."""
    return subprocess.Popen([sys.executable, "-m", "jitwarm.precompile", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def run_worker(name: str, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<name>`` with this interpreter."""
    return subprocess.run([sys.executable, str(WORKERS / name), *args], capture_output=True, text=True,
                          timeout=timeout)


def json_out(proc: subprocess.CompletedProcess) -> dict:
    """The JSON object a command printed on its last stdout line."""
    return json.loads(proc.stdout.strip().splitlines()[-1])
