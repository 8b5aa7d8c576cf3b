"""Cold start of the DSpark-128 plan (30 specs): jitwarm warm (jobs=1, jobs=cores) vs lazy load_inline.

Every round starts each variant from an empty cache, in a fresh process, and rotates the order.
usage: python bench/cold_start.py [--target cpu|sm_90] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from harness import DSPARK, ROOT, alternate, jitwarm_cmd, report, run, summarize

CUDA_ENV = {"CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda"), "TVM_FFI_CUDA_ARCH_LIST": "9.0"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    env = CUDA_ENV if args.target != "cpu" else {}
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-bench-"))

    def fresh(tag: str, r: int) -> Path:
        path = scratch / f"{tag}-{r}"
        shutil.rmtree(path, ignore_errors=True)
        return path

    def lazy(r: int) -> float:
        wall, out = run([sys.executable, str(ROOT / "bench" / "lazy_load_inline.py"), args.target, *DSPARK],
                        env={**env, "TVM_FFI_CACHE_DIR": str(fresh("tvm", r))})
        return wall

    def jitwarm(jobs: int):
        def go(r: int) -> float:
            wall, out = run(jitwarm_cmd("warm", *DSPARK, "--target", args.target, "--jobs", str(jobs), "--json",
                                        "--cache-dir", str(fresh(f"jw{jobs}", r))), env=env)
            assert json.loads(out)["totals"]["built"] == 30, out
            return wall
        return go

    variants = {"lazy load_inline (status quo)": lazy, "jitwarm warm --jobs 1": jitwarm(1)}
    if cores > 1:
        variants[f"jitwarm warm --jobs {cores}"] = jitwarm(cores)
    samples = alternate(variants, args.rounds)
    rows = summarize(samples, "lazy load_inline (status quo)")
    one = next(r for r in rows if r["variant"] == "jitwarm warm --jobs 1")["median_s"]
    for row in rows:
        row["speedup_vs_jobs1"] = one / row["median_s"]
    shutil.rmtree(scratch, ignore_errors=True)
    report(f"cold_start_{args.target}", {f"cold start, DSpark-128 (30 specs), target {args.target}, "
                                         f"wall seconds per process": rows},
           {"rounds": args.rounds, "samples": samples}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
