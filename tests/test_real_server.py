"""The zero-JIT boot proven on a real vLLM server (vLLM's CPU build, tests/vllm_cpu.py), from the library's files.

One module fixture runs the operator's flow, each step a real process:

1. ``jitwarm capture --export`` runs ``vllm serve`` once on an empty node (``capture``): a cold start, which
   compiles (its own ledger is the control: a start without the restore compiles);
2. ``jitwarm prestart --offline`` restores the bundle on a fresh node, run with the server's environment;
3. a real start there with ``JITWARM_LEDGER``, a completion, a stop by its process group.

The restored start must compile nothing: its ledger's total is 0, and no compiled artifact appears in the
libraries' caches during it, checked from the files. The server runs with ``VLLM_USE_AOT_COMPILE=0``, the
configuration under which this build's restored start compiles nothing (it cannot load its own AOT artifact:
``test_an_aot_capture_is_said_and_its_factors_are_the_servers`` below runs the default and sees why).

Nothing is faked here: no GPU is involved, the CPU platform captures no CUDA graphs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import vllm_cpu as server

#: What a library's cache may gain in a start that compiles nothing: Inductor's lock files (one per module
#: loaded, codecache.py; they hold no code).
NOT_COMPILED = ("/locks/",)
#: What is a compiled artifact: Inductor's modules and their C++ (.py/.cpp/.so), its precompiled headers and FX
#: and AOTAutograd entries, vLLM's compile tree and model inspection.
COMPILED_SUFFIXES = (".so", ".cpp", ".py", ".gch", ".h", ".json")


def cache_files(node: Path) -> dict[str, int]:
    """Every file under the node's library caches (``VLLM_CACHE_ROOT``, Inductor's own, Triton's), with its size."""
    roots = [node / "vllm", *(node / "tmp").glob("torchinductor_*"), node / "home" / ".triton"]
    found = {}
    for root in roots:
        for path in root.rglob("*") if root.is_dir() else ():
            if path.is_file():
                found[str(path.relative_to(node))] = path.stat().st_size
    return found


def unit_records(manifest: Path) -> list[dict]:
    """The manifest's unit records (capture adds one ``capture`` record: how it ran the server)."""
    return [r for r in map(json.loads, manifest.read_text().splitlines()) if r["kind"] != "capture"]


def compiled(files: dict[str, int]) -> list[str]:
    """The compiled artifacts among ``files`` (see :data:`COMPILED_SUFFIXES`)."""
    return sorted(f for f in files if not any(part in f for part in NOT_COMPILED)
                  and (f.endswith(COMPILED_SUFFIXES) or "/fxgraph/" in f or "/aotautograd/" in f))


@pytest.fixture(scope="module")
def flow(vllm_cpu, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_server")
    first, node = tmp / "capture-node", tmp / "fresh-node"
    manifest, bundle = tmp / "server.jsonl", tmp / "kernels.tar"
    captured = vllm_cpu.jitwarm("capture", "--manifest", str(manifest), "--export", str(bundle), "--timeout", "900",
                                "--json", "--", *vllm_cpu.serve(server.free_port()), env=vllm_cpu.env(first))
    assert captured.returncode == 0, captured.stderr[-4000:]
    prestart = vllm_cpu.jitwarm("prestart", "--manifest", str(manifest), "--bundle", str(bundle), "--offline",
                                "--json", env=vllm_cpu.env(node))
    assert prestart.returncode == 0, prestart.stderr
    before = cache_files(node)
    ledger = node / "ledger.json"
    with server.serving(vllm_cpu, node, JITWARM_LEDGER=str(ledger)) as (port, ready_s):
        answer = server.complete(port, vllm_cpu.model)
    return {"tmp": tmp, "first": first, "node": node, "manifest": manifest, "bundle": bundle,
            "captured": json.loads(captured.stdout), "capture_err": captured.stderr,
            "prestart": json.loads(prestart.stdout), "before": before, "after": cache_files(node),
            "ledger": json.loads(ledger.read_text()), "answer": answer, "ready_s": ready_s,
            "log": (node / "server.log").read_text(errors="replace")}


def test_capture_runs_the_server_once_stores_every_unit_and_bundles_them(flow):
    done = flow["captured"]
    assert done["units"]["inductor"] >= 10 and done["units"]["vllm_modelinfo"] == 1, done
    records = unit_records(flow["manifest"])
    assert len(records) == done["entries"] == sum(done["units"].values())
    assert all(r["kind"] == "jit_cache" and r["under"] == "vllm" for r in records)
    assert done["sha256"] and flow["bundle"].stat().st_size > 0
    assert done["compiled"] > 0  # the control: the same server without a restore compiles (its own ledger)
    assert "waiting for http://127.0.0.1:" in flow["capture_err"]


def test_every_unit_the_start_wrote_in_the_library_caches_is_a_captured_unit(flow):
    """The census: capture's start ran on private caches, and every unit it wrote there is recorded; the caller's
    own caches got nothing."""
    assert flow["captured"]["unrecorded"] == []
    assert compiled(cache_files(flow["first"])) == []


def _in_root(path: str) -> str:
    """A path under the node (``tmp/torchinductor_root/7v/c7v.so``) as its library's unit names it (``7v/c7v.so``)."""
    return path.split("/", 2)[-1]


def test_prestart_restores_offline_on_a_fresh_node_with_the_servers_fingerprints(flow):
    ready = flow["prestart"]
    assert ready["ready"] is True and ready["offline"] is True
    assert ready["bundle"]["supplied"] == flow["captured"]["entries"]
    records = unit_records(flow["manifest"])
    restored = {_in_root(f) for f in flow["before"]}
    assert {rel for r in records for rel in r["files"]} <= restored  # each file where its library looks


def test_the_restored_start_compiles_nothing_and_answers(flow):
    ledger = flow["ledger"]
    assert ledger["compiled"] == 0, ledger
    assert ledger["families"]["inductor"]["served"] >= 1  # Inductor's own FX cache hit counter
    assert ledger["families"]["vllm_modelinfo"]["present_at_start"] == 1
    new = compiled({f: s for f, s in flow["after"].items() if flow["before"].get(f) != s})
    assert new == [], f"the restored start compiled: {new}"
    assert flow["answer"]["choices"][0]["text"] and flow["answer"]["usage"]["completion_tokens"] == 5


def test_the_ledger_is_reported_at_the_ready_point_in_the_servers_own_log(flow):
    lines = [line for line in flow["log"].splitlines() if "jitwarm: ledger: " in line]
    assert any("jitwarm: ledger: inductor: served from cache" in line for line in lines), flow["log"][-3000:]
    assert all(line.startswith("(") and " INFO " in line for line in lines)  # vLLM's own format, its process tag


@pytest.fixture(scope="module")
def aot(vllm_cpu, tmp_path_factory):
    """vLLM's default, AOT compile on: captured, then restored on two fresh nodes (one whose factor truly differs)."""
    tmp = tmp_path_factory.mktemp("real_server_aot")
    first = tmp / "capture-node"
    manifest, bundle = tmp / "server.jsonl", tmp / "kernels.tar"

    def env(node: Path, **extra: str) -> dict[str, str]:
        values = vllm_cpu.env(node, **extra)
        values.pop("VLLM_USE_AOT_COMPILE")  # vLLM's default: on with torch >= 2.10 (envs.py:377-386)
        return values

    captured = vllm_cpu.jitwarm("capture", "--manifest", str(manifest), "--export", str(bundle), "--json", "--",
                                *vllm_cpu.serve(server.free_port()), env=env(first))
    assert captured.returncode == 0, captured.stderr[-4000:]
    node = vllm_cpu.jitwarm("prestart", "--manifest", str(manifest), "--bundle", str(bundle), "--offline",
                            env=env(tmp / "fresh-node"))
    other = vllm_cpu.jitwarm("prestart", "--manifest", str(manifest), "--bundle", str(bundle), "--offline",
                             env=env(tmp / "other-node", VLLM_BATCH_INVARIANT="1"))
    # vLLM's units alone, so that nothing the restore places is under $TMPDIR: what appears there is a side effect
    vllm_only = tmp / "vllm-only.jsonl"
    vllm_only.write_text("".join(line for line in manifest.read_text().splitlines(keepends=True)
                                 if json.loads(line).get("library") != "inductor"))
    bare = vllm_cpu.jitwarm("prestart", "--manifest", str(vllm_only), "--bundle", str(bundle), "--offline",
                            env=env(tmp / "bare-node"))
    assert bare.returncode == 0, bare.stderr
    made = sorted(str(p.relative_to(tmp / "bare-node")) for p in (tmp / "bare-node").rglob("*"))
    return {"first": first, "manifest": manifest, "captured": json.loads(captured.stdout),
            "capture_err": captured.stderr, "node": node, "other": other, "fresh": tmp / "fresh-node",
            "made": made}


def test_an_aot_capture_is_said_and_its_factors_are_the_servers(aot):
    """This build cannot load its own AOT artifact: capture and prestart say so. The unit's env factors, recorded in
    the server's worker, match the node's as computed after vLLM's platform set its own (the false refusal of
    VLLM_DISABLE_SHARED_EXPERTS_STREAM is gone); a factor the node truly differs in is still refused, exit 4."""
    assert "cannot load its own AOT artifact" in aot["capture_err"]
    records = unit_records(aot["manifest"])
    rank = [r for r in records if r["library"] == "vllm_compile" and r["unit"].endswith("/rank_0_0")]
    assert len(rank) == 1 and rank[0]["fingerprint"]["vllm:env:VLLM_DISABLE_SHARED_EXPERTS_STREAM"] == "true"
    assert aot["node"].returncode == 0, aot["node"].stderr
    assert "AOT artifact(s) of vllm_compile restored, but vLLM's CPU build cannot load" in aot["node"].stderr
    assert (aot["fresh"] / "vllm" / "torch_compile_cache" / rank[0]["unit"] / "model").is_file()
    # The node's factors came from vLLM itself, in a child that imports torch: it left nothing outside the
    # restore's destination (VLLM_CACHE_ROOT) and jitwarm's cache root, no $TMPDIR/torchinductor_$USER
    # (issue #31). Only the empty tmp/ the test made is there besides.
    outside = [p for p in aot["made"] if p.split("/", 1)[0] not in ("vllm", "jitwarm") and p != "tmp"]
    assert outside == [], outside
    other = aot["other"]
    assert other.returncode == 4, other.stderr
    assert "recorded with vllm:env:VLLM_BATCH_INVARIANT 'false', this node has 'true'" in other.stderr


def test_an_aot_starts_files_are_captured_units_too(aot):
    """The census in AOT mode: vLLM's tree (its rank directory, Inductor's units in it) and the model inspection."""
    records = unit_records(aot["manifest"])
    assert any("torch_aot_compile/" in r["unit"] for r in records)
    assert aot["captured"]["unrecorded"] == []
