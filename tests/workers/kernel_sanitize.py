"""Run every tvm-ffi kernel family on a GPU through the kernel_checks harness, for compute-sanitizer
(memcheck, racecheck, synccheck); every run is also checked against the reference.

Usage on a GPU box (the cache comes from ``$JITWARM_CACHE_DIR``; run once plainly to build, then under
the sanitizer so that no nvcc runs inside it)::

    python kernel_sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python kernel_sanitize.py

Shapes: the incident's ragged layout, a uniform one, one request, and more requests than CTA threads, with
outputs sized exactly to what the layout allows (``kernel_checks`` sizes every buffer so), so any
out-of-bounds access is reported.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from jitwarm.kernels import ModelDims, VerifyLayout, dispatch, specs_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the kernel_checks harness
from kernel_checks import INCIDENT, check  # noqa: E402

LAYOUTS = [
    INCIDENT,
    VerifyLayout((6,) * 128),
    VerifyLayout((5,)),
    VerifyLayout(tuple(1 + i % 4 for i in range(3000))),
]
BF16 = ModelDims(head_dim=128, num_q_heads=16, compress_ratios=(4,), dtype="bfloat16")
RUNS = [(layout, BF16) for layout in LAYOUTS] + [
    (LAYOUTS[0], ModelDims(head_dim=256, num_q_heads=1, compress_ratios=(4,), dtype="float32")),
    (LAYOUTS[2], ModelDims(head_dim=64, num_q_heads=2, compress_ratios=(4,), dtype="float32")),
]


def main(device: str = "cuda") -> int:
    target = dispatch.target_of(device)
    for seed, (layout, model) in enumerate(RUNS):
        for spec in specs_for(layout, model, "tvm_ffi", target):
            kernel = dispatch.ensure_loaded(spec)
            kernel.preload()
            check(kernel, layout, device, seed)
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"kernel_sanitize: all launches completed and matched the reference on {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
