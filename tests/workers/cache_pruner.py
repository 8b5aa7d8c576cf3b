"""Worker for the claim tests: prune a root to nothing, over and over, until a stop file appears.

Usage: cache_pruner.py ROOT STOP_FILE READY_FILE

Runs ``KernelCache(ROOT).prune(max_bytes=0)`` in a loop (touching READY_FILE after the first one) and prints
one JSON line: {"prunes", "removed", "skipped_locked" (how many times each key was kept), "errors"}.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from jitwarm.cache import KernelCache


def main() -> int:
    root, stop, ready = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    cache = KernelCache(root=root, layers=())
    prunes, removed, skipped, errors = 0, 0, collections.Counter(), []
    while not stop.exists():
        try:
            report = cache.prune(max_bytes=0)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        prunes += 1
        removed += len(report.removed)
        skipped.update(report.skipped_locked)
        if prunes == 1:
            ready.touch()
    print(json.dumps({"prunes": prunes, "removed": removed, "skipped_locked": dict(skipped), "errors": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
