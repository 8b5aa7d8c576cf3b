"""Specialization rules: which KernelSpecs each family needs for one verify layout.

Planning and run-time dispatch call the same ``specs_for``, so a warm plan provably covers what capture
asks for. Pure Python: importing this module imports neither torch nor any compiler.
"""

from __future__ import annotations

from jitwarm.kernels.layout import VerifyLayout
from jitwarm.kernels.spec import KernelSpec, ModelDims


def plan_threads(slots: int) -> int:
    """Threads of the plan kernel's single CTA: ``min(1024, max(32, next_pow2(slots)))``."""
    return min(1024, max(32, 1 << max(0, slots - 1).bit_length()))


class Family:
    """A kernel family's specialization rule.

    Subclasses define ``name`` and ``specs_for``; ``specs_for`` must be a pure function of its arguments
    and must not import torch, triton or tvm_ffi.
    """

    name: str = ""

    def specs_for(self, layout: VerifyLayout, model: ModelDims, backend: str, target: str
                  ) -> tuple[KernelSpec, ...]:
        """Return the specs a batch with this layout dispatches, in a stable order."""
        raise NotImplementedError


class PlanFamily(Family):
    """Ragged verify layout and compression plan: one spec per compress ratio and thread count."""

    name = "plan"

    def specs_for(self, layout, model, backend, target):  # noqa: D102
        threads = plan_threads(layout.slots)
        return tuple(KernelSpec(self.name, backend, target, {"ratio": r, "threads": threads})
                     for r in model.compress_ratios)


class CompressorFamily(Family):
    """Online softmax pooling over blocks of ``ratio`` positions."""

    name = "compressor"

    def specs_for(self, layout, model, backend, target):  # noqa: D102
        return tuple(
            KernelSpec(self.name, backend, target, {
                "ratio": r, "head_dim": model.head_dim, "dtype": model.dtype,
                "uniform": int(layout.uniform), "max_len": layout.max_len,
            })
            for r in model.compress_ratios)


class NormRopeFamily(Family):
    """Fused RMSNorm + NeoX rotary embedding, in place."""

    name = "norm_rope"

    def specs_for(self, layout, model, backend, target):  # noqa: D102
        return (KernelSpec(self.name, backend, target, {
            "head_dim": model.head_dim, "rope_dim": model.rope_dim, "num_q_heads": model.num_q_heads,
            "num_kv_heads": model.num_kv_heads, "dtype": model.dtype,
            "uniform": int(layout.uniform), "max_len": layout.max_len,
        }),)


FAMILIES: dict[str, Family] = {f.name: f for f in (NormRopeFamily(), CompressorFamily(), PlanFamily())}


def specs_for(layout: VerifyLayout, model: ModelDims, backend: str, target: str) -> tuple[KernelSpec, ...]:
    """Return every family's specs for one layout, families in :data:`FAMILIES` order."""
    return tuple(s for fam in FAMILIES.values() for s in fam.specs_for(layout, model, backend, target))
