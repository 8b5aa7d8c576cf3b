"""GPU check (H200): warm the DSpark-128 plan for the local arch, capture all 35 graphs behind the hook,
check every replay against the torch reference, and show what a kernel first compiled inside capture does
without the hook (negative control) and with the guard.

usage: python bench/gpu_capture_check.py [--backend tvm_ffi --backend triton] [--out DIR] [--race-runs N]
Prints tables; writes gpu_capture_check.json into --out. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from jitwarm.cache import KernelCache
from jitwarm.kernels import VerifyLayout, dispatch, ops, reference
from jitwarm.kernels.spec import max_out_rows
from jitwarm.precompile import CaptureHook, ServingConfig, WarmPlan, capture_ladder, warm

HOOK_WORKER = Path(__file__).resolve().parents[1] / "tests" / "workers" / "hook_worker.py"
DSPARK = dict(graph_max_bs=128, max_requests=128, draft_algorithm="DSPARK",
              draft_tokens=6, ragged_verify_mode="compact")
D, HQ, HK, ROPE = 128, 16, 1, 64


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


class Batch:
    """Static buffers for one captured shape; ``forward`` runs plan -> compress (both ratios) -> norm_rope."""

    def __init__(self, layout: VerifyLayout, backend: str, dev: torch.device, ratios=(4, 128)) -> None:
        self.layout, self.backend, self.ratios = layout, backend, ratios
        n, r = layout.num_tokens, layout.slots
        self.lens = torch.tensor(layout.verify_lens, dtype=torch.int32, device=dev)
        self.prefix = torch.zeros(r, dtype=torch.int32, device=dev)
        self.kv = torch.empty(n, D, dtype=torch.bfloat16, device=dev)
        self.score = torch.empty_like(self.kv)
        self.state = {ratio: torch.empty(r, 3, D, dtype=torch.float32, device=dev) for ratio in ratios}
        self.out = {ratio: torch.empty(max_out_rows(layout, ratio), D, dtype=torch.bfloat16, device=dev)
                    for ratio in ratios}
        self.q = torch.empty(n, HQ, D, dtype=torch.bfloat16, device=dev)
        self.k = torch.empty(n, HK, D, dtype=torch.bfloat16, device=dev)
        self.qw = torch.empty(D, dtype=torch.bfloat16, device=dev)
        self.kw = torch.empty_like(self.qw)

    def randomize(self, seed: int) -> dict:
        g = torch.Generator(device=self.kv.device).manual_seed(seed)
        self.prefix.copy_(torch.randint(0, 4096, self.prefix.shape, generator=g, device=self.kv.device,
                                        dtype=torch.int32))
        for t in (self.kv, self.score, self.q, self.k):
            t.copy_(torch.randn(t.shape, generator=g, device=t.device))
        for t in (self.qw, self.kw):
            t.copy_(torch.rand(t.shape, generator=g, device=t.device) + 0.5)
        for st in self.state.values():
            st.copy_(torch.randn(st.shape, generator=g, device=st.device))
            st[:, 1].abs_().add_(0.5)  # a running sum is positive
        for o in self.out.values():
            o.fill_(float("nan"))  # poison: an unwritten row fails the check
        return {"state": {r: s.clone() for r, s in self.state.items()}, "q": self.q.clone(), "k": self.k.clone()}

    def forward(self) -> dict:
        plans = {}
        for ratio in self.ratios:
            p = ops.plan(self.layout, self.lens, self.prefix, ratio=ratio, backend=self.backend)
            ops.compress(self.layout, self.kv, self.score, p, self.state[ratio], self.out[ratio], ratio=ratio,
                         backend=self.backend)
            plans[ratio] = p
        ops.norm_rope(self.layout, self.q, self.k, plans[self.ratios[0]].token_pos, self.qw, self.kw,
                      rope_dim=ROPE, backend=self.backend)
        return plans

    def check(self, plans: dict, before: dict) -> float:
        """Compare the graph's outputs with the reference run on the saved inputs; return the max error."""
        worst = 0.0
        for ratio in self.ratios:
            ref = reference.plan(self.layout, self.lens, self.prefix, ratio)
            for name in ref._fields:
                if not torch.equal(getattr(ref, name), getattr(plans[ratio], name)):
                    raise AssertionError(f"plan ratio={ratio} field {name} differs")
            state = before["state"][ratio].clone()
            out = torch.full_like(self.out[ratio], float("nan"))
            reference.compress(self.layout, self.kv, self.score, ref, state, out, ratio)
            rows = int(ref.num_out.item())
            worst = max(worst, _err(out[:rows], self.out[ratio][:rows]), _err(state, self.state[ratio]))
        q, k = before["q"].clone(), before["k"].clone()
        reference.norm_rope(self.layout, q, k, reference.plan(self.layout, self.lens, self.prefix, 4).token_pos,
                            self.qw, self.kw, ROPE, 1e-6, 10000.0)
        return max(worst, _err(q, self.q), _err(k, self.k))


def _err(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Max relative error where the reference is finite; a non-finite mismatch (e.g. an unwritten row) is inf."""
    ref, got = ref.float(), got.float()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(ref[~finite].nan_to_num(0.0),
                                                                       got[~finite].nan_to_num(0.0)):
        return float("inf")
    if not finite.any():
        return 0.0
    return float(((ref[finite] - got[finite]).abs() / (ref[finite].abs() + 1.0)).max().item())


class EagerGraph:
    """--dry-run on a CPU: 'capture' runs the forward eagerly; 'replay' runs it again (checks the script)."""

    def __init__(self) -> None:
        self.forward = None


def capture_and_check(plan: WarmPlan, cache: KernelCache, backend: str, dev: torch.device) -> dict:
    batches = {s.bs: Batch(s.layout, backend, dev) for s in plan.shapes}
    hook = CaptureHook(plan, cache=cache, device=dev, policy="strict", timeout_s=60)
    t0 = time.perf_counter()
    first = hook()
    hook_s = time.perf_counter() - t0
    for bs, b in batches.items():
        b.randomize(bs)
    t0 = time.perf_counter()
    fakes = {} if dev.type == "cuda" else {"graph_factory": EagerGraph, "capture": lambda g: contextlib.nullcontext()}
    graphs = capture_ladder(plan, lambda shape: batches[shape.bs].forward(), hook, **fakes)
    capture_s = time.perf_counter() - t0
    rows, worst = [], 0.0
    for shape in plan.shapes:
        b = batches[shape.bs]
        graph, plans = graphs[shape.bs]
        errs = []
        for rep in range(2):
            before = b.randomize(1000 * shape.bs + rep)
            if dev.type == "cuda":
                graph.replay()
                torch.cuda.synchronize()
            else:
                plans.update(b.forward())
            errs.append(b.check(plans, before))
        err = max(errs)
        worst = max(worst, err)
        rows.append([shape.bs, shape.layout.run_length(), "ok" if err < 2e-2 else "FAIL", f"{err:.2e}"])
    hook.close()
    return {"backend": backend, "shapes": len(plan.shapes), "specs_loaded": first.loaded,
            "hook_first_s": hook_s, "hook_steps": first.steps, "capture_s": capture_s, "max_rel_err": worst,
            "all_ok": worst < 2e-2, "rows": rows}


def plan_race(dev: torch.device, runs: int, backend: str) -> dict:
    layout = VerifyLayout((3,) * 104 + (2,) * 24)
    lens = torch.tensor(layout.verify_lens, dtype=torch.int32, device=dev)
    bad = 0
    g = torch.Generator(device=dev).manual_seed(7)
    for _ in range(runs):
        prefix = torch.randint(0, 1 << 16, (layout.slots,), dtype=torch.int32, device=dev, generator=g)
        got = ops.plan(layout, lens, prefix, ratio=4, backend=backend)
        ref = reference.plan(layout, lens, prefix, 4)
        bad += any(not torch.equal(getattr(ref, f), getattr(got, f)) for f in ref._fields)
    return {"backend": backend, "runs": runs, "bad": bad}


NEGATIVE = r'''
import json, sys, torch
from jitwarm.cache import KernelCache
from jitwarm.kernels import VerifyLayout, dispatch, ops
mode = sys.argv[1]
dispatch.set_cache(KernelCache(root=sys.argv[2]))
if mode == "no_guard":  # behave like a JIT that never checks for capture: the status quo
    dispatch.stream_is_capturing = lambda: False
if mode == "guard":
    from jitwarm.precompile import guard
    guard.install()
layout = VerifyLayout((3,) * 104 + (2,) * 24)
lens = torch.tensor(layout.verify_lens, dtype=torch.int32, device="cuda")
prefix = torch.zeros_like(lens)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
result = {"mode": mode}
try:
    with torch.cuda.graph(g):
        p = ops.plan(layout, lens, prefix, ratio=4)   # first use: compile + module load inside capture
    g.replay(); torch.cuda.synchronize()
    result["outcome"] = "captured"
    result["num_out"] = int(p.num_out.item())
except Exception as exc:
    result["outcome"] = type(exc).__name__
    result["message"] = str(exc).splitlines()[0][:300]
try:
    torch.cuda.synchronize(); x = torch.ones(4, device="cuda") + 1; torch.cuda.synchronize()
    result["context_after"] = "usable"
except Exception as exc:
    result["context_after"] = type(exc).__name__ + ": " + str(exc).splitlines()[0][:200]
print(json.dumps(result))
'''


def negative_control(mode: str) -> dict:
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-c", NEGATIVE, mode, root], capture_output=True, text=True,
                                  timeout=90)
        except subprocess.TimeoutExpired:
            return {"mode": mode, "outcome": "hung: killed after 90 s", "seconds": time.perf_counter() - t0}
        out = proc.stdout.strip().splitlines()
        data = json.loads(out[-1]) if out and out[-1].startswith("{") else {
            "mode": mode, "outcome": f"process exit {proc.returncode}", "message": proc.stderr[-300:]}
        data["returncode"], data["seconds"] = proc.returncode, time.perf_counter() - t0
        return data


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", action="append", dest="backends")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--race-runs", type=int, default=5000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--dry-run", action="store_true", help="run the script's logic on the CPU (no graphs)")
    args = ap.parse_args()
    backends = args.backends or ["tvm_ffi"]
    dev = torch.device("cpu" if args.dry_run else "cuda")
    target = dispatch.target_of(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)"
    results: dict = {"device": name, "target": target, "torch": torch.__version__,
                     "sections": {}}
    print(f"device {results['device']} target {target} torch {torch.__version__}")
    root = Path(tempfile.mkdtemp(prefix="jitwarm-gpu-"))
    cache = KernelCache(root=root)
    dispatch.set_cache(cache)
    for backend in backends:
        section: dict = {}
        results["sections"][backend] = section
        try:
            plan = WarmPlan.build(ServingConfig(**DSPARK, backends=(backend,), targets=(target,)))
            t0 = time.perf_counter()
            report = warm(plan, cache=cache, jobs=args.jobs, progress=False)
            section["warm"] = {"specs": len(plan.specs), "built": report.built, "failed": report.failed,
                               "seconds": time.perf_counter() - t0,
                               "errors": [r.error for r in report.results if r.error][:3]}
            print(f"[{backend}] warm: {report.built} built, {report.failed} failed "
                  f"in {section['warm']['seconds']:.1f}s")
            again = warm(plan, cache=cache, jobs=args.jobs, progress=False)
            section["warm_again"] = {"built": again.built, "hits": again.hits, "seconds": again.seconds}
            proc = subprocess.run([sys.executable, str(HOOK_WORKER),
                                   str(root), "strict", "60", "--", "--cuda-graph-max-bs-decode", "128",
                                   "--max-running-requests", "128", "--speculative-algorithm", "DSPARK",
                                   "--speculative-num-draft-tokens", "6", "--ragged-verify-mode", "compact",
                                   "--backend", backend, "--target", target], capture_output=True, text=True)
            section["fresh_process_hook"] = json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr[-500:]
            cap = capture_and_check(plan, cache, backend, dev)
            section["capture"] = {k: v for k, v in cap.items() if k != "rows"}
            print(f"[{backend}] capture of {cap['shapes']} shapes, hook {cap['hook_first_s']:.3f}s, "
                  f"max rel err {cap['max_rel_err']:.2e}, all ok: {cap['all_ok']}")
            print(table(cap["rows"], ["bs", "verify_lens", "replay", "max rel err"]))
            section["race"] = plan_race(dev, args.race_runs, backend)
            print(f"[{backend}] plan kernel on [3]*104+[2]*24: {section['race']['bad']} bad of {args.race_runs}")
        except Exception:
            section["error"] = traceback.format_exc()[-2000:]
            print(section["error"])
    for mode in ("no_guard", "guard") if dev.type == "cuda" else ():
        data = negative_control(mode)
        results["sections"][f"negative_{mode}"] = data
        print(f"negative control ({mode}): {data}")
    out = Path(args.out) / "gpu_capture_check.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
