"""Run a CaptureHook in a fresh process and print its report and dispatch counters as JSON.

usage: hook_worker.py CACHE_ROOT POLICY TIMEOUT_S -- SERVING_FLAGS...
"""

import json
import sys
import time

start = time.perf_counter()
from jitwarm.cache import KernelCache  # noqa: E402
from jitwarm.kernels import dispatch  # noqa: E402
from jitwarm.precompile import CaptureHook, KernelsNotReady, ServingConfig, WarmPlan  # noqa: E402

root, policy, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
flags = sys.argv[sys.argv.index("--") + 1:]
plan = WarmPlan.build(ServingConfig.from_args(flags))
hook = CaptureHook(plan, cache=KernelCache(root=root), policy=policy, timeout_s=timeout)
try:
    report = hook()
except KernelsNotReady as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    sys.exit(3)
print(json.dumps({"built": report.built, "waited": report.waited, "hits": report.hits, "loaded": report.loaded,
                  "seconds": report.seconds, "process_seconds": time.perf_counter() - start,
                  "dispatch": dispatch.counters(), "loaded_specs": len(dispatch.loaded_specs())}))
