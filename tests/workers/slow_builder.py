"""Hold one spec's build lock for a while: write MARKER once the lock is held, sleep, then build for real.

usage: slow_builder.py CACHE_ROOT SPEC_JSON MARKER SLEEP_S
"""

import json
import sys
import time
from pathlib import Path

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec
from jitwarm.kernels import backend as kernel_backend

root, spec_json, marker, sleep_s = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
spec = KernelSpec.from_json(json.loads(spec_json))
backend = kernel_backend(spec.backend)


def build(staging: Path) -> None:
    marker.write_text("locked")
    time.sleep(sleep_s)
    backend.build(spec, staging)


result = KernelCache(root=root).get_or_build_ex(backend.description(spec), build)
print(result.outcome)
