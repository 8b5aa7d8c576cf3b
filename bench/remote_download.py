"""Remote tier: warm a plan by compiling it from nothing vs by downloading it from Redis (the fleet's other nodes).

Three variants, each a real `jitwarm warm` process on a fresh, empty cache root:
  compile (no remote)    builds every spec locally (what every node pays without the remote tier)
  compile + upload       builds every spec and uploads it to a fresh key prefix (what the first node pays)
  download               builds nothing: every spec is downloaded, checked and published (every other node)
The download variant reads a prefix filled once before the rounds; the order of the variants rotates every
round; medians over the rounds.
usage: python bench/remote_download.py [--plan dspark|tiny] [--target cpu] [--rounds 3] [--remote URL] [--out DIR]
Starts its own redis-server on a free loopback port unless --remote is given.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from harness import DSPARK, alternate, jitwarm_cmd, report, run, summarize

from jitwarm.cache import KernelCache

TINY = ["--cuda-graph-bs", "1", "--compress-ratios", "4", "--head-dim", "64", "--rope-dim", "32",
        "--num-q-heads", "2", "--dtype", "float32"]


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    """A redis-server of our own on a free loopback port, no persistence; returns (process, URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", choices=["dspark", "tiny"], default="dspark")
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--remote", help="use this Redis instead of starting one")
    ap.add_argument("--out")
    args = ap.parse_args()
    flags = [*(DSPARK if args.plan == "dspark" else TINY), "--target", args.target]
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-bench-remote-"))
    server, url = (None, args.remote) if args.remote else start_redis(scratch)
    seeded = f"bench-{uuid.uuid4().hex[:8]}"
    counter = iter(range(10**6))

    def warm(prefix: str | None) -> tuple[float, dict, Path]:
        root = scratch / f"root{next(counter)}"
        remote = ["--remote", url, "--remote-prefix", prefix] if prefix else []
        wall, out = run(jitwarm_cmd("warm", *flags, "--json", "--cache-dir", str(root), *remote))
        return wall, json.loads(out.strip().splitlines()[-1]), root

    def timed(prefix_of_round, expect: str):
        def variant(_round: int) -> float:
            wall, data, root = warm(prefix_of_round())
            assert data["ok"] and data["totals"][expect] == len(data["specs"]), data["totals"]
            shutil.rmtree(root)
            return wall
        return variant

    try:
        _, seed, seed_root = warm(seeded)  # fills the prefix the download variant reads
        specs, size = len(seed["specs"]), KernelCache(root=seed_root, layers=()).size_bytes()
        samples = alternate({
            "compile (no remote)": timed(lambda: None, "built"),
            "compile + upload": timed(lambda: f"bench-{uuid.uuid4().hex[:8]}", "built"),
            "download": timed(lambda: seeded, "downloaded"),
        }, args.rounds)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    rows = summarize(samples, "compile (no remote)")
    report("remote_download", {f"warm {args.plan} plan ({specs} specs, {size / 2**20:.1f} MiB) on {args.target}, "
                               f"wall seconds of `jitwarm warm`, {args.rounds} rounds": rows},
           extra={"plan": args.plan, "target": args.target, "specs": specs, "entry_bytes": size,
                  "samples": samples}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
