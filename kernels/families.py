"""The kernel families in one table: specialization rule, params, run() arguments and sources (pure Python).

Planning and dispatch call the same :meth:`Family.specs_for`, so a warm plan covers what capture asks for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jitwarm.kernels.backend import SpecError
from jitwarm.kernels.spec import KernelSpec, ModelDims, VerifyLayout
from jitwarm.kernels.target import Target, TargetError

Rule = Callable[[VerifyLayout, ModelDims], list[dict[str, int | str]]]


def next_pow2(n: int) -> int:
    """The least power of two at or above ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def plan_threads(slots: int) -> int:
    """Threads of the plan kernel's single CTA: ``min(1024, max(32, next_pow2(slots)))``."""
    return min(1024, max(32, next_pow2(slots)))


@dataclass(frozen=True)
class Family:
    """One kernel family: sorted ``params``, its tvm_ffi header in ``csrc/`` and C++ type (a field per param)."""

    name: str
    params: tuple[str, ...]
    run_args: tuple[str, ...]
    source: str
    cxx_kernel: str
    triton_kernel: str
    rule: Rule

    def specs_for(self, layout: VerifyLayout, model: ModelDims, backend: str, target: str
                  ) -> tuple[KernelSpec, ...]:
        """Return the specs a batch with this layout dispatches, in a stable order (a pure function)."""
        return tuple(KernelSpec(self.name, backend, target, params) for params in self.rule(layout, model))


def _plan_rule(layout: VerifyLayout, model: ModelDims) -> list[dict[str, int | str]]:
    threads = plan_threads(layout.slots)
    return [{"ratio": r, "threads": threads} for r in model.compress_ratios]


def _compressor_rule(layout: VerifyLayout, model: ModelDims) -> list[dict[str, int | str]]:
    return [{"ratio": r, "head_dim": model.head_dim, "dtype": model.dtype, "uniform": int(layout.uniform),
             "max_len": layout.max_len} for r in model.compress_ratios]


def _norm_rope_rule(layout: VerifyLayout, model: ModelDims) -> list[dict[str, int | str]]:
    return [{"head_dim": model.head_dim, "rope_dim": model.rope_dim, "num_q_heads": model.num_q_heads,
             "num_kv_heads": model.num_kv_heads, "dtype": model.dtype, "uniform": int(layout.uniform),
             "max_len": layout.max_len}]


#: Every family, in dispatch order within a batch: norm_rope, compressor, plan.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("norm_rope", ("dtype", "head_dim", "max_len", "num_kv_heads", "num_q_heads", "rope_dim", "uniform"),
           ("q", "k", "positions", "q_weight", "k_weight", "eps", "theta"), "norm_rope.cuh",
           "jitwarm::norm_rope::Kernel<{head_dim}, {rope_dim}, {num_q_heads}, {num_kv_heads}, {dtype}, {uniform}, "
           "{max_len}>", "norm_rope_kernel", _norm_rope_rule),
    Family("compressor", ("dtype", "head_dim", "max_len", "ratio", "uniform"),
           ("kv", "score", "cu_lens", "token_out_row", "state", "out"), "compressor.cuh",
           "jitwarm::compressor::Kernel<{ratio}, {head_dim}, {dtype}, {uniform}, {max_len}>", "compressor_kernel",
           _compressor_rule),
    Family("plan", ("ratio", "threads"),
           ("verify_lens", "prefix_lens", "cu_lens", "token_req", "token_pos", "token_out_row", "num_out",
            "uniform"), "plan.cuh", "jitwarm::plan::Kernel<{ratio}, {threads}>", "plan_kernel", _plan_rule),
)}


def specs_for(layout: VerifyLayout, model: ModelDims, backend: str, target: str) -> tuple[KernelSpec, ...]:
    """Return every family's specs for one layout, families in :data:`FAMILIES` order."""
    return tuple(s for fam in FAMILIES.values() for s in fam.specs_for(layout, model, backend, target))


def family(spec: KernelSpec) -> Family:
    """The family of ``spec``; SpecError for an unknown family or params that are not exactly the family's."""
    fam = FAMILIES.get(spec.family)
    if fam is None:
        raise SpecError(f"{spec.id}: unknown family {spec.family!r}; known: {', '.join(FAMILIES)}")
    names = tuple(name for name, _ in spec.params)
    if names != fam.params:
        raise SpecError(f"{spec.id}: params {names} are not the {fam.name} params {fam.params}")
    return fam


def checked(spec: KernelSpec, backend: str) -> tuple[Target, Family]:
    """The target and family of a ``backend`` spec of a known family; SpecError otherwise."""
    if spec.backend != backend:
        raise SpecError(f"{spec.id}: not a {backend} spec (backend {spec.backend!r})")
    fam = family(spec)
    try:
        return Target.parse(spec.target), fam
    except TargetError as exc:
        raise SpecError(f"{spec.id}: {exc}") from None
