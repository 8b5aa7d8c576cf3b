"""A fresh 'server' process: import what a server has loaded (torch, tvm_ffi), then time CaptureHook().

usage: hook_fresh.py CACHE_ROOT FLAGS...    Prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import sys
import time

start = time.perf_counter()
import torch  # noqa: E402,F401  (a server has these loaded before capture)
import tvm_ffi  # noqa: E402,F401

from jitwarm.cache import KernelCache  # noqa: E402
from jitwarm.kernels import backend, dispatch  # noqa: E402
from jitwarm.precompile import CaptureHook, ServingConfig, WarmPlan  # noqa: E402

backend("tvm_ffi")  # the other side imports tvm_ffi.cpp before its clock starts too
gc.collect()  # both sides: a server collected long before capture; do not time a pending collection
imported = time.perf_counter()
plan = WarmPlan.build(ServingConfig.from_args(sys.argv[2:]))
t0 = time.perf_counter()
report = CaptureHook(plan, cache=KernelCache(root=sys.argv[1]), device="cpu", policy="strict")()
hook_s = time.perf_counter() - t0
assert report.built == 0 and dispatch.counters()["builds"] == 0
print(json.dumps({"hook_s": hook_s, "loaded": report.loaded, "steps": report.steps,
                  "import_s": imported - start, "process_s": time.perf_counter() - start}))
