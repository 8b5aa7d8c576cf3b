"""Worker for the build-counting tests: get, load and run kernel specs in a fresh process.

Usage: ``python kernel_build_worker.py CACHE_ROOT SPECS_JSON [GO_FILE]``. ``SPECS_JSON`` is a file with a
list of ``KernelSpec.to_json()`` dicts. With ``GO_FILE`` the worker waits until that file exists, so
several workers start their builds together. Prints one JSON line: the cache's build count and the
dispatch counters of this process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec, dispatch


def main(argv: list[str]) -> int:
    root, specs_file = argv[1], Path(argv[2])
    specs = [KernelSpec.from_json(d) for d in json.loads(specs_file.read_text())]
    cache = KernelCache(root, layers=())
    if len(argv) > 3:
        go = Path(argv[3])
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    start = time.perf_counter()
    ids = [dispatch.ensure_loaded(spec, cache=cache).spec.id for spec in specs]
    print(json.dumps({"builds": cache.stats().builds, "dispatch": dispatch.counters(), "loaded": ids,
                      "seconds": round(time.perf_counter() - start, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
