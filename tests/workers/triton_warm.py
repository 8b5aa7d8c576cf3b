"""Worker: get-or-build every triton spec of the DSpark-128 plan for one target against one cache root.

Usage: ``python triton_warm.py ROOT TARGET``. Prints one JSON line: ``{"outcomes": {outcome: count},
"builds": n}`` where ``builds`` counts the times this process ran ``triton_backend.build``.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from jitwarm.cache import KernelCache
from jitwarm.kernels import triton_backend as backend
from jitwarm.precompile.plan import WarmPlan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the kernel_checks harness
from kernel_checks import dspark_config  # noqa: E402


def main(root: str, target: str) -> int:
    cache = KernelCache(root, layers=(), lock_dir=Path(root) / "locks")
    outcomes: collections.Counter[str] = collections.Counter()
    builds = 0
    for spec in WarmPlan.build(dspark_config("triton", target)).specs:
        def build(staging: Path, spec=spec) -> None:
            nonlocal builds
            builds += 1
            backend.build(spec, staging)

        outcomes[cache.get_or_build_ex(backend.description(spec), build).outcome] += 1
    print(json.dumps({"outcomes": dict(outcomes), "builds": builds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
