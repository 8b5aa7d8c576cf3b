"""Worker: check, on this GPU, every triton entry under a cache root that was built elsewhere.

Usage: ``python triton_gpu_entries.py ROOT``. Entries are found by their ``launch.json`` (not by key,
so entries from another Triton version or build box are checked too). Each one for this device's arch
is loaded with this process's Triton, preloaded and checked against the reference on a layout that fits
its spec. Prints one JSON line per entry and exits 1 if any failed.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from jitwarm.kernels import KernelSpec, VerifyLayout
from jitwarm.kernels import triton_backend as backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the kernel_checks harness
from kernel_checks import check  # noqa: E402


def layout_for(spec: KernelSpec) -> VerifyLayout:
    """A layout that dispatches ``spec``: its max_len and uniformity, or its plan thread count."""
    if spec.family == "plan":
        slots = int(spec["threads"]) if int(spec["threads"]) > 32 else 20
        return VerifyLayout((3,) * (slots - slots // 3) + (2,) * (slots // 3))
    n = int(spec["max_len"])
    return VerifyLayout((n,) * 8 if int(spec["uniform"]) else (n,) * 5 + (n - 1,) * 3)


def main(root: str) -> int:
    major, minor = torch.cuda.get_device_capability()
    failed = 0
    for launch_json in sorted(Path(root).glob("**/launch.json")):
        launch = json.loads(launch_json.read_text())
        spec = KernelSpec.from_json(launch["spec"])
        if spec.target.removesuffix("a") != f"sm_{major}{minor}":
            continue
        report = {"spec": spec.id, "built_with": launch.get("triton_version")}
        try:
            files = tuple(p.name for p in launch_json.parent.iterdir())
            entry = SimpleNamespace(path=launch_json.parent, files=files)
            kernel = backend.load(spec, entry)
            kernel.preload()
            check(kernel, layout_for(spec), "cuda", seed=3)
            torch.cuda.synchronize()
            report["ok"] = True
        except Exception as exc:  # noqa: BLE001 - report every entry, then fail
            failed += 1
            report.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000],
                          where=traceback.format_exc()[-1500:])
        print(json.dumps(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
