"""The server's own Triton kernels: start until every kernel is ready, and compiles of 8 ranks starting together.

A manifest of N Triton specializations (tests/workers/server_kernels.py: ``fill_lens`` for N-1 power-of-two
buckets, like sglang's ragged-verify helpers, and one ``scaled_copy``) is recorded once. Then a fresh "server"
process (tests/workers/triton_server.py: Triton's real JIT, a driver that only reports sm_90, so no GPU is
needed and nothing is launched) runs its warmup, which compiles or finds each kernel; the time is that warmup,
until every kernel is ready, in three setups:

- Triton cold: Triton's own cache manager on an empty cache (every kernel compiled);
- Triton warm: Triton's own manager on the cache a previous run filled;
- jitwarm: TRITON_CACHE_MANAGER=jitwarm.kernels.libraries.triton.cache:CacheManager over a cache filled by
  ``jitwarm warm --manifest`` on this box (no GPU), Triton's own cache empty.

Then 8 processes start together on an empty cache, once with Triton's own manager sharing one TRITON_CACHE_DIR
and once with jitwarm's: the compiles each setup ran in total (Triton's stages started, per its compilation
listener). usage: python bench/server_kernels.py [--kernels 12] [--rounds 5] [--ranks 8] [--out DIR]
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

from harness import ROOT, alternate, jitwarm_cmd, machine, report, run

WORKERS = ROOT / "tests" / "workers"
SERVER = WORKERS / "triton_server.py"
MANAGER = "jitwarm.kernels.libraries.triton.cache:CacheManager"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=12, help="specializations in the manifest (2 or more)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-bench-server-"))
    buckets = ",".join(str(2 ** i) for i in range(args.kernels - 1))
    env = {"PYTHONPATH": str(WORKERS), "TRITON_DEFAULT_FP_FUSION": "1", "SERVER_KERNELS_BUCKETS": buckets}
    manifest = scratch / "server.jsonl"
    run([sys.executable, str(SERVER), "record", str(manifest)], env=env)
    replay_s, _ = run(jitwarm_cmd("warm", "--manifest", str(manifest), "--target", "sm_90",
                                  "--cache-dir", str(scratch / "jitwarm")), env=env)
    warm_triton = scratch / "triton-warm"
    run([sys.executable, str(SERVER), "serve"], env={**env, "SERVER_TRITON_CACHE_DIR": str(warm_triton)})

    inner: dict[str, list[float]] = {}
    counts: dict[str, list[int]] = {}

    def start(name: str, extra: dict[str, str]) -> float:
        wall, out = run([sys.executable, str(SERVER), "serve"], env={**env, **extra})
        data = json.loads(out.strip().splitlines()[-1])
        inner.setdefault(name, []).append(data["seconds"])
        counts.setdefault(name, []).append(sum(not c["cache_hit"] for c in data["compiles"]))
        return wall

    def cold(r: int) -> float:
        return start("Triton cold", {"SERVER_TRITON_CACHE_DIR": str(scratch / f"triton-cold-{r}")})

    def warm(r: int) -> float:
        return start("Triton warm", {"SERVER_TRITON_CACHE_DIR": str(warm_triton)})

    def served(r: int) -> float:
        return start("jitwarm", {"TRITON_CACHE_MANAGER": MANAGER, "JITWARM_CACHE_DIR": str(scratch / "jitwarm")})

    walls = alternate({"Triton cold": cold, "Triton warm": warm, "jitwarm": served}, args.rounds)
    base = statistics.median(inner["Triton cold"])
    start_rows = [{"setup": name, "kernels": args.kernels, "compiles": max(counts[name]),
                   "ready_median_s": statistics.median(xs), "process_wall_median_s": statistics.median(walls[name]),
                   "vs_triton_cold": base / statistics.median(xs),
                   "vs_triton_warm": statistics.median(inner["Triton warm"]) / statistics.median(xs)}
                  for name, xs in inner.items()]

    race_rows = []
    for name, extra in (("Triton's own manager", {"SERVER_TRITON_CACHE_DIR": str(scratch / "shared-triton")}),
                        ("jitwarm", {"TRITON_CACHE_MANAGER": MANAGER, "JITWARM_CACHE_DIR": str(scratch / "race")})):
        signal = scratch / f"go-{len(race_rows)}"
        procs = [subprocess.Popen([sys.executable, str(SERVER), "serve-after", str(signal)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env={**os.environ, **env, **extra})
                 for _ in range(args.ranks)]
        while len(list(scratch.glob(f"{signal.name}.ready-*"))) < args.ranks:
            time.sleep(0.02)  # every rank has imported torch and Triton: they reach the first compile together
        t0 = time.perf_counter()
        signal.touch()
        results = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
        wall = time.perf_counter() - t0
        compiled = sum(not c["cache_hit"] for r in results for c in r["compiles"])
        race_rows.append({"manager": name, "ranks": args.ranks, "kernels": args.kernels, "compiles": compiled,
                          "compiles_per_kernel": compiled / args.kernels, "all_ready_s": wall})
    shutil.rmtree(scratch, ignore_errors=True)
    report("server_kernels", {"start until every kernel is ready (fresh process)": start_rows,
                              f"{args.ranks} processes starting together on an empty cache": race_rows},
           {"machine": machine(), "replay_s": replay_s, "rounds": args.rounds}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
