"""Hold one spec's build lock until told: write MARKER once the lock is held, wait for RELEASE, then build for real.

The holder waits for a file, not a fixed time: on a busy box a timed hold could end before the test's slow steps
(a whole `jitwarm warm` start) had found the key still held.

usage: slow_builder.py CACHE_ROOT SPEC_JSON MARKER RELEASE
"""

import json
import sys
import time
from pathlib import Path

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec
from jitwarm.kernels import backend as kernel_backend

root, spec_json, marker, release = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
spec = KernelSpec.from_json(json.loads(spec_json))
backend = kernel_backend(spec.backend)


def build(staging: Path) -> None:
    marker.write_text("locked")
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    backend.build(spec, staging)


result = KernelCache(root=root).get_or_build_ex(backend.description(spec), build)
print(result.outcome)
