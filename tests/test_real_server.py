"""The zero-JIT boot proven on a real vLLM server (vLLM's CPU build, tests/vllm_cpu.py), on vLLM's defaults.

One module fixture runs the operator's flow, each step a real process, with nothing of vLLM's configuration changed
(AOT compile on, vLLM's default with torch >= 2.10: ``envs.py:377-386``):

1. ``jitwarm capture --export`` runs ``vllm serve`` once on an empty node: a cold start, which compiles (its own
   ledger is the control: a start without the restore compiles) and saves vLLM's AOT artifact;
2. ``jitwarm prestart --bundle B --offline`` restores the bundle alone (no manifest, no server line: the bundle
   carries its manifest) on a fresh node, run with the server's environment; and ``--manifest`` with it on two more
   nodes: one whose env factor differs (refused), one given vLLM's units alone (what prestart leaves);
3. a real start on the fresh node with ``JITWARM_LEDGER`` loads vLLM's AOT artifact (jitwarm's plugin makes this
   build's artifact loadable: ``plugin.load_aot_artifacts``) and compiles nothing, neither up to ready nor at the
   first requests capture sent (``precompile/warm_requests.py``: logprobs, chat, top-p/top-k, a batch, then five
   greedy completions): its log, its ledgers at ready and at stop, the files, and a ``g++`` first on its ``PATH``
   that logs every call (none);
4. its answers to the greedy requests are capture's cold start's (kept beside the manifest): text and top
   logprobs equal.

Nothing is faked here: no GPU is involved, the CPU platform captures no CUDA graphs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import vllm_cpu as server
from compiled_files import compiled, files_under
from first_answers import compared, kept
from test_real_ledger import seen, witnessed
from workers.capture_harness import wait_for

from jitwarm.precompile import warm_requests
from jitwarm.precompile.ledger import stop_path, stop_request_path

SHIM = "given one that does nothing"


def cache_files(node: Path) -> dict[str, int]:
    """Every file under the node's library caches (``VLLM_CACHE_ROOT``, Inductor's own, Triton's), with its size."""
    return files_under(node, [node / "vllm", *(node / "tmp").glob("torchinductor_*"), node / "home" / ".triton"])


@pytest.fixture(scope="module")
def flow(vllm_cpu, vllm_captured, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_server")
    defaults = server.on_defaults(vllm_cpu)
    node = tmp / "fresh-node"
    first, manifest, bundle = vllm_captured["first"], vllm_captured["manifest"], vllm_captured["bundle"]

    def prestart(where: Path, listed: Path = manifest, **extra: str):
        return defaults.jitwarm("prestart", "--manifest", str(listed), "--bundle", str(bundle), "--offline",
                                "--json", env=defaults.env(where, **extra))

    # the bundle alone, as an operator with nothing else in hand runs it (the start that follows is the proof)
    restored = defaults.jitwarm("prestart", "--bundle", str(bundle), "--offline", "--json", env=defaults.env(node))
    assert restored.returncode == 0, restored.stderr
    other = prestart(tmp / "other-node", VLLM_BATCH_INVARIANT="1")
    # vLLM's units alone, so that nothing the restore places is under $TMPDIR: what appears there is a side effect
    vllm_only = tmp / "vllm-only.jsonl"
    vllm_only.write_text("".join(line for line in manifest.read_text().splitlines(keepends=True)
                                 if json.loads(line).get("library") != "inductor"))
    bare = prestart(tmp / "bare-node", vllm_only)
    assert bare.returncode == 0, bare.stderr
    made = sorted(str(p.relative_to(tmp / "bare-node")) for p in (tmp / "bare-node").rglob("*"))
    before = cache_files(node)
    ledger = node / "ledger.json"
    witness, witnessing = witnessed(tmp, defaults.env(node)["PATH"])
    with server.serving(defaults, node, JITWARM_LEDGER=str(ledger), **witnessing) as (port, ready_s):
        at_ready = cache_files(node)
        answer = server.complete(port, defaults.model)
        # what capture sent: vLLM compiles its logprobs op at first use (v1/sample/ops/logprobs.py:10)
        answered = warm_requests.send(f"http://127.0.0.1:{port}/health",
                                      warm_requests.read(vllm_captured["requests"]))
        after = cache_files(node)
        stop_ledger = asked_stop_ledger(ledger)
    log = (node / "server.log").read_text(errors="replace")
    return {"tmp": tmp, "first": first, "node": node, "manifest": manifest, "bundle": bundle,
            "requests": vllm_captured["requests"],
            "captured": json.loads(vllm_captured["stdout"]), "capture_err": vllm_captured["stderr"],
            "prestart": json.loads(restored.stdout), "prestart_err": restored.stderr, "other": other, "made": made,
            "before": before, "at_ready": at_ready, "after": after, "ledger": json.loads(ledger.read_text()),
            "stop_ledger": stop_ledger, "answer": answer, "answered": answered,
            "witness": seen(witness), "ready_s": ready_s,
            "log": log}


def asked_stop_ledger(ledger: Path) -> dict[str, Any]:
    """The ledger at stop of the running server, asked for as capture asks (``ledger.stop-request``)."""
    stop_request_path(ledger).touch()
    done = stop_path(ledger)
    wait_for("the ledger at stop", done.is_file, 300)
    return json.loads(done.read_text())


def records(flow) -> list[dict]:
    """The manifest's unit records (capture adds one ``capture`` record: how it ran the server)."""
    return [r for r in map(json.loads, flow["manifest"].read_text().splitlines()) if r["kind"] != "capture"]


def test_capture_runs_the_server_once_stores_every_unit_and_bundles_them(flow):
    """The AOT tree (its rank directory, Inductor's units vLLM put in it), the model inspection; no header."""
    done = flow["captured"]
    assert done["units"]["vllm_compile"] >= 10 and done["units"]["vllm_modelinfo"] == 1, done
    listed = records(flow)
    assert len(listed) == done["entries"] == sum(done["units"].values())
    assert all(r["kind"] == "jit_cache" and r["under"] == "vllm" for r in listed)
    rank = [r["unit"] for r in listed if r["library"] == "vllm_compile" and r["unit"].endswith("/rank_0_0")]
    assert len(rank) == 1 and rank[0].startswith("torch_aot_compile/"), rank
    assert all(f"{rank[0].rsplit('/', 1)[0]}/inductor_cache/" in r["unit"] for r in listed
               if r["library"] == "vllm_compile" and r["unit"] != rank[0])  # Inductor's units vLLM redirected
    assert done["sha256"] and flow["bundle"].stat().st_size > 0
    assert done["compiled"] > 0  # the control: the same server without a restore compiles (its own ledger)
    assert "waiting for http://127.0.0.1:" in flow["capture_err"]
    assert "cannot load its own AOT artifact" not in flow["capture_err"]  # the plugin makes it load
    # Inductor's precompiled headers off (recorded): no 156 MB header to ship, no g++ -E at a restored start
    assert done["environment"]["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"
    assert not any(r["unit"].startswith("precompiled_headers/") for r in listed)


def test_capture_sent_the_first_requests_and_captured_what_they_compiled(flow):
    """The logprobs op compiled at the first request that asked for it, after ready: its units are in the
    manifest, and the ledger the plugin wrote at stop says so, per family."""
    done = flow["captured"]
    assert done["warm_requests"] == len(warm_requests.read(flow["requests"])) > len(server.GREEDY), done
    after = done["compiled_after_ready"]  # the plugin's ledger at stop, asked for by capture
    assert {"inductor", "vllm_compile"} <= after["families"].keys(), after
    assert not [w for w in done["warnings"] if "warm request" in w], done["warnings"]


def test_every_unit_the_start_wrote_in_the_library_caches_is_a_captured_unit(flow):
    """The census: capture's start ran on private caches, and every unit it wrote there is recorded (the AOT tree
    among them); the caller's own caches got nothing."""
    assert flow["captured"]["unrecorded"] == []
    assert any("torch_aot_compile/" in r["unit"] for r in records(flow))
    assert compiled(cache_files(flow["first"])) == []


def _in_root(path: str) -> str:
    """A path under the node (``tmp/torchinductor_root/7v/c7v.so``) as its library's unit names it (``7v/c7v.so``)."""
    return path.split("/", 2)[-1]


def test_the_bundle_alone_restores_offline_on_a_fresh_node_everything_it_holds(flow):
    """No manifest and no server line: the bundle's own manifest says where each unit goes (a bundle alone once
    restored nothing and said ready); the start that follows compiles nothing (below)."""
    ready = flow["prestart"]
    assert ready["ready"] is True and ready["offline"] is True
    assert ready["bundle"]["manifest"] is True, ready
    assert ready["bundle"]["supplied"] == flow["captured"]["entries"] == ready["bundle"]["entries"]
    assert sum(family["placed"] for family in ready["restored"].values()) == flow["captured"]["entries"]
    restored = {_in_root(f) for f in flow["before"]}
    assert {rel for r in records(flow) for rel in r["files"]} <= restored  # each file where its library looks
    assert "AOT artifact(s) of vllm_compile restored, but" not in flow["prestart_err"]


def test_the_restored_start_loads_vllms_aot_artifact_and_compiles_nothing(flow):
    log = flow["log"]
    assert server.LOADED in log and server.LOAD_FAILED not in log, log[-4000:]
    assert log.count(SHIM) == 1  # said once, by the worker that compiles (the engine process builds no model)
    ledger = flow["ledger"]
    assert ledger["compiled"] == 0, ledger
    assert ledger["families"]["vllm_compile"]["served"] >= 1  # vLLM's own counter: its AOT artifact loaded
    assert ledger["families"]["vllm_modelinfo"]["present_at_start"] == 1
    new = compiled({f: s for f, s in flow["at_ready"].items() if flow["before"].get(f) != s})
    assert new == [], f"the restored start compiled: {new}"
    assert flow["answer"]["choices"][0]["text"] and flow["answer"]["usage"]["completion_tokens"] == 5


def test_the_first_requests_on_the_restored_node_run_no_compiler_and_write_no_compiled_file(flow):
    """The requests capture sent, sent again: no compiled file, no compiler process (``g++ -E`` included: the
    precompiled headers are off at both ends), and the ledger at stop says nothing compiled after ready."""
    assert [a.failure for a in flow["answered"] if a.failure] == []
    new = compiled({f: s for f, s in flow["after"].items() if flow["before"].get(f) != s})
    assert new == [], f"the first requests compiled: {new}"
    # Only Inductor's questions to the compiler (cpp_builder.py: --version, -v): no compile, no preprocess
    assert set(flow["witness"]) <= {"--version", "-v"}, flow["witness"]
    stop = flow["stop_ledger"]
    assert stop["phase"] == "stop" and stop["after_ready"]["compiled"] == 0, stop["after_ready"]
    assert stop["compiled"] == 0 and stop["families"]["inductor"]["compiler_runs"] == 0, stop


def test_the_restored_starts_outputs_are_a_cold_starts(flow):
    """The artifact loaded is the model capture's cold start compiled: the same greedy text, the same top logprobs
    (capture kept its start's answers; that start compiled: nothing to load)."""
    assert server.LOADED not in (flow["first"].parent / "server.log").read_text(errors="replace")
    cold, restored = compared(kept(flow["captured"]["answers"]), flow["answered"])
    assert len(restored) == len(server.GREEDY) + 1  # the default logprobs completion is greedy too
    assert all(choice["text"] and choice["logprobs"]["top_logprobs"] for [choice] in restored)
    assert restored == cold


def test_the_ledger_is_reported_at_the_ready_point_in_the_servers_own_log(flow):
    lines = [line for line in flow["log"].splitlines() if "jitwarm: ledger: " in line]
    assert any("jitwarm: ledger: vllm_compile: served from cache 1, compiled now 0" in line for line in lines), \
        flow["log"][-3000:]
    assert all(line.startswith("(") and " INFO " in line for line in lines)  # vLLM's own format, its process tag


def test_the_aot_units_factors_are_the_servers_and_one_that_differs_is_refused(flow):
    """The unit's env factors, recorded in the server's worker, match the node's as computed after vLLM's platform
    set its own (the false refusal of VLLM_DISABLE_SHARED_EXPERTS_STREAM is gone); a factor the node truly differs
    in is refused, exit 4."""
    rank = [r for r in records(flow) if r["library"] == "vllm_compile" and r["unit"].endswith("/rank_0_0")]
    assert rank[0]["fingerprint"]["vllm:env:VLLM_DISABLE_SHARED_EXPERTS_STREAM"] == "true"
    assert (flow["node"] / "vllm" / "torch_compile_cache" / rank[0]["unit"] / "model").is_file()
    # The node's factors came from vLLM itself, in a child that imports torch: it left nothing outside the
    # restore's destination (VLLM_CACHE_ROOT) and jitwarm's cache root, no $TMPDIR/torchinductor_$USER.
    # Only the empty tmp/ the test made is there besides.
    outside = [p for p in flow["made"] if p.split("/", 1)[0] not in ("vllm", "jitwarm") and p != "tmp"]
    assert outside == [], outside
    other = flow["other"]
    assert other.returncode == 4, other.stderr
    assert "recorded with vllm:env:VLLM_BATCH_INVARIANT 'false', this node has 'true'" in other.stderr
