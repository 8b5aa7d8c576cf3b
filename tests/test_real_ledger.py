"""The ledger is proof: a real vLLM server (vLLM's CPU build, tests/vllm_cpu.py) whose restore lost a file.

One module fixture runs the operator's flow on the path the docs deploy (vLLM's defaults: AOT compile on,
Inductor's precompiled headers off), each step a real process: ``jitwarm capture --export`` ran ``vllm serve`` once
on an empty node (conftest ``vllm_captured``, the run's one capture); ``jitwarm prestart --offline`` restores the
bundle on a fresh node; then one of the graph kernels (a ``.so`` in vLLM's AOT tree) is deleted there, as a node
whose volume lost a file, and the server starts with ``JITWARM_LEDGER`` and a ``g++`` first on its ``PATH`` that
logs each call and runs the real compiler (the witness, which asks no library); it answers capture's first
requests, then writes the ledger at stop when asked (its counts since the start).

vLLM loads its AOT artifact (its counter: served) and Inductor's own counters say "hit, no miss" for that start,
yet Inductor's loader builds the missing kernel again from the source beside it: the ledger must say what the
witness saw. (The same case with a lost precompiled header, on a plain ``torch.compile``: tests/test_ledger.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import vllm_cpu as server
from workers.capture_harness import wait_for

from jitwarm.precompile import warm_requests
from jitwarm.precompile.ledger import stop_path, stop_request_path

#: A g++ first on PATH that logs each call, then runs the real one as it was called: argv[0] "g++" and PATH
#: without this folder, so the compiler finds itself where it is and ``g++ -v`` (which Inductor keys its ISA
#: probes and precompiled headers on: cpp_builder.py ``get_compiler_version_info``) says what it says without it.
WITNESS = """#!/bin/bash
printf '%s\\n' "$*" >> "$JITWARM_TEST_WITNESS"
PATH="${PATH#"${0%/*}:"}" exec -a g++ g++ "$@"
"""


def witnessed(tmp: Path, path: str) -> tuple[Path, dict[str, str]]:
    """:data:`WITNESS` as ``g++`` first on ``path`` (a ``PATH`` value): its log, and the variables a start takes."""
    log, bin_dir = tmp / "witness.log", tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "g++").write_text(WITNESS)
    (bin_dir / "g++").chmod(0o755)
    return log, {"JITWARM_TEST_WITNESS": str(log), "PATH": os.pathsep.join([str(bin_dir), path])}


def seen(log: Path) -> list[str]:
    """The witness's calls, one a line (none where it never ran)."""
    return log.read_text().splitlines() if log.is_file() else []


def compiles(witness: list[str]) -> list[str]:
    """The witness's lines that compiled: an output named (``-o``), not a preprocessing (``-E``) or a question."""
    return [line for line in witness if " -o " in f" {line} " and " -E " not in f" {line} "]


def outputs(lines: list[str]) -> set[str]:
    return {line.split(" -o ", 1)[1].split()[0] for line in lines}


@pytest.fixture(scope="module")
def lost(vllm_cpu, vllm_captured, tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ here: Inductor's CPU build needs it")
    tmp = tmp_path_factory.mktemp("real_ledger")
    node = tmp / "fresh-node"
    manifest, bundle = vllm_captured["manifest"], vllm_captured["bundle"]
    defaults = server.on_defaults(vllm_cpu)  # as the documented pod runs it
    env = defaults.env(node)
    prestart = vllm_cpu.jitwarm("prestart", "--manifest", str(manifest), "--bundle", str(bundle), "--offline",
                                env=env)
    assert prestart.returncode == 0, prestart.stderr
    status_before = vllm_cpu.jitwarm("status", "--manifest", str(manifest), env=env)
    # a graph's kernel (the ISA probes' .so are beside them), loaded as the artifact loads: up to ready
    [so, *_] = sorted((node / "vllm").glob("torch_compile_cache/torch_aot_compile/*/inductor_cache/*/*.main.so"))
    so.unlink()
    status = vllm_cpu.jitwarm("status", "--manifest", str(manifest), env=env)
    verify = vllm_cpu.jitwarm("verify", "--manifest", str(manifest), "--json", env=env)
    witness, witnessing = witnessed(tmp, env["PATH"])
    ledger = node / "ledger.json"
    with server.serving(defaults, node, JITWARM_LEDGER=str(ledger), **witnessing) as (port, _):
        answer = server.complete(port, vllm_cpu.model)
        warm_requests.send(f"http://127.0.0.1:{port}/health", warm_requests.DEFAULT)
        stop_request_path(ledger).touch()
        wait_for("the ledger at stop", stop_path(ledger).is_file, 300)
        since_start = json.loads(stop_path(ledger).read_text())
    gate = vllm_cpu.jitwarm("ledger", str(ledger), "--require-zero", env=env)
    return {"node": node, "so": so, "ledger": since_start, "answer": answer, "gate": gate,
           "witness": seen(witness), "status": status,
           "status_before": status_before, "verify": verify, "log": (node / "server.log").read_text(errors="replace")}


def test_a_restored_start_that_rebuilt_a_kernel_says_so_with_the_witness_evidence(lost):
    ledger = lost["ledger"]
    assert ledger["families"]["vllm_compile"]["served"] >= 1 and server.LOADED in lost["log"]  # its artifact loaded
    inductor = ledger["families"]["inductor"]
    assert inductor["served"] >= 1  # Inductor's own counters: a hit
    ran = compiles(lost["witness"])
    assert outputs(ran) == {str(lost["so"])}, lost["witness"]
    assert lost["so"].is_file()  # the start wrote it again
    assert inductor["compiled"] >= 1 and ledger["compiled"] >= inductor["compiled"], inductor
    assert inductor["compiler_runs"] == len(ran) and set(inductor["compiler_outputs"]) == outputs(ran), inductor
    assert inductor["compiler_probes"] == len(lost["witness"]) - len(ran)  # --version, -v: not compiles
    assert ledger["unattributed"]["compiler_runs"] == 0  # every g++ was Inductor's
    unit = str(lost["so"].relative_to(lost["node"] / "vllm" / "torch_compile_cache")).split(".")[0]
    assert unit in inductor["keys"] and inductor["written"] >= 1, inductor
    assert lost["answer"]["usage"]["completion_tokens"] == 5


def test_the_gate_fails_that_start(lost):
    gate = lost["gate"]
    assert gate.returncode == 1, gate.stdout + gate.stderr
    assert any(line.startswith("jitwarm: ledger: inductor: ") for line in gate.stdout.splitlines())


def test_status_and_verify_see_the_deleted_unit_where_vllm_looks(lost):
    assert lost["status_before"].returncode == 0, lost["status_before"].stdout + lost["status_before"].stderr
    status = lost["status"]
    assert status.returncode == 5, status.stdout + status.stderr
    assert f"missing at {lost['so']}" in status.stdout
    verify = lost["verify"]
    assert verify.returncode == 5, verify.stderr
    named = [why for whys in json.loads(verify.stdout)["not_where_looked"].values() for why in whys]
    assert f"missing at {lost['so']}" in named


def test_the_start_says_the_restore_is_short_of_one_unit_where_vllm_looks(lost):
    """The plugin's restore check at start, in the ledger's report: vLLM's tree holds one unit fewer than placed."""
    [line] = [x for x in lost["gate"].stdout.splitlines() if x.startswith("jitwarm: restore: vllm_compile: ")]
    found, placed = map(int, re.search(r"found (\d+) of (\d+)$", line).groups())
    assert found == placed - 1, line
