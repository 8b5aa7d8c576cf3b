"""Scaling: how cold warm time, warm-cache re-warm and the hook grow with the plan (about 10 to 300 specs).

Host target so every size fits on a small box; the cold warm uses every core. The hook is timed in a fresh
process (bench/hook_fresh.py). usage: python bench/scaling.py [--sizes 9 30 91 310] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from harness import ROOT, jitwarm_cmd, report, run

PLANS = {  # spec count (target cpu) -> serving flags
    9: "--cuda-graph-max-bs-decode 128 --max-running-requests 128 --speculative-algorithm EAGLE "
       "--speculative-num-draft-tokens 6",
    30: "--cuda-graph-max-bs-decode 128 --max-running-requests 128 --speculative-algorithm DSPARK "
        "--speculative-num-draft-tokens 6 --ragged-verify-mode compact",
    91: "--cuda-graph-max-bs-decode 256 --max-running-requests 256 --speculative-algorithm DSPARK "
        "--speculative-num-draft-tokens 8 --ragged-verify-mode compact --compress-ratios 4 16 64 128",
    310: "--cuda-graph-max-bs-decode 512 --max-running-requests 512 --speculative-algorithm DSPARK "
         "--speculative-num-draft-tokens 12 --ragged-verify-mode compact "
         "--compress-ratios 2 3 4 6 8 12 16 24 32 48 64 96 128 256",
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=list(PLANS))
    ap.add_argument("--hook-rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-bench-"))
    rows = []
    for size in args.sizes:
        flags = [*PLANS[size].split(), "--target", "cpu"]
        root = scratch / str(size)
        cold, out = run(jitwarm_cmd("warm", *flags, "--json", "--cache-dir", str(root)))
        data = json.loads(out)
        assert data["totals"]["built"] == size, data["totals"]
        again, _ = run(jitwarm_cmd("warm", *flags, "--json", "--cache-dir", str(root)))
        hooks = sorted(json.loads(run([sys.executable, str(ROOT / "bench" / "hook_fresh.py"), str(root), *flags])[1])
                       ["hook_s"] for _ in range(args.hook_rounds))
        hook = hooks[len(hooks) // 2]
        rows.append({"specs": size, "cold_warm_s": cold, "cold_per_spec_s": cold / size, "rewarm_all_hits_s": again,
                     "hook_fresh_process_s": hook, "hook_per_spec_ms": 1000 * hook / size,
                     "cache_mib": sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 2**20})
        print(f"  {size} specs: cold {cold:.1f}s, re-warm {again:.2f}s, hook {hook * 1000:.1f}ms",
              file=sys.stderr, flush=True)
        shutil.rmtree(root, ignore_errors=True)
    report("scaling", {f"plan size scaling, target cpu, jobs={os.cpu_count()}": rows}, {"plans": PLANS}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
