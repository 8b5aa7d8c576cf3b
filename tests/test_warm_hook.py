"""Warm service, capture hook, guard: real compiles, real processes and locks; the GPU and TP group are fakes."""

import json
import time

import pytest
import torch
from precompile_fixtures import SMALL, TINY, TINY_FAST, jitwarm, plan_of, run_worker

from jitwarm.cache import KernelCache
from jitwarm.kernels import VerifyLayout, dispatch, ops
from jitwarm.kernels.artifacts import artifact
from jitwarm.precompile import (
    CaptureHook,
    CompileDuringCaptureError,
    KernelsNotReady,
    WarmTimeout,
    capture_guard,
    capture_ladder,
    start_warm,
    warm,
)
from jitwarm.precompile.warming import warm_specs


class RecordingDevice:
    """A fake CUDA device (no GPU here): records synchronize() and how many plan specs were loaded then."""

    target = "cpu"

    def __init__(self, events, plan):
        self.events, self.plan = events, plan

    def synchronize(self):
        loaded = sum(1 for s in self.plan.specs if dispatch.is_loaded(s))
        self.events.append(("sync", loaded))


def small_forward(events):
    """A real forward on CPU tensors: plan -> compress -> norm_rope for the shape's layout."""
    def forward(shape):
        events.append(("forward", shape.bs))
        layout = shape.layout
        gen = torch.Generator().manual_seed(shape.bs)
        lens = torch.tensor(layout.verify_lens, dtype=torch.int32)
        prefix = torch.randint(0, 50, (layout.slots,), dtype=torch.int32, generator=gen)
        p = ops.plan(layout, lens, prefix, ratio=4)
        n, d = layout.num_tokens, 64
        kv, score = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
        state = torch.zeros(layout.slots, 3, d)
        state[:, 0] = float("-inf")
        out = torch.zeros(n, d)
        ops.compress(layout, kv, score, p, state, out, ratio=4)
        q, k = torch.randn(n, 2, d, generator=gen), torch.randn(n, 1, d, generator=gen)
        ops.norm_rope(layout, q, k, p.token_pos, torch.rand(d) + 0.5, torch.rand(d) + 0.5, rope_dim=32)
        return out, q, k
    return forward


def test_call_order_load_sync_barrier_before_graph(prestarted):
    """sglang #33795 / #34286: after the last warmup, before CUDAGraph(): loaded, synchronized, barrier."""
    root, _ = prestarted
    plan = plan_of(SMALL)
    events = []
    device = RecordingDevice(events, plan)
    hook = CaptureHook(plan, cache=KernelCache(root=root), barrier=lambda: events.append(("barrier",)),
                       device=device, policy="strict")

    class Graph:
        def __init__(self):
            events.append(("graph",))

    class Capture:
        def __init__(self, graph):
            pass

        def __enter__(self):
            events.append(("capture",))

        def __exit__(self, *exc):
            events.append(("end",))

    try:
        graphs = capture_ladder(plan, small_forward(events), hook, graph_factory=Graph, capture=Capture)
    finally:
        hook.close()
    assert list(graphs) == [s.bs for s in plan.shapes]
    assert events[0] == ("sync", len(plan.specs))  # the hook's first sync: every spec already loaded
    graph_at = [i for i, e in enumerate(events) if e == ("graph",)]
    assert len(graph_at) == len(plan.shapes)
    for i in graph_at:
        last_forward = max(j for j in range(i) if events[j][0] == "forward")
        # the post-warmup hook ran after the last warmup: synchronize, then barrier, then the graph
        assert events[last_forward + 1:i] == [("sync", len(plan.specs)), ("barrier",)]
        assert events[i + 1] == ("capture",) and events[i + 2][0] == "forward"


def test_prestart_then_strict_hook_in_fresh_process(prestarted):
    root, proc = prestarted
    assert "jitwarm: ready: plan" in proc.stdout and "7/7 specs present and verified" in proc.stdout
    out = run_worker("hook_worker.py", str(root), "strict", "60", "--", *SMALL)
    assert out.returncode == 0, out.stderr + out.stdout
    report = json.loads(out.stdout)
    assert report["built"] == 0 and report["dispatch"]["builds"] == 0
    assert report["loaded"] == 7 and report["loaded_specs"] == 7 and report["hits"] == 7
    assert report["seconds"] > 0


def test_strict_hook_names_missing_specs(tmp_path):
    out = run_worker("hook_worker.py", str(tmp_path / "empty"), "strict", "60", "--", *TINY)
    assert out.returncode == 3
    report = json.loads(out.stdout)
    assert report["error"] == "KernelsNotReady" and "3 spec(s)" in report["message"]
    assert "norm_rope/tvm_ffi/cpu/" in report["message"] and "jitwarm warm" in report["message"]


def test_jitwarm_strict_env_forces_strict(tmp_path, monkeypatch):
    monkeypatch.setenv("JITWARM_STRICT", "1")
    hook = CaptureHook(plan_of(TINY), cache=KernelCache(root=tmp_path), device="cpu", policy="build")
    assert hook.policy == "strict"


def test_hook_second_call_only_syncs_and_meets(prestarted):
    root, _ = prestarted
    plan = plan_of(SMALL)
    events = []
    hook = CaptureHook(plan, cache=KernelCache(root=root), device=RecordingDevice(events, plan),
                       barrier=lambda: events.append(("barrier",)))
    try:
        first = hook()
        before = dispatch.counters()
        second = hook()
    finally:
        hook.close()
    assert first.first and first.loaded == 7 and not second.first
    assert set(second.steps) == {"synchronize", "barrier"} and dispatch.counters() == before
    assert events == [("sync", 7), ("barrier",), ("sync", 7), ("barrier",)]


def test_two_warm_processes_build_each_spec_once(tmp_path):
    from precompile_fixtures import start_jitwarm

    root = str(tmp_path / "cache")
    procs = [start_jitwarm("warm", *TINY_FAST, "--cache-dir", root, "--jobs", "1", "--json") for _ in range(2)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    assert sum(r["totals"]["built"] for r in reports) == 3
    assert all(r["ok"] and len(r["specs"]) == 3 for r in reports)
    assert sum(r["totals"]["waited"] + r["totals"]["hit"] for r in reports) == 3
    again = json.loads(jitwarm("warm", *TINY_FAST, "--cache-dir", root, "--json").stdout)
    assert again["totals"] == {"built": 0, "hit": 3, "waited": 0, "failed": 0}


def test_hook_waits_for_another_builder_then_loads(tmp_path):
    root = tmp_path / "cache"
    cache = KernelCache(root=root)
    plan = plan_of(TINY)
    first, rest = plan.specs[0], plan.specs[1:]
    assert warm_specs(rest, plan.plan_id, cache, jobs=1, progress=False).ok
    marker, release = tmp_path / "locked", tmp_path / "release"
    import subprocess
    import sys
    import threading

    from precompile_fixtures import WORKERS

    builder = subprocess.Popen([sys.executable, str(WORKERS / "slow_builder.py"), str(root),
                                json.dumps(first.to_json()), str(marker), str(release)],
                               stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline and builder.poll() is None
            time.sleep(0.05)
        with pytest.raises(WarmTimeout, match="timed out"):
            CaptureHook(plan, cache=cache, device="cpu", policy="wait", timeout_s=0.5)()
        timed_out = jitwarm("warm", *TINY, "--cache-dir", str(root), "--timeout", "0.5")
        assert timed_out.returncode == 3, timed_out.stderr
        # The builder lets go 2 s into the hook's wait: the hook must find the key held, wait, then load.
        let_go = threading.Timer(2.0, release.touch)
        let_go.start()
        hook = CaptureHook(plan, cache=cache, device="cpu", policy="wait", timeout_s=120)
        try:
            report = hook()
        finally:
            hook.close()
        assert report.waited == 1 and report.built == 0 and report.loaded == 3
        assert builder.wait(60) == 0 and builder.stdout.read().strip() == "built"
    finally:
        release.touch()
        builder.kill()


def test_capture_guard_names_the_missing_spec(tmp_path):
    layout = VerifyLayout((2, 1, 1))
    lens = torch.tensor(layout.verify_lens, dtype=torch.int32)
    before = dispatch.counters()
    with capture_guard(), pytest.raises(CompileDuringCaptureError) as info:
        ops.plan(layout, lens, torch.zeros(3, dtype=torch.int32), ratio=7)
    message = str(info.value)
    assert "kernel plan" in message and "ratio=7" in message and "threads=32" in message
    assert "VerifyLayout([2]*1+[1]*2)" in message and "jitwarm warm" in message
    assert dispatch.counters()["builds"] == before["builds"]


def test_start_warm_is_joined_by_the_hook(tmp_path):
    cache = KernelCache(root=tmp_path / "cache")
    plan = plan_of(TINY_FAST)
    handle = start_warm(plan, cache=cache, jobs=2)
    hook = CaptureHook(plan, cache=cache, device="cpu", warm=handle, policy="strict")
    try:
        report = hook()
    finally:
        hook.close()
    assert handle.done() and handle.join().built == 3
    assert report.built == 0 and report.loaded == 3
    assert cache.read_plan_record(plan.plan_id)["complete"] is True


def test_warm_report_and_plan_record(tmp_path):
    cache = KernelCache(root=tmp_path / "cache")
    plan = plan_of(TINY_FAST)
    seen = []
    report = warm(plan, cache=cache, jobs=2, progress=False, on_result=seen.append)
    assert report.ok and report.built == 3 and len(seen) == 3
    assert [r.spec for r in report.results] == list(plan.specs)
    record = cache.read_plan_record(plan.plan_id)
    assert record["keys"] == [artifact(s).key for s in plan.specs]
    data = report.to_json()
    assert data["totals"]["built"] == 3 and all(s["outcome"] == "built" for s in data["specs"])


@pytest.fixture
def parent_lookups(monkeypatch):
    """Every lookup this (the parent) process makes, by key: the cache protocol's, under every caller."""
    from jitwarm.cache.store import KernelCache

    keys, lookup = [], KernelCache.lookup

    def counted(self, key, **kwargs):
        keys.append(key)
        return lookup(self, key, **kwargs)

    monkeypatch.setattr(KernelCache, "lookup", counted)
    return keys


def test_warm_looks_each_fresh_spec_up_once_and_uses_the_workers_entry(tmp_path, parent_lookups):
    """Cold: one lookup per spec before the workers, none after a build (the worker's entry is used)."""
    cache = KernelCache(root=tmp_path / "cache")
    plan = plan_of(TINY_FAST)
    report = warm(plan, cache=cache, jobs=2, progress=False)
    assert report.built == 3
    assert sorted(parent_lookups) == sorted(artifact(s).key for s in plan.specs)
    for result in report.results:
        fresh = KernelCache(root=tmp_path / "cache").lookup(result.key)
        assert result.entry == fresh and result.entry.signature == fresh.signature


def test_the_hooks_cold_build_looks_each_spec_up_once(tmp_path, parent_lookups):
    """The hook's own lookup is the only one in this process: warm_specs is told the specs missed."""
    plan = plan_of(TINY_FAST)
    hook = CaptureHook(plan, cache=KernelCache(root=tmp_path / "cache"), device="cpu", policy="build", jobs=2)
    try:
        report = hook()
    finally:
        hook.close()
    assert report.built == 3 and report.loaded == 3
    assert sorted(parent_lookups) == sorted(artifact(s).key for s in plan.specs)


def test_a_crashing_compiler_fails_its_spec_not_the_run(tmp_path):
    """The compiler kills its build process for norm_rope only: that spec fails, the others are built."""
    fake = tmp_path / "crashing-c++"
    fake.write_text('#!/bin/sh\nif grep -qs norm_rope kernel.cc; then kill -9 $PPID; sleep 5; fi\n'
                    'exec g++ "$@"\n')
    fake.chmod(0o755)
    proc = jitwarm("warm", *TINY, "--cache-dir", str(tmp_path / "cache"), "--jobs", "2", "--json",
                   env={"CXX": str(fake)})
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    outcome = {s["spec"].split("/")[0]: s for s in report["specs"]}
    assert outcome["norm_rope"]["outcome"] == "failed"
    assert "build process died" in outcome["norm_rope"]["error"]
    assert outcome["compressor"]["outcome"] == "built" and outcome["plan"]["outcome"] == "built"
    entries = sorted(p.name for p in (tmp_path / "cache" / "v1" / "entries").glob("*/*"))
    assert entries == sorted([outcome["compressor"]["key"], outcome["plan"]["key"]])


def test_hook_refuses_a_plan_without_this_target(tmp_path):
    plan = plan_of([*TINY[:-1], "sm_90"])
    with pytest.raises(KernelsNotReady, match="no specs for this device's target cpu"):
        CaptureHook(plan, cache=KernelCache(root=tmp_path), device="cpu")()


def test_warm_says_every_line_with_the_jitwarm_prefix_the_cache_s_quarantine_included(tmp_path):
    """A corrupt entry found by warm's lookup is quarantined and rebuilt; the cache's warning says ``jitwarm: ``."""
    root = tmp_path / "cache"
    assert jitwarm("warm", *TINY_FAST, "--cache-dir", str(root)).returncode == 0
    victim = next(p for p in sorted(root.glob("v1/entries/*/*/*")) if p.name != "entry.json")
    victim.chmod(0o644)
    victim.write_bytes(victim.read_bytes() + b"\n# tampered\n")
    proc = jitwarm("warm", *TINY_FAST, "--cache-dir", str(root))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert any("quarantined" in line and victim.parent.name in line for line in lines), lines
    assert all(line.startswith("jitwarm: ") and not line.startswith("jitwarm: jitwarm:") for line in lines), lines
