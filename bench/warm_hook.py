"""Warm cache, fresh process: time until the capture hook returns vs tvm-ffi's own cache-hit path.

Both caches are filled first. Then, alternating, a fresh process either runs CaptureHook(plan,
policy="strict") over jitwarm's cache, or load_inline()s the same 30 sources from tvm-ffi's cache.
Reported: the in-process time to have every kernel loaded (both sides have torch and tvm_ffi imported
already, as a server does), the whole process wall time, and the cost per spec.
The claim layer was weighed with this bench's ``--claims both`` (docs/performance.md); the flag went with the
layer: weighing it again means running the bench of a checkout that has ``KernelCache.claim_all``.
usage: python bench/warm_hook.py [--rounds 7] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from harness import DSPARK, ROOT, alternate, jitwarm_cmd, report, run

HOOK = ROOT / "bench" / "hook_fresh.py"
LAZY = ROOT / "bench" / "lazy_load_inline.py"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--flags", default=" ".join(DSPARK),
                    help="serving flags of the plan, as one string (default DSpark-128)")
    ap.add_argument("--out")
    args = ap.parse_args()
    plan_flags = args.flags.split()
    flags = [*plan_flags, "--target", "cpu"]
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-bench-"))
    jw, tvm = scratch / "jitwarm", scratch / "tvm-ffi"
    run(jitwarm_cmd("warm", *flags, "--cache-dir", str(jw)))
    run([sys.executable, str(LAZY), "cpu", *plan_flags], env={"TVM_FFI_CACHE_DIR": str(tvm)})
    inner: dict[str, list[float]] = {"jitwarm hook": [], "tvm-ffi load_inline hits": []}
    specs = 0

    def hook(r: int) -> float:
        nonlocal specs
        wall, out = run([sys.executable, str(HOOK), str(jw), *flags])
        data = json.loads(out)
        specs = data["loaded"]
        inner["jitwarm hook"].append(data["hook_s"])
        return wall

    def lazy(r: int) -> float:
        wall, out = run([sys.executable, str(LAZY), "cpu", *plan_flags], env={"TVM_FFI_CACHE_DIR": str(tvm)})
        inner["tvm-ffi load_inline hits"].append(json.loads(out)["load_s"])
        return wall

    walls = alternate({"jitwarm hook": hook, "tvm-ffi load_inline hits": lazy}, args.rounds)
    import statistics as st

    base_in, base_wall = st.median(inner["tvm-ffi load_inline hits"]), st.median(walls["tvm-ffi load_inline hits"])
    rows = [{"variant": name, "specs": specs, "load_all_median_s": st.median(inner[name]),
             "per_spec_ms": 1000 * st.median(inner[name]) / specs, "process_wall_median_s": st.median(walls[name]),
             "speedup_load": base_in / st.median(inner[name]), "speedup_wall": base_wall / st.median(walls[name])}
            for name in walls]
    shutil.rmtree(scratch, ignore_errors=True)
    report("warm_hook", {f"warm cache, fresh process, {specs} specs (target cpu)": rows},
           {"rounds": args.rounds, "inner": inner, "walls": walls}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
