"""How a family's ``run()`` arguments map onto its Triton kernel: signature, constexprs, checks and grid."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jitwarm.kernels.backend import SpecError
from jitwarm.kernels.families import FAMILIES, next_pow2
from jitwarm.kernels.spec import KernelSpec

#: Every pointer argument must be this aligned: the AOT signature promises ``tt.divisibility = 16``.
ALIGN = 16

#: ``run()`` argument order per family (the family table's).
RUN_ARGS: dict[str, tuple[str, ...]] = {name: fam.run_args for name, fam in FAMILIES.items()}

_TRITON_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
_TORCH_DTYPE = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "i32": "torch.int32"}


@dataclass(frozen=True)
class KernelSignature:
    """The compile-time view of one spec's kernel: typed parameters in order, constexpr values, warps."""

    kernel: str
    arg_names: tuple[str, ...]
    types: dict[str, str]
    constexprs: dict[str, int]
    num_warps: int

    def attrs(self) -> dict[tuple[int, ...], list[list[Any]]]:
        """Triton attrs: 16-byte divisibility on every pointer, none elsewhere (as the JIT packs them)."""
        return {(i,): [["tt.divisibility", ALIGN]] if self.types[name].startswith("*") else []
                for i, name in enumerate(self.arg_names)}

    def options(self) -> dict[str, Any]:
        """Compile options, all explicit so a Triton default change cannot change a cached cubin."""
        # enable_fp_fusion explicit: Triton 3.9 warns when unset and flips its default in 3.10.
        return {"num_warps": self.num_warps, "num_ctas": 1, "num_stages": 1, "enable_fp_fusion": True}

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, stored in the cache description and in ``launch.json``."""
        return {"kernel": self.kernel, "arg_names": list(self.arg_names), "types": dict(self.types),
                "constexprs": dict(self.constexprs), "options": self.options(), "line_info": False}


@functools.lru_cache(maxsize=1024)
def kernel_signature(spec: KernelSpec) -> KernelSignature:
    """Return what ``spec`` compiles to, memoized (every launch asks; read-only); SpecError for a bad family/dtype."""
    p = spec.params_dict
    if spec.family == "plan":
        types = {**dict.fromkeys(RUN_ARGS["plan"], "*i32"), "num_reqs": "i32"}
        constexprs = {"RATIO": int(p["ratio"]), "THREADS": int(p["threads"])}
        num_warps = max(1, min(32, constexprs["THREADS"] // 32))
    elif spec.family == "compressor":
        dt = _dtype(spec)
        types = {"kv": f"*{dt}", "score": f"*{dt}", "cu_lens": "*i32", "token_out_row": "*i32",
                 "state": "*fp32", "out": f"*{dt}"}
        block_d = next_pow2(int(p["head_dim"]))
        constexprs = {"RATIO": int(p["ratio"]), "HEAD_DIM": int(p["head_dim"]), "BLOCK_D": block_d,
                      "UNIFORM": int(p["uniform"]), "MAX_LEN": int(p["max_len"])}
        num_warps = max(1, min(4, block_d // 128))
    elif spec.family == "norm_rope":
        dt = _dtype(spec)
        types = {"q": f"*{dt}", "k": f"*{dt}", "positions": "*i32", "q_weight": f"*{dt}",
                 "k_weight": f"*{dt}", "num_tokens": "i32", "eps": "fp32", "theta": "fp64"}
        block_d = next_pow2(int(p["head_dim"]))
        block_qh = next_pow2(int(p["num_q_heads"]))
        constexprs = {"HEAD_DIM": int(p["head_dim"]), "BLOCK_D": block_d, "ROPE_DIM": int(p["rope_dim"]),
                      "NUM_Q_HEADS": int(p["num_q_heads"]), "BLOCK_QH": block_qh,
                      "NUM_KV_HEADS": int(p["num_kv_heads"]), "BLOCK_KH": next_pow2(int(p["num_kv_heads"])),
                      "UNIFORM": int(p["uniform"]), "MAX_LEN": int(p["max_len"])}
        num_warps = max(1, min(8, block_qh * block_d // 512))
    else:
        raise SpecError(f"triton backend has no kernel for family {spec.family!r}")
    types.update(dict.fromkeys(constexprs, "constexpr"))  # the kernel's order: run-time params, then constexprs
    return KernelSignature(FAMILIES[spec.family].triton_kernel, tuple(types), types, constexprs, num_warps)


def bind(spec: KernelSpec, args: Sequence[Any]) -> tuple[tuple[int, int, int], tuple[Any, ...]]:
    """Check ``run()`` arguments against ``spec``; return the grid and every kernel parameter in signature order.

    ValueError on a wrong count, dtype, shape, device, a non-contiguous tensor or a pointer not 16-byte aligned.
    """
    names = RUN_ARGS[spec.family]
    if len(args) != len(names):
        raise ValueError(f"{spec.id}: run() takes {len(names)} arguments ({', '.join(names)}), "
                         f"got {len(args)}")
    a = dict(zip(names, args, strict=True))
    sig = kernel_signature(spec)
    tensors = [n for n in names if sig.types[n].startswith("*")]
    _check_tensors(spec, sig, {n: a[n] for n in tensors})
    c = sig.constexprs
    if spec.family == "plan":
        num_reqs = _numel(a["verify_lens"])
        if num_reqs > c["THREADS"]:
            raise ValueError(f"{spec.id}: {num_reqs} requests exceed the spec's {c['THREADS']} lanes")
        _expect(spec, "cu_lens", _numel(a["cu_lens"]) == num_reqs + 1, f"{num_reqs + 1} elements")
        _expect(spec, "prefix_lens", _numel(a["prefix_lens"]) == num_reqs, f"{num_reqs} elements")
        for n in ("num_out", "uniform"):
            _expect(spec, n, _numel(a[n]) == 1, "1 element")
        ntok = {_numel(a[n]) for n in ("token_req", "token_pos", "token_out_row")}
        _expect(spec, "token_req/token_pos/token_out_row", len(ntok) == 1, "the same length")
        return (1, 1, 1), _ordered(sig, a, num_reqs=num_reqs)
    if spec.family == "compressor":
        d, slots = c["HEAD_DIM"], tuple(a["state"].shape)[0]
        num_tokens = tuple(a["kv"].shape)[0]
        for n in ("kv", "score"):
            _expect(spec, n, tuple(a[n].shape) == (num_tokens, d), f"shape [{num_tokens}, {d}]")
        _expect(spec, "state", tuple(a["state"].shape) == (slots, 3, d), f"shape [R, 3, {d}]")
        _expect(spec, "out", a["out"].dim() == 2 and tuple(a["out"].shape)[1] == d, f"shape [rows, {d}]")
        _expect(spec, "cu_lens", _numel(a["cu_lens"]) == slots + 1, f"{slots + 1} elements (R + 1)")
        _expect(spec, "token_out_row", _numel(a["token_out_row"]) == num_tokens, f"{num_tokens} elements")
        bound = slots * c["MAX_LEN"]
        ok = num_tokens == bound if c["UNIFORM"] else num_tokens <= bound
        _expect(spec, "kv", ok, f"{'exactly' if c['UNIFORM'] else 'at most'} R * max_len = {bound} rows")
        return (slots, 1, 1), _ordered(sig, a)
    d, num_tokens = c["HEAD_DIM"], tuple(a["q"].shape)[0]
    _expect(spec, "q", tuple(a["q"].shape) == (num_tokens, c["NUM_Q_HEADS"], d),
            f"shape [N, {c['NUM_Q_HEADS']}, {d}]")
    _expect(spec, "k", tuple(a["k"].shape) == (num_tokens, c["NUM_KV_HEADS"], d),
            f"shape [{num_tokens}, {c['NUM_KV_HEADS']}, {d}]")
    _expect(spec, "positions", _numel(a["positions"]) == num_tokens, f"{num_tokens} elements")
    for n in ("q_weight", "k_weight"):
        _expect(spec, n, tuple(a[n].shape) == (d,), f"shape [{d}]")
    if c["UNIFORM"]:
        _expect(spec, "q", num_tokens % c["MAX_LEN"] == 0, f"a multiple of max_len={c['MAX_LEN']} tokens")
    grid = (-(-num_tokens // c["MAX_LEN"]), 1, 1)
    return grid, _ordered(sig, a, num_tokens=num_tokens, eps=float(a["eps"]), theta=float(a["theta"]))


def _ordered(sig: KernelSignature, run_args: dict[str, Any], **scalars: Any) -> tuple[Any, ...]:
    values = {**run_args, **scalars, **sig.constexprs}
    return tuple(values[name] for name in sig.arg_names)


def _dtype(spec: KernelSpec) -> str:
    dtype = str(spec["dtype"])
    if dtype not in _TRITON_DTYPE:
        raise SpecError(f"{spec.id}: triton kernels take float32 or bfloat16, not {dtype!r}")
    return _TRITON_DTYPE[dtype]


def _numel(t: Any) -> int:
    return int(t.numel())


def _expect(spec: KernelSpec, name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{spec.id}: {name} must have {what}")


def _check_tensors(spec: KernelSpec, sig: KernelSignature, tensors: dict[str, Any]) -> None:
    devices = set()
    for name, t in tensors.items():
        if not hasattr(t, "data_ptr"):
            raise ValueError(f"{spec.id}: {name} must be a tensor, got {type(t).__name__}")
        want = _TORCH_DTYPE[sig.types[name][1:]]
        if str(t.dtype) != want:
            raise ValueError(f"{spec.id}: {name} must be {want}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{spec.id}: {name} must be contiguous")
        if t.data_ptr() % ALIGN:
            raise ValueError(f"{spec.id}: {name} must be {ALIGN}-byte aligned (the kernel was compiled "
                             f"assuming it), its data_ptr is {t.data_ptr():#x}; pass a fresh or "
                             f"cloned tensor rather than an offset view")
        devices.add(str(t.device))
    if len(devices) > 1:
        raise ValueError(f"{spec.id}: all tensors must be on one device, got {sorted(devices)}")
