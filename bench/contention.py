"""Contention: 8 processes (TP8 on one node) start cold on one cache at the same moment, vs one alone.

Each round: one `jitwarm warm` alone on an empty cache; then 8 started together on another empty cache.
Reports total builds across the 8 (must equal the spec count) and the wall time of the slowest of the 8
against the single process. usage: python bench/contention.py [--procs 8] [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import DSPARK, ROOT, jitwarm_cmd, report


def warm_together(n: int, root: Path) -> tuple[float, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cmd = jitwarm_cmd("warm", *DSPARK, "--target", "cpu", "--json", "--cache-dir", str(root))
    start = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for _ in range(n)]
    outs = [p.communicate() for p in procs]
    wall = time.perf_counter() - start
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(err)
    return wall, [json.loads(out) for out, _ in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-bench-"))
    single, many, builds, waited = [], [], [], []
    for r in range(args.rounds):
        order = [1, args.procs] if r % 2 == 0 else [args.procs, 1]
        for n in order:
            wall, reports = warm_together(n, scratch / f"{n}-{r}")
            (single if n == 1 else many).append(wall)
            if n > 1:
                builds.append(sum(x["totals"]["built"] for x in reports))
                waited.append(sum(x["totals"]["waited"] for x in reports))
            print(f"  round {r + 1}: {n} process(es): {wall:.1f}s", file=sys.stderr, flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    rows = [{"variant": "1 process alone", "median_s": statistics.median(single), "builds": 30, "ratio": 1.0},
            {"variant": f"{args.procs} processes together (slowest)", "median_s": statistics.median(many),
             "builds": f"{min(builds)}..{max(builds)}", "ratio": statistics.median(many) / statistics.median(single)}]
    report("contention", {f"{args.procs} cold processes on one cache, DSpark-128 (30 specs), target cpu": rows},
           {"single": single, "many": many, "builds_per_round": builds, "waited_per_round": waited}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
