"""Worker: run a cpu-target (interpreted) triton kernel first, then check compiled Triton is untouched.

Prints one JSON line: the kernel types of the interpreter copy and of the normal module, the
``TRITON_INTERPRET`` env var and knob after the run, whether an sm_90 AOT build still works, and whether
the interpreted plan matched the reference.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from jitwarm.kernels import KernelSpec, VerifyLayout, reference
from jitwarm.kernels import triton_backend as backend


def main() -> int:
    assert "jitwarm.kernels.triton_kernels" not in sys.modules
    layout = VerifyLayout((3,) * 104 + (2,) * 24)
    spec = KernelSpec("plan", "triton", "cpu", {"ratio": 4, "threads": 128})
    with tempfile.TemporaryDirectory() as tmp:
        backend.build(spec, Path(tmp))
        kernel = backend.load(spec, SimpleNamespace(path=Path(tmp), files=("launch.json",)))
        lens = torch.tensor(layout.verify_lens, dtype=torch.int32)
        prefix = torch.arange(layout.slots, dtype=torch.int32)
        outs = [torch.empty(n, dtype=torch.int32) for n in (129, 360, 360, 360, 1, 1)]
        kernel.run(lens, prefix, *outs)
        want = reference.plan(layout, lens, prefix, 4)
        plan_ok = all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))

    from triton import knobs

    from jitwarm.kernels import triton_kernels

    with tempfile.TemporaryDirectory() as tmp:
        backend.build(KernelSpec("plan", "triton", "sm_90", {"ratio": 4, "threads": 128}), Path(tmp))
        aot_after = (Path(tmp) / "plan_kernel.cubin").stat().st_size > 0
    report = {"interpreted": type(backend.interpreted_kernels().plan_kernel).__name__,
              "compiled": type(triton_kernels.plan_kernel).__name__,
              "env": os.environ.get("TRITON_INTERPRET"), "knob": bool(knobs.runtime.interpret),
              "aot_after": aot_after, "plan_ok": plan_ok}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
