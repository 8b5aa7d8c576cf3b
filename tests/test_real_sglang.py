"""The zero-JIT boot proven on a real sglang server: sglang 0.5.23's CPU engine and its CPU graph runner
(tests/sglang_cpu.py), whose ``--enable-torch-compile`` compiles one Inductor graph per decode batch size at
capture: the CPU form of the CUDA-graph ladder.

One module fixture runs the operator's flow, each step a real process, on the one capture of the run
(conftest ``sglang_captured``: ``jitwarm capture --export`` of a cold start, sizes 1..2):

1. ``jitwarm prestart --offline`` restores the bundle on a fresh node, in the server's environment;
2. a real start there with ``JITWARM_LEDGER`` and a ``g++`` witness first on its ``PATH`` captures its graphs
   and compiles nothing: its files, the witness, its ledger; it answers capture's first requests, among them one
   greedy request alone (the size-1 graph) and a batch of two (the size-2 graph), as capture's cold start answered
   them (kept beside the manifest): the restored graphs compute the cold start's tokens;
3. the same node started with one size more (``--torch-compile-max-bs 3``): exactly size 3 compiles, and
   jitwarm's plugin names it during the capture, a warning by default (the start serves); and a second restored
   node started so under ``JITWARM_STRICT=1``: an error, the start stopped at the first kernel, before writing it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import sglang_cpu as server_set
import vllm_cpu
from compiled_files import compiled, files_under
from first_answers import compared, kept
from test_real_ledger import compiles, seen, witnessed

from jitwarm.precompile import warm_requests
from jitwarm.precompile.capture import ServerProcess

#: What the plugin says of a compile in a restored node's CPU graph capture (precompile/servers/sglang/plugin.py).
NAMED = "CPU graph capture on a restored node"


def cache_files(node: Path) -> dict[str, int]:
    """Every file under the node's library caches (``SGLANG_CACHE_DIR``, ``$TMPDIR/torchinductor_*``), its size."""
    return files_under(node, [node / "sglang", *(node / "tmp").glob("torchinductor_*")])


def first_requests(port: int, captured: dict) -> list:
    """Capture's first requests (its default ones, then :data:`sglang_cpu.GREEDY`), sent again; each answer."""
    return warm_requests.send(f"http://127.0.0.1:{port}/health", warm_requests.read(captured["requests"]))


def strict_start(server: server_set.SglangCpu, node: Path, timeout: float = 900) -> tuple[int | None, str]:
    """A start under ``JITWARM_STRICT=1`` with one size more, until it exits (or is ready: then stopped)."""
    port = vllm_cpu.free_port()
    log = node / "strict.log"
    proc = ServerProcess.start([*server.serve(port), "--torch-compile-max-bs", str(server_set.MAX_BS + 1)],
                               server.env(node, JITWARM_STRICT="1"), log)
    try:
        from jitwarm.precompile.capture import answers as up

        while proc.exited() is None and time.monotonic() - proc.started < timeout:
            if up(f"http://127.0.0.1:{port}/health"):
                break
            time.sleep(0.5)
        return proc.exited(), log.read_text(errors="replace")
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def flow(sglang_cpu, sglang_captured, tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ here: Inductor's CPU build needs it")
    tmp = tmp_path_factory.mktemp("real_sglang")
    node = tmp / "fresh-node"
    env = sglang_cpu.env(node)
    restored = sglang_cpu.jitwarm("prestart", "--manifest", str(sglang_captured["manifest"]), "--bundle",
                                  str(sglang_captured["bundle"]), "--offline", "--json", env=env)
    assert restored.returncode == 0, restored.stderr
    before = cache_files(node)
    witness, witnessing = witnessed(tmp, env["PATH"])
    ledger = node / "ledger.json"
    with vllm_cpu.serving(sglang_cpu, node, timeout=1200, JITWARM_LEDGER=str(ledger), **witnessing) as (port, ready_s):
        at_ready, ready_files = json.loads(ledger.read_text()), cache_files(node)
        got = first_requests(port, sglang_captured)
        after = cache_files(node)
    log = (node / "server.log").read_text(errors="replace")
    with vllm_cpu.serving(sglang_cpu, node, timeout=1200,
                          args=("--torch-compile-max-bs", str(server_set.MAX_BS + 1))) as (port, _):
        warned = first_requests(port, sglang_captured)
    warn_log = (node / "server.log").read_text(errors="replace")
    # a node of its own: the warned start wrote size 3's kernels into this one
    strict_node = tmp / "strict-node"
    again = sglang_cpu.jitwarm("prestart", "--manifest", str(sglang_captured["manifest"]), "--bundle",
                               str(sglang_captured["bundle"]), "--offline", env=sglang_cpu.env(strict_node))
    assert again.returncode == 0, again.stderr
    strict_code, strict_log = strict_start(sglang_cpu, strict_node)
    return {"node": node, "prestart": json.loads(restored.stdout), "before": before, "at_ready": ready_files,
            "after": after,
            "ledger": at_ready, "answers": got,
            "cold_answers": kept(json.loads(sglang_captured["stdout"])["answers"]), "ready_s": ready_s, "log": log,
            "witness": seen(witness),
            "strict_code": strict_code, "strict_log": strict_log, "strict_node": strict_node, "warned": warned,
            "warn_log": warn_log}


def sglang_cpu_gate_only() -> str:
    return f"{server_set.GATE},jitwarm"


def records(captured) -> list[dict]:
    return [r for r in map(json.loads, captured["manifest"].read_text().splitlines()) if r["kind"] != "capture"]


def test_capture_records_every_cache_the_start_fills_and_bundles_them(sglang_captured, sglang_cpu):
    """Inductor's units under $SGLANG_CACHE_DIR/inductor (recorded under sglang), its precompiled header under
    $TMPDIR (recorded under no server: Inductor's own default), nothing the census found unrecorded."""
    done = json.loads(sglang_captured["stdout"])
    listed = records(sglang_captured)
    assert done["unrecorded"] == [] and done["entries"] == len(listed) == sum(done["units"].values())
    assert done["compiled"] > 0  # the control: the cold start's own ledger says it compiled
    under = {(r["library"], r["under"], r["unit"].startswith("precompiled_headers/")) for r in listed}
    assert under == {("inductor", "sglang", False), ("inductor", "", True)}, under
    assert any("/fxgraph/" in f"/{r['unit']}" for r in listed)
    assert done["environment"] == {"SGLANG_PLUGINS": sglang_cpu_gate_only()}
    assert sglang_captured["bundle"].stat().st_size > 0
    print(f"install {sglang_cpu.install_seconds} s; capture ready {done['ready_s']} s")


def plan_ladder(server: server_set.SglangCpu, *args: str, source: str = "builtin") -> list[int]:
    """``jitwarm plan --json -- <the server's line> ARGS``'s capture sizes, by ``source``."""
    proc = server.jitwarm("plan", "--json", "--ladder-source", source, "--", *server.serve(vllm_cpu.free_port()),
                          *args, env=server.env(Path(os.environ["JITWARM_CACHE_DIR"]).parent / "plan-node"))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["ladder"]["capture_bs"]


def test_the_ladder_plan_gives_is_the_one_the_server_logs(sglang_captured, sglang_cpu):
    """sglang's CPU ladder (cuda_graph_hook.py:535-553, capped by --torch-compile-max-bs) by jitwarm's rules and by
    the installed sglang's own functions, against the sizes the real capture logged."""
    log = sglang_captured["log"].read_text(errors="replace")
    logged = server_set.graph_sizes(log)
    assert logged == [plan_ladder(sglang_cpu)] == [plan_ladder(sglang_cpu, source="sglang")] == [[1, 2]]
    assert plan_ladder(sglang_cpu, "--torch-compile-max-bs", str(server_set.MAX_BS + 1)) == [1, 2, 3]
    assert "jitwarm: ledger: inductor:" in log


def test_prestart_puts_each_unit_where_that_sglang_looks(flow, sglang_captured):
    ready = flow["prestart"]
    assert ready["ready"] is True and ready["offline"] is True
    for r in records(sglang_captured):
        root = next((flow["node"] / "tmp").glob("torchinductor_*")) if not r["under"] else \
            flow["node"] / "sglang" / "inductor"
        assert all((root / rel).is_file() for rel in r["files"]), (r["unit"], root)


def test_the_restored_start_captures_its_graphs_and_compiles_nothing(flow):
    """No compiler ran (the witness, the ledger's compiler tap), no kernel, header or FX entry was written, and the
    ledger says 0.

    sglang's CPU runner freezes the weights into its graphs (``freezing=True``, cpu_graph_runner.py:125), which
    Inductor packs for oneDNN: its FX cache does not take such a graph ("mkldnn tensors unpickleable",
    codecache.py ``BypassFxGraphCache``), so each is lowered again at every start, warm or restored, and writes its
    Python wrapper anew (it names the weights' addresses); its C++ kernels come from the restored cache. The ledger
    counts those apart ("not cacheable"), not as compiled.
    """
    log = flow["log"]
    assert server_set.graph_sizes(log) == [list(range(1, server_set.MAX_BS + 1))]
    for files in (flow["at_ready"], flow["after"]):  # up to ready, then through capture's first requests
        new = compiled({f: s for f, s in files.items() if flow["before"].get(f) != s})
        assert [f for f in new if not f.endswith(".py")] == [], f"the restored start compiled: {new}"
    new = compiled({f: s for f, s in flow["at_ready"].items() if flow["before"].get(f) != s})
    assert compiles(flow["witness"]) == [], flow["witness"]
    inductor = flow["ledger"]["families"]["inductor"]
    assert inductor["compiler_runs"] == 0 and inductor["compiler_outputs"] == [], inductor
    assert flow["ledger"]["compiled"] == inductor["compiled"] == 0, flow["ledger"]
    assert inductor["uncached"] > 0 and flow["ledger"]["uncached"] == inductor["uncached"], inductor
    assert inductor["written"] == inductor["rewritten"] == len(new) <= inductor["uncached"] + inductor["served"]
    assert inductor["served"] >= 1, inductor
    assert NAMED not in log
    said = [line for line in log.splitlines() if "jitwarm: ledger: inductor:" in line]
    assert "compiled now 0, not cacheable" in said[0], said
    print(f"restored: ready {flow['ready_s']:.1f} s, graph capture {server_set.capture_seconds(log)} s, "
          f"{inductor['served']} FX graphs served, {inductor['uncached']} not cacheable (lowered again), 0 compiled")


def test_the_ledger_is_reported_after_the_cpu_graphs_before_the_server_is_ready(flow):
    lines = flow["log"].splitlines()
    end = next(i for i, line in enumerate(lines) if "Capture target decode CPU graph end" in line)
    ledger = next(i for i, line in enumerate(lines) if "jitwarm: ledger: inductor: served from cache" in line)
    fired = next(i for i, line in enumerate(lines) if "The server is fired up and ready to roll" in line)
    assert end < ledger < fired


def test_a_compile_in_a_restored_capture_is_an_error_under_strict(flow, sglang_cpu):
    assert flow["strict_code"] not in (None, 0), flow["strict_log"][-3000:]
    log = flow["strict_log"]
    assert server_set.graph_sizes(log) == [plan_ladder(sglang_cpu, "--torch-compile-max-bs", "3")]
    assert "CompileDuringCaptureError" in log and NAMED in log, log[-3000:]
    # stopped at the first kernel the restore lacked, before it was written: not after the batch size compiled
    assert "; 1 such)" in log and "compiled during sglang's CPU graph capture" not in log, log[-3000:]
    kernel = re.search(r"Inductor C\+\+ kernel (\S+) would be compiled", log).group(1)
    assert not list(flow["strict_node"].rglob(kernel)), kernel


def test_a_compile_in_a_restored_capture_is_a_warning_by_default(flow):
    log = flow["warn_log"]
    assert server_set.graph_sizes(log) == [list(range(1, server_set.MAX_BS + 2))]
    warnings = [line for line in log.splitlines() if NAMED in line]
    assert warnings and all("WARNING" in line or "jitwarm:" in line for line in warnings), log[-3000:]
    assert "Inductor C++ kernel" in warnings[0]
    cold, warned = compared(flow["cold_answers"], flow["warned"])
    assert warned == cold


def test_the_restored_starts_answers_are_the_cold_starts(flow):
    """Capture's first requests, sent again: every one answered, and the greedy ones (a single request and a batch
    of two: two graph sizes) with the tokens capture's cold start gave, which compiled those graphs."""
    assert [a.failure for a in flow["answers"] if a.failure] == []
    cold, restored = compared(flow["cold_answers"], flow["answers"])
    single, batch = restored[-2:]  # sglang_cpu.GREEDY, after capture's default first requests
    assert len(single) == 1 and len(batch) == 2 and all(len(ids) == 8 for ids in batch)
    assert single[0] == batch[0]
    assert restored == cold
