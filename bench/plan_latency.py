"""`jitwarm plan` latency and the import cost of jitwarm.precompile, against a bare interpreter start.

usage: python bench/plan_latency.py [--rounds 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from harness import DSPARK, alternate, jitwarm_cmd, report, run

IMPORT = ("import time, sys; t = time.perf_counter(); import jitwarm.precompile; i = time.perf_counter() - t; "
          "from jitwarm.precompile import ServingConfig, WarmPlan; t = time.perf_counter(); "
          "p = WarmPlan.build(ServingConfig.from_args(sys.argv[1:] + ['--target', 'cpu'])); "
          "b = time.perf_counter() - t; import json; "
          "print(json.dumps({'import_s': i, 'build_s': b, 'heavy': [m for m in ('torch', 'triton', 'tvm_ffi') "
          "if m in sys.modules]}))")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    walls = alternate({
        "python -c pass": lambda r: run([sys.executable, "-c", "pass"])[0],
        "jitwarm plan (DSpark-128)": lambda r: run(jitwarm_cmd("plan", *DSPARK, "--target", "cpu"))[0],
        "jitwarm plan --json": lambda r: run(jitwarm_cmd("plan", *DSPARK, "--target", "cpu", "--json"))[0],
    }, args.rounds)
    inner = [json.loads(run([sys.executable, "-c", IMPORT, *DSPARK])[1]) for _ in range(args.rounds)]
    base = statistics.median(walls["python -c pass"])
    rows = [{"what": name, "median_s": statistics.median(xs), "max_s": max(xs),
             "over_bare_python_s": statistics.median(xs) - base} for name, xs in walls.items()]
    rows += [{"what": "import jitwarm.precompile (in process)",
              "median_s": statistics.median(x["import_s"] for x in inner), "max_s": max(x["import_s"] for x in inner),
              "over_bare_python_s": ""},
             {"what": "WarmPlan.build (in process)", "median_s": statistics.median(x["build_s"] for x in inner),
              "max_s": max(x["build_s"] for x in inner), "over_bare_python_s": ""}]
    heavy = sorted({m for x in inner for m in x["heavy"]})
    report("plan_latency", {"jitwarm plan latency (wall seconds)": rows},
           {"heavy_modules_imported": heavy, "walls": walls}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
