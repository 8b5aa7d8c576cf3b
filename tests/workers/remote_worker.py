"""Worker process for the remote-tier tests: one "node" (its own root) doing get_or_build through Redis.

Usage: remote_worker.py ROOT URL PREFIX N [options]

Gets or builds the test artifact N (cache_worker's desc/artifact_bytes) and prints one JSON line:
{"key", "outcome", "files", "pid", "stats", "holder"} ("holder": who held the fleet lease when this
call started waiting, else null). With --hang the build appends to --counter, writes a partial file,
touches --in-build, then sleeps until killed (holding the host lock and the fleet lease). On an error it
prints {"error": "<Type>: <message>"} and exits 2. --go / --ready-dir start workers together as in
cache_worker.py. The lease lifetime comes from JITWARM_REMOTE_LEASE_S.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from cache_worker import _count, _touch, artifact_bytes, desc, wait_for_go

from jitwarm.cache import CacheError, KernelCache


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("url")
    ap.add_argument("prefix")
    ap.add_argument("n", type=int)
    ap.add_argument("--counter")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--required", action="store_true")
    ap.add_argument("--in-build")
    ap.add_argument("--on-wait")
    ap.add_argument("--go")
    ap.add_argument("--ready-dir")
    args = ap.parse_args()

    cache = KernelCache(root=args.root, layers=(), remote=args.url, remote_prefix=args.prefix,
                        remote_required=args.required)
    if args.go and not wait_for_go(args.go, args.ready_dir):
        return 3

    def build(staging: Path) -> None:
        _count(args.counter, args.n)
        if args.hang:
            (staging / "kernel.bin").write_bytes(artifact_bytes(args.n)[:100])  # a partial artifact
            _touch(args.in_build)
            while True:
                time.sleep(1)
        _touch(args.in_build)
        time.sleep(args.sleep)
        (staging / "kernel.bin").write_bytes(artifact_bytes(args.n))
        (staging / "meta").mkdir()
        (staging / "meta" / "info.json").write_text(json.dumps({"n": args.n}))

    holders = []

    def on_wait(holder: object) -> None:
        holders.append(holder.to_json() if holder is not None else None)
        _touch(args.on_wait)

    try:
        entry, outcome = cache.get_or_build_ex(desc(args.n), build, timeout_s=args.timeout, on_wait=on_wait)
    except CacheError as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}", "stats": cache.stats().to_json()}))
        return 2
    print(json.dumps({"key": entry.key, "outcome": outcome, "files": list(entry.files), "pid": os.getpid(),
                      "stats": cache.stats().to_json(), "holder": holders[0] if holders else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
