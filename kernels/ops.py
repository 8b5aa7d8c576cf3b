"""Public kernel API: validate the arguments, derive the spec, dispatch, run (docs/kernels.md, "Specs and dispatch").

Each op derives its spec with the family's ``specs_for`` (the planner's); every argument is checked first
(``ValueError`` naming it), and nothing is read back from the device.
"""

from __future__ import annotations

from typing import Any

import torch

from jitwarm.kernels import dispatch
from jitwarm.kernels.backend import BACKEND_NAMES
from jitwarm.kernels.families import FAMILIES
from jitwarm.kernels.spec import KernelSpec, ModelDims, TokenMap, VerifyLayout, max_out_rows

__all__ = ["TokenMap", "compress", "max_out_rows", "norm_rope", "plan", "spec_for"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _tensor(name: str, x: Any, shape: tuple[int | None, ...], dtypes: tuple[torch.dtype, ...],
            device: torch.device | None = None) -> torch.Tensor:  # None in shape: any size in that dim
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if x.dim() != len(shape) or any(want is not None and got != want
                                    for got, want in zip(x.shape, shape, strict=True)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: on {x.device}, but the other arguments are on {device}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {x.device} is neither cpu nor cuda")
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    return x


def _instance(name: str, value: Any, cls: type) -> Any:
    if not isinstance(value, cls):
        raise ValueError(f"{name}: expected a {cls.__name__}, got {type(value).__name__}")
    return value


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def spec_for(family: str, layout: VerifyLayout, model: ModelDims, backend: str, device: torch.device
             ) -> KernelSpec:
    """Return the one spec ``family`` dispatches for this call (``specs_for`` with a one-ratio model)."""
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend: unknown backend {backend!r}; known: {', '.join(BACKEND_NAMES)}")
    (spec,) = FAMILIES[family].specs_for(layout, model, backend, dispatch.target_of(device))
    return spec


def plan(layout: VerifyLayout, verify_lens: torch.Tensor, prefix_lens: torch.Tensor, ratio: int = 4, *,
         out: TokenMap | None = None, backend: str = "tvm_ffi") -> TokenMap:
    """Plan a ragged verify batch on the device of ``verify_lens``; return ``out`` or a fresh :class:`TokenMap`.

    ``verify_lens`` and ``prefix_lens`` are ``int32[R]``, ``R = layout.slots``; ``verify_lens`` must equal the
    layout's lengths and ``prefix_lens`` be non-negative (never read back to check). ``out`` is a preallocated
    :class:`TokenMap` to write into (CUDA-graph friendly); ``backend`` is ``"tvm_ffi"`` or ``"triton"``.
    """
    layout = _instance("layout", layout, VerifyLayout)
    ratio = _positive_int("ratio", ratio)
    r, n = layout.slots, layout.num_tokens
    dev = _tensor("verify_lens", verify_lens, (r,), (torch.int32,)).device
    _tensor("prefix_lens", prefix_lens, (r,), (torch.int32,), dev)
    sizes = (r + 1, n, n, n, 1, 1)
    if out is None:
        out = TokenMap(*(torch.empty(size, dtype=torch.int32, device=dev) for size in sizes))
    else:
        _instance("out", out, TokenMap)
        for field, size in zip(TokenMap._fields, sizes, strict=True):
            _tensor(f"out.{field}", getattr(out, field), (size,), (torch.int32,), dev)
    spec = spec_for("plan", layout, ModelDims(compress_ratios=(ratio,)), backend, dev)
    dispatch.ensure_loaded(spec, shape=layout).run(verify_lens, prefix_lens, *out)
    return out


def compress(layout: VerifyLayout, kv: torch.Tensor, score: torch.Tensor, p: TokenMap, state: torch.Tensor,
             out: torch.Tensor, ratio: int = 4, *, backend: str = "tvm_ffi") -> None:
    """Fold the batch into the per-request softmax ``state`` (updated) and write every block the plan closes.

    ``kv`` and ``score`` are ``[N, D]`` float32 or bfloat16, ``p`` the batch's :class:`TokenMap` from :func:`plan`
    with the same ``ratio``, ``state`` ``float32[R, 3, D]``, ``out`` ``[rows, D]`` in the dtype of ``kv`` with
    ``rows >= max_out_rows(layout, ratio)``.
    """
    layout = _instance("layout", layout, VerifyLayout)
    ratio = _positive_int("ratio", ratio)
    r, n = layout.slots, layout.num_tokens
    kv = _tensor("kv", kv, (n, None), tuple(_DTYPE_NAMES))
    dev, d = kv.device, kv.shape[1]
    if d < 1:
        raise ValueError("kv: head dim must be at least 1")
    _tensor("score", score, (n, d), (kv.dtype,), dev)
    _instance("p", p, TokenMap)
    _tensor("p.cu_lens", p.cu_lens, (r + 1,), (torch.int32,), dev)
    _tensor("p.token_out_row", p.token_out_row, (n,), (torch.int32,), dev)
    _tensor("state", state, (r, 3, d), (torch.float32,), dev)
    _tensor("out", out, (None, d), (kv.dtype,), dev)
    if out.shape[0] < max_out_rows(layout, ratio):
        raise ValueError(f"out: has {out.shape[0]} rows; a batch with this layout and ratio {ratio} can "
                         f"write up to {max_out_rows(layout, ratio)}")
    model = ModelDims(head_dim=d, dtype=_DTYPE_NAMES[kv.dtype], compress_ratios=(ratio,))
    spec = spec_for("compressor", layout, model, backend, dev)
    dispatch.ensure_loaded(spec, shape=layout).run(kv, score, p.cu_lens, p.token_out_row, state, out)


def norm_rope(layout: VerifyLayout, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
              q_weight: torch.Tensor, k_weight: torch.Tensor, rope_dim: int = 64, eps: float = 1e-6,
              theta: float = 10000.0, *, backend: str = "tvm_ffi") -> None:
    """RMSNorm + NeoX rotary embedding of ``q [N, Hq, D]`` and ``k [N, Hk, D]`` (one dtype), in place.

    ``positions`` is the plan's ``token_pos``; weights are ``[D]``; ``rope_dim`` is even and at most ``D``;
    ``eps >= 0`` and ``theta > 0``.
    """
    layout = _instance("layout", layout, VerifyLayout)
    n = layout.num_tokens
    q = _tensor("q", q, (n, None, None), tuple(_DTYPE_NAMES))
    dev, hq, d = q.device, q.shape[1], q.shape[2]
    k = _tensor("k", k, (n, None, d), (q.dtype,), dev)
    if hq < 1 or k.shape[1] < 1 or d < 1:
        raise ValueError(f"q: heads and head dim must be at least 1 (q {list(q.shape)}, k {list(k.shape)})")
    _tensor("positions", positions, (n,), (torch.int32,), dev)
    _tensor("q_weight", q_weight, (d,), (q.dtype,), dev)
    _tensor("k_weight", k_weight, (d,), (q.dtype,), dev)
    rope_dim = _positive_int("rope_dim", rope_dim)
    if rope_dim % 2 or rope_dim > d:
        raise ValueError(f"rope_dim: must be even and at most the head dim {d}, got {rope_dim}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps: expected a finite float >= 0, got {eps!r}")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not 0 < theta < float("inf"):
        raise ValueError(f"theta: expected a finite float > 0, got {theta!r}")
    model = ModelDims(head_dim=d, rope_dim=rope_dim, num_q_heads=hq, num_kv_heads=k.shape[1],
                      dtype=_DTYPE_NAMES[q.dtype])
    spec = spec_for("norm_rope", layout, model, backend, dev)
    dispatch.ensure_loaded(spec, shape=layout).run(q, k, positions, q_weight, k_weight, float(eps),
                                                   float(theta))
