"""The status quo: each spec compiled lazily, serially, at first use, through tvm-ffi's own load_inline cache.

usage: lazy_load_inline.py TARGET FLAGS...   (TVM_FFI_CACHE_DIR chooses tvm-ffi's cache)
Prints one JSON line: seconds spent in load_inline (all specs), per-spec seconds, and the spec count.
The sources, flags and include paths are exactly what jitwarm's tvm_ffi backend compiles.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time

start = time.perf_counter()
import tvm_ffi.cpp  # noqa: E402

from jitwarm.kernels import Target, tvm_backend  # noqa: E402
from jitwarm.precompile import ServingConfig, WarmPlan  # noqa: E402

target, flags = sys.argv[1], sys.argv[2:]
plan = WarmPlan.build(ServingConfig.from_args([*flags, "--target", target]))
per_spec = []
gc.collect()  # as bench/hook_fresh.py: no pending collection inside the timed loop
t0 = time.perf_counter()
for spec in plan.specs:  # first-needed capture order: what lazy JIT at first dispatch does
    unit = tvm_backend.translation_unit(spec)
    name = "jw_" + hashlib.sha256(spec.id.encode()).hexdigest()[:16]
    s0 = time.perf_counter()
    if target != "cpu":
        tvm_ffi.cpp.load_inline(name, cuda_sources=unit,
                                extra_cuda_cflags=["-O2", *tvm_backend.gencode(Target.parse(target))],
                                extra_include_paths=[str(tvm_backend.CSRC)])
    else:
        tvm_ffi.cpp.load_inline(name, cpp_sources=unit, extra_cflags=["-O2"],
                                extra_include_paths=[str(tvm_backend.CSRC)])
    per_spec.append(time.perf_counter() - s0)
print(json.dumps({"specs": len(plan.specs), "load_s": time.perf_counter() - t0, "per_spec_s": per_spec,
                  "process_s": time.perf_counter() - start}))
